"""Stage `rlvr`: the GRPO-family loop.

    scheduler ─tasks─▶ rollout worker (policy v: generate groups, verify) ─▶ learner (v → v+1) ─▶ publish

The rollout worker samples with the learner's weights on its mesh, a copy on devices of its own (`rl.placement =
split`, rl/rollout/placement.py), or sampler process groups do (`disaggregated`). `rl.max_staleness = 0`: each step
samples with the current weights, verifies, then updates (on-policy, deterministic for a seed). `>= 1`: an
`AsyncProducer` samples and verifies the next batches on its threads while the learner updates (switching weights
mid-generation with `rl.inflight_update_every`), and the learner corrects the lag with importance weights between the
recorded behaviour log-probs and the proximal ones. Each step is `rollout_step`, `learn_step`, `publish_step` over an
explicit `RLState`; `run` wires them.

The reward of a sample is composed in `learn_step` (`reward_model.RewardComposer`: verifier reward
and, for RLHF, the learned reward model's normalised score); with `rl.advantage = "gae"` the
policy is a `critic.ValueDecoder` and the learner adds the critic's loss (PPO with GAE).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import time
from functools import partial

import jax

from posttrain.config import RunConfig
from posttrain.core import lineage
from posttrain.core.alerts import AlertMonitor
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.harness import CHECKPOINT_ITEMS, Harness, Result, evaluation_due
from posttrain.core.metrics import compiled
from posttrain.core.step import check_nonfinite
from posttrain.rl.algo.learner import advantage_targets, batch_rows, compute_advantages, rl_batch
from posttrain.rl.checks import check_rlvr_stage
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.rollout.hosts import all_values, sampled_reward_stats
from posttrain.rl.rollout.inflight import token_version_metrics
from posttrain.rl.rollout.placement import place_devices
from posttrain.rl.rollout.producer import AsyncProducer
from posttrain.rl.rollout.worker import RolloutBatch, RolloutWorker, collect_batch, evaluate
from posttrain.stages.rlvr_parts import PRODUCERS, Components, RLState, build

__all__ = ["RLState", "Components", "run", "rl_batch", "compute_advantages", "RolloutWorker", "AsyncProducer"]


def rollout_step(c: Components, rl: RLState) -> tuple[list[Rollout], RolloutBatch]:
    """The rollouts of batch `rl.step`: sampled now with the current weights (on-policy), or taken
    from the producer (overlapped)."""
    if c.producer is not None:
        return c.producer.take(rl.step)
    r = c.cfg.rl
    batch = collect_batch(
        c.worker,
        c.scheduler,
        *c.weights(rl),
        jax.random.fold_in(c.base_key, rl.step),
        num_groups=r.prompts_per_step,
        filter_groups=r.filter_groups,
        max_rounds=r.max_resample_rounds,
    )
    return batch.rollouts(rl.step), batch


def learn_step(c: Components, rl: RLState, rollouts: list[Rollout]) -> tuple[RLState, dict]:
    """Advantages and PPO-style updates on one batch; an empty batch (dynamic sampling kept no
    group, or no sample has a verdict: nothing to train on) skips the update and is counted."""
    r = c.cfg.rl
    if not rollouts or not all_values([sum(x is not None for ro in rollouts for x in ro.group.verdicts)]).sum():
        rl = dataclasses.replace(rl, skipped_updates=rl.skipped_updates + 1)
        return rl, {"rl/skipped_updates": rl.skipped_updates}
    num_real = sum(len(ro.group.trajectories) for ro in rollouts)
    longest = int(all_values([max(len(t.tokens) for ro in rollouts for t in ro.group.trajectories)]).max())
    n_rows, shards = batch_rows(len(rollouts), r, r.minibatches), c.learner.shards  # shards: zig-zag needs 2n | S
    batch = rl_batch(
        rollouts, pad_id=c.pad_id, num_rows=n_rows, longest=longest, sequence_shards=shards, seq_bucket=r.seq_bucket
    )
    versions = token_version_metrics(batch, rl.step, r.max_staleness) if "versions" in batch else {}
    rows = [t.tokens for ro in rollouts for t in ro.group.trajectories]
    unfinished = [t.info.get("truncated") is not None for ro in rollouts for t in ro.group.trajectories]
    judged = [v is not None for ro in rollouts for v in ro.group.verdicts]  # rl.truncated_reward=min: their floor
    batch["rewards"][:num_real], reward_metrics = c.rewards(rows, batch["rewards"][:num_real], unfinished, judged)
    with c.clock.busy():
        batch = c.learner.prepare(rl.train, batch, c.ref)
        batch.update(advantage_targets(batch, r))
        rewards, judged = batch.pop("rewards")[:num_real], batch.pop("judged")[:num_real]
        state, metrics = c.learner.update(rl.train, batch, c.ref, rl.step, num_real)
    rewards = all_values(rewards[judged])  # every process's rows with a verdict
    prefix = "rl/kept_" if r.filter_groups else "rl/"  # the batch trained on: with filter_groups, the kept groups
    metrics.update(
        {
            f"{prefix}reward_mean": float(rewards.mean()) if rewards.size else 0.0,
            f"{prefix}reward_std": float(rewards.std()) if rewards.size else 0.0,
            "rl/skipped_updates": rl.skipped_updates,
            **reward_metrics,
            **versions,
        }
    )
    return dataclasses.replace(rl, train=state), metrics


def publish_step(c: Components, rl: RLState) -> None:
    """Hand the weights of version `rl.step` to the producer (the synchronous path reads them directly);
    split: as a callable, so that the copy onto the sampler's devices runs on the producer's thread."""
    if c.producer is not None:
        c.producer.publish(rl.step, c.weights(rl) if c.worker.mesh is None else partial(c.weights, rl))


def run_eval(c: Components, rl: RLState, writer, step: int) -> RLState:
    """Held-out evaluation with the current weights, written at `step`: the number of updates
    they have had (0: the starting weights), the step their checkpoint is saved at."""
    scorer, key = c.rewards.scorer, jax.random.fold_in(c.base_key, 2**31 - 1)
    score_fn = scorer.score if scorer is not None else None
    last_eval = evaluate(c.worker, *c.weights(rl), c.held_out, key, c.cfg.rl.eval_samples, score_fn=score_fn)
    writer.write(step, last_eval)
    logging.info("rlvr step %d: %s", step, {k: round(v, 4) for k, v in last_eval.items()})
    return dataclasses.replace(rl, last_eval=last_eval)


def save(c: Components, ckpt: Checkpointer, rl: RLState) -> None:
    """Checkpoint after `rl.step` batches: weights, optimizer, the scheduler as of the last trained batch."""
    ckpt.save(
        rl.step,
        {k: getattr(rl.train, k) for k in CHECKPOINT_ITEMS},
        data={
            "scheduler": rl.scheduler_state,
            "skipped_updates": rl.skipped_updates,
            "optimizer_steps": int(rl.train.step),
            "reward_stats": c.rewards.stats.get_state(),
            "reward_model_step": c.rewards.step,  # a resume loads this step of rl.reward_model
        },
        meta={
            "seed": c.cfg.seed,
            "stage": "rlvr",
            "optim": c.cfg.optim.name,
            lineage.KEY: lineage.of_init(c.cfg.init_from),
        },
    )


def run(cfg: RunConfig) -> Result:
    """Train with RLVR for `train.steps` (or `rl.steps`) rollout batches; `Result.eval` is the
    final evaluation."""
    cfg = cfg.for_stage("rlvr")
    check_rlvr_stage(cfg)
    placement = place_devices(cfg)  # rl.placement: the learner's mesh and rules, the sampler's own mesh or None
    alerts = AlertMonitor.from_config(cfg.alerts)
    harness = Harness.open(
        "rlvr", cfg.workdir, cfg.train.steps, cfg.checkpoint, progress=cfg.train.progress, alerts=alerts
    )
    pool, c = concurrent.futures.ThreadPoolExecutor(cfg.rl.verifier_workers), None
    try:
        with harness.running(*placement[:2]):
            c, rl = build(cfg, harness, pool, tuple(placement))
            c.producer = PRODUCERS[cfg.rl.placement](c, rl)
            rl, rows = train_loop(c, rl, harness)
    finally:
        if c is not None and c.producer is not None:
            c.producer.close()
        pool.shutdown(wait=False, cancel_futures=True)
    return Result(c.graphdef, rl.train, rows, rl.last_eval)


def train_loop(c: Components, rl: RLState, run: Harness) -> tuple[RLState, list[dict]]:
    """Steps `rl.step` … `run.steps − 1`: rollout, learn, publish, log, evaluate, checkpoint."""
    cfg, r, rows, steps = c.cfg, c.cfg.rl, [], run.steps
    if r.eval_every and evaluation_due(rl.step, steps, r.eval_every):  # the starting weights, or again on resuming
        rl = run_eval(c, rl, run.writer, rl.step)
    bar = run.bar(rl.step)
    wall0, busy0 = time.perf_counter(), c.clock.total
    first = rl.step
    for step in bar:
        t0 = time.perf_counter()
        rollouts, produced = rollout_step(c, rl)
        t1 = time.perf_counter()
        rl, metrics = learn_step(c, rl, rollouts)
        if step == first:
            compiled(bar, "rlvr")
        check_nonfinite(metrics, cfg.train.max_nonfinite_steps, step, run.ckpt)
        if c.rollout_log is not None:
            c.rollout_log.write(step, rollouts)
        rl = dataclasses.replace(rl, step=step + 1, scheduler_state=produced.scheduler_state)
        publish_step(c, rl)
        t2 = time.perf_counter()
        wall, busy = time.perf_counter() - wall0, c.clock.total - busy0
        info = dict(produced.info)
        all_sampled = sampled_reward_stats(info, r.verifier_weight)  # every sampled group, kept or not
        if r.filter_groups:  # (else the batch trained on is every sampled group, as learn_step reports)
            metrics.update(all_sampled)
        metrics.update(
            {
                "rl/wait_s": t1 - t0,
                "rl/update_s": t2 - t1,
                "rl/device_idle_frac": max(0.0, 1 - busy / wall),
                **{f"rl/{k}": v for k, v in info.items()},
                **produced.task_metrics,
            }
        )
        if c.producer is not None:
            metrics.update(c.producer.buffer.stats())
        if step % cfg.train.log_every == 0 or step == steps - 1:
            rows.append(run.write(step, metrics))
            if "rl/reward_mean" in metrics:
                bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}")
            run.alert(step, rows[-1], bar)
        if r.eval_every and evaluation_due(rl.step, steps, r.eval_every):
            rl = run_eval(c, rl, run.writer, rl.step)  # at the number of updates it measures, as its checkpoint
        run.end_step(rl.step, partial(save, c, run.ckpt, rl))
    return rl, rows
