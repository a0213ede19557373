"""The run harness every training stage shares: where a run starts (initial weights, resume from the
newest readable checkpoint), and `Harness`, which owns a run's checkpointer, metrics writer,
progress bar and alert monitor and ends each step the same way (checkpoint when due; on SIGINT /
SIGTERM save at the step and stop).

The gradient loop (`core/loop.py`: SFT, reward model, DPO, lm) and the RL loop (`stages/rlvr.py`)
are its clients; they differ only in what one step does.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from tqdm import tqdm

from posttrain.core import interrupt, lineage
from posttrain.core.alerts import AlertMonitor, AlertStop
from posttrain.core.checkpoint import Checkpointer, abstract_with_shardings
from posttrain.core.metrics import MetricsWriter, compiling
from posttrain.core.state import TrainState
from posttrain.errors import UserError
from posttrain.parallel import agree, use_sharding


@dataclasses.dataclass
class Result:
    """What a stage's run returns: the final train state, the logged rows, the final evaluation."""

    graphdef: nnx.GraphDef
    state: TrainState
    rows: list[dict]
    eval: dict
    train_step_compiles: int = 0  # programs the train step compiled: one per sequence-length stage run


CHECKPOINT_ITEMS = ("params", "rest", "opt_state")  # the step is the checkpoint's own number


def evaluation_due(done: int, steps: int, every: int) -> bool:
    """Whether a loop evaluates after `done` of `steps` updates: every `every` (0: never) and at the
    end. A loop also evaluates on resuming from a step where this holds: the evaluation was logged
    before that step's checkpoint and its row went with the rows past it (MetricsWriter)."""
    return done == steps or bool(every) and done % every == 0


def restore_target(state_shapes: TrainState, shardings: TrainState) -> dict[str, Any]:
    """What a resume asks orbax for: the `CHECKPOINT_ITEMS` of the train state as
    ShapeDtypeStructs carrying the train step's shardings, so each array is read straight into
    its shards on any mesh (`Checkpointer.restore`). state_shapes: shapes and dtypes only."""
    abstract = abstract_with_shardings(state_shapes, shardings)
    return {k: getattr(abstract, k) for k in CHECKPOINT_ITEMS}


def check_optimizer_matches(ckpt: Checkpointer, step: int, optim_name: str) -> None:
    """Refuse to resume checkpoint `step` under another optimizer (its state has another structure):
    a UserError naming optim.name rather than every checkpoint reported unreadable. Checkpoints
    without the `optim` meta key predate the choice and hold AdamW's state."""
    try:
        saved = ckpt.restore(step, {})[2].get("optim", "adamw")
    except Exception:  # an unreadable newest checkpoint: restore_newest reports it and falls back
        return
    if saved != optim_name:
        raise UserError(
            f"config.optim.name={optim_name!r}: checkpoint {ckpt.directory}/{step} holds the state of "
            f"optim.name={saved!r}; resume with that optimizer, or start a new workdir (init_from "
            "the checkpoint's weights) to switch",
            key="optim.name",
        )


def starting_state(
    state: TrainState,
    shardings: TrainState,
    ckpt: Checkpointer,
    start: int,
    init_model=None,
    *,
    need_start_weights: bool = False,
    optim_name: str = "adamw",
) -> tuple[TrainState, tuple, dict]:
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
    if start:  # the newest readable checkpoint: an unreadable newer one is skipped, with a warning
        check_optimizer_matches(ckpt, start, optim_name)
        found = ckpt.restore_newest(restore_target(jax.eval_shape(lambda: state), shardings), at_most=start)
        if found is not None:
            start, trees, data, _ = found
            state = state.replace(step=jnp.asarray(start, jnp.int32), **trees)
    return state, start_weights, data


def start_lineage(ckpt: Checkpointer, start: int, init_from: str) -> dict:
    """The lineage a run carries (see `posttrain.core.lineage`): its checkpoint's when resuming,
    else inherited from `init_from`."""
    if start:
        meta = ckpt.restore(start, {})[2]
        if meta.get(lineage.KEY):
            return meta[lineage.KEY]
    return lineage.of_init(init_from)


