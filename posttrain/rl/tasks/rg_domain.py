"""reasoning-gym datasets as RL task domains: `rl.domains=rg:<dataset>[:weight]`.

Prompts are reasoning-gym's generated questions (with the math instruction: the final answer
boxed), rewards its scorers behind posttrain's guard (`verifiers/rg.py`, which also lists the
datasets served and those refused with the reason). Settings:
- `rl.rg_settings` ("chain_sum.max_terms=4; leg_counting.max_animals=3"): the generator's config
  fields, checked against its config dataclass (an unknown one is refused naming the valid ones;
  `seed` and `size` are posttrain's), then by the generator's own `validate`;
- `rl.curriculum.rg_levels` ("0,1,2"): tasks drawn at those levels of the dataset's curriculum
  (`BaseCurriculum.set_global_level`, settings for the attributes the curriculum does not set
  kept), an equal share each, labelled `level<n>` (the scheduler's per-difficulty metrics and
  held-out accuracy per level; with `rl.curriculum.band_weights` the draws favour the tasks, so the
  levels, whose pass rate is in the band asked).

Splits. Item i of a reasoning-gym dataset is drawn from `Random(seed + i)`; each (split, level)
draws from its own range of such seeds (`item_seeds`, disjoint by construction), and held out by
meaning: a training task whose meaning (`meaning`: the expression with commuting operands
sorted, the animals counted, the numbers of a gcd, ...) is a held-out task's is dropped (counted
in the log). Held-out tasks are distinct by meaning.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from posttrain.config import RunConfig
from posttrain.config.registry import DOMAINS
from posttrain.config.syntax import parse_ints, parse_settings
from posttrain.data.synthetic import SPLITS, canonical_text
from posttrain.errors import UserError
from posttrain.rl.envs.base import Task
from posttrain.rl.tasks.domains import MATH_INSTRUCTION, Domain
from posttrain.rl.verifiers.rg import SUPPORTED, RGTask, check_dataset, load_rg

SPAN = 1 << 16  # items per (split, level): the seeds of one never reach another's
MAX_LEVEL_SLOTS = 64
OWN_SETTINGS = ("seed", "size")  # set by posttrain: the split's seeds, the number of tasks
HELD_OUT_TRIES = 8  # draws per held-out task asked before giving up on distinct meanings


def item_seeds(run_seed: int, split: str, slot: int) -> int:
    """The reasoning-gym seed of a split's items at level slot `slot` (items i use `seed + i`,
    i < SPAN): the ranges of different (split, slot) pairs, and of different run seeds, are disjoint."""
    return run_seed * (2 * MAX_LEVEL_SLOTS * SPAN) + (SPLITS.index(split) * MAX_LEVEL_SLOTS + slot) * SPAN


def _sorted_numbers(entry: Mapping[str, Any]) -> str:
    return ",".join(str(n) for n in sorted(entry["metadata"]["numbers"]))


def _equation(entry: Mapping[str, Any]) -> str:
    meta = entry["metadata"]
    return canonical_text(meta["equation"].replace(meta["variable"], "x"))


# What makes two items the same problem, per dataset (others: the question's canonical text).
MEANING: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "basic_arithmetic": lambda e: canonical_text(e["metadata"]["expression"]),
    "chain_sum": lambda e: canonical_text(e["metadata"]["expression"]),
    "products": lambda e: canonical_text(e["metadata"]["expression"]),
    "leg_counting": lambda e: ",".join(f"{a}={n}" for a, n in sorted(e["metadata"]["animals"].items())),
    "gcd": _sorted_numbers,
    "lcm": _sorted_numbers,
    "count_bits": lambda e: str(e["metadata"]["number"]),
    "letter_counting": lambda e: f"{e['metadata']['target_letter']}:{' '.join(e['metadata']['span']).lower()}",
    "simple_equations": _equation,
}


def meaning(dataset: str, entry: Mapping[str, Any]) -> str:
    """The key two equivalent items of `dataset` share (the split compares these, never spellings)."""
    key = MEANING.get(dataset)
    return f"{dataset}:{key(entry) if key else canonical_text(entry['question'])}"


def check_settings(dataset: str, settings: Mapping[str, Any]) -> None:
    """Refuse settings the dataset's config dataclass has no field for (naming the valid ones), the
    ones posttrain sets, and values the generator's own check rejects."""
    from reasoning_gym.factory import DATASETS

    fields = [f.name for f in dataclasses.fields(DATASETS[dataset][1]) if f.name not in OWN_SETTINGS]
    for key in settings:
        if key in OWN_SETTINGS:
            raise UserError(
                f"rl.rg_settings: {dataset}.{key} is posttrain's (the split's seeds and the task count: "
                "seed, rl.arithmetic_size / rl.eval_size)",
                key="rl.rg_settings",
            )
        if key not in fields:
            raise UserError(
                f"rl.rg_settings: rg:{dataset} has no setting {key!r}; valid: {', '.join(fields)}", key="rl.rg_settings"
            )
    _generator_config(dataset, dict(settings))


