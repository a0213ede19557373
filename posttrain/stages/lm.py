"""Stage `lm`: next-token training of the decoder on the built-in arithmetic text task.

The foundation's end-to-end check: mesh, sharded init, jitted train step with donated buffers,
metrics, progress bar and checkpoints, on data that needs no files.
"""

from __future__ import annotations

import functools

import jax
from flax import nnx

from posttrain.core.loop import TrainSpec, train
from posttrain.core.step import lm_loss
from posttrain.data.synthetic import arithmetic_lm_batch
from posttrain.models.decoder import Decoder


class ArithmeticBatches:
    """Endless arithmetic-text batches; the state is just the step (data is a function of it)."""

    def __init__(self, seed: int, batch_size: int, seq_len: int):
        self.seed, self.batch_size, self.seq_len, self.step = seed, batch_size, seq_len, 0

    def __iter__(self):
        return self

    def __next__(self) -> dict:
        """This process's rows of the step's global batch (the same global batch for any process count)."""
        batch = arithmetic_lm_batch(self.seed, self.step, self.batch_size, self.seq_len)
        self.step += 1
        n, i = jax.process_count(), jax.process_index()
        if self.batch_size % n:
            raise ValueError(f"train.batch_size={self.batch_size}: must be a multiple of the {n} processes")
        rows = self.batch_size // n
        return {k: v[i * rows : (i + 1) * rows] for k, v in batch.items()}

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        self.step = int(state["step"])

    def continue_from(self, previous: ArithmeticBatches) -> None:
        """Carry on from `previous` (another length): the data is a function of the step."""
        self.step = previous.step


def run(cfg) -> list[dict]:
    """Train for `cfg.train.steps` steps; returns the logged metric rows."""
    if cfg.data.task != "arithmetic":
        raise ValueError(f"data.task={cfg.data.task!r}: stage 'lm' supports 'arithmetic'")
    if cfg.eval.long_context.lengths:
        raise ValueError("eval.long_context.lengths is set but stage 'lm' has no chat evaluation; use stage sft")
    if cfg.model.vocab_size < 256:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: byte tokens need >= 256")
    batches_for = lambda seq_len: ArithmeticBatches(cfg.seed, cfg.train.batch_size, seq_len)
    stage = TrainSpec(
        name="lm",
        make_model=lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed)),
        loss_fn=functools.partial(lm_loss, moe_cfg=cfg.model.moe),
        batches=batches_for(cfg.train.seq_len),
        batches_for=batches_for,
    )
    return train(cfg, stage).rows
