"""A small ViT image tower (`model.vision.encoder = vit`), laid out as LLaVA's SigLIP tower.

Each image (its (image_size / patch_size)² patches, raster order, pixels in [0, 1]) is normalised per
channel ((x - image_mean) / image_std: a HF processor's constants), embedded by a linear map over the
flattened patch (equal to a stride-p conv), plus a learned position embedding, then runs through
`vit_layers` pre-LayerNorm layers (bidirectional attention within the image, GELU-tanh MLP), an
optional final LayerNorm, and a 2-layer GELU projector (LLaVA's `multi_modal_projector`) into the
decoder's width. The outputs replace the image's placeholder embeddings in order.

The decoder hands the tower the whole row (tokens, patches, positions, segment ids), possibly
zig-zag permuted: the tower restores token order from (segment id, position), gathers the row's
placeholders into at most S // num_patches images (unused slots compute and are discarded), and
scatters the encoded patches back. Tower weights are replicated (small); the projector's output dim
is sharded like the token embedding.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.layers import dtype_of, fan_in_init, param

NORM_EPS = 1e-6  # SigLIP's layer_norm_eps (an import with another value is refused)


def _zeros(rngs, shape, names, dtype) -> nnx.Param:
    return param(rngs, jax.nn.initializers.zeros, shape, names, dtype)


def _ones(rngs, shape, names, dtype) -> nnx.Param:
    return param(rngs, jax.nn.initializers.ones, shape, names, dtype)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array) -> jax.Array:
    """LayerNorm over the last dim in float32 (eps `NORM_EPS`), back in x's dtype."""
    h = x.astype(jnp.float32)
    mean = h.mean(-1, keepdims=True)
    var = ((h - mean) ** 2).mean(-1, keepdims=True)
    h = (h - mean) * jax.lax.rsqrt(var + NORM_EPS) * scale.astype(jnp.float32) + bias.astype(jnp.float32)
    return h.astype(x.dtype)


