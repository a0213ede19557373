"""What the RLVR loop trains on: the task domains, the held-out tasks, the environments and the
reward sources, each from a registry (`posttrain.config.registry`).

- `DOMAINS`: name → builder of a (training domain, held-out tasks) pair, `builder(cfg, make_env)`,
  both disjoint by construction. The built-ins (`arithmetic`, `gsm8k`, `humaneval`, the agent domain
  `repo_fix`, which needs `rl.env = "tool"`, and the screenshot agent's `screen`, which needs
  `rl.env = "screen"`) register here, reasoning-gym's datasets as the family `rg:<dataset>`
  (`rg_domain.py`); `@DOMAINS.register(name)` adds more. The user's own files
  (`rl.train_files`, `rl.eval_files`, see `files.py`) add one domain per `domain` field of their records.
- `ENVIRONMENTS` (`rl.env`): name → factory of one episode's environment.
- `VERIFIERS`: the built-in `math`, `code` (sandboxed) and `label` verifiers register in their own
  modules, by the task type they judge; user functions by name (`rl.verifiers = "mypkg.rewards:score"`,
  or `USER_VERIFIERS.register(name, fn)`), run with a timeout (`rl.verifier_timeout_s`; the contract
  is in `verifiers/user.py` and the README).
Reward sources are composed here, in one place (`make_reward_fn`): verifiers per task type with
the configured shaping. A learned reward model is another source beside them (`reward_model`).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable

from posttrain.config import RLConfig, RunConfig
from posttrain.config.registry import DOMAINS, ENVIRONMENTS, USER_VERIFIERS, VERIFIERS
from posttrain.config.rl import domain_weights as domain_spec
from posttrain.config.syntax import parse_weights as _parse_weights
from posttrain.data.images import ImageSpec
from posttrain.data.sources import SkipLog
from posttrain.rl.envs import SingleTurnEnv
from posttrain.rl.envs.base import Task
from posttrain.rl.envs.images import ImageTokens
from posttrain.rl.envs.screen_env import ScreenEnv
from posttrain.rl.envs.workspace import WORKSPACE_LIMITS, WorkspaceEnv
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.tasks import domains as domain_lib
from posttrain.rl.tasks import files as task_files
from posttrain.rl.tasks import repo_domain, screen_domain
from posttrain.rl.tasks import rg_domain as _rg_domain  # noqa: F401  (registers the rg:<dataset> family)
from posttrain.rl.tasks.scheduler import BANDS
from posttrain.rl.verifiers.user import ScoreFn, UserTask, UserVerifier, load_callable
from posttrain.sandbox import Sandbox

DomainBuilder = Callable[[RunConfig, Callable], tuple[domain_lib.Domain, list[Task]]]


@DOMAINS.register("arithmetic")
def _arithmetic(cfg: RunConfig, env):
    r, kw = cfg.rl, dict(instruction=cfg.rl.instruction, max_value=cfg.data.synthetic_max_value)
    return (
        domain_lib.arithmetic_domain(env, n=r.arithmetic_size, seed=cfg.seed + 1, **kw),
        domain_lib.arithmetic_tasks(r.eval_size, seed=cfg.seed + 10_000, **kw),
    )


@DOMAINS.register("gsm8k")
def _gsm8k(cfg: RunConfig, env):
    return domain_lib.gsm8k_domain(env, split="train"), domain_lib.gsm8k_tasks(split="test", limit=cfg.rl.eval_size)


@DOMAINS.register("humaneval")
def _humaneval(cfg: RunConfig, env):
    return domain_lib.humaneval_domain(env), domain_lib.humaneval_tasks(limit=cfg.rl.eval_size)


@DOMAINS.register("repo_fix")
def _repo_fix(cfg: RunConfig, env):
    if cfg.rl.env != "tool":
        raise ValueError(
            f"rl.domains: repo_fix is an agent domain (tool calls in a sandboxed repository); it needs "
            f"rl.env='tool', got rl.env={cfg.rl.env!r}"
        )
    return (
        repo_domain.repo_fix_domain(env, seed=cfg.seed + 1),
        repo_domain.repo_tasks("test", cfg.rl.eval_size, seed=cfg.seed + 10_000),
    )


@DOMAINS.register("screen")
def _screen(cfg: RunConfig, env):
    if cfg.rl.env != "screen":
        raise ValueError(f"rl.domains: screen runs screenshot episodes; it needs rl.env='screen', got {cfg.rl.env!r}")
    # Held-out screens are few (`screen_domain.held_out_counts`): more than exist is refused, not
    # repeated; none are drawn when nothing evaluates them (rl.eval_every = 0).
    n = cfg.rl.eval_size if cfg.rl.eval_every else 0
    if n > (most := screen_domain.max_held_out()):
        counts = ", ".join(f"{c} {k}" for k, c in screen_domain.held_out_counts().items())
        raise ValueError(
            f"rl.eval_size={n}: the screen domain has only {most} distinct held-out tasks ({counts}, "
            f"kinds in turn); set rl.eval_size <= {most}"
        )
    return (
        screen_domain.screen_domain(env, seed=cfg.seed + 1),
        screen_domain.screen_tasks(n, cfg.seed + 10_000, "test"),
    )


def register_domain(name: str, builder: DomainBuilder) -> None:
    """Make `name` usable in `rl.domains` (`DOMAINS.register`)."""
    DOMAINS.register(name, builder)


def register_verifier(name: str, fn: ScoreFn) -> None:
    """Make `name` usable as a record's `"verifier"`: `fn(prompt, response, record)` (see verifiers/user.py)."""
    if name in VERIFIERS:
        raise ValueError(f"verifier {name!r} is already registered")
    USER_VERIFIERS.register(name, fn)


