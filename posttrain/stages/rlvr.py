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
import jax.numpy as jnp
from flax import nnx

from posttrain.config.rl import ppo_steps
from posttrain.core import lineage
from posttrain.core.alerts import AlertMonitor
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.harness import CHECKPOINT_ITEMS, Harness, Result, starting_state
from posttrain.core.init import init_model_from
from posttrain.core.metrics import compiled
from posttrain.core.optim import lr_schedule, make_optimizer
from posttrain.core.state import TrainState, create_train_state, model_params
from posttrain.core.step import check_nonfinite
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import sequence_shards
from posttrain.rl.algo.advantages import uses_critic
from posttrain.rl.algo.critic import ValueDecoder
from posttrain.rl.algo.learner import Learner, advantage_targets, batch_rows, compute_advantages, rl_batch
from posttrain.rl.algo.reward_model import RewardComposer
from posttrain.rl.checks import check_rlvr_stage
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.hosts import all_values, sampled_reward_stats
from posttrain.rl.rollout.inflight import enforce_token_staleness
from posttrain.rl.rollout.log import RolloutLog
from posttrain.rl.rollout.placement import place_devices, sampler_weights
from posttrain.rl.rollout.producer import AsyncProducer
from posttrain.rl.rollout.remote import RemoteProducer
from posttrain.rl.rollout.worker import BusyClock, RolloutBatch, RolloutWorker, collect_batch, evaluate
from posttrain.rl.tasks.registry import curriculum_options, domain_weights, make_domains, make_reward_fn
from posttrain.rl.tasks.scheduler import TaskScheduler
from posttrain.sampling.continuous import SlotConfig
from posttrain.sampling.layout import sampler_rules
from posttrain.sampling.prefix_cache import PrefixCache
from posttrain.sampling.rules import SamplingParams

__all__ = ["RLState", "run", "rl_batch", "compute_advantages", "RolloutWorker", "AsyncProducer"]


@dataclasses.dataclass
class RLState:
    """Where an RLVR run stands between steps (host side). `step` is the number of batches trained
    and the policy version; `scheduler_state` is the scheduler as of the last trained batch (what
    a checkpoint saves: no draws of batches not yet trained on)."""

    train: TrainState
    step: int
    scheduler_state: dict | None = None
    skipped_updates: int = 0
    last_eval: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Components:
    """The fixed parts of a run that the step functions use."""

    cfg: object
    worker: RolloutWorker
    learner: Learner
    scheduler: TaskScheduler
    producer: AsyncProducer | None
    ref: tuple
    base_key: jax.Array
    held_out: list
    clock: BusyClock
    pad_id: int
    rewards: RewardComposer
    rollout_log: RolloutLog | None = None
    learner_sharding: tuple | None = None  # (mesh, rules) of the learner's params, (…, sampler mesh) if split

    def weights(self, rl: RLState) -> tuple:
        """(params, rest) the policy samples with: the learner's, resharded into the decode layout
        when sampling.layout says so (a second copy), quantised when sampling.quantize says so (the
        behaviour log-probs are then the quantised policy's, the learner's importance weights correct
        the gap); on the sampler's own devices under rl.placement = split (`placement.sampler_weights`)."""
        params = model_params(rl.train, self.cfg.lora)
        return sampler_weights(params, rl.train.rest, self.cfg.sampling, self.learner_sharding)


def rollout_sampling(cfg, stop_ids) -> SamplingParams:
    """The rollouts' sampling params: rl.temperature/top_k/top_p/max_new_tokens/group_size, the
    sampler's sampling.speculative_k / draft_layers, and whether it records routing (replay)."""
    r = cfg.rl
    return SamplingParams(
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_ids=tuple(stop_ids),
        num_samples=r.group_size,
        speculative_k=cfg.sampling.speculative_k,
        draft_layers=cfg.sampling.draft_layers,
        record_routing=cfg.model.moe.routing_replay == "sampler",
    )


def rollout_prefix_cache(cfg) -> PrefixCache | None:
    """The rollouts' prefix cache: `sampling.prefix_cache` tokens of prompt KV kept across sampler calls
    (the turns of multi-turn episodes, resampled prompts), emptied when the weights change; 0: none."""
    return PrefixCache(cfg.sampling.prefix_cache) if cfg.sampling.prefix_cache else None


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
    versions = enforce_token_staleness(batch, rl.step, r.max_staleness) if "versions" in batch else {}
    rows = [t.tokens for ro in rollouts for t in ro.group.trajectories]
    unfinished = [t.info.get("truncated") is not None for ro in rollouts for t in ro.group.trajectories]
    batch["rewards"][:num_real], reward_metrics = c.rewards(rows, batch["rewards"][:num_real], unfinished)
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