class ViTLayer(nnx.Module):
    """Pre-LayerNorm encoder layer: x + attn(ln1(x)), then x + fc2(gelu_tanh(fc1(ln2(x))))."""

    def __init__(self, width: int, heads: int, mlp_dim: int, pdt, dtype, *, rngs: nnx.Rngs):
        self.heads, self.dtype = heads, dtype
        self.ln1_scale, self.ln1_bias = _ones(rngs, (width,), (None,), pdt), _zeros(rngs, (width,), (None,), pdt)
        self.ln2_scale, self.ln2_bias = _ones(rngs, (width,), (None,), pdt), _zeros(rngs, (width,), (None,), pdt)
        for name in ("wq", "wk", "wv", "wo"):
            setattr(self, name, param(rngs, fan_in_init(), (width, width), (None, None), pdt))
            setattr(self, name + "_bias", _zeros(rngs, (width,), (None,), pdt))
        self.fc1 = param(rngs, fan_in_init(), (width, mlp_dim), (None, None), pdt)
        self.fc1_bias = _zeros(rngs, (mlp_dim,), (None,), pdt)
        self.fc2 = param(rngs, fan_in_init(), (mlp_dim, width), (None, None), pdt)
        self.fc2_bias = _zeros(rngs, (width,), (None,), pdt)

    def _linear(self, x, name):
        w, b = getattr(self, name)[...], getattr(self, name + "_bias")[...]
        return jnp.einsum("...i,io->...o", x, w.astype(self.dtype)) + b.astype(self.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x [n, N, W] (n images of N patches) → [n, N, W]."""
        n, length, width = x.shape
        h = layer_norm(x, self.ln1_scale[...], self.ln1_bias[...])
        split = lambda t: t.reshape(n, length, self.heads, width // self.heads)
        q, k, v = (split(self._linear(h, name)) for name in ("wq", "wk", "wv"))
        scores = jnp.einsum("nqhd,nkhd->nhqk", q, k, preferred_element_type=jnp.float32) * (width // self.heads) ** -0.5
        probs = jax.nn.softmax(scores, axis=-1).astype(self.dtype)
        a = jnp.einsum("nhqk,nkhd->nqhd", probs, v).reshape(n, length, width)
        x = x + self._linear(a, "wo")
        h = layer_norm(x, self.ln2_scale[...], self.ln2_bias[...])
        return x + self._linear(jax.nn.gelu(self._linear(h, "fc1"), approximate=True), "fc2")


def placeholder_ranks(is_image: jax.Array, positions=None, segment_ids=None) -> jax.Array:
    """is_image [B, S] (a row's image placeholders, possibly zig-zag permuted; positions and segment
    ids [B, S] give the token order) → each token's rank among its row's placeholders in token order
    (-1 before the first). Rows hold whole images (packing never cuts one), so placeholder k is
    patch k mod N of its image."""
    b, s = is_image.shape
    if positions is None:
        positions = jnp.broadcast_to(jnp.arange(s), (b, s))
    if segment_ids is None:
        segment_ids = jnp.ones((b, s), jnp.int32)
    order = jnp.lexsort((positions, segment_ids), axis=-1)  # layout index of the i-th token in order
    ranked = jnp.cumsum(jnp.take_along_axis(is_image, order, axis=-1), axis=-1) - 1
    return jnp.take_along_axis(ranked, jnp.argsort(order, axis=-1), axis=-1)


class ViT(nnx.Module):
    """The image tower and projector of `model.vision.encoder = vit` (see the module docstring)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        v = cfg.vision
        pdt, self.dtype = dtype_of(cfg.param_dtype), dtype_of(cfg.dtype)
        self.token_id = v.image_token_id
        self.num_patches = (v.image_size // v.patch_size) ** 2
        self.mean, self.std = tuple(map(float, v.image_mean)), tuple(map(float, v.image_std))
        width, patch_dim = v.vit_width, v.patch_size**2 * 3
        self.patch = param(rngs, fan_in_init(), (patch_dim, width), (None, None), pdt)
        self.patch_bias = _zeros(rngs, (width,), (None,), pdt)
        self.pos = param(rngs, jax.nn.initializers.normal(width**-0.5), (self.num_patches, width), (None, None), pdt)
        self.layers = nnx.List(
            [ViTLayer(width, v.vit_heads, v.vit_mlp_dim, pdt, self.dtype, rngs=rngs) for _ in range(v.vit_layers)]
        )
        self.final_norm = (
            nnx.Dict(scale=_ones(rngs, (width,), (None,), pdt), bias=_zeros(rngs, (width,), (None,), pdt))
            if v.vit_final_norm
            else None
        )
        d = cfg.embed_dim
        self.proj1 = param(rngs, fan_in_init(), (width, d), (None, "embed"), pdt)
        self.proj1_bias = _zeros(rngs, (d,), ("embed",), pdt)
        self.proj2 = param(rngs, fan_in_init(), (d, d), (None, "embed"), pdt)
        self.proj2_bias = _zeros(rngs, (d,), ("embed",), pdt)

    def encode(self, images: jax.Array) -> jax.Array:
        """images [n, N, patch_dim] (raster patches, row-major pixels, RGB last, in [0, 1]) →
        [n, N, embed_dim]: each patch's input embedding for the decoder."""
        n, length, patch_dim = images.shape
        px = images.astype(jnp.float32).reshape(n, length, patch_dim // 3, 3)
        px = ((px - jnp.asarray(self.mean)) / jnp.asarray(self.std)).reshape(images.shape).astype(self.dtype)
        x = jnp.einsum("nlp,pw->nlw", px, self.patch[...].astype(self.dtype)) + self.patch_bias[...].astype(self.dtype)
        x = x + self.pos[...].astype(self.dtype)
        for layer in self.layers:
            x = layer(x)
        if self.final_norm is not None:
            x = layer_norm(x, self.final_norm["scale"][...], self.final_norm["bias"][...])
        h = jnp.einsum("nlw,wd->nld", x, self.proj1[...].astype(self.dtype)) + self.proj1_bias[...].astype(self.dtype)
        h = jax.nn.gelu(h, approximate=False)  # LLaVA's projector_hidden_act "gelu" (erf)
        return jnp.einsum("nld,de->nle", h, self.proj2[...].astype(self.dtype)) + self.proj2_bias[...].astype(
            self.dtype
        )

    def __call__(self, tokens, patches, x, positions=None, segment_ids=None) -> jax.Array:
        """tokens [B, S], patches [B, S, patch_dim], token embeddings x [B, S, D] (positions and
        segment ids [B, S]: the token order, which may be permuted) → x with the k-th placeholder
        of each row (in token order) replaced by patch k mod N of image k // N, encoded."""
        b, s = tokens.shape
        slots = (s // self.num_patches) * self.num_patches
        if slots == 0:
            return x
        is_image = tokens == self.token_id
        rank = placeholder_ranks(is_image, positions, segment_ids)
        key = jnp.where(is_image, rank, s + jnp.arange(s))
        where = jnp.argsort(key, axis=-1)[:, :slots]  # layout index of placeholder 0, 1, ...
        images = jnp.take_along_axis(patches, where[..., None], axis=1).reshape(-1, self.num_patches, patches.shape[-1])
        encoded = self.encode(images).reshape(b, slots, -1)
        per_token = jnp.take_along_axis(encoded, jnp.clip(rank, 0, slots - 1)[..., None], axis=1)
        return jnp.where(is_image[..., None], per_token.astype(x.dtype), x)
