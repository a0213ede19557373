"""CPU quickstart: a tiny MoE decoder learns arithmetic text for a few hundred steps."""

from posttrain.config import base_config


def get_config():
    cfg = base_config()
    cfg.stage = "lm"
    cfg.workdir = "runs/quickstart"
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers = 256, 64, 2
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 4, 2, 16, 128
    m.moe.num_experts, m.moe.top_k, m.moe.expert_mlp_dim = 4, 2, 64
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 300, 16, 64
    return cfg
