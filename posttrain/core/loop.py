"""The training loop every gradient stage shares: sharded init or resume, jitted steps, metrics,
progress bar, asynchronous checkpoints, periodic evaluation.

A stage supplies a `TrainSpec`: how to build the model, its loss, and its batches. The loop owns
everything else, so SFT, reward modelling and DPO differ only in those three things.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from posttrain.data.schedule import ScheduledBatches, parse_seq_len_schedule
from posttrain.errors import UserError
from posttrain.core.alerts import AlertMonitor
from posttrain.data.reshard import state_for_process
from posttrain.parallel import allgather_json, mesh_and_rules, named_sharding, use_sharding
from posttrain.parallel.zigzag import zigzag_batch
from posttrain.core import interrupt
from posttrain.core import lineage
from posttrain.core.checkpoint import Checkpointer, abstract_with_shardings
from posttrain.core.metrics import DataCounts, MetricsWriter, compiled, compiling, summary
from posttrain.core.optim import lr_schedule, make_optimizer
from posttrain.core.state import TrainState, create_train_state, model_params
from posttrain.core.step import check_nonfinite, make_train_step


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
    batch_axes: dict[str, tuple[str, ...]] | None = None   # per-key logical axes; default (batch, length)
    extra: tuple = ()
    eval_fn: Callable[[nnx.Module, int], dict] | None = None   # (model, step) → metrics
    sample_fn: Callable[[nnx.Module, int], None] | None = None   # logs generations at eval time
    init_model: Callable[[Any, Any], tuple[Any, Any]] | None = None   # (params, rest) → starting (params, rest)


@dataclasses.dataclass
class Result:
    graphdef: nnx.GraphDef
    state: TrainState
    rows: list[dict]
    eval: dict
    train_step_compiles: int = 0      # programs the train step compiled: one per sequence-length stage run


def put_batch(batch: dict, axes: dict[str, tuple[str, ...]] | None = None) -> dict:
    """Host batch (this process's rows) → global arrays sharded by logical names.

    Every process holds the same number of rows; the global batch is their concatenation in
    process order, and its sharding is derived from that global shape (a local shape could drop
    batch axes that the global batch divides).
    """
    processes = jax.process_count()

    def put(k, v):
        v = np.asarray(v)
        names = (axes or {}).get(k, ("batch", "length")[:v.ndim])
        shape = (v.shape[0] * processes, *v.shape[1:]) if v.ndim else v.shape
        sharding = named_sharding(names, shape)
        if processes > 1 and v.ndim and sharding.is_fully_replicated:
            raise ValueError(f"batch[{k!r}]: {shape[0]} rows over {processes} processes, but the batch axes "
                             f"{sharding.mesh.shape} do not split them; make the batch size a multiple of them")
        return jax.make_array_from_process_local_data(sharding, v, shape)
    return {k: put(k, v) for k, v in batch.items()}


CHECKPOINT_ITEMS = ("params", "rest", "opt_state")   # the step is the checkpoint's own number


def restore_target(state_shapes: TrainState, shardings: TrainState) -> dict[str, Any]:
    """What a resume asks orbax for: the `CHECKPOINT_ITEMS` of the train state as
    ShapeDtypeStructs carrying the train step's shardings, so each array is read straight into
    its shards on any mesh (`Checkpointer.restore`). state_shapes: shapes and dtypes only."""
    abstract = abstract_with_shardings(state_shapes, shardings)
    return {k: getattr(abstract, k) for k in CHECKPOINT_ITEMS}


def run_eval(stage: TrainSpec, graphdef: nnx.GraphDef, state: TrainState, lora_cfg=None) -> dict:
    """The stage's evaluation on the current weights, keys prefixed `eval/`."""
    model = nnx.merge(graphdef, model_params(state, lora_cfg), state.rest)
    return {f"eval/{k}": float(v) for k, v in stage.eval_fn(model, int(state.step)).items()}


def check_optimizer_matches(ckpt: Checkpointer, step: int, optim_name: str) -> None:
    """Refuse to resume checkpoint `step` under another optimizer (its state has another structure):
    a UserError naming optim.name rather than every checkpoint reported unreadable. Checkpoints
    without the `optim` meta key predate the choice and hold AdamW's state."""
    try:
        saved = ckpt.restore(step, {})[2].get("optim", "adamw")
    except Exception:      # an unreadable newest checkpoint: restore_newest reports it and falls back
        return
    if saved != optim_name:
        raise UserError(f"config.optim.name={optim_name!r}: checkpoint {ckpt.directory}/{step} holds the state of "
                        f"optim.name={saved!r}; resume with that optimizer, or start a new workdir (init_from "
                        "the checkpoint's weights) to switch", key="optim.name")


def starting_state(state: TrainState, shardings: TrainState, ckpt: Checkpointer, start: int,
                   init_model=None, *, need_start_weights: bool = False,
                   optim_name: str = "adamw") -> tuple[TrainState, tuple, dict]:
    """Where a run begins: the initial weights (`init_model`, e.g. init_from), then, when `start`
    > 0, the newest readable checkpoint at or before `start` (written with the same `optim_name`).
    Returns (state, start weights (params, rest), data JSON); `state.step` is the step the run
    continues from.

    Under LoRA the starting weights are the frozen base and are needed on resume too; with
    `need_start_weights` (a KL reference) they are loaded on resume as well.
    """
    lora_on = state.frozen is not None
    if init_model is not None and (lora_on or not start or need_start_weights):
        weights, rest = init_model(state.frozen if lora_on else state.params, state.rest)
        state = state.replace(rest=rest, **({"frozen": weights} if lora_on else {"params": weights}))
    start_weights = (state.frozen if lora_on else state.params, state.rest)
    data = {}
    if start:      # the newest readable checkpoint: an unreadable newer one is skipped, with a warning
        check_optimizer_matches(ckpt, start, optim_name)
        found = ckpt.restore_newest(restore_target(jax.eval_shape(lambda: state), shardings), at_most=start)
        if found is not None:
            start, trees, data, _ = found
            state = state.replace(step=jnp.asarray(start, jnp.int32), **trees)
    return state, start_weights, data


@jax.jit
def longest_context(longest: jax.Array, batch: dict) -> jax.Array:
    """`longest` raised to the longest sequence in `batch`: the last position + 1 of any real
    (segment id > 0) token, over every `*positions` array with its `*segment_ids`."""
    for key, positions in batch.items():
        if key.endswith("positions") and key.replace("positions", "segment_ids") in batch:
            real = batch[key.replace("positions", "segment_ids")] > 0
            longest = jnp.maximum(longest, jnp.max(jnp.where(real, positions + 1, 0)).astype(jnp.int32))
    return longest


def start_lineage(ckpt: Checkpointer, start: int, init_from: str) -> dict:
    """The lineage a run carries (see `posttrain.core.lineage`): its checkpoint's when resuming,
    else inherited from `init_from`."""
    if start:
        meta = ckpt.restore(start, {})[2]
        if meta.get(lineage.KEY):
            return meta[lineage.KEY]
    return lineage.of_init(init_from)


def train(cfg, stage: TrainSpec) -> Result:
    """Run `cfg.train.steps` updates of `stage`, resuming from `{workdir}/checkpoints` if present."""
    mesh, rules = mesh_and_rules(cfg)
    steps = cfg.train.steps
    schedule = lr_schedule(cfg.optim, steps)
    tx = make_optimizer(cfg.optim, steps)
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"), every=cfg.checkpoint.every,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    data = ScheduledBatches(parse_seq_len_schedule(cfg.train.seq_len_schedule, cfg.train.seq_len, steps),
                            stage.batches, stage.batches_for, stage.name)
    shards = mesh.shape["sequence"]      # > 1: rows in zig-zag order (causal balance of context parallelism)
    for length in parse_seq_len_schedule(cfg.train.seq_len_schedule, cfg.train.seq_len, steps).lengths:
        if shards > 1 and length % (2 * shards):
            raise ValueError(f"train.seq_len={length} (or a train.seq_len_schedule stage): context parallelism over "
                             f"mesh.sequence={shards} needs lengths divisible by 2 × {shards}")
    start = ckpt.latest_step() or 0
    writer = MetricsWriter(cfg.workdir, enabled=jax.process_index() == 0, resume_step=start)
    rows, evals = [], {}
    with use_sharding(mesh, rules), interrupt.on_signal():      # SIGINT/SIGTERM: save at the step, stop
        graphdef, state, shardings = create_train_state(stage.make_model, tx, mesh, rules, cfg.lora, cfg.seed)
        state, _, data_state = starting_state(state, shardings, ckpt, start, stage.init_model,
                                              optim_name=cfg.optim.name)
        start = int(state.step)       # older than the newest checkpoint if that one was unreadable
        if start:
            states = data_state["processes"] if "processes" in data_state else [data_state]
            data.set_state(state_for_process(states, jax.process_index(), jax.process_count()) if states[0] else {})
        source = start_lineage(ckpt, start, cfg.init_from)
        trained = jnp.asarray(source.get("trained_context") or 0, jnp.int32)
        step_fn = jax.jit(make_train_step(graphdef, tx, stage.loss_fn, schedule, cfg.lora),
                          out_shardings=(shardings, None), donate_argnums=0)
        bar = tqdm(range(start, steps), desc=stage.name, initial=start, total=steps,
                   disable=not cfg.train.progress or jax.process_index() != 0)
        t0, last, monitor = time.perf_counter(), start - 1, AlertMonitor.from_config(cfg)
        counts = DataCounts(stage.name)
        compiling(bar, stage.name)
        for step in bar:
            batch = put_batch(zigzag_batch(data.at(step), shards), stage.batch_axes)
            trained = longest_context(trained, batch)
            state, metrics = step_fn(state, batch, *stage.extra)
            if step == start:
                compiled(bar, stage.name)
            if step % cfg.train.log_every == 0 or step == steps - 1:
                metrics = jax.device_get(metrics)
                now = time.perf_counter()
                if "tokens" in metrics:   # first interval includes compilation
                    metrics["tokens_per_s"] = float(metrics["tokens"]) * (step - last) / max(now - t0, 1e-9)
                metrics.update(counts.read(step, data.batches))      # data/skipped, data/truncated
                if data.staged:
                    metrics.update({"seq_len": data.length, "data/deferred": getattr(data.batches, "deferred", 0)})
                rows.append(writer.write(step, metrics))
                check_nonfinite(metrics, cfg.train.max_nonfinite_steps, step, ckpt)
                bar.set_postfix(loss=f"{rows[-1]['loss']:.4f}", **({"tok/s": f"{metrics['tokens_per_s']:.0f}"}
                                                                  if "tokens_per_s" in metrics else {}))
                monitor.check(step, rows[-1], writer, bar)
                t0, last = now, step
            done = step + 1
            if stage.eval_fn is not None and (done == steps or cfg.train.eval_every and done % cfg.train.eval_every == 0):
                evals = run_eval(stage, graphdef, state, cfg.lora)
                rows.append(writer.write(step, evals))
                logging.info("%s step %d: %s", stage.name, done, summary(evals))
                if stage.sample_fn is not None:      # every process: sampling runs on the global mesh
                    stage.sample_fn(nnx.merge(graphdef, model_params(state, cfg.lora), state.rest), step)
            def save():
                writer.flush()      # rows up to the checkpoint reach a gs:// metrics.jsonl before it
                ckpt.save(done, {k: getattr(state, k) for k in CHECKPOINT_ITEMS},
                          data={"processes": allgather_json(data.get_state())},
                          meta={"seed": cfg.seed, "stage": stage.name, "config": cfg.to_dict(), "optim": cfg.optim.name,
                                lineage.KEY: lineage.merge(source, int(trained))})
            if saved := ckpt.should_save(done, steps):
                save()
            interrupt.stop_if_requested(done, saved=saved, save=save, ckpt=ckpt, workdir=cfg.workdir, writer=writer,
                                        agree_every=cfg.train.log_every)
        if stage.eval_fn is not None and not evals:      # resumed after the last step: gates still need it
            evals = run_eval(stage, graphdef, state, cfg.lora)
            logging.info("%s step %d: %s", stage.name, int(state.step), summary(evals))
    ckpt.close()
    writer.close()
    logging.info("%s: finished %d steps in %s", stage.name, steps, cfg.workdir)
    return Result(graphdef, state, rows, evals, getattr(step_fn, "_cache_size", lambda: 0)())
