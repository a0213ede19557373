"""What the RLVR loop trains on: the task domains, the held-out tasks and the reward sources.

Reward sources are composed here, in one place (`make_reward_fn`): verifiers per task type with
the configured shaping. A learned reward model is another source to add beside them.
"""

from __future__ import annotations

from posttrain.rl import domains as domain_lib
from posttrain.rl.envs import SingleTurnEnv
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.verifiers.code import CodeTask, CodeVerifier
from posttrain.rl.verifiers.math import MathTask, MathVerifier


def parse_weights(spec: str) -> dict[str, float]:
    """"arithmetic:2,gsm8k" → {"arithmetic": 2.0, "gsm8k": 1.0}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition(":")
        out[name] = float(w) if w else 1.0
    if not out:
        raise ValueError("rl.domains is empty: name at least one of arithmetic, gsm8k, humaneval")
    return out


def make_domains(cfg, tok, reward_fn) -> tuple[dict[str, domain_lib.Domain], list[tuple[str, object]]]:
    """Training domains and held-out (domain, task) pairs for evaluation, from `rl.domains`."""
    r = cfg.rl
    env = lambda: SingleTurnEnv(tok, reward_fn, max_turn_tokens=r.max_new_tokens)
    kw = dict(instruction=r.instruction, max_value=cfg.data.synthetic_max_value)
    table = {
        "arithmetic": lambda: (domain_lib.arithmetic_domain(env, n=r.arithmetic_size, seed=cfg.seed + 1, **kw),
                               domain_lib.arithmetic_tasks(r.eval_size, seed=cfg.seed + 10_000, **kw)),
        "gsm8k": lambda: (domain_lib.gsm8k_domain(env, split="train"),
                          domain_lib.gsm8k_tasks(split="test", limit=r.eval_size)),
        "humaneval": lambda: (domain_lib.humaneval_domain(env), domain_lib.humaneval_tasks(limit=r.eval_size)),
    }
    domains, held_out = {}, []
    for name in parse_weights(r.domains):
        if name not in table:
            raise ValueError(f"rl.domains: unknown {name!r}; valid: {sorted(table)}")
        domains[name], tasks = table[name]()
        held_out += [(name, t) for t in tasks]
    return domains, held_out


def make_reward_fn(cfg) -> RewardFunction:
    """Math and code verifiers with the configured format and overlong shaping."""
    r = cfg.rl
    config = RewardConfig(format_penalty=r.format_penalty,
                          max_tokens=r.max_new_tokens if r.overlong_buffer else None,
                          overlong_buffer=r.overlong_buffer)
    verifiers = {MathTask: MathVerifier()}
    if "humaneval" in parse_weights(r.domains):
        verifiers[CodeTask] = CodeVerifier()
    return RewardFunction(verifiers, config)