class Harness:
    """A training run's fixed parts: its checkpointer, metrics writer (process 0 writes), progress
    bar and alert monitor; `start` is the newest checkpoint's step (0 for a fresh run)."""

    def __init__(
        self,
        name: str,
        steps: int,
        ckpt: Checkpointer,
        writer: MetricsWriter,
        *,
        workdir: str,
        progress: bool,
        alerts: AlertMonitor,
        agree_every: int = 1,
        start: int = 0,
    ):
        self.name, self.steps, self.ckpt, self.writer, self.workdir = name, steps, ckpt, writer, workdir
        self.progress, self.monitor, self.agree_every, self.start = progress, alerts, agree_every, start
        self._closed = False

    @classmethod
    def open(cls, name: str, workdir: str, steps: int, checkpoint_cfg, **kw) -> Harness:
        """The harness of a run in `workdir`: its checkpoints (`checkpoint_cfg`: every, keep,
        async_save) and a metrics writer that drops rows past the newest checkpoint."""
        ckpt = Checkpointer(
            os.path.join(workdir, "checkpoints"),
            every=checkpoint_cfg.every,
            keep=checkpoint_cfg.keep,
            async_save=checkpoint_cfg.async_save,
        )
        # the newest checkpoint every process lists (all then take the resume path, or none)
        start = agree(ckpt.latest_step() or 0, name="newest checkpoint step", reduce="min")
        writer = MetricsWriter(workdir, enabled=jax.process_index() == 0, resume_step=start)
        return cls(name, steps, ckpt, writer, workdir=workdir, start=start, **kw)

    @contextlib.contextmanager
    def running(self, mesh, rules) -> Iterator[None]:
        """The run's block: the mesh and rules current, SIGINT/SIGTERM caught (save at the step,
        stop); the checkpointer and writer closed when it ends, however it ends."""
        try:
            with use_sharding(mesh, rules), interrupt.on_signal():
                yield
        finally:
            self.close()

    def bar(self, start: int) -> tqdm:
        """The progress bar over steps `start` … `steps − 1` (process 0, `train.progress`), saying
        that the first step compiles."""
        bar = tqdm(
            range(start, self.steps),
            desc=self.name,
            initial=start,
            total=self.steps,
            disable=not self.progress or jax.process_index() != 0,
        )
        compiling(bar, self.name)
        return bar

    def write(self, step: int, metrics: dict) -> dict:
        """Record `metrics` at `step` (metrics.jsonl, TensorBoard); the row as written."""
        return self.writer.write(step, metrics)

    def alert(self, step: int, row: dict, bar: tqdm | None = None) -> None:
        """Let the alert monitor read a logged row (warn, event row, bar; AlertStop in mode stop).
        Several processes stop together: a rule may read local facts (throughput_stall reads this
        host's clock), so in mode stop they agree whether any process's rules fired."""
        if self.monitor.mode != "stop" or jax.process_count() == 1:
            self.monitor.check(step, row, self.writer, bar)
            return
        try:
            self.monitor.check(step, row, self.writer, bar)
            stop = None
        except AlertStop as e:
            stop = e
        if agree(stop is not None, name=f"alert stop at step {step}", reduce="any"):
            raise stop or AlertStop(f"run stopped at step {step} by alerts.on='stop': another process's alerts fired")

    def end_step(self, done: int, save: Callable[[], None]) -> None:
        """After `done` steps: checkpoint with `save()` when due (the metrics flushed first, so a
        gs:// metrics.jsonl has every row up to the checkpoint), then stop if a signal asked to."""

        def flushed_save():
            self.writer.flush()
            save()

        if saved := self.ckpt.should_save(done, self.steps):
            flushed_save()
        interrupt.stop_if_requested(
            done,
            saved=saved,
            save=flushed_save,
            ckpt=self.ckpt,
            workdir=self.workdir,
            writer=self.writer,
            agree_every=self.agree_every,
        )

    def close(self) -> None:
        """Wait for pending checkpoints and close the writer (once)."""
        if not self._closed:
            self._closed = True
            self.ckpt.close()
            self.writer.close()
