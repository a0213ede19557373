"""SFT of a tiny MoE decoder on generated arithmetic conversations (CPU, ~1 minute).

Data: `data.synthetic = "arithmetic"` with the files "synthetic:" generates them in {workdir}/synthetic/;
point `sft.train_files` / `sft.eval_files` at your own JSONL ({"messages": [...]} or
{"prompt", "response"}) to train on real data.
"""

from posttrain.config import base_config


def get_config():
    cfg = base_config()
    cfg.stage = "sft"
    cfg.workdir = "runs/sft_tiny"
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        264,
        64,
        2,
        4,
        2,
        16,
        128,
    )
    m.moe.num_experts, m.moe.top_k, m.moe.expert_mlp_dim = 4, 2, 64
    cfg.data.synthetic = "arithmetic"
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files = "synthetic:"
    cfg.sft.gate = "eval/loss<1.0"
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.eval_every = 200, 16, 128, 100
    cfg.checkpoint.every = 50
    return cfg
