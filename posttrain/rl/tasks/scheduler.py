"""Task scheduler: which tasks the sampler gets next, and what their results say about them.

- Mixture: each task of a batch comes from domain d with probability weights[d] / sum(weights).
- Difficulty bands (curriculum): a task's band follows its observed pass rate: "new" (fewer
  than `min_attempts` samples), "hard" (< band_edges[0]), "easy" (> band_edges[1]), else
  "medium". With `band_weights`, a draw in a domain picks a non-empty band by weight, then a task
  uniformly in it (e.g. favour medium tasks, rarely revisit solved ones); without, tasks are
  drawn uniformly. With `window`, the pass rate is that of the task's last `window` samples
  (a task that became easy moves out of "hard" without its early failures holding it back).
- Retirement: once a task has `retire_after` samples, a pass rate >= `retire_above` (too easy) or
  < `retire_below` (too hard) moves it to the "retired" band, never drawn again (unless every
  task of its domain is retired: then the domain is drawn uniformly, counted in
  `tasks/{domain}/exhausted_draws`). Per-band pass rates (`tasks/{domain}/band_{band}/pass_rate`:
  samples scored while the task was in that band) show what the curriculum is feeding the policy.
- Dynamic sampling (DAPO): a group whose rewards are all equal has zero advantage and trains
  nothing. `filter_groups` drops such groups; `dynamic_sample` draws replacements until the batch
  is full or `max_rounds` sampling rounds are spent (then the batch is short, and counted).
- Resume: the tasks of batch k depend only on (seed, k) and the bands, and the bands only on the
  recorded pass counts, so `get_state()` (JSON) restores a scheduler that continues the sequence.
  A caller that draws on one thread and records on another must draw batch k only after the
  batches before it are recorded whenever `draws_use_results` (bands or retirement steer the
  draws): then the sequence never depends on thread timing (`rollout.producer`).

Rewards are recorded per sample; a sample passes when its reward >= `pass_threshold`.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from posttrain.rl.envs.base import Task, Trajectory
from posttrain.rl.tasks.domains import Domain

BANDS = ("new", "hard", "medium", "easy")  # the bands a draw may pick
RETIRED = "retired"
STATE_VERSION = 1
_COUNTERS = ("samples", "passes", "groups", "dropped_groups", "exhausted_draws")


@dataclasses.dataclass
class Group:
    """The samples of one task: its domain, the task, one reward per sample, (for the learner)
    the trajectories they came from, and (for accuracy) each sample's verdict correctness
    (`Reward.correct`: 1 = solved, whatever the shaping took off the reward)."""

    domain: str
    task: Task
    rewards: Sequence[float]
    trajectories: Sequence[Trajectory] = ()
    correct: Sequence[float] = ()

    def __post_init__(self) -> None:
        if self.correct and len(self.correct) != len(self.rewards):
            raise ValueError(
                f"group of task {self.task.id!r}: {len(self.correct)} correct for {len(self.rewards)} rewards"
            )

    @property
    def verdicts(self) -> list[float | None]:
        """The rewards, None where the verifier reached no verdict (its reward has `error` set: a
        timeout or a sandbox failure is not a wrong answer): what pass rates and filtering see."""
        if not self.trajectories:
            return list(self.rewards)
        return [
            None if t.reward is not None and t.reward.error is not None else r
            for r, t in zip(self.rewards, self.trajectories)
        ]


def informative(rewards: Sequence[float], tol: float = 1e-6) -> bool:
    """Whether a group's rewards differ (by more than `tol`): only then has it a learning signal."""
    return len(rewards) > 0 and max(rewards) - min(rewards) > tol