def parse_weights(spec: str) -> dict[str, float]:
    """ "arithmetic:2,gsm8k" → {"arithmetic": 2.0, "gsm8k": 1.0}; empty is an error naming the domains."""
    out = _parse_weights(spec)
    if not out:
        raise ValueError(f"rl.domains is empty: name at least one of {sorted(DOMAINS)} or set rl.train_files")
    return out


def domain_weights(r, domains) -> dict[str, float]:
    """Mixture weights of the training `domains`: as `rl.domains` gives them, else 1."""
    spec = domain_spec(r)
    return {name: spec.get(name, 1.0) for name in domains}


def curriculum_options(c) -> dict:
    """`rl.curriculum` as TaskScheduler keyword arguments (its module docstring says what each does)."""
    weights = None
    if c.band_weights.strip():
        weights = {}
        for part in filter(None, (p.strip() for p in c.band_weights.split(","))):
            band, _, w = part.partition(":")
            try:
                weights[band.strip()] = float(w) if w else 1.0
            except ValueError:
                raise ValueError(
                    f"rl.curriculum.band_weights={c.band_weights!r}: {part!r} is not band[:weight]"
                ) from None
        unknown = sorted(set(weights) - set(BANDS))
        if unknown or sum(weights.values()) <= 0 or min(weights.values()) < 0:
            raise ValueError(
                f"rl.curriculum.band_weights={c.band_weights!r}: expected non-negative weights, some "
                f"positive, of the bands {BANDS}" + (f"; unknown {unknown}" if unknown else "")
            )
    return dict(
        band_weights=weights,
        band_edges=(c.hard_below, c.easy_above),
        min_attempts=c.min_attempts,
        pass_threshold=c.pass_threshold,
        window=c.window,
        retire_after=c.retire_after,
        retire_above=c.retire_above if c.retire_above >= 0 else None,
        retire_below=c.retire_below if c.retire_below >= 0 else None,
    )


