"""RLHF on generated arithmetic data: pipeline [sft, reward_model, rlvr] (CPU, a few minutes).

SFT teaches the answer format; the reward model learns the preference pairs (a worked sum whose
final answer agrees with it is preferred); then PPO with a critic (GAE, a value head on the policy)
maximises the learned reward, normalised by running statistics, with the KL to the SFT policy paid
as per-token reward. The rlvr stage starts from the SFT policy (a reward model is not a policy) and
reads the reward model of stage 1 through `rl.reward_model = "@reward_model"`. The verifier's
reward is not trained on (`rl.verifier_weight = 0`): held-out accuracy measures what the learned
reward taught.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.stage = "pipeline"
    cfg.workdir = "runs/rlhf_tiny"
    cfg.pipeline.stages = ("sft", "reward_model", "rlvr")
    cfg.train.seq_len = 64
    cfg.sft.steps = 200
    cfg.reward_model.train_files = "synthetic:"
    cfg.reward_model.eval_files = "synthetic:"
    cfg.reward_model.gate = "eval/accuracy>0.6"
    cfg.reward_model.steps, cfg.reward_model.lr = 150, 1e-3
    r = cfg.rl
    r.reward_model, r.verifier_weight, r.reward_model_weight = "@reward_model", 0.0, 1.0
    r.advantage, r.gamma, r.lam, r.value_coef, r.value_clip = "gae", 1.0, 0.95, 0.5, 0.2
    r.kl_coef, r.kl_in_reward, r.kl_estimator = 0.05, True, "k1"
    r.updates_per_batch, r.minibatches = 2, 2
    r.prompts_per_step, r.group_size, r.max_new_tokens = 8, 4, 40
    r.eval_every, r.eval_size, r.eval_samples = 10, 64, 4
    r.steps, r.lr = 40, 5e-4
    r.gate = ""
    cfg.optim.warmup_steps = 5
    cfg.checkpoint.every = 20
    cfg.train.log_every = 1
    return cfg
