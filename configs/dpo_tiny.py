"""DPO on generated arithmetic preference pairs (right vs. wrong answer), from `init_from` if given.

Run configs/sft_tiny.py first and pass `--config.init_from=runs/sft_tiny` to start from it;
otherwise DPO starts (and references) the seed's initial weights.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.stage = "dpo"
    cfg.workdir = "runs/dpo_tiny"
    cfg.dpo.train_files = "synthetic:"
    cfg.dpo.eval_files = "synthetic:"
    cfg.dpo.beta = 0.1
    cfg.dpo.gate = "eval/reward_accuracy>0.6"
    cfg.dpo.steps, cfg.dpo.lr = 100, 5e-4
    cfg.train.seq_len = 64
    return cfg