def user_verifiers(r) -> dict[str, ScoreFn]:
    """Registered user verifiers plus those of `rl.verifiers` ("[name=]package.module:function,..."; the
    name defaults to the function's)."""
    out = {name: USER_VERIFIERS[name] for name in USER_VERIFIERS}
    for spec in filter(None, (s.strip() for s in r.verifiers.split(","))):
        name, eq, target = spec.partition("=")
        if not eq:
            name, target = spec.rpartition(":")[2].rpartition(".")[2], spec
        name = name.strip()
        if name in VERIFIERS or name in out:
            raise ValueError(
                f"rl.verifiers: the name {name!r} is taken (built-ins {VERIFIERS.names()}, "
                f"registered {sorted(USER_VERIFIERS)}); give yours another: 'myname={target.strip()}'"
            )
        out[name] = load_callable(target.strip())
    return out


def make_domains(
    cfg: RunConfig, tok, reward_fn, *, rl: RLConfig | None = None
) -> tuple[dict[str, domain_lib.Domain], list[tuple[str, object]]]:
    """Training domains and held-out (domain, task) pairs for evaluation: the registry's domains
    named in `rl.domains`, then those of `rl.train_files` / `rl.eval_files`. `rl`: the rl section
    to read instead of `cfg.rl` (the eval suites' and rejection sampling's variants)."""
    if rl is not None:
        cfg = dataclasses.replace(cfg, rl=rl)
    r = cfg.rl
    env = make_env_factory(cfg.rl, tok, reward_fn, ImageSpec.from_config(cfg.model.vision), cfg.workdir)
    spec, domains, held_out = domain_spec(r), {}, []
    file_domains, eval_tasks = _user_tasks(cfg)
    for name in spec:
        if name in DOMAINS and name not in file_domains:
            domains[name], tasks = DOMAINS[name](cfg, env)
            if r.eval_every and len(tasks) < r.eval_size:  # a data set smaller than asked: say so
                logging.warning(
                    "rl.eval_size=%d: domain %s has only %d held-out tasks; it is evaluated on those %d",
                    r.eval_size,
                    name,
                    len(tasks),
                    len(tasks),
                )
            held_out += [(name, t) for t in tasks]
        elif name not in file_domains:
            raise ValueError(
                f"rl.domains: unknown {name!r}; valid: {sorted(DOMAINS)} and the domains of "
                f"rl.train_files {sorted(file_domains)}"
            )
    for name, tasks in file_domains.items():
        if name in DOMAINS and name in spec:
            raise ValueError(
                f"rl.train_files: domain {name!r} is also a built-in domain named in rl.domains; "
                "rename it in the records' 'domain' field"
            )
        domains[name] = domain_lib.Domain(name, [t for _, t in tasks], env)
    # Held-out tasks of a domain not trained on run in any domain's environment (they are all the same).
    fallback = next(iter(domains), None)
    for name, tasks in eval_tasks.items():
        held_out += [(name if name in domains else fallback, t) for _, t in tasks[: r.eval_size]]
    if not domains:
        raise ValueError("no training tasks: rl.domains names none and rl.train_files has none")
    if r.eval_every and not held_out:
        raise ValueError(
            f"rl.eval_every={r.eval_every} but there are no held-out tasks: set rl.eval_files (or rl.eval_every=0)"
        )
    return domains, held_out


@ENVIRONMENTS.register("single")
def _single(r: RLConfig, tok, reward_fn, images: ImageTokens | None, workdir: str) -> Callable:
    return lambda: SingleTurnEnv(tok, reward_fn, max_turn_tokens=r.max_new_tokens, image_part=images)


@ENVIRONMENTS.register("screen")
def _screen_env(r: RLConfig, tok, reward_fn, images: ImageTokens | None, workdir: str) -> Callable:
    screens = os.path.join(workdir, "screens")
    return lambda: ScreenEnv(
        tok, reward_fn, screens, max_turns=r.max_turns, max_turn_tokens=r.max_new_tokens, image_part=images
    )


