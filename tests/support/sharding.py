"""A tiny MoE config and a random LM batch for it, as the sharding tests build them."""

import jax.numpy as jnp
import numpy as np

from posttrain.config import RunConfig
from tests.support.typed_configs import run_cfg


def moe_config(changes: dict | None = None) -> RunConfig:
    """The run config of a tiny MoE decoder (a dense first layer, then 8 experts and a shared one),
    with dotted `changes` ({"optim.lr": 1e-2}) applied last."""
    shape = dict(vocab_size=64, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    moe = dict(num_experts=8, top_k=2, expert_mlp_dim=16, first_dense=1, num_shared_experts=1, shared_mlp_dim=16)
    return run_cfg(
        {
            **{f"model.{k}": v for k, v in shape.items()},
            **{f"model.moe.{k}": v for k, v in moe.items()},
            **(changes or {}),
        }
    )


def batch(cfg, b=8, s=8):
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, cfg.model.vocab_size, (b, s + 1))
    return {
        "inputs": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.asarray(rng.random((b, s)) < 0.8, jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(s), (b, s)),
        "segment_ids": jnp.ones((b, s), jnp.int32),
    }
