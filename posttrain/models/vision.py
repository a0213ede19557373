"""Images in the decoder (`model.vision`): a Fuyu-style linear patch embedding.

Each image reaches the decoder as placeholder tokens (one per patch, `model.vision.image_token_id`)
and, aligned with them, its patches (`data.packing`: float32 [B, S, patch_size² · 3], zeros at other
positions). The placeholder's token embedding is replaced by `patch @ proj + bias`; everything after
the embedding (blocks, rotary positions — the tokens' 1-D positions —, masks, loss) is unchanged,
and the placeholder is never predicted (`PatchEmbed.mask_logits`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.config import VISION_ENCODERS
from posttrain.models.layers import dtype_of, fan_in_init, param
from posttrain.models.quant import weight_einsum
from posttrain.models.vit import ViT, placeholder_ranks
from posttrain.parallel.sharding import constrain


def make_vision(cfg, rngs: nnx.Rngs) -> PatchEmbed | VisionTower | None:
    """The image embedding `model.vision.encoder` asks for: None (none), a `PatchEmbed` (linear)
    or a `VisionTower` (vit: `models.vit`)."""
    vision = getattr(cfg, "vision", None)  # a model config saved before model.vision existed: none
    encoder = "none" if vision is None else vision.encoder
    if encoder == "none":
        return None
    if encoder == "vit":
        return VisionTower(cfg, rngs=rngs)
    if encoder not in VISION_ENCODERS:
        raise ValueError(f"model.vision.encoder={encoder!r}: expected one of {VISION_ENCODERS}")
    return PatchEmbed(cfg, rngs=rngs)


class PatchEmbed(nnx.Module):
    """Linear patch embedding: the input of each image placeholder token is its projected patch.

    The projection's output dim is sharded like the token embedding's (the `embed` rule); its
    input dim (patch values) is whole.
    """

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        pdt = dtype_of(cfg.param_dtype)
        self.dtype = dtype_of(cfg.dtype)
        self.token_id = cfg.vision.image_token_id
        patch_dim = cfg.vision.patch_size**2 * 3
        self.proj = param(rngs, fan_in_init(), (patch_dim, cfg.embed_dim), (None, "embed"), pdt)
        self.bias = param(rngs, jax.nn.initializers.zeros, (cfg.embed_dim,), ("embed",), pdt)
        self.num_patches = (cfg.vision.image_size // cfg.vision.patch_size) ** 2
        # model.vision.patch_positions: a learned embedding per place in the image (raster index),
        # zero at the start (the plain linear embedding); where a patch stands is otherwise only in
        # attention scores (1-D rotary positions), never in what a patch's token carries
        self.pos = (
            param(rngs, jax.nn.initializers.zeros, (self.num_patches, cfg.embed_dim), (None, "embed"), pdt)
            if getattr(cfg.vision, "patch_positions", False)  # a model config saved before the key: none
            else None
        )

    def __call__(self, tokens: jax.Array, patches: jax.Array, x: jax.Array, positions=None, segment_ids=None):
        """tokens [B, S], patches [B, S, patch_dim], token embeddings x [B, S, D] → x with each
        placeholder's embedding replaced by its projected patch, plus, with `patch_positions`, the
        embedding of the patch's place in its image (positions and segment ids: the token order,
        which may be permuted; read only then)."""
        is_image = tokens == self.token_id
        patches = constrain(patches.astype(self.dtype), ("activation_batch", "activation_length", None))
        image = weight_einsum("bsp,pd->bsd", patches, self.proj[...], self.dtype) + self.bias[...].astype(self.dtype)
        if self.pos is not None:
            place = jnp.maximum(placeholder_ranks(is_image, positions, segment_ids), 0) % self.num_patches
            image = image + jnp.take(self.pos[...].astype(self.dtype), place, axis=0)
        return jnp.where(is_image[..., None], image.astype(x.dtype), x)

    def mask_logits(self, logits: jax.Array) -> jax.Array:
        """logits [..., V] with the placeholder's set to -1e9 (finite: a masked loss term stays 0):
        the placeholder stands for an image's input, never a token to predict or sample, so the
        learner and the sampler (which read these logits) agree that it has no probability."""
        placeholder = jnp.arange(logits.shape[-1]) == self.token_id
        return jnp.where(placeholder, jnp.asarray(-1e9, logits.dtype), logits)


class VisionTower(ViT):
    """`model.vision.encoder = vit`: the ViT tower (`models.vit`), whose placeholder is never
    predicted either."""

    mask_logits = PatchEmbed.mask_logits
