"""The sampler tests' prompts and tiny models (dense or MoE), and the sampling distribution
computed the plain way."""

import numpy as np

from posttrain.config import ModelConfig
from tests.support.typed_configs import model

PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 3, 9, 1, 5], [2], [3, 3, 8, 1, 12]]


def model_config(kind, changes: dict | None = None, **fields) -> ModelConfig:
    """The tiny dense (`kind` "dense") or MoE ("moe") decoder's config, then `fields` and dotted
    `changes` ({"moe.dispatch": "ragged"})."""
    shape = dict(vocab_size=64, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    moe = dict(num_experts=8, top_k=2, expert_mlp_dim=16, first_dense=1, num_shared_experts=1, shared_mlp_dim=16)
    moe = {f"moe.{k}": v for k, v in moe.items()} if kind == "moe" else {}
    return model({**moe, **(changes or {})}, **{**shape, "qk_norm": True, **fields})


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
