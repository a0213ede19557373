"""Multi-turn agent RL on the built-in repo_fix domain (CPU): episodes of up to 4 model turns with
shell calls in a persistent sandboxed repository, reward from its tests after the episode.

Start from the SFT warm start (configs/agent_sft_tiny.py; a random model makes no valid calls):
    python -m posttrain.main --config configs/agent_rl_tiny.py --config.init_from=runs/agent_sft_tiny
`eval/tool_success_rate` is the held-out episodes' solve rate (greedy), logged every rl.eval_every steps.
"""

from configs.sft_tiny import get_config as sft_config


def get_config():
    cfg = sft_config()
    cfg.stage = "rlvr"
    cfg.workdir = "runs/agent_rl_tiny"
    cfg.data.synthetic = ""
    r = cfg.rl
    r.env, r.domains, r.max_turns, r.max_new_tokens, r.tool_timeout_s = "tool", "repo_fix", 4, 96, 5.0
    r.invalid_tool_call_penalty, r.redundant_tool_call_penalty = 0.1, 0.1
    r.prompts_per_step, r.group_size = 8, 8
    r.eval_every, r.eval_size, r.eval_samples = 10, 64, 2
    r.steps, r.lr = 20, 3e-4
    r.verifier_workers = 4
    cfg.optim.warmup_steps = 3
    cfg.checkpoint.every = 10
    cfg.train.log_every = 1
    return cfg