def _generator_config(dataset: str, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The generator's full config for `kwargs` (its dataclass's fields), checked by its `validate`."""
    from reasoning_gym.factory import DATASETS

    try:
        config = DATASETS[dataset][1](**kwargs)
        if hasattr(config, "validate"):
            config.validate()
    except (AssertionError, TypeError, ValueError) as e:
        raise UserError(
            f"rl.rg_settings: rg:{dataset} refuses {kwargs}: {e or type(e).__name__}", key="rl.rg_settings"
        ) from None
    return {k: v for k, v in dataclasses.asdict(config).items() if k not in OWN_SETTINGS}


def level_settings(dataset: str, settings: Mapping[str, Any], level: int | None) -> dict[str, Any]:
    """The generator's settings at a curriculum level (None: the settings alone)."""
    if level is None:
        return _generator_config(dataset, dict(settings))
    from reasoning_gym.factory import create_curriculum, has_curriculum

    if not has_curriculum(dataset):
        raise UserError(
            f"rl.curriculum.rg_levels: rg:{dataset} has no curriculum in reasoning-gym; drop it from rl.domains "
            "or set rl.curriculum.rg_levels=''",
            key="rl.curriculum.rg_levels",
        )
    curriculum = create_curriculum(dataset)
    top = max(len(a.levels) for a in curriculum.attributes.values()) - 1
    if level > top:
        raise UserError(
            f"rl.curriculum.rg_levels: rg:{dataset} has levels 0..{top}, not {level}", key="rl.curriculum.rg_levels"
        )
    curriculum.set_global_level(level)
    config = curriculum.generate_configuration(defaults={})
    for attr in curriculum.attributes.values():
        names = [attr.field_name] if hasattr(attr, "field_name") else [attr.lower_field_name, attr.upper_field_name]
        clash = sorted(set(names) & set(settings))
        if clash:
            raise UserError(
                f"rl.rg_settings: {dataset}.{clash[0]} is set by rl.curriculum.rg_levels (the curriculum's "
                f"attribute {attr.name!r}); set one or the other",
                key="rl.rg_settings",
            )
    return _generator_config(dataset, {**dataclasses.asdict(config), **settings})


def _draw(dataset: str, kwargs: Mapping[str, Any], seed: int, n: int) -> list[dict[str, Any]]:
    """`n` items of the generator (`kwargs` its settings) from `Random(seed + i)`, i < n."""
    from reasoning_gym.factory import create_dataset

    data = create_dataset(dataset, **kwargs, seed=seed, size=max(n, 1))
    return [data[i] for i in range(n)]


