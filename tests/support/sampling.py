"""The sampler tests' prompts and tiny models (dense or MoE), and the sampling distribution
computed the plain way."""

import numpy as np

from posttrain.config import base_config

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 3, 9, 1, 5], [2], [3, 3, 8, 1, 12]]


def model_config(kind):
    cfg = base_config().model
    cfg.vocab_size, cfg.embed_dim, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.mlp_dim = (
        64,
        16,
        2,
        4,
        2,
        8,
        32,
    )
    cfg.qk_norm = True
    if kind == "moe":
        cfg.moe.num_experts, cfg.moe.top_k, cfg.moe.expert_mlp_dim, cfg.moe.first_dense = 8, 2, 16, 1
        cfg.moe.num_shared_experts, cfg.moe.shared_mlp_dim = 1, 16
    return cfg


def reference_distribution(logits, temperature, top_k, top_p):
    """The sampling distribution computed the plain way, in float64."""
    z = np.asarray(logits, np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p)
    keep = np.zeros_like(p, bool)
    keep[order[: top_k or len(p)]] = True
    p = np.where(keep, p, 0) / p[keep].sum()
    mass_before = np.cumsum(p[order]) - p[order]
    keep[order[mass_before >= top_p]] = False
    return np.where(keep, p, 0) / p[keep].sum()
