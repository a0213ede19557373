"""Rollout buffer between the sampler and the learner: in-process, bounded, thread-safe, FIFO.

Each entry is one group (the G samples of a task, with verified rewards) tagged with the policy
version that sampled it and the behaviour log-probs the sampler recorded. A rollout's staleness
is `current_version − version` at the time the learner takes it; with `max_staleness = 0` only
rollouts of the current weights are trained on (synchronous, on-policy), with `>= 1` the sampler
may run ahead by that many updates (generation of the next batch overlaps verification and the
update of the current one) and the learner corrects with truncated importance weights
(`offpolicy.truncated_is_weights`). Rollouts staler than the bound are dropped and counted, never
trained on.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time
from collections.abc import Sequence

import numpy as np

from posttrain.rl.tasks.scheduler import Group


class BufferClosed(Exception):
    """`put` on a closed buffer (or one closed while the producer waited for room)."""


@dataclasses.dataclass(frozen=True)
class Rollout:
    """One group as the learner needs it: `version` is the policy version that sampled it;
    `behav_logprobs[j]` holds the sampler's log-probs of `group.trajectories[j].tokens` (float32,
    same length; only the entries under the trajectory's loss mask are meaningful); `routing[j]`
    (empty unless `model.moe.routing_replay = sampler`) the experts the sampler chose for each of
    those tokens, [len(tokens), MoE layers, k] (`rl.rollout.routing`); `versions[j]` (empty unless
    `rl.inflight_update_every`) the policy version that drew each of those tokens (int32), whose
    oldest is `version` (`rl.rollout.inflight`)."""

    group: Group
    version: int
    behav_logprobs: Sequence[np.ndarray] = ()
    routing: Sequence[np.ndarray] = ()
    versions: Sequence[np.ndarray] = ()

    def __post_init__(self) -> None:
        if len(self.behav_logprobs) != len(self.group.trajectories):
            raise ValueError(
                f"Rollout of task {self.group.task.id!r}: {len(self.behav_logprobs)} behav_logprobs "
                f"for {len(self.group.trajectories)} trajectories"
            )
        for j, (lp, traj) in enumerate(zip(self.behav_logprobs, self.group.trajectories)):
            if len(lp) != len(traj.tokens):
                raise ValueError(
                    f"Rollout of task {self.group.task.id!r}: behav_logprobs[{j}] has {len(lp)} "
                    f"entries for {len(traj.tokens)} tokens"
                )
        if self.routing and [len(r) for r in self.routing] != [len(t.tokens) for t in self.group.trajectories]:
            raise ValueError(
                f"Rollout of task {self.group.task.id!r}: routing of {[len(r) for r in self.routing]} tokens "
                f"for trajectories of {[len(t.tokens) for t in self.group.trajectories]}"
            )
        if self.versions and [len(v) for v in self.versions] != [len(t.tokens) for t in self.group.trajectories]:
            raise ValueError(
                f"Rollout of task {self.group.task.id!r}: versions of {[len(v) for v in self.versions]} tokens "
                f"for trajectories of {[len(t.tokens) for t in self.group.trajectories]}"
            )


class RolloutBuffer:
    """At most `capacity_groups` rollouts; `get` never hands out one with staleness above
    `max_staleness`. `close()` wakes every waiting producer and consumer."""

    def __init__(self, capacity_groups: int, max_staleness: int) -> None:
        if capacity_groups < 1:
            raise ValueError(f"capacity_groups must be >= 1, got {capacity_groups}")
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        self.capacity = capacity_groups
        self.max_staleness = max_staleness
        self._queue: collections.deque[Rollout] = collections.deque()
        self._lock = threading.Lock()
        self._not_full = threading.Condition(self._lock)
        self._not_empty = threading.Condition(self._lock)
        self._closed = False
        self._dropped = 0
        self._handed_out = 0
        self._last_staleness: list[int] = []

    def put(self, rollout: Rollout, timeout: float | None = None) -> None:
        """Append a rollout, waiting up to `timeout` seconds (None: forever) for room.
        Raises TimeoutError when none came, BufferClosed when the buffer is or gets closed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_full:
            while not self._closed and len(self._queue) >= self.capacity:
                if _remaining(deadline) == 0:
                    raise TimeoutError(f"RolloutBuffer.put: still full ({self.capacity} groups) after {timeout}s")
                self._not_full.wait(_remaining(deadline))
            if self._closed:
                raise BufferClosed("RolloutBuffer.put on a closed buffer")
            self._queue.append(rollout)
            self._not_empty.notify_all()

    def get(self, num_groups: int, current_version: int, timeout: float | None = None) -> list[Rollout]:
        """The `num_groups` oldest rollouts with staleness <= max_staleness, in the order put,
        waiting up to `timeout` seconds (None: forever) until there are that many. Staler rollouts
        met on the way are dropped and counted. Raises TimeoutError (taking nothing fresh) when
        they do not arrive in time; once closed, returns what is left, up to `num_groups` (possibly
        fewer, [] when drained)."""
        if not 1 <= num_groups <= self.capacity:
            raise ValueError(f"num_groups must be in [1, capacity={self.capacity}], got {num_groups}")
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._not_empty:
            while True:
                self._drop_stale(current_version)
                if len(self._queue) >= num_groups or self._closed:
                    break
                if _remaining(deadline) == 0:
                    raise TimeoutError(f"RolloutBuffer.get: {len(self._queue)} of {num_groups} groups after {timeout}s")
                self._not_empty.wait(_remaining(deadline))
            out = [self._queue.popleft() for _ in range(min(num_groups, len(self._queue)))]
            self._handed_out += len(out)
            self._last_staleness = [current_version - r.version for r in out]
            self._not_full.notify_all()
            return out

    def _drop_stale(self, current_version: int) -> None:
        """Remove (and count) every queued rollout staler than the bound; caller holds the lock."""
        fresh = [r for r in self._queue if current_version - r.version <= self.max_staleness]
        if len(fresh) < len(self._queue):
            self._dropped += len(self._queue) - len(fresh)
            self._queue = collections.deque(fresh)
            self._not_full.notify_all()

    def close(self) -> None:
        """Refuse further puts and wake every waiting `put` (BufferClosed) and `get` (returns)."""
        with self._lock:
            self._closed = True
            self._not_full.notify_all()
            self._not_empty.notify_all()

    def __len__(self) -> int:
        with self._lock:
            return len(self._queue)

    def stats(self) -> dict[str, float]:
        """`rl/staleness_mean` and `_max` of the last batch handed out; cumulative
        `rl/buffer_dropped_stale` and `rl/buffer_handed_out`; `rl/buffer_size` now."""
        with self._lock:
            last = self._last_staleness
            return {
                "rl/staleness_mean": float(np.mean(last)) if last else 0.0,
                "rl/staleness_max": float(max(last, default=0)),
                "rl/buffer_dropped_stale": float(self._dropped),
                "rl/buffer_handed_out": float(self._handed_out),
                "rl/buffer_size": float(len(self._queue)),
            }


def _remaining(deadline: float | None) -> float | None:
    """Seconds left until `deadline` (None: no deadline)."""
    return None if deadline is None else max(0.0, deadline - time.monotonic())