@ENVIRONMENTS.register("tool")
def _tool(r: RLConfig, tok, reward_fn, images: ImageTokens | None, workdir: str) -> Callable:
    sandbox, limits = Sandbox(WORKSPACE_LIMITS), dataclasses.replace(WORKSPACE_LIMITS, wall_s=r.tool_timeout_s)
    return lambda: WorkspaceEnv(
        tok, reward_fn, sandbox, max_turns=r.max_turns, max_turn_tokens=r.max_new_tokens, limits=limits
    )


def make_env_factory(r: RLConfig, tok, reward_fn, images: ImageSpec | None = None, workdir: str = ".") -> Callable:
    """The environment of one episode, per the `rl` section's `env` (`ENVIRONMENTS`): `single` (one
    answer), `tool` (up to `rl.max_turns` model turns of `rl.max_new_tokens` each, with shell/Python
    calls in a persistent sandboxed working directory; `envs/workspace.py`; one sandbox serves all
    episodes) or `screen` (rendered screens, written under `workdir/screens`; `envs/screen_env.py`).
    `images` (`model.vision`): image parts of prompts become that many placeholder tokens."""
    return ENVIRONMENTS[r.env](r, tok, reward_fn, None if images is None else ImageTokens(images), workdir)


def _user_tasks(cfg: RunConfig) -> tuple[dict[str, list[tuple[str, Task]]], dict[str, list[tuple[str, Task]]]]:
    """(train, eval) tasks of the user's files by domain; every rl.verifiers entry must be used."""
    r = cfg.rl
    names = user_verifiers(r)
    skips = SkipLog(cfg.data.on_error)
    train = task_files.read_task_files(r.train_files, names, skips) if r.train_files else {}
    evals = task_files.read_task_files(r.eval_files, names, skips) if r.eval_files else {}
    overlap = 0
    if evals:
        prompts = {task_files.normalise_prompt(t): where for tasks in train.values() for where, t in tasks}
        overlap = task_files.drop_overlap(evals, prompts)
    used = {
        t.target.verifier for d in (train, evals) for ts in d.values() for _, t in ts if isinstance(t.target, UserTask)
    }
    unused = sorted(set(names) - set(USER_VERIFIERS) - used)
    if unused:
        raise ValueError(
            f"rl.verifiers: {unused} verify no record of rl.train_files / rl.eval_files (a record "
            "names its verifier in its 'verifier' field)"
        )
    if skips.skipped:
        logging.warning(
            "rl.train_files / rl.eval_files: skipped %d bad task records (data.on_error='skip')", skips.skipped
        )
    for what, found in (("rl.train_files", train), ("rl.eval_files", evals)):
        if getattr(r, what.split(".")[1]) and not any(found.values()):
            why = (
                f" ({overlap} were training prompts in another spelling)" if what == "rl.eval_files" and overlap else ""
            )
            raise ValueError(f"{what}={getattr(r, what.split('.')[1])!r}: no usable task record{why}")
    return train, evals


def make_reward_fn(r: RLConfig) -> RewardFunction:
    """Math, code (sandboxed, built when first needed) and user verifiers with the shaping the
    `rl` section `r` configures (format, overlong, tool-call penalties)."""
    # The overlong ramp is over a sample's model tokens: one turn, or all turns of an episode.
    budget = r.max_new_tokens * (r.max_turns if r.env != "single" else 1)
    config = RewardConfig(
        format_penalty=r.format_penalty,
        max_tokens=budget if r.overlong_buffer else None,
        overlong_buffer=r.overlong_buffer,
        invalid_tool_call_penalty=r.invalid_tool_call_penalty,
        redundant_tool_call_penalty=r.redundant_tool_call_penalty,
    )
    verifiers = {VERIFIERS[name].task: VERIFIERS[name].make() for name in VERIFIERS}
    functions = user_verifiers(r)
    if functions:
        verifiers[UserTask] = UserVerifier(functions, timeout_s=r.verifier_timeout_s)
    return RewardFunction(verifiers, config)
