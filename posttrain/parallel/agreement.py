"""Agreement across processes: a choice one process makes from local facts (a device's memory, the
checkpoints it can read, a signal it received, its share of an evaluation) must be the same on
every process before it changes a collective — otherwise the processes trace different programs,
or one waits in a collective the others never enter.

`agree(value, name=...)` all-gathers every process's JSON-serialisable view and either checks that
they are equal (raising `Disagreement` with each process's view) or reduces them (`reduce`:
min, max, any, all, intersection, union). With one process it is the identity and runs no
collective. The exchange is `multihost_utils.process_allgather` (through `allgather_json`), so
every process must call `agree` at the same point of the run, with the same `name`. The exchange
runs on a helper thread: jax's trace state is per thread, so a choice made while a program traces
(e.g. `auto` context parallelism) can still run the exchange's own small program.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from typing import Any

import jax

from posttrain.parallel.distributed import allgather_json


class Disagreement(RuntimeError):
    """Processes hold different views of a value that must be the same on each."""


def _sets(views: list) -> list[set]:
    return [set(v) for v in views]


REDUCERS: dict[str, Callable[[list], Any]] = {
    "min": min,
    "max": max,
    "any": lambda views: any(views),
    "all": lambda views: all(views),
    "intersection": lambda views: set.intersection(*_sets(views)),
    "union": lambda views: set.union(*_sets(views)),
}


def _portable(value: Any, reduce: str | None) -> Any:
    """The value as JSON (sets as sorted lists)."""
    if reduce in ("intersection", "union"):
        return sorted(value)
    return value


def combine(views: list, name: str, reduce: str | None = None) -> Any:
    """The agreed value of every process's `views` (in process order): the common one (raising
    `Disagreement` naming `name` and each process's view when they differ), or their `reduce`."""
    if reduce is None:
        if any(v != views[0] for v in views[1:]):
            seen = ", ".join(f"process {i}: {v!r}" for i, v in enumerate(views))
            raise Disagreement(f"processes disagree on {name}: {seen}")
        return views[0]
    if reduce not in REDUCERS:
        raise ValueError(f"agree({name!r}): reduce={reduce!r}: expected one of {sorted(REDUCERS)} or None")
    return REDUCERS[reduce](views)


def agree(value: Any, *, name: str, reduce: str | None = None) -> Any:
    """`value` as every process sees it (see the module docstring). `reduce=None`: check equal;
    "min" / "max" / "any" / "all": of the views; "intersection" / "union": of sets (returns a set).
    Called by every process at the same point; one process: `value` itself (a set for the set
    reductions), no collective."""
    if reduce is not None and reduce not in REDUCERS:
        raise ValueError(f"agree({name!r}): reduce={reduce!r}: expected one of {sorted(REDUCERS)} or None")
    if jax.process_count() == 1:
        return set(value) if reduce in ("intersection", "union") else value
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="agree") as pool:
        views = pool.submit(lambda: allgather_json(_portable(value, reduce))).result()
    agreed = combine(views, name, reduce)
    return value if reduce is None else agreed  # equal views: this process's own (tuples stay tuples)
