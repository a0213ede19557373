"""Reward model (Bradley–Terry) on generated arithmetic preference pairs (CPU, ~1 minute).

`--config.init_from=runs/sft_tiny` starts the decoder from an SFT run; the value head is new.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.stage = "reward_model"
    cfg.workdir = "runs/reward_model_tiny"
    cfg.reward_model.train_files = "synthetic:"
    cfg.reward_model.eval_files = "synthetic:"
    cfg.reward_model.gate = "eval/accuracy>0.6"
    cfg.train.steps, cfg.train.seq_len, cfg.train.eval_every = 150, 64, 50
    cfg.optim.lr = 1e-3
    return cfg
