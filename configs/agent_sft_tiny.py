"""SFT warm start for multi-turn agent RL: the tiny MoE decoder of sft_tiny.py on scripted,
sandbox-checked repo_fix episodes (tool-call format, tool outputs masked out of the loss).

A quarter of the demonstrations fix the module with `sed` (the value cut out of the test by the
shell), the rest copy the value by hand (`echo 'SIZE = 37' > config.py`), which this tiny model does
not learn to do (it writes the right constant with a guessed number; its eval loss stays at the
no-copy floor in each of three initialisations, BENCHMARKS.md): the SFT policy mostly copies and
mostly fails, and RL (configs/agent_rl_tiny.py) has to find out which of its two habits solves
held-out tasks.

    python tools/agent_demos.py --out runs/data/repo_fix_sft/demos.jsonl --n 3000 --seed 1 --extract_frac 0.25
    python tools/agent_demos.py --out runs/data/repo_fix_sft_eval.jsonl --n 100 --seed 2 --extract_frac 0.25
    python -m posttrain.main --config configs/agent_sft_tiny.py
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.workdir = "runs/agent_sft_tiny"
    cfg.data.synthetic = ""
    cfg.sft.train_files = "runs/data/repo_fix_sft/*.jsonl"
    cfg.sft.eval_files = "runs/data/repo_fix_sft_eval.jsonl"
    cfg.sft.gate, cfg.sft.sample_tokens = "", 0
    # An episode is 340-390 byte tokens: one per packed row.
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.eval_every = 600, 16, 400, 100
    cfg.checkpoint.every = 200
    return cfg
