"""A tiny MoE config and a random LM batch for it, as the sharding tests build them."""

import jax.numpy as jnp
import numpy as np

from posttrain.config import base_config


def moe_config():
    cfg = base_config()
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 64, 16, 2, 4, 2, 8, 32
    m.moe.num_experts, m.moe.top_k, m.moe.expert_mlp_dim, m.moe.first_dense = 8, 2, 16, 1
    m.moe.num_shared_experts, m.moe.shared_mlp_dim = 1, 16
    return cfg


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
