"""Evaluation suites: the held-out tasks of the built-in domains and the user's task files, named by
`eval.suites` ("arithmetic, gsm8k, rg:chain_sum, mine=/data/x.jsonl"), each a `Domain` (its tasks and the
environment that scores them). Stage `eval` (`posttrain/stages/eval.py`) runs them, and the
lm-eval tasks the spec names as `lm_eval:<task>` (`lm_eval_suites`) through `eval/lm_harness.py`.

A user suite's records are `rl.eval_files` records (`rl/tasks/files.py`): `{"prompt", "answer"}`
(math) and the code, label and user-verifier forms; a prompt is a string or messages whose contents
may hold image parts (paths relative to the suite file's folder), shown to a vision model
(`model.vision`) as its placeholder tokens and patches. An image prompt for a text-only model is
refused, naming its file:line. A reasoning-gym dataset (`rg:<dataset>`) is evaluated on the
held-out tasks an rlvr run of the same seed draws for it (`rl.rg_settings` and
`rl.curriculum.rg_levels` apply; disjoint by meaning from that run's training tasks).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
from collections.abc import Callable

from posttrain.config.train import LM_EVAL
from posttrain.data.images import ImageSpec
from posttrain.data.sources import SkipLog
from posttrain.rl.envs.base import Task
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.tasks.files import jsonl_tasks
from posttrain.rl.tasks.registry import DOMAINS, make_domains, make_env_factory, make_reward_fn, user_verifiers

BUILTIN = ("arithmetic", "gsm8k", "humaneval", "repo_fix")
_TASK_NAME = re.compile(r"[\w.\-]+")  # an lm-eval task name after `lm_eval:`
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
        if name.startswith(LM_EVAL) and not path:
            if not _TASK_NAME.fullmatch(name.removeprefix(LM_EVAL)):
                raise ValueError(f"eval.suites: bad lm-eval task in {part!r}: expected lm_eval:<task name>")
            out.append((name, ""))
            continue
        if not path and _family_member(name):
            DOMAINS[name]  # noqa: B018  (a member that does not exist is refused, naming the valid ones)
            out.append((name, ""))
            continue
        if not path and name not in BUILTIN and name not in EXTRA_SUITES:
            raise ValueError(
                f"eval.suites: unknown suite {name!r}; built-in: {', '.join(BUILTIN + tuple(EXTRA_SUITES))}"
                ', name=path.jsonl for a file of {"prompt", "answer"} records, lm_eval:<task> for an lm-eval '
                "task, or rg:<dataset> for a reasoning-gym dataset's held-out tasks"
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


def _family_member(name: str) -> bool:
    """A task domain family's member (`rg:<dataset>`): evaluated on its held-out tasks as RL draws them."""
    return ":" in name and not name.startswith(LM_EVAL) and name in DOMAINS


def lm_eval_suites(spec: str) -> list[str]:
    """The suites of `eval.suites` spec that are lm-eval tasks (`lm_eval:<task>`), as named there."""
    return [n for n, p in parse_suites(spec) if not p and n.startswith(LM_EVAL)]


def _has_image(task: Task) -> bool:
    return any(
        isinstance(m["content"], list) and any(isinstance(p, dict) and p.get("type") == "image" for p in m["content"])
        for m in task.prompt
    )


def user_tasks(
    name: str, path: str, on_error: str = "raise", *, verifiers=(), images: bool = True, vision: str = "none"
) -> list[Task]:
    """The records of a JSONL file as tasks (`rl.eval_files` records: `files.record_task`; image
    paths resolved against the file's folder), ids `{name}:{line}`. `verifiers`: the user verifier
    names there are; `images`: whether the model sees images — else an image prompt is refused,
    naming its file:line and `model.vision.encoder` (`vision`)."""
    skips, tasks = SkipLog(on_error), []
    for where, line, _, task in jsonl_tasks(path, verifiers, skips):
        if not images and _has_image(task):
            raise ValueError(
                f"eval.suites: {name}={path}: {where} has an image prompt, but model.vision.encoder={vision!r} "
                "(a text-only model cannot see it): evaluate a vision model or drop the image"
            )
        tasks.append(dataclasses.replace(task, id=f"{name}:{line}"))
    return tasks


def multi_turn_suites(spec: str) -> list[str]:
    """The suites of `eval.suites` spec that run multi-turn tool episodes."""
    return [n for n, p in parse_suites(spec) if not p and n in MULTI_TURN]


def _builtin_suites(cfg, tok, names: list[str], env: str) -> dict[str, Domain]:
    """The held-out tasks of built-in domains `names`, in `rl.env = env` environments."""
    if not names:
        return {}
    rl = dataclasses.replace(cfg.rl, domains=",".join(names), eval_size=cfg.eval.size, env=env)
    domains, held_out = make_domains(cfg, tok, make_reward_fn(rl), rl=rl)
    return {n: Domain(n, [t for d, t in held_out if d == n], domains[n].make_env) for n in names}


def make_suites(cfg, tok) -> dict[str, Domain]:
    """The suites of `eval.suites` but lm-eval tasks (stage `eval` runs those through
    `eval.lm_harness`): name -> Domain (its tasks and environment). Built-in
    single-turn suites get one-answer environments and multi-turn ones (`MULTI_TURN`) tool
    episodes, whatever `rl.env` says (it is the RL stage's switch)."""
    named = parse_suites(cfg.eval.suites)
    builtin = [n for n, p in named if not p and (n in BUILTIN or _family_member(n))]
    if not builtin and not lm_eval_suites(cfg.eval.suites) and cfg.eval.size != 128:
        raise ValueError(
            f"eval.size={cfg.eval.size} cannot take effect: it sizes the built-in suites "
            f"({', '.join(BUILTIN)}) and lm-eval tasks, and eval.suites={cfg.eval.suites!r} has none"
        )
    multi = multi_turn_suites(cfg.eval.suites)
    suites = {
        **_builtin_suites(cfg, tok, [n for n in builtin if n not in multi], "single"),
        **_builtin_suites(cfg, tok, multi, "tool"),
    }
    rl = dataclasses.replace(cfg.rl, env="single")
    reward_fn = make_reward_fn(rl)
    spec = ImageSpec.from_config(cfg.model.vision)  # None: text only
    env = make_env_factory(rl, tok, reward_fn, spec, cfg.workdir)  # one answer, image parts as patches
    names = tuple(user_verifiers(rl))
    for n, path in named:
        if path:
            tasks = user_tasks(
                n, path, cfg.data.on_error, verifiers=names, images=spec is not None, vision=cfg.model.vision.encoder
            )
            suites[n] = Domain(n, tasks, env)
        elif n in EXTRA_SUITES:
            suites[n] = EXTRA_SUITES[n](cfg, tok, reward_fn)
    return {n: suites[n] for n, _ in named if n in suites}