def run(cfg) -> Result:
    """Train with RLVR for `train.steps` (or `rl.steps`) rollout batches; `Result.eval` is the
    final evaluation."""
    cfg = cfg.for_stage("rlvr")
    check_rlvr_stage(cfg)
    r = cfg.rl
    tok = load_tokenizer(cfg.data.tokenizer)
    domains, held_out = make_domains(cfg, tok, make_reward_fn(cfg.rl))
    scheduler = TaskScheduler(domains, domain_weights(r, domains), seed=cfg.seed, **curriculum_options(r.curriculum))
    mesh, rules, sampler_mesh = place_devices(cfg)  # rl.placement: the sampler's own mesh, or None
    steps = cfg.train.steps
    tx = make_optimizer(cfg.optim, steps * ppo_steps(r))
    decoder = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    # PPO with a critic: the policy carries the value head (a fresh head on an init_from decoder).
    make = (lambda: ValueDecoder(cfg.model, rngs=nnx.Rngs(cfg.seed))) if uses_critic(r.advantage) else decoder
    sampling = rollout_sampling(cfg, tok.stop_ids)
    harness = Harness.open(
        "rlvr",
        cfg.workdir,
        steps,
        cfg.checkpoint,
        progress=cfg.train.progress,
        alerts=AlertMonitor.from_config(cfg.alerts),
    )
    start = harness.start
    clock, pool, producer = BusyClock(), concurrent.futures.ThreadPoolExecutor(r.verifier_workers), None
    try:
        with harness.running(mesh, rules):
            graphdef, state, shardings = create_train_state(make, tx, mesh, rules, cfg.lora, cfg.seed)
            state, start_weights, data = starting_state(
                state,
                shardings,
                harness.ckpt,
                start,
                init_model_from(cfg.init_from, decoder, mesh, rules),
                need_start_weights=bool(r.kl_coef),
                optim_name=cfg.optim.name,
            )
            start = int(state.step)  # older than the newest checkpoint if that one was unreadable
            # The KL reference: the starting weights, a copy since the policy's buffers are donated to each update.
            # Under LoRA its params are the frozen base the state carries (None here: read from it), its rest a copy.
            ref = ()
            if r.kl_coef:
                ref = jax.tree.map(jnp.copy, start_weights[1] if state.frozen is not None else start_weights)
                ref = (None, ref) if state.frozen is not None else ref
            rl = RLState(state, start)
            if start:
                scheduler.set_state(data["scheduler"])
                rl = RLState(
                    state.replace(step=jnp.asarray(data.get("optimizer_steps", start), jnp.int32)),
                    start,
                    data["scheduler"],
                    int(data.get("skipped_updates", 0)),
                )
            learner = Learner(
                graphdef,
                tx,
                lr_schedule(cfg.optim, steps * ppo_steps(r)),
                shardings,
                rl_cfg=r,
                moe_cfg=cfg.model.moe,
                lora_cfg=cfg.lora,
                sampling=sampling,
                donate=r.max_staleness == 0,
                seed=cfg.seed,
                context=(sequence_shards(mesh, rules)[1], cfg.model.attention_block),  # zig-zag where it balances
            )
            worker = RolloutWorker(
                graphdef,
                domains,
                sampling,
                tok.pad_id,
                pool,
                r.verifier_delay,
                clock,
                episodes=partial(rollout_episodes, cohorts=r.episode_cohorts) if r.env != "single" else None,
                prefix_cache=rollout_prefix_cache(cfg),
                continuous=SlotConfig.of(cfg.sampling),
                rules=sampler_rules(rules, cfg.sampling.layout),
                mesh=sampler_mesh,
                inflight_every=r.inflight_update_every,
            )
            base_key = jax.random.key(cfg.seed)
            rewards = RewardComposer.from_config(
                cfg.rl,
                mesh,
                rules,
                pad_id=tok.pad_id,
                policy=(cfg.data.tokenizer, cfg.model.vocab_size),
                step=data.get("reward_model_step") if start else None,
            )
            if start and "reward_stats" in data:
                rewards.stats.set_state(data["reward_stats"])
            c = Components(
                cfg=cfg,
                worker=worker,
                learner=learner,
                scheduler=scheduler,
                producer=None,
                ref=ref,
                base_key=base_key,
                held_out=held_out,
                clock=clock,
                pad_id=tok.pad_id,
                rewards=rewards,
                learner_sharding=(mesh, rules, sampler_mesh),
            )
            if r.rollouts_every:
                kept = dict(every=r.rollouts_every, fraction=r.rollouts_fraction, seed=cfg.seed)
                c.rollout_log = RolloutLog(cfg.workdir, tok, **kept, enabled=jax.process_index() == 0)
            if r.placement == "disaggregated":  # the samplers are other process groups (rl/rollout/remote.py)
                producer = c.producer = RemoteProducer.for_learner(c, start, c.weights(rl))
            elif r.max_staleness > 0:
                producer = c.producer = AsyncProducer(
                    worker,
                    scheduler,
                    num_groups=r.prompts_per_step,
                    max_staleness=r.max_staleness,
                    base_key=base_key,
                    start=start,
                    weights=c.weights(rl),
                    mesh=mesh,
                    rules=rules,
                ).start()
            rl, rows = train_loop(c, rl, harness)
    finally:
        if producer is not None:
            producer.close()
        pool.shutdown(wait=False, cancel_futures=True)
    return Result(graphdef, rl.train, rows, rl.last_eval)


def train_loop(c: Components, rl: RLState, run: Harness) -> tuple[RLState, list[dict]]:
    """Steps `rl.step` … `run.steps − 1`: rollout, learn, publish, log, evaluate, checkpoint."""
    cfg, r, rows, steps = c.cfg, c.cfg.rl, [], run.steps
    if r.eval_every and rl.step == 0:
        rl = run_eval(c, rl, run.writer, 0)
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
        if r.eval_every and (rl.step % r.eval_every == 0 or rl.step == steps):
            rl = run_eval(c, rl, run.writer, rl.step)  # at the number of updates it measures, as its checkpoint
        run.end_step(rl.step, partial(save, c, run.ckpt, rl))
    return rl, rows
