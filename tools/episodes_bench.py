"""Multi-turn episodes in cohorts vs lockstep rounds (`python tools/bench.py --section episodes`,
or `python tools/episodes_bench.py [--init_from RUN] [--episodes 16] [--rounds 3]`).

`rl.episodes.rollout_episodes` on the built-in repo_fix domain with real sandboxed tool calls and
final checks, the tiny MoE policy of configs/agent_rl_tiny.py (random weights, or an SFT checkpoint
with `--init_from`: a random policy makes no calls, so its episodes are one turn and the
environment work is the final check alone), `rl.verifier_workers` threads for the environment
steps. Each round runs the same tasks with C = 1 (lockstep rounds) and C = 2 cohorts back to back,
after a warm-up pass over every round (compilation of each prompt-length bucket and batch size).
Sampled (T = 1, as RL samples) the two draw different keys (module docstring of rl/episodes.py),
so their episodes differ in detail but not in distribution; `--greedy` (as held-out evaluation)
makes them the same episodes (checked: same turns and tokens), so the times compare like for like.
Rows per C: episodes_s (wall time of the batch), model_s and env_s
(sums of sampler and environment time), the overlap (model_s + env_s) / episodes_s (1: none), turns
per episode; and the per-round ratio episodes_s(C=1) / episodes_s(C=2), median (range).

`--tool_wait S` adds S seconds of waiting (not computing) to every environment step, as a tool that
waits on I/O or a remote service would: host time that does not compete with the sampler for the
CPU cores, unlike this machine's sandbox processes.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import sys
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from configs.agent_rl_tiny import get_config  # noqa: E402
from posttrain.config import run_config  # noqa: E402
from posttrain.core.init import load_model_state  # noqa: E402
from posttrain.core.state import init_model_state  # noqa: E402
from posttrain.data.tokenizer import load_tokenizer  # noqa: E402
from posttrain.models.decoder import Decoder  # noqa: E402
from posttrain.parallel import make_mesh, parse_rules, use_sharding  # noqa: E402
from posttrain.rl.rollout.episodes import rollout_episodes  # noqa: E402
from posttrain.rl.rollout.worker import RolloutWorker  # noqa: E402
from posttrain.rl.tasks.registry import make_domains, make_reward_fn  # noqa: E402
from posttrain.stages.rlvr_parts import rollout_sampling  # noqa: E402


class WaitingEnv:
    """An environment whose every step first waits `wait` seconds (a tool waiting on I/O)."""

    def __init__(self, env, wait: float):
        self.env, self.wait = env, wait

    def reset(self, task):
        return self.env.reset(task)

    def step(self, action):
        time.sleep(self.wait)
        return self.env.step(action)

    def trajectory(self):
        return self.env.trajectory()


KEYS = ("episodes_s", "model_s", "env_s", "turns_per_episode", "new_tokens")


def episodes_bench(
    *,
    init_from: str = "",
    episodes: int = 16,
    group_size: int = 4,
    rounds: int = 3,
    cohorts: tuple[int, ...] = (1, 2),
    greedy: bool = False,
    tool_wait: float = 0.0,
) -> list[dict]:
    """Rows for BENCHMARKS.md: per cohort count the median episode-batch numbers, and the
    per-round speed-up of each C > 1 over C = 1."""
    cfg = run_config(get_config())
    tok = load_tokenizer(cfg.data.tokenizer)
    domains, _ = make_domains(cfg, tok, make_reward_fn(cfg.rl))
    domain = domains["repo_fix"]
    if tool_wait:
        plain = domain.make_env
        domain = domains["repo_fix"] = dataclasses.replace(domain, make_env=lambda: WaitingEnv(plain(), tool_wait))
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    with use_sharding(mesh, rules):
        params, rest = (
            load_model_state(init_from, make, mesh, rules)[:2] if init_from else init_model_state(make, mesh, rules)
        )
    graphdef = nnx.split(make(), nnx.Param, ...)[0]
    sampling = rollout_sampling(cfg, tok.stop_ids)
    n = episodes // group_size
    batches = [[("repo_fix", t) for t in domain.tasks[r * n : (r + 1) * n]] for r in range(rounds)]
    info: dict[int, list[dict]] = {c: [] for c in cohorts}
    with use_sharding(mesh, rules), concurrent.futures.ThreadPoolExecutor(cfg.rl.verifier_workers) as pool:
        worker = RolloutWorker(graphdef, domains, sampling, tok.pad_id, pool)
        run = lambda tasks, r, c: (
            rollout_episodes(
                worker, params, rest, tasks, jax.random.key(r), num_samples=group_size, greedy=greedy, cohorts=c
            ).info
        )
        for r, tasks in enumerate(batches):  # warm-up: every prompt bucket and batch size compiled
            for c in cohorts:
                run(tasks, r, c)
        for r, tasks in enumerate(batches):
            for c in cohorts:
                info[c].append(run(tasks, r, c))
                if greedy and info[c][-1]["new_tokens"] != info[cohorts[0]][-1]["new_tokens"]:
                    raise RuntimeError(f"round {r}: greedy episodes of C={c} differ from C={cohorts[0]}'s")
            print(
                f"round {r}: "
                + "; ".join(f"C={c} " + " ".join(f"{k} {info[c][-1][k]:.2f}" for k in KEYS) for c in cohorts),
                flush=True,
            )
    rows = []
    for c in cohorts:
        med = {k: float(np.median([i[k] for i in info[c]])) for k in KEYS}
        overlap = [(i["model_s"] + i["env_s"]) / i["episodes_s"] for i in info[c]]
        row = {
            "name": f"{episodes} episodes{', greedy' if greedy else ''}"
            f"{f', tool wait {tool_wait}s' if tool_wait else ''}, C={c}",
            **med,
            "overlap (median)": float(np.median(overlap)),
        }
        if c != cohorts[0]:
            ratios = np.array([a["episodes_s"] / b["episodes_s"] for a, b in zip(info[cohorts[0]], info[c])])
            row.update(
                {
                    f"x vs C={cohorts[0]} per round (median)": float(np.median(ratios)),
                    "min": float(ratios.min()),
                    "max": float(ratios.max()),
                }
            )
        rows.append(row)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--init_from", default="", help="an SFT run dir of configs/agent_sft_tiny.py's model")
    p.add_argument("--episodes", type=int, default=16)
    p.add_argument("--group_size", type=int, default=4)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cohorts", default="1,2", help="cohort counts, the first the baseline")
    p.add_argument("--greedy", action="store_true", help="greedy episodes: the same for every cohort count")
    p.add_argument(
        "--tool_wait", type=float, default=0.0, help="seconds every environment step waits (I/O-bound tools)"
    )
    args = p.parse_args()
    for r in episodes_bench(
        init_from=args.init_from,
        episodes=args.episodes,
        group_size=args.group_size,
        rounds=args.rounds,
        cohorts=tuple(int(c) for c in args.cohorts.split(",")),
        greedy=args.greedy,
        tool_wait=args.tool_wait,
    ):
        print("| " + " | ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()) + " |")


if __name__ == "__main__":
    main()
