"""A sampler's liveness by progress, not by a running thread (`rl.placement = disaggregated`).

A sampler keeps its lease by beating (`WorkQueue.heartbeat`; the learner re-issues the leases of a
sampler silent for `rl.lease_timeout_s`). A beat from a thread alone would keep the lease of a
sampler whose generation or verifier thread hung for ever, so the beat is conditional: while the
sampler works on a lease, its worker bumps a `Progress` counter (each in-flight weight check
between decode steps, each generated batch, each verified response) and the heartbeat renews only
if it moved within `rl.progress_deadline_s`. A sampler waiting (for a lease, for the learner's
weights) beats unconditionally: waiting for the learner is not a hang.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

from posttrain.rl.rollout.ticker import Ticker
from posttrain.rl.rollout.workqueue import WorkQueue


class Progress:
    """What a sampler has done on its current lease: `bump` as work moves, `working` around the work."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock, self.count, self.busy, self.moved = clock, 0, False, clock()

    def bump(self, n: int = 1) -> None:
        """Record `n` units of work done (a counter read by another thread: a plain int suffices)."""
        self.count += n
        self.moved = self.clock()

    @contextlib.contextmanager
    def working(self):
        """The enclosed work must keep bumping (its start counts as a move)."""
        self.busy, self.moved = True, self.clock()
        try:
            yield self
        finally:
            self.busy = False

    def stalled(self, deadline_s: float) -> bool:
        """Whether work is under way that has not moved for more than `deadline_s` seconds."""
        return self.busy and self.clock() - self.moved > deadline_s


class Heartbeat:
    """A thread that records every `every_s` seconds that this sampler is alive, unless its
    `progress` has stalled for more than `deadline_s` (then its leases lapse and are re-issued)."""

    def __init__(self, queue: WorkQueue, name: str, every_s: float, progress: Progress, deadline_s: float) -> None:
        self.queue, self.name, self.progress, self.deadline_s = queue, name, progress, deadline_s
        self._warned = False
        self._ticker = Ticker(self.tick, every_s, "heartbeat")

    def start(self) -> Heartbeat:
        """Beat once now, then on the thread."""
        self.queue.heartbeat(self.name)
        self._ticker.start()
        return self

    def tick(self) -> bool:
        """Beat unless the work has stalled; whether it beat."""
        if self.progress.stalled(self.deadline_s):
            if not self._warned:
                logging.warning(
                    "rl sampler %s: no progress for %g s (rl.progress_deadline_s): its lease is left to lapse",
                    *(self.name, self.deadline_s),
                )
            self._warned = True
            return False
        self._warned = False
        self.queue.heartbeat(self.name)
        return True

    def stop(self) -> None:
        """Stop beating."""
        self._ticker.stop()