class TaskScheduler:
    """Weighted mixture over domains with pass-rate tracking, difficulty bands, dynamic sampling
    and resumable state (see module docstring).

    weights: domain name -> non-negative weight (default: equal); seed: fixes the draws;
    band_weights: band name -> weight, None for uniform draws within a domain; band_edges:
    (hard_below, easy_above) pass rates; min_attempts: samples before a task leaves "new";
    window: pass rates over a task's last n samples (0: all); retire_above / retire_below: pass
    rates that retire a task (None: never) once it has retire_after samples.
    """

    def __init__(
        self,
        domains: Mapping[str, Domain],
        weights: Mapping[str, float] | None = None,
        *,
        seed: int = 0,
        band_weights: Mapping[str, float] | None = None,
        band_edges: tuple[float, float] = (0.2, 0.8),
        min_attempts: int = 1,
        pass_threshold: float = 0.5,
        window: int = 0,
        retire_above: float | None = None,
        retire_below: float | None = None,
        retire_after: int = 1,
    ) -> None:
        if not domains:
            raise ValueError("TaskScheduler needs at least one domain")
        if not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed must be a non-negative int, got {seed!r}")
        if not 0.0 <= band_edges[0] <= band_edges[1] <= 1.0:
            raise ValueError(f"band_edges must satisfy 0 <= hard_below <= easy_above <= 1, got {band_edges}")
        if min_attempts < 1:
            raise ValueError(f"min_attempts must be >= 1, got {min_attempts}")
        if window < 0 or retire_after < 1:
            raise ValueError(f"window must be >= 0 and retire_after >= 1, got {window}, {retire_after}")
        if retire_above is not None and retire_below is not None and retire_below > retire_above:
            raise ValueError(f"retire_below={retire_below} > retire_above={retire_above}: every task would retire")
        self.window, self.retire_above, self.retire_below, self.retire_after = (
            window,
            retire_above,
            retire_below,
            retire_after,
        )
        self.domains = dict(domains)
        self.names = list(self.domains)
        self.seed = seed
        self.band_edges = band_edges
        self.min_attempts = min_attempts
        self.pass_threshold = pass_threshold
        self.set_weights(weights or {name: 1.0 for name in self.names})
        if band_weights is not None:
            _check_weights(band_weights, BANDS, "band_weights")
        self.band_weights = None if band_weights is None else {b: float(band_weights.get(b, 0.0)) for b in BANDS}
        self._index = {name: _task_index(d) for name, d in self.domains.items()}
        self._reset_tracking()

    def set_weights(self, weights: Mapping[str, float]) -> None:
        """Change the mixture (e.g. on a curriculum schedule) from the next batch on; domains
        left out get weight 0."""
        _check_weights(weights, self.names, "weights")
        self.weights = {name: float(weights.get(name, 0.0)) for name in self.names}
        w = np.array(list(self.weights.values()))
        self._p = w / w.sum()

    def _reset_tracking(self) -> None:
        self._batches = 0
        self._short_batches = 0
        self._stats: dict[str, dict[int, list[int]]] = {name: {} for name in self.names}
        self._counters = {name: dict.fromkeys(_COUNTERS, 0) for name in self.names}
        self._recent: dict[str, dict[int, list[int]]] = {name: {} for name in self.names}
        self._band_counts = {name: {b: [0, 0] for b in BANDS} for name in self.names}
        self._bands = {name: {b: [] for b in (*BANDS, RETIRED)} for name in self.names}
        for name in self.names:
            self._bands[name]["new"] = list(range(len(self.domains[name].tasks)))

    # --- drawing ------------------------------------------------------------------------------

    @property
    def draws_use_results(self) -> bool:
        """Whether recorded results steer the draws (band weights or retirement); without, the
        tasks of batch k depend on (seed, k) and the mixture weights alone."""
        return self.band_weights is not None or self.retire_above is not None or self.retire_below is not None

    @property
    def batches_drawn(self) -> int:
        """How many batches `next_batch` has drawn (the position in the task sequence)."""
        return self._batches

    def next_batch(self, n: int) -> list[tuple[str, Task]]:
        """The next `n` (domain name, task) pairs; deterministic in (seed, batches drawn, bands)."""
        if n < 0:
            raise ValueError(f"batch size must be >= 0, got {n}")
        rng = np.random.default_rng([self.seed, self._batches])
        self._batches += 1
        picks = rng.choice(len(self.names), size=n, p=self._p)
        return [(self.names[d], self._draw(self.names[d], rng)) for d in picks]

    def _draw(self, name: str, rng: np.random.Generator) -> Task:
        """One task of domain `name`: by band weight among the non-empty bands, then uniformly."""
        tasks = self.domains[name].tasks
        bands = self._bands[name]
        if len(bands[RETIRED]) == len(tasks):
            self._counters[name]["exhausted_draws"] += 1
            return tasks[int(rng.integers(len(tasks)))]
        w = np.array([self.band_weights[b] if bands[b] else 0.0 for b in BANDS]) if self.band_weights else None
        if w is None or w.sum() == 0:  # no curriculum, or only zero-weight bands left: uniform over active tasks
            if not bands[RETIRED]:
                return tasks[int(rng.integers(len(tasks)))]
            active = sorted(i for b in BANDS for i in bands[b])
            return tasks[active[int(rng.integers(len(active)))]]
        members = bands[BANDS[int(rng.choice(len(BANDS), p=w / w.sum()))]]
        return tasks[members[int(rng.integers(len(members)))]]

    # --- results ------------------------------------------------------------------------------

    def band(self, attempts: int, passes: int, recent: Sequence[int] | None = None) -> str:
        """The band of a task with this record (`recent`: its last outcomes, 1 = pass, when windowed)."""
        if attempts < self.min_attempts:
            return "new"
        rate = float(np.mean(recent)) if recent else passes / attempts
        if attempts >= self.retire_after and (
            (self.retire_above is not None and rate >= self.retire_above)
            or (self.retire_below is not None and rate < self.retire_below)
        ):
            return RETIRED
        return "hard" if rate < self.band_edges[0] else "easy" if rate > self.band_edges[1] else "medium"

    def _band_of(self, domain: str, i: int) -> str:
        return self.band(*self._stats[domain].get(i, (0, 0)), self._recent[domain].get(i))

    def record(self, domain: str, task_id: str, rewards: Sequence[float | None]) -> None:
        """Add one group's rewards (one per sample; None: no verdict, not counted) to the task's
        pass count and the domain's metrics."""
        rewards = [r for r in rewards if r is not None]
        i = self._task(domain, task_id)
        outcomes = [int(float(r) >= self.pass_threshold) for r in rewards]
        passes = sum(outcomes)
        old = self._band_of(domain, i)
        stats = self._stats[domain].setdefault(i, [0, 0])
        stats[0] += len(rewards)
        stats[1] += passes
        if self.window:
            self._recent[domain][i] = (self._recent[domain].get(i, []) + outcomes)[-self.window :]
        self._move(domain, i, old, self._band_of(domain, i))
        if old in self._band_counts[domain]:  # a retired task drawn only when its domain is exhausted
            self._band_counts[domain][old][0] += len(rewards)
            self._band_counts[domain][old][1] += passes
        counters = self._counters[domain]
        counters["samples"] += len(rewards)
        counters["passes"] += passes
        counters["groups"] += 1

    def pass_rate(self, domain: str, task_id: str) -> float | None:
        """Observed pass rate of one task (None before its first sample)."""
        attempts, passes = self._stats[domain].get(self._task(domain, task_id), (0, 0))
        return passes / attempts if attempts else None

    def filter_groups(self, groups: Sequence[Group]) -> tuple[list[Group], list[Group]]:
        """(kept, dropped): groups whose rewards differ, and those whose rewards are all equal
        (counted per domain as dropped_groups)."""
        kept, dropped = [], []
        for g in groups:
            if informative([r for r in g.verdicts if r is not None]):
                kept.append(g)
            else:
                dropped.append(g)
                self._counters[self._domain(g.domain)]["dropped_groups"] += 1
        return kept, dropped

    def dynamic_sample(
        self, sample_groups: Callable[[list[tuple[str, Task]]], list[Group]], num_groups: int, *, max_rounds: int = 4
    ) -> list[Group]:
        """Up to `num_groups` informative groups: draw tasks, let `sample_groups` sample and
        score a group for each, record every group, keep the informative ones, and draw again
        for the shortfall, at most `max_rounds` rounds (DAPO's cap on generation batches)."""
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds}")
        kept: list[Group] = []
        for _ in range(max_rounds):
            if len(kept) >= num_groups:
                break
            batch = self.next_batch(num_groups - len(kept))
            groups = sample_groups(batch)
            if len(groups) != len(batch):
                raise ValueError(f"sample_groups returned {len(groups)} groups for {len(batch)} tasks")
            for g in groups:
                self.record(g.domain, g.task.id, g.verdicts)
            kept += self.filter_groups(groups)[0]
        self._short_batches += len(kept) < num_groups
        return kept

    # --- metrics and state ----------------------------------------------------------------------

    def metrics(self) -> dict[str, float]:
        """Cumulative per-domain numbers (`tasks/{domain}/...`): pass rate, samples, groups,
        dropped groups and their fraction, tasks per band; plus batches drawn and short batches."""
        out: dict[str, float] = {"tasks/batches": self._batches, "tasks/short_batches": self._short_batches}
        for name in self.names:
            c = self._counters[name]
            prefix = f"tasks/{name}/"
            out.update({prefix + k: v for k, v in c.items()})
            out[prefix + "pass_rate"] = c["passes"] / c["samples"] if c["samples"] else 0.0
            out[prefix + "dropped_frac"] = c["dropped_groups"] / c["groups"] if c["groups"] else 0.0
            out.update({f"{prefix}band_{b}": len(members) for b, members in self._bands[name].items()})
            for b, (samples, passes) in self._band_counts[name].items():
                out[f"{prefix}band_{b}/samples"] = samples
                out[f"{prefix}band_{b}/pass_rate"] = passes / samples if samples else 0.0
            out.update(self._difficulty_metrics(name))
        return out

    def _difficulty_metrics(self, name: str) -> dict[str, float]:
        """Samples and pass rate per difficulty label the data gives (`tasks/{domain}/difficulty/{label}/...`)."""
        tasks, totals = self.domains[name].tasks, {}
        for i, (attempts, passes) in self._stats[name].items():
            label = getattr(tasks[i], "difficulty", None)
            if label is not None:
                t = totals.setdefault(label, [0, 0])
                t[0], t[1] = t[0] + attempts, t[1] + passes
        out = {}
        for label, (attempts, passes) in sorted(totals.items()):
            out[f"tasks/{name}/difficulty/{label}/samples"] = attempts
            out[f"tasks/{name}/difficulty/{label}/pass_rate"] = passes / attempts
        return out

    def get_state(self) -> dict[str, Any]:
        """JSON-serialisable state: draws so far, mixture weights, per-task pass counts, metric counters."""
        stats = {
            name: {self.domains[name].tasks[i].id: list(s) for i, s in sorted(self._stats[name].items())}
            for name in self.names
        }
        return {
            "version": STATE_VERSION,
            "seed": self.seed,
            "domains": list(self.names),
            "batches": self._batches,
            "short_batches": self._short_batches,
            "weights": dict(self.weights),
            "stats": stats,
            "counters": {name: dict(c) for name, c in self._counters.items()},
            "band_counts": {name: {b: list(c) for b, c in bc.items()} for name, bc in self._band_counts.items()},
            "recent": {
                name: {self.domains[name].tasks[i].id: list(r) for i, r in sorted(self._recent[name].items())}
                for name in self.names
            },
        }

    def set_state(self, state: Mapping[str, Any]) -> None:
        """Restore `get_state()`; refused when the seed or the domains differ."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"scheduler state version {state.get('version')!r}, expected {STATE_VERSION}")
        for key, mine in (("seed", self.seed), ("domains", self.names)):
            if state[key] != mine:
                raise ValueError(
                    f"scheduler state was saved with {key}={state[key]!r} but this scheduler has "
                    f"{mine!r}: the task sequence would differ"
                )
        self._reset_tracking()
        self.set_weights(state["weights"])
        self._batches, self._short_batches = int(state["batches"]), int(state["short_batches"])
        for name in self.names:
            self._counters[name] = {k: int(state["counters"][name].get(k, 0)) for k in _COUNTERS}
            for b, counts in state.get("band_counts", {}).get(name, {}).items():
                self._band_counts[name][b] = [int(c) for c in counts]
            for task_id, recent in (state.get("recent", {}).get(name, {}) if self.window else {}).items():
                self._recent[name][self._task(name, task_id)] = [int(o) for o in recent][-self.window :]
            for task_id, (attempts, passes) in state["stats"][name].items():
                i = self._task(name, task_id)
                self._stats[name][i] = [int(attempts), int(passes)]
                self._move(name, i, "new", self._band_of(name, i))

    # --- helpers --------------------------------------------------------------------------------

    def _domain(self, name: str) -> str:
        if name not in self.domains:
            raise KeyError(f"unknown domain {name!r}; known: {self.names}")
        return name

    def _task(self, domain: str, task_id: str) -> int:
        index = self._index[self._domain(domain)]
        if task_id not in index:
            raise KeyError(f"domain {domain!r} has no task {task_id!r}")
        return index[task_id]

    def _move(self, domain: str, i: int, old: str, new: str) -> None:
        """Move task index i between band lists (kept sorted, so bands depend only on the stats)."""
        if old == new:
            return
        members = self._bands[domain][old]
        del members[bisect.bisect_left(members, i)]
        bisect.insort(self._bands[domain][new], i)


def _check_weights(weights: Mapping[str, float], names: Sequence[str], what: str) -> None:
    """Known keys, non-negative values, positive total."""
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"{what} has unknown keys {unknown}; known: {list(names)}")
    bad = {k: v for k, v in weights.items() if not v >= 0}
    if bad:
        raise ValueError(f"{what} must be >= 0, got {bad}")
    if sum(weights.values()) <= 0:
        raise ValueError(f"{what} must have a positive total, got {dict(weights)}")


def _task_index(domain: Domain) -> dict[str, int]:
    """Task id -> position in the domain's task list."""
    return {t.id: i for i, t in enumerate(domain.tasks)}
