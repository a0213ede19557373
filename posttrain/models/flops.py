"""Model FLOPs per token (activated parameters only), for MFU."""

from __future__ import annotations

from posttrain.models.decoder import layer_kinds


def activated_matmul_params(cfg) -> int:
    """Weights one token multiplies through: attention, dense MLP or top-k experts (+ shared, router), LM head."""
    d, h, kv, hd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    attn = d * hd * (2 * h + 2 * kv)
    m = cfg.moe
    per_kind = {
        "dense": 3 * d * cfg.mlp_dim,
        "moe": 3 * d * m.expert_mlp_dim * m.top_k + 3 * d * m.shared_mlp_dim * m.num_shared_experts + d * m.num_experts,
    }
    return sum(attn + per_kind[k] for k in layer_kinds(cfg)) + d * cfg.vocab_size


def train_flops_per_token(cfg, seq_len: int) -> float:
    """6·N_activated plus causal attention scores/values (12·L·H·Dh·S / 2 for the causal half)."""
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq_len / 2
    return 6 * activated_matmul_params(cfg) + attn
