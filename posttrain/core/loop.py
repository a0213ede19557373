"""The training loop every gradient stage shares: sharded init or resume, jitted steps, metrics,
progress bar, asynchronous checkpoints, periodic evaluation.

A stage supplies a `TrainSpec`: how to build the model, its loss, and its batches. The loop owns
everything else, so SFT, reward modelling and DPO differ only in those three things; the parts it
shares with the RL loop (checkpoints, resume, metrics, progress, alerts, interrupts) are
`core/harness.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.config import RunConfig
from posttrain.core import lineage
from posttrain.core.alerts import AlertMonitor
from posttrain.core.batch import put_batch
from posttrain.core.harness import CHECKPOINT_ITEMS, Harness, Result, evaluation_due, start_lineage, starting_state
from posttrain.core.metrics import DataCounts, compiled, summary
from posttrain.core.optim import lr_schedule, make_optimizer
from posttrain.core.state import TrainState, create_train_state, model_params
from posttrain.core.step import MAX_STEPS_AHEAD, check_nonfinite, dispatched, make_train_step
from posttrain.data.reshard import state_for_process
from posttrain.data.schedule import ScheduledBatches, parse_seq_len_schedule
from posttrain.parallel import allgather_json, mesh_and_rules
from posttrain.parallel.zigzag import balanced_batch, sequence_shards


@dataclasses.dataclass
class TrainSpec:
    """What a training stage supplies to `train`.

    loss_fn(model, batch, *extra) -> (loss, metrics); `extra` are fixed pytrees passed to every
    step (e.g. a frozen reference policy's params for DPO). batches yields host batches and may
    have get_state/set_state (saved in checkpoints) and a `skipped` count.
    """

    name: str
    make_model: Callable[[], nnx.Module]
    loss_fn: Callable[..., tuple[jax.Array, dict]]
    batches: Iterator[dict]
    # batches at another sequence length (train.seq_len_schedule); the iterators offer continue_from
    batches_for: Callable[[int], Iterator[dict]] | None = None
    batch_axes: dict[str, tuple[str, ...]] | None = None  # per-key logical axes; default (batch, length)
    extra: tuple = ()
    eval_fn: Callable[[nnx.Module, int], dict] | None = None  # (model, step) → metrics
    sample_fn: Callable[[nnx.Module, int], None] | None = None  # logs generations at eval time
    init_model: Callable[[Any, Any], tuple[Any, Any]] | None = None  # (params, rest) → starting (params, rest)


def run_eval(stage: TrainSpec, graphdef: nnx.GraphDef, state: TrainState, lora_cfg=None) -> dict:
    """The stage's evaluation on the current weights, keys prefixed `eval/`."""
    model = nnx.merge(graphdef, model_params(state, lora_cfg), state.rest)
    return {f"eval/{k}": float(v) for k, v in stage.eval_fn(model, int(state.step)).items()}


@jax.jit
def longest_context(longest: jax.Array, batch: dict) -> jax.Array:
    """`longest` raised to the longest sequence in `batch`: the last position + 1 of any real
    (segment id > 0) token, over every `*positions` array with its `*segment_ids`. One program
    per step (the global batch's maximum, so every process records the same value)."""
    for key, positions in batch.items():
        if key.endswith("positions") and key.replace("positions", "segment_ids") in batch:
            real = batch[key.replace("positions", "segment_ids")] > 0
            longest = jnp.maximum(longest, jnp.max(jnp.where(real, positions + 1, 0)).astype(jnp.int32))
    return longest


def context_shards(lengths, mesh, rules) -> int:
    """The shards the `length` sharding rule splits rows over (> 1: rows in zig-zag order where that
    balances the attention tiles); every length of the schedule must split into 2 × that many."""
    axes, shards = sequence_shards(mesh, rules)
    for length in lengths:
        if shards > 1 and length % (2 * shards):
            where = ", ".join(f"mesh.{a}={mesh.shape[a]}" for a in axes)
            raise ValueError(
                f"train.seq_len={length} (or a train.seq_len_schedule stage): context parallelism over "
                f"{where} (the `length` sharding rule: {shards} shards) needs lengths divisible by 2 × {shards}"
            )
    return shards


@dataclasses.dataclass
class Loop:
    """What the steps of `train` share: the config, the stage, the harness, the data, the jitted step."""

    cfg: RunConfig
    stage: TrainSpec
    run: Harness
    data: ScheduledBatches
    step_fn: Callable
    graphdef: nnx.GraphDef
    shards: int
    source: dict
    counts: DataCounts = None
    rows: list = dataclasses.field(default_factory=list)
    evals: dict = dataclasses.field(default_factory=dict)


def train(cfg: RunConfig, stage: TrainSpec) -> Result:
    """Run `cfg.train.steps` updates of `stage`, resuming from `{workdir}/checkpoints` if present."""
    mesh, rules = mesh_and_rules(cfg)
    steps = cfg.train.steps
    tx = make_optimizer(cfg.optim, steps)
    alerts = AlertMonitor.from_config(cfg.alerts)
    run = Harness.open(
        stage.name,
        cfg.workdir,
        steps,
        cfg.checkpoint,
        progress=cfg.train.progress,
        alerts=alerts,
        agree_every=cfg.train.log_every,
    )
    schedule = parse_seq_len_schedule(cfg.train.seq_len_schedule, cfg.train.seq_len, steps)
    data = ScheduledBatches(schedule, stage.batches, stage.batches_for, stage.name)
    shards = context_shards(schedule.lengths, mesh, rules)
    with run.running(mesh, rules):
        graphdef, state, shardings = create_train_state(stage.make_model, tx, mesh, rules, cfg.lora, cfg.seed)
        state, _, data_state = starting_state(
            state, shardings, run.ckpt, run.start, stage.init_model, optim_name=cfg.optim.name
        )
        start = int(state.step)  # older than the newest checkpoint if that one was unreadable
        if start:
            states = data_state["processes"] if "processes" in data_state else [data_state]
            data.set_state(state_for_process(states, jax.process_index(), jax.process_count()) if states[0] else {})
        step_fn = jax.jit(
            make_train_step(graphdef, tx, stage.loss_fn, lr_schedule(cfg.optim, steps), cfg.lora),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
        loop = Loop(cfg, stage, run, data, step_fn, graphdef, shards, start_lineage(run.ckpt, start, cfg.init_from))
        state = run_steps(loop, state, start)
    logging.info("%s: finished %d steps in %s", stage.name, steps, cfg.workdir)
    return Result(graphdef, state, loop.rows, loop.evals, getattr(step_fn, "_cache_size", lambda: 0)())


def run_steps(loop: Loop, state: TrainState, start: int) -> TrainState:
    """Steps `start` … `train.steps − 1`: a batch, the update, its row every `train.log_every`, the
    evaluation every `train.eval_every` and at the end, a checkpoint when due."""
    cfg, stage, run = loop.cfg, loop.stage, loop.run
    trained = jnp.asarray(loop.source.get("trained_context") or 0, jnp.int32)
    bar = run.bar(start)
    timer = [time.perf_counter(), start - 1]  # (time, step) of the last row
    loop.counts = DataCounts(stage.name)
    in_flight = deque(maxlen=MAX_STEPS_AHEAD + 1)
    every = cfg.train.eval_every
    if stage.eval_fn is not None and (evaluation_due(start, run.steps, every) if start else cfg.train.eval_first):
        evaluate(loop, state, start)  # the starting weights, or again on resuming (evaluation_due)
    for step in bar:
        batch = loop.data.at(step)
        batch = put_batch(balanced_batch(batch, loop.shards, cfg.model.attention_block)[0], stage.batch_axes)
        trained = longest_context(trained, batch)
        state, metrics = loop.step_fn(state, batch, *stage.extra)
        dispatched(in_flight, metrics)
        if step == start:
            compiled(bar, stage.name)
        if step % cfg.train.log_every == 0 or step == run.steps - 1:
            log_row(loop, bar, step, metrics, timer)
        done = step + 1
        if stage.eval_fn is not None and evaluation_due(done, run.steps, every):
            evaluate(loop, state, done)
        run.end_step(done, functools.partial(save, loop, done, state, trained))  # (read when a save is due)
    return state


def evaluate(loop: Loop, state: TrainState, done: int) -> None:
    """The stage's evaluation after `done` updates: its row (at the number of updates it measures,
    as RL's) and, where the stage samples, greedy samples of a few eval prompts (`step`: the same)."""
    loop.evals = run_eval(loop.stage, loop.graphdef, state, loop.cfg.lora)
    loop.rows.append(loop.run.write(done, loop.evals))
    logging.info("%s step %d: %s", loop.stage.name, done, summary(loop.evals))
    if loop.stage.sample_fn is not None:  # every process: sampling runs on the global mesh
        loop.stage.sample_fn(nnx.merge(loop.graphdef, model_params(state, loop.cfg.lora), state.rest), done)


def log_row(loop: Loop, bar, step: int, metrics: dict, timer: list) -> None:
    """Write step `step`'s row: its metrics, tokens/s since the last row, the data counts; the
    non-finite guard, the progress bar and the alerts read it."""
    cfg, run, data = loop.cfg, loop.run, loop.data
    metrics = jax.device_get(metrics)
    now = time.perf_counter()
    if "tokens" in metrics:  # first interval includes compilation
        metrics["tokens_per_s"] = float(metrics["tokens"]) * (step - timer[1]) / max(now - timer[0], 1e-9)
    metrics.update(loop.counts.read(step, data.batches))  # data/skipped, data/truncated
    if data.staged:
        metrics.update({"seq_len": data.length, "data/deferred": getattr(data.batches, "deferred", 0)})
    loop.rows.append(run.write(step, metrics))
    check_nonfinite(metrics, cfg.train.max_nonfinite_steps, step, run.ckpt)
    bar.set_postfix(
        loss=f"{loop.rows[-1]['loss']:.4f}",
        **({"tok/s": f"{metrics['tokens_per_s']:.0f}"} if "tokens_per_s" in metrics else {}),
    )
    run.alert(step, loop.rows[-1], bar)
    timer[:] = now, step


def save(loop: Loop, done: int, state: TrainState, trained: jax.Array) -> None:
    """Checkpoint after `done` steps: the state, every process's data position, the run's lineage."""
    cfg, data = loop.cfg, loop.data
    loop.run.ckpt.save(
        done,
        {k: getattr(state, k) for k in CHECKPOINT_ITEMS},
        data={"processes": allgather_json(data.get_state())},
        meta={
            "seed": cfg.seed,
            "stage": loop.stage.name,
            "config": cfg.to_dict(),
            "optim": cfg.optim.name,
            lineage.KEY: lineage.merge(loop.source, int(trained), data.length),
        },
    )
