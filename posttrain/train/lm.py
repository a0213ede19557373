"""Stage `lm`: next-token training of the decoder on the built-in arithmetic text task.

The quickstart's first stage and the foundation's end-to-end check: mesh, sharded init, jitted
train step with donated buffers, metrics and a progress bar.
"""

from __future__ import annotations

import logging

import jax
from flax import nnx
from tqdm import tqdm

from posttrain.data.synthetic import arithmetic_lm_batch
from posttrain.models.decoder import Decoder
from posttrain.parallel import make_mesh, named_sharding, parse_rules, use_sharding
from posttrain.train.metrics import MetricsWriter
from posttrain.train.optim import lr_schedule, make_optimizer
from posttrain.train.state import create_train_state
from posttrain.train.step import BATCH_AXES, make_train_step


def put_batch(batch: dict, shape_names=BATCH_AXES) -> dict:
    """Host batch (this process's rows) → global arrays sharded by logical names."""
    return {k: jax.make_array_from_process_local_data(named_sharding(shape_names, v.shape), v)
            for k, v in batch.items()}


def run(cfg) -> list[dict]:
    """Train for `cfg.train.steps` steps; returns the logged metric rows."""
    if cfg.data.task != "arithmetic":
        raise ValueError(f"data.task={cfg.data.task!r}: stage 'lm' supports 'arithmetic'")
    if cfg.model.vocab_size < 256:
        raise ValueError(f"model.vocab_size={cfg.model.vocab_size}: byte tokens need >= 256")
    mesh = make_mesh(cfg.mesh.to_dict())
    rules = parse_rules(cfg.sharding.rules.to_dict())
    logging.info("mesh %s", dict(mesh.shape))
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    writer = MetricsWriter(cfg.workdir, enabled=jax.process_index() == 0)
    rows = []
    with use_sharding(mesh, rules):
        graphdef, state, shardings = create_train_state(
            lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed)), tx, mesh, rules)
        step_fn = jax.jit(make_train_step(graphdef, tx, cfg.model.moe, lr_schedule(cfg.optim, cfg.train.steps)),
                          in_shardings=(shardings, None), out_shardings=(shardings, None), donate_argnums=0)
        bar = tqdm(range(cfg.train.steps), desc="lm", disable=not cfg.train.progress)
        for step in bar:
            batch = arithmetic_lm_batch(cfg.seed, step, cfg.train.batch_size, cfg.train.seq_len)
            state, metrics = step_fn(state, put_batch(batch))
            if step % cfg.train.log_every == 0 or step == cfg.train.steps - 1:
                row = writer.write(step, jax.device_get(metrics))
                rows.append(row)
                bar.set_postfix(loss=f"{row['loss']:.4f}")
    writer.close()
    return rows
