"""GRPO on generated arithmetic problems (CPU, a few minutes), from `init_from` if given.

Run configs/sft_tiny.py first and pass `--config.init_from=runs/sft_tiny`: RL needs a policy that
already answers in the expected format.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.stage = "rlvr"
    cfg.workdir = "runs/rlvr_tiny"
    cfg.rl.domains = "arithmetic"
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 8, 8, 40
    cfg.rl.eval_every, cfg.rl.eval_size, cfg.rl.eval_samples = 10, 64, 4
    cfg.rl.steps, cfg.rl.lr = 60, 5e-4
    cfg.rl.gate = "eval/accuracy>0.0"
    cfg.optim.warmup_steps = 5
    cfg.checkpoint.every = 20
    cfg.train.log_every = 1
    return cfg
