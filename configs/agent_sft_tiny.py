"""SFT warm start for multi-turn agent RL: the tiny MoE decoder of sft_tiny.py on scripted,
sandbox-checked repo_fix episodes (tool-call format, tool outputs masked out of the loss).

    python tools/agent_demos.py --out runs/data/repo_fix_sft.jsonl --n 1000 --seed 1
    python tools/agent_demos.py --out runs/data/repo_fix_sft_eval.jsonl --n 100 --seed 2
    python -m posttrain.main --config configs/agent_sft_tiny.py
then RL: configs/agent_rl_tiny.py.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.workdir = "runs/agent_sft_tiny"
    cfg.data.synthetic = ""
    cfg.sft.train_files = "runs/data/repo_fix_sft.jsonl"
    cfg.sft.eval_files = "runs/data/repo_fix_sft_eval.jsonl"
    cfg.sft.gate, cfg.sft.sample_tokens = "", 0
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.eval_every = 300, 16, 512, 100
    cfg.checkpoint.every = 100
    return cfg
