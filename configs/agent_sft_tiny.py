"""SFT warm start for multi-turn agent RL: the tiny MoE decoder of sft_tiny.py on scripted,
sandbox-checked repo_fix episodes (tool-call format, tool outputs masked out of the loss) plus
copy drills (the same message format on names no task uses), meant to teach the copy of a value
from a tool's output into the fix; measured in BENCHMARKS.md: not yet learned in 600 steps.

    python tools/agent_demos.py --out runs/data/repo_fix_sft/demos.jsonl --n 3000 --seed 1
    python tools/agent_demos.py --out runs/data/repo_fix_sft/drills.jsonl --n 0 --copy_drills 8000 --seed 7
    python tools/agent_demos.py --out runs/data/repo_fix_sft_eval.jsonl --n 100 --seed 2
    python -m posttrain.main --config configs/agent_sft_tiny.py
then RL: configs/agent_rl_tiny.py.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.workdir = "runs/agent_sft_tiny"
    cfg.data.synthetic = ""
    cfg.sft.train_files = "runs/data/repo_fix_sft/*.jsonl"
    cfg.sft.eval_files = "runs/data/repo_fix_sft_eval.jsonl"
    cfg.sft.gate, cfg.sft.sample_tokens = "", 0
    # An episode is ~344 byte tokens, a drill ~175: one episode (or two drills) per packed row.
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.eval_every = 600, 16, 384, 100
    cfg.checkpoint.every = 200
    return cfg