def _shares(dataset: str, n: int, parts: int) -> list[int]:
    """`n` tasks split over `parts` levels; at most SPAN each (their seeds would reach the next range)."""
    if n > SPAN * parts:
        raise UserError(
            f"rg:{dataset}: at most {SPAN} tasks per split and level, asked for {n} over {parts} level(s) "
            "(rl.arithmetic_size, rl.eval_size)",
            key="rl.arithmetic_size",
        )
    return [n // parts + (k < n % parts) for k in range(parts)]


def rg_tasks(
    dataset: str,
    split: str,
    n: int,
    run_seed: int,
    settings: Mapping[str, Any] | None = None,
    levels: list[int] | None = None,
    held_out: frozenset[str] = frozenset(),
) -> list[Task]:
    """`n` tasks of `dataset` from `split`'s seeds, an equal share per level of `levels` (none: the
    settings alone), ids `rg:{dataset}/{split}/{level}:{i}`. Test tasks are distinct by meaning;
    training tasks whose meaning is in `held_out` are left out (logged), so a split may come short."""
    check_dataset(dataset)
    settings, slots = dict(settings or {}), list(levels or [None])
    out, dropped = [], 0
    for slot, (level, share) in enumerate(zip(slots, _shares(dataset, n, len(slots)))):
        kwargs = level_settings(dataset, settings, level)
        seed, label = item_seeds(run_seed, split, slot), None if level is None else f"level{level}"
        tries = share * HELD_OUT_TRIES if split == "test" else share
        seen: set[str] = set()
        for i, entry in enumerate(_draw(dataset, kwargs, seed, min(tries, SPAN))):
            key = meaning(dataset, entry)
            if key in held_out or (split == "test" and key in seen):
                dropped += split == "train"
                continue
            seen.add(key)
            task = RGTask(
                dataset, json.dumps(kwargs, sort_keys=True), entry["question"], str(entry["answer"]), entry["metadata"]
            )
            prompt = ({"role": "user", "content": entry["question"] + MATH_INSTRUCTION},)
            out.append(Task(f"rg:{dataset}/{split}/{label or 'default'}:{i}", prompt, task, difficulty=label))
            if len(seen) == share and split == "test":
                break
    if dropped:
        logging.warning("rg:%s train: left out %d tasks that mean a held-out task", dataset, dropped)
    return out


def rg_config(cfg: RunConfig) -> tuple[dict[str, dict[str, Any]], list[int] | None]:
    """The run's generator settings per dataset and curriculum levels (None: no levels)."""
    levels = parse_ints(cfg.rl.curriculum.rg_levels)
    return parse_settings(cfg.rl.rg_settings), levels or None


def check_rg(cfg: RunConfig) -> None:
    """Start-up check of a run's rg domains: the package, the dataset names, the settings (each for
    a dataset the run trains on) and the curriculum levels, before a model is built."""
    from posttrain.config.rl import domain_weights

    names = [n.partition(":")[2] for n in domain_weights(cfg.rl) if n.startswith("rg:")]
    settings, levels = rg_config(cfg)
    if not names:
        return
    load_rg()
    for name in names:
        check_dataset(name)
    unused = sorted(set(settings) - set(names))
    if unused:
        raise UserError(
            f"rl.rg_settings: {unused} are not in rl.domains ({', '.join('rg:' + n for n in names)})",
            key="rl.rg_settings",
        )
    for name in names:
        check_settings(name, settings.get(name, {}))
        for level in levels or [None]:
            level_settings(name, settings.get(name, {}), level)
        for n in (cfg.rl.arithmetic_size, cfg.rl.eval_size):
            _shares(name, n, len(levels or [None]))


def _builder(dataset: str, cfg: RunConfig, env: Callable) -> tuple[Domain, list[Task]]:
    """Domain `rg:<dataset>` (training tasks, `rl.arithmetic_size` of them) and its held-out tasks."""
    settings, levels = rg_config(cfg)
    kw = dict(run_seed=cfg.seed, settings=settings.get(dataset), levels=levels)
    held_out = rg_tasks(dataset, "test", cfg.rl.eval_size, **kw)
    keys = frozenset(meaning(dataset, t.target.entry) for t in held_out)
    return Domain(
        f"rg:{dataset}", rg_tasks(dataset, "train", cfg.rl.arithmetic_size, held_out=keys, **kw), env
    ), held_out


def _resolve(dataset: str) -> Callable:
    """The domain builder of `rg:<dataset>`, once the package and the dataset are checked."""
    load_rg()
    check_dataset(dataset)
    return functools.partial(_builder, dataset)


DOMAINS.register_family("rg", _resolve)
__all__ = ["SUPPORTED", "check_rg", "meaning", "rg_tasks"]
