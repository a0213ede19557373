"""The tiny vision decoder (linear patch embedding or ViT), its config and a batch with images."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.config import RunConfig
from posttrain.data.images import ImageSpec
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.models.decoder import Decoder
from tests.support.typed_configs import run_cfg

BYTE = ByteTokenizer()
SPEC = ImageSpec(image_size=8, patch_size=4, token_id=BYTE.image_id)  # 4 patches of 48 values


def vision_config(changes=None, **vision) -> RunConfig:
    """The run config of the tiny vision decoder: model.vision's `vision` keys, then dotted `changes`
    ({"model.vocab_size": 320}) applied together (checked as one)."""
    shape = dict(vocab_size=264, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    vision = {"encoder": "linear", "image_size": 8, "patch_size": 4, **vision}
    return run_cfg(
        {
            **{f"model.{k}": v for k, v in shape.items()},
            **{f"model.vision.{k}": v for k, v in vision.items()},
            **(changes or {}),
        }
    )


def abstract_split(encoder: str = "linear", vocab_size: int = 264, **vision):
    """(graphdef, params, rest) of the tiny decoder as shapes (nothing computed)."""
    from posttrain.parallel.sharding import abstract_model

    cfg = vision_config({"model.vocab_size": vocab_size}, encoder=encoder, **vision)
    return nnx.split(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))), nnx.Param, ...)


@functools.cache
def split_model(**vision):
    """(graphdef, params, rest) of the tiny vision decoder, initialised in one jitted program (eager
    initialisation runs op by op, slowly on 8 simulated devices); shared by this file's tests. A
    patch-position embedding (`patch_positions=True`) is drawn at random, not left at its zeros."""
    cfg = vision_config(**vision)
    graphdef, _, _ = abstract_split(**vision)
    params, rest = jax.jit(lambda: nnx.split(Decoder(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)[1:])()
    if "pos" in params["vision"]:
        pos = params["vision"]["pos"]
        pos[...] = jax.random.normal(jax.random.key(5), pos.shape, pos.dtype)
    return graphdef, params, rest


def image_batch(b=4, s=16, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(7, 263, (b, s + 1))
    tokens[:, 2:6] = BYTE.image_id  # one image in every row, a second in row 1
    tokens[1, 9:13] = BYTE.image_id
    patches = np.where((tokens[:, :-1] == BYTE.image_id)[..., None], rng.random((b, s, SPEC.patch_dim)), 0.0)
    return {
        "inputs": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.asarray((tokens[:, 1:] != BYTE.image_id) & (rng.random((b, s)) < 0.9), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(s), (b, s)),
        "segment_ids": jnp.ones((b, s), jnp.int32),
        "patches": jnp.asarray(patches, jnp.float32),
    }
