"""The overlapped rollout producer: one object that owns its threads, its lock, its error and its
shutdown.

With `rl.max_staleness >= 1` the device generates batch p+1 (on the producer thread) while a
verifier thread scores batch p and the learner trains on an earlier one. Batch p is trained at
step p; it is sampled with a policy version >= p − max_staleness (the producer waits for the
learner to publish one), so the learner never meets a rollout staler than the bound.

Reproducible draws: the tasks of batch p are a function of (seed, p, the scheduler after recording
batches 0..p−1), never of thread timing, so the same seed, or a resume from a checkpoint's
scheduler state, draws the same tasks as the synchronous loop does. With a plain mixture the draws
do not read recorded results (`TaskScheduler.draws_use_results` is False) and batch p+1 is drawn
and generated while batch p is verified. With difficulty bands or retirement they do: the producer
then waits for batch p to be recorded before it draws batch p+1, so generation of p+1 no longer
overlaps verification of p (both still overlap the learner's update).

An exception on either thread (verifier, sandbox, XLA) is stored, the buffer is closed, and the
next `take` re-raises that exception object, with its original traceback, in the main thread.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
from collections.abc import Callable

import jax

from posttrain.parallel import use_sharding
from posttrain.rl.rollout.buffer import BufferClosed, Rollout, RolloutBuffer
from posttrain.rl.rollout.worker import Pending, RolloutBatch, RolloutWorker
from posttrain.rl.tasks.scheduler import TaskScheduler


class AsyncProducer:
    """Produces batches `start, start+1, …` on background threads for a learner at step `start`.

    weights: the (params, rest) of policy version `start`; later versions come by `publish`.
    Batch p draws its tasks from the scheduler and samples with fold_in(base_key, p), so a resumed
    run continues the sequence.
    """

    def __init__(
        self,
        worker: RolloutWorker,
        scheduler: TaskScheduler,
        *,
        num_groups: int,
        max_staleness: int,
        base_key: jax.Array,
        start: int,
        weights: tuple,
        mesh,
        rules,
        poll_s: float = 0.2,
    ) -> None:
        if max_staleness < 1:
            raise ValueError(f"AsyncProducer needs max_staleness >= 1 (0 is the synchronous loop), got {max_staleness}")
        self.worker, self.scheduler = worker, scheduler
        self.num_groups, self.max_staleness, self.base_key = num_groups, max_staleness, base_key
        self.mesh, self.rules, self.poll_s = mesh, rules, poll_s
        self.buffer = RolloutBuffer(num_groups * (max_staleness + 1), max_staleness)
        self._cv = threading.Condition()  # guards everything below and the scheduler
        self._version, self._weights, self._produced = start, weights, start
        self._batches: collections.deque[RolloutBatch] = collections.deque()  # verified, metadata only
        self._error: BaseException | None = None
        self._stopping = False
        self._thread = threading.Thread(target=self._run, daemon=True, name="rollouts")

    # --- main thread --------------------------------------------------------------------------

    def start(self) -> AsyncProducer:
        """Start the producer thread."""
        self._thread.start()
        return self

    def publish(self, version: int, weights: tuple | Callable[[], tuple]) -> None:
        """Make policy `version` (its (params, rest)) the one new batches are sampled with. A callable
        returning them is called on the producer thread when it next samples (`rl.placement = split`:
        the copy onto the sampler's devices runs there, beside the learner's next update)."""
        with self._cv:
            self._version, self._weights = version, weights
            self._cv.notify_all()

    def take(self, step: int) -> tuple[list[Rollout], RolloutBatch]:
        """The rollouts of batch `step` and its metadata (info, scheduler snapshot), waiting for
        them; re-raises the producer's exception as soon as there is one."""
        while True:
            self._raise_if_failed()
            try:
                rollouts = self.buffer.get(self.num_groups, step, timeout=self.poll_s)
            except TimeoutError:
                continue
            self._raise_if_failed()
            if len(rollouts) < self.num_groups:
                raise RuntimeError(
                    f"rollout producer stopped: {len(rollouts)} of {self.num_groups} groups for step {step}"
                )
            with self._cv:
                return rollouts, self._batches.popleft()

    def close(self, timeout: float = 60.0) -> None:
        """Stop both threads and wait for them (a generation in flight finishes first)."""
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        self.buffer.close()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _raise_if_failed(self) -> None:
        with self._cv:
            error = self._error
        if error is not None:
            raise error

    # --- producer threads ---------------------------------------------------------------------

    def _fail(self, error: BaseException) -> None:
        """Record the first error, close the buffer, wake everyone."""
        with self._cv:
            if self._error is None and not self._stopping:
                self._error = error
            self._stopping = True
            self._cv.notify_all()
        self.buffer.close()

    def _run(self) -> None:
        """Generate batch p+1 on the device while the verifier thread scores batch p."""
        verifying = None
        try:
            with use_sharding(self.mesh, self.rules), concurrent.futures.ThreadPoolExecutor(1) as verifier:
                while True:
                    if verifying is not None and self.scheduler.draws_use_results:
                        verifying.result()  # batch p−1 recorded before batch p is drawn (module docstring)
                    with self._cv:
                        # Batch p is trained at step p: sample it no earlier than version p − max_staleness.
                        self._cv.wait_for(
                            lambda: self._stopping or self._version >= self._produced - self.max_staleness
                        )
                        if self._stopping:
                            break
                        version, weights, p = self._version, self._weights, self._produced
                        tasks = self.scheduler.next_batch(self.num_groups)
                        draws = self.scheduler.batches_drawn
                    params, rest = self._resolve(version, weights)
                    pending = self.worker.generate(
                        params, rest, tasks, jax.random.fold_in(self.base_key, p), latest=self._latest
                    )
                    self._produced = p + 1
                    if verifying is not None:
                        verifying.result()
                    verifying = verifier.submit(self._finish, pending, version, draws)
                if verifying is not None:
                    verifying.result()
        except BufferClosed:
            return
        except BaseException as e:  # noqa: BLE001 — handed to the main thread by `take`
            self._fail(e)

    def _resolve(self, version: int, weights) -> tuple:
        """(params, rest) of `version`: called once if published as a callable, then kept for the
        next batches until a newer version is published."""
        if not callable(weights):
            return weights
        weights = weights()
        with self._cv:
            if self._version == version:
                self._weights = weights
        return weights

    def _latest(self) -> tuple:
        """(version, params, rest) of the newest published policy: what an in-flight sampler
        switches to between decode steps (`rl.rollout.inflight`)."""
        with self._cv:
            version, weights = self._version, self._weights
        return (version, *self._resolve(version, weights))

    def _finish(self, pending: Pending, version: int, draws: int) -> None:
        """Verify a generated batch, record it in the scheduler and hand it to the learner."""
        try:
            batch = self.worker.verify(pending)
            with self._cv:
                for grp in batch.groups:
                    self.scheduler.record(grp.domain, grp.task.id, grp.verdicts)
                # As of this batch: its own draws and records, none of the batches drawn after it.
                batch.scheduler_state = {**self.scheduler.get_state(), "batches": draws}
                batch.task_metrics = self.scheduler.metrics()
                batch.info["kept_groups"] = len(batch.groups)
                self._batches.append(RolloutBatch([], [], batch.info, batch.scheduler_state, batch.task_metrics))
            for ro in batch.rollouts(version):
                self.buffer.put(ro)
        except BufferClosed:
            return
        except BaseException as e:  # noqa: BLE001
            self._fail(e)
            raise
