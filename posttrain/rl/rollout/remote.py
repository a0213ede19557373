"""`rl.placement = disaggregated`, the learner's side: sampler process groups instead of a thread.

    learner (this process group)                       sampler groups (stages/rlvr_sampler.py)
    TaskScheduler ─ issue batch p ─▶ rl/tasks/p.json ─ lease ─▶ pull newest weights, sample, verify
    take(p) ◀─ rl/done/p.<lease>.json (groups, version, behaviour log-probs) ◀───────────────── deliver
    publish(v) ─ transfer server (rl/rollout/transfer.py) ──────────────────────▶ pulled between batches

`RemoteProducer` has `AsyncProducer`'s interface (`publish`, `take`, `close`, `buffer.stats()`), so
the learner's loop (`stages.rlvr.train_loop`) is unchanged. The learner owns the scheduler and
issues batch p's tasks itself: the task sequence is the seed's, whatever the samplers do (batch
p's key is `stages.rlvr_sampler.batch_key` on whichever sampler takes it). Batch p may be sampled
by a policy version >= p − rl.max_staleness (its `min_version`); the learner issues at most
max_staleness + 1 batches ahead (back-pressure), or one when the scheduler's draws read recorded
results. A result staler than the bound, or sampled for an earlier learner in this workdir (each
learner start is a new `run`), is dropped, counted (`rl/buffer_dropped_stale`) and its batch
re-issued; a lease whose sampler stopped beating for `rl.lease_timeout_s` is re-issued
(`rl/reissued`). Once the learner has taken its last batch it writes `rl/finished.json`; the
samplers exit 0. A learner stopped earlier leaves them waiting: a restarted learner resumes from
its checkpoint (scheduler included: the same task sequence) under a new token and run id, and the
samplers reconnect.

The learner may be several processes (as a colocated run, `rl/rollout/hosts.py`): every process
runs the scheduler and the loop, the lead process alone talks to the queue and hands each taken
batch to the others (`rl/rollout/group.py`), and each trains on its share of the batch's groups.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time

import numpy as np

from posttrain.config import ROLES
from posttrain.errors import UserError
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.rollout.group import from_lead, is_lead, local_share
from posttrain.rl.rollout.transfer import WeightServer, transfer_module
from posttrain.rl.rollout.worker import RolloutBatch
from posttrain.rl.rollout.workqueue import WorkQueue, decode_batch, decode_versions
from posttrain.rl.tasks.scheduler import TaskScheduler

__all__ = ["ROLES", "RemoteProducer", "check_disaggregated"]


def check_disaggregated(cfg) -> None:
    """What `disaggregated` cannot do yet, refused before anything compiles (naming the key)."""
    r = cfg.rl
    transfer_module()
    refusals = [
        (r.filter_groups, "rl.filter_groups", "dynamic sampling re-draws from the learner's scheduler"),
        (cfg.sampling.quantize != "none", "sampling.quantize", "the sampler pulls the learner's unquantised layout"),
    ]
    for refused, key, why in refusals:
        if refused:
            raise UserError(f"rl.placement='disaggregated' does not support {key} here: {why}", key=key)


def payload_id(payload: dict) -> tuple:
    """(version, learner run) of a delivered batch, for logs."""
    return payload["version"], payload["run"]


class _Stats:
    """`rl/…` counters of the remote queue, as `RolloutBuffer.stats` names them."""

    def __init__(self) -> None:
        self.dropped = self.handed_out = self.reissued = 0
        self.staleness: list[int] = []

    def stats(self) -> dict[str, float]:
        """Staleness of the last batch, dropped / handed-out groups, re-issued batches."""
        return {
            "rl/staleness_mean": float(np.mean(self.staleness)) if self.staleness else 0.0,
            "rl/staleness_max": float(max(self.staleness, default=0)),
            "rl/buffer_dropped_stale": float(self.dropped),
            "rl/buffer_handed_out": float(self.handed_out),
            "rl/reissued": float(self.reissued),
        }


class RemoteProducer:
    """Batches `start, start+1, …` sampled by sampler process groups through the workdir queue."""

    def __init__(
        self,
        queue: WorkQueue,
        server: WeightServer,
        scheduler: TaskScheduler,
        domains: dict,
        *,
        num_groups: int,
        max_staleness: int,
        start: int,
        lease_timeout_s: float,
        steps: int | None = None,
        poll_s: float = 0.05,
    ) -> None:
        self.queue, self.server, self.scheduler = queue, server, scheduler
        self.num_groups, self.max_staleness, self.lease_timeout_s, self.poll_s = (
            num_groups,
            max_staleness,
            lease_timeout_s,
            poll_s,
        )
        self.tasks_by_id = {(name, t.id): t for name, d in domains.items() for t in d.tasks}
        self.version, self.issued, self.draws = start, start, {}
        self.run = from_lead(lambda: secrets.token_hex(8))  # this learner's incarnation (one for its processes)
        self.steps = steps  # after taking batch steps − 1 the samplers are told to exit
        self.buffer = _Stats()

    @classmethod
    def for_learner(cls, c, start: int, weights: tuple) -> RemoteProducer:
        """The producer of an rlvr run's `Components` at step `start`, publishing `weights` as version
        `start` (the queue of an earlier learner in this workdir is forgotten first)."""
        cfg = c.cfg  # (checked at start-up: rl.checks.check_rlvr_stage, check_disaggregated)
        if cfg.rl.role != "learner":  # main.run sends rl.role=sampler of stage rlvr to stages.rlvr_sampler
            raise UserError(
                f"rl.role={cfg.rl.role!r} reached the learner: run each sampler group as its own "
                "`python -m posttrain.main` command with config.stage='rlvr' (not inside a pipeline)",
                key="rl.role",
            )
        queue = WorkQueue(cfg.workdir)
        if is_lead():
            queue.reset()
        mesh, rules = c.learner_sharding[:2]
        server = WeightServer(queue, mesh, rules, cfg.sampling.layout)
        domains = c.worker.domains
        r = cfg.rl
        producer = cls(
            queue,
            server,
            c.scheduler,
            domains,
            num_groups=r.prompts_per_step,
            max_staleness=r.max_staleness,
            start=start,
            lease_timeout_s=r.lease_timeout_s,
            steps=cfg.train.steps,
        )
        producer.publish(start, weights)
        if start >= cfg.train.steps and is_lead():  # nothing left to sample
            queue.finish()
        logging.info("rl learner: transfer server at %s; samplers find it in %s", server.server.address(), queue.path())
        return producer

    def publish(self, version: int, weights) -> None:
        """Offer policy `version` to the samplers (a callable is called here for its weights)."""
        self.version = version
        self.server.publish(version, weights() if callable(weights) else weights)

    def _issue_upto(self, step: int) -> None:
        """Issue batches up to `step + max_staleness` (up to `step` when draws read results)."""
        last = step if self.scheduler.draws_use_results else step + self.max_staleness
        last = last if self.steps is None else min(last, self.steps - 1)  # none past the run's last step
        while self.issued <= last:
            p = self.issued
            tasks = self.scheduler.next_batch(self.num_groups)
            if is_lead():
                self.queue.issue(p, tasks, min_version=max(0, p - self.max_staleness), run=self.run)
            self.draws[p] = self.scheduler.batches_drawn
            self.issued += 1

    def take(self, step: int) -> tuple[list[Rollout], RolloutBatch]:
        """Batch `step`'s rollouts and metadata, waiting for a sampler to deliver it; records its
        groups in the scheduler (in order of issue). Several processes: this process's share."""
        self._issue_upto(step)
        got = from_lead(lambda: self._await(step))
        payload, self.buffer.dropped, self.buffer.reissued = got["payload"], got["dropped"], got["reissued"]
        if is_lead():
            self.queue.consume(step)
            if step + 1 == self.steps:  # the last batch: the samplers may go
                self.queue.finish()
        groups, behav, routing = decode_batch(payload, self.tasks_by_id)
        for g in groups:
            self.scheduler.record(g.domain, g.task.id, g.verdicts)
        info = {**payload["info"], "kept_groups": len(groups)}
        state = {**self.scheduler.get_state(), "batches": self.draws.pop(step)}
        batch = RolloutBatch(groups, behav, info, state, self.scheduler.metrics(), routing, decode_versions(payload))
        self.buffer.handed_out += len(groups)  # (in-flight updates: each group's version is its oldest token's)
        self.buffer.staleness = [step - ro.version for ro in batch.rollouts(payload["version"])]
        fields = ("groups", "behav", "routing", "versions")
        mine = dataclasses.replace(batch, **dict(zip(fields, local_share(*(getattr(batch, f) for f in fields)))))
        return mine.rollouts(payload["version"]), mine

    def _await(self, step: int) -> dict:
        """Batch `step`'s result from the queue (the lead process), dropping and re-issuing stale
        ones and the leases of stopped samplers meanwhile; with the counters of both."""
        while True:
            payload = self.queue.result(step)
            if payload is not None:
                if payload["run"] == self.run and 0 <= step - payload["version"] <= self.max_staleness:
                    return {"payload": payload, "dropped": self.buffer.dropped, "reissued": self.buffer.reissued}
                self.buffer.dropped += len(payload["groups"])  # too stale, or sampled for an earlier learner
                logging.warning(
                    "rl learner: batch %d of version %d (run %s) dropped; re-issued", step, *payload_id(payload)
                )
                self.queue.reissue(step)
            if swept := self.queue.sweep():
                logging.info("rl learner: %d results no current lease names swept", swept)
            again = self.queue.reissue_dead(self.lease_timeout_s)
            if again:
                logging.warning("rl learner: batches %s re-issued (their sampler stopped)", again)
                self.buffer.reissued += len(again)
            time.sleep(self.poll_s)

    def close(self) -> None:
        """Stop serving weights. The samplers were told to exit when the last batch was taken; a
        learner stopped before that (interrupted, failed) leaves them waiting for its restart,
        which they reconnect to (a new token in learner.json)."""
        self.server.close()
