"""Evaluation suites: the held-out tasks of the built-in domains and the user's `{"prompt", "answer"}`
files, named by `eval.suites` ("arithmetic, gsm8k, mine=/data/x.jsonl"), each a `Domain` (its tasks
and the environment that scores them). Stage `eval` (`posttrain/stages/eval.py`) runs them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable

from posttrain.data.sources import SkipLog, read_jsonl
from posttrain.rl.envs import SingleTurnEnv
from posttrain.rl.envs.base import Task
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.tasks.registry import make_domains, make_reward_fn
from posttrain.rl.verifiers.math import MathTask

BUILTIN = ("arithmetic", "gsm8k", "humaneval", "repo_fix")
MULTI_TURN = ("repo_fix",)  # built-in suites of multi-turn tool episodes (rl.env = "tool")
# A suite's greedy accuracy also under a headline name, for gates ("unit_test_pass>=0.6").
HEADLINE = {
    "humaneval": "unit_test_pass",
    "gsm8k": "gsm8k_accuracy",
    "arithmetic": "arithmetic_accuracy",
    "repo_fix": "tool_success_rate",
}
# Hook for further built-in single-turn suites: name -> (cfg, tokenizer, reward_fn) -> Domain (multi-turn
# ones are the MULTI_TURN domains of rl.tasks). The long-context grid (eval.long_context.*, metrics
# long_ctx_needle / long_ctx_multihop) runs beside the suites, through posttrain/eval/long_context_eval.py.
EXTRA_SUITES: dict[str, Callable] = {}


def suite_version(tasks) -> str:
    """A short hash of a suite's records (ids, prompts, targets): changes when any record does."""
    h = hashlib.sha256()
    for t in tasks:
        target = dataclasses.asdict(t.target) if dataclasses.is_dataclass(t.target) else repr(t.target)
        h.update(json.dumps([t.id, list(t.prompt), target], sort_keys=True, default=repr).encode())
    return h.hexdigest()[:16]


def parse_suites(spec: str) -> list[tuple[str, str]]:
    """ "arithmetic, mine=/data/x.jsonl" → [("arithmetic", ""), ("mine", "/data/x.jsonl")]."""
    out = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, path = (s.strip() for s in part.partition("="))
        if not path and name not in BUILTIN and name not in EXTRA_SUITES:
            raise ValueError(
                f"eval.suites: unknown suite {name!r}; built-in: {', '.join(BUILTIN + tuple(EXTRA_SUITES))}"
                ', or name=path.jsonl for a file of {"prompt", "answer"} records'
            )
        if not name or "/" in name:
            raise ValueError(
                f"eval.suites: bad suite name {name!r} in {part!r} (a name without '/', e.g. mine=x.jsonl)"
            )
        out.append((name, path))
    if not out:
        raise ValueError("eval.suites is empty: name at least one suite")
    if len({n for n, _ in out}) != len(out):
        raise ValueError(f"eval.suites={spec!r}: a suite name appears twice")
    return out


def user_tasks(name: str, path: str, on_error: str = "raise") -> list[Task]:
    """The records `{"prompt", "answer"}` of a JSONL file as math tasks, ids `{name}:{line}`."""
    skips, tasks = SkipLog(on_error), []
    for rec in read_jsonl(path, skips=skips):
        prompt, answer = rec.data.get("prompt"), rec.data.get("answer")
        if not isinstance(prompt, str) or answer is None or isinstance(answer, (dict, list)):
            skips.bad(f"{rec.path}:{rec.line}", 'expected {"prompt": str, "answer": str or number}')
            continue
        tasks.append(Task(f"{name}:{rec.line}", ({"role": "user", "content": prompt},), MathTask(str(answer))))
    return tasks


def multi_turn_suites(spec: str) -> list[str]:
    """The suites of `eval.suites` spec that run multi-turn tool episodes."""
    return [n for n, p in parse_suites(spec) if not p and n in MULTI_TURN]


def _builtin_suites(cfg, tok, names: list[str], env: str) -> dict[str, Domain]:
    """The held-out tasks of built-in domains `names`, in `rl.env = env` environments."""
    if not names:
        return {}
    sub = cfg.copy_and_resolve_references()
    sub.rl.domains, sub.rl.eval_size, sub.rl.env = ",".join(names), cfg.eval.size, env
    domains, held_out = make_domains(sub, tok, make_reward_fn(sub.rl))
    return {n: Domain(n, [t for d, t in held_out if d == n], domains[n].make_env) for n in names}


def make_suites(cfg, tok) -> dict[str, Domain]:
    """The suites of `eval.suites`: name -> Domain (its tasks and environment). Built-in
    single-turn suites get one-answer environments and multi-turn ones (`MULTI_TURN`) tool
    episodes, whatever `rl.env` says (it is the RL stage's switch)."""
    named = parse_suites(cfg.eval.suites)
    builtin = [n for n, p in named if not p and n in BUILTIN]
    if not builtin and cfg.eval.size != 128:
        raise ValueError(
            f"eval.size={cfg.eval.size} cannot take effect: it sizes the built-in suites "
            f"({', '.join(BUILTIN)}) and eval.suites={cfg.eval.suites!r} has none"
        )
    multi = multi_turn_suites(cfg.eval.suites)
    suites = {
        **_builtin_suites(cfg, tok, [n for n in builtin if n not in multi], "single"),
        **_builtin_suites(cfg, tok, multi, "tool"),
    }
    sub = cfg.copy_and_resolve_references()
    sub.rl.env = "single"
    reward_fn = make_reward_fn(sub.rl)
    env = lambda: SingleTurnEnv(tok, reward_fn, max_turn_tokens=cfg.rl.max_new_tokens)
    for n, path in named:
        if path:
            suites[n] = Domain(n, user_tasks(n, path, cfg.data.on_error), env)
        elif n in EXTRA_SUITES:
            suites[n] = EXTRA_SUITES[n](cfg, tok, reward_fn)
    return {n: suites[n] for n, _ in named}
