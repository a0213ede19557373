"""Divergence: a non-finite loss or gradient skips the update (counted), the loop stops after
`train.max_nonfinite_steps` in a row, no checkpoint holds NaN, metrics.jsonl stays strict JSON."""

import functools
import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.core.checkpoint import Checkpointer, NonFiniteCheckpoint
from posttrain.core.metrics import MetricsWriter, read_metrics
from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state
from posttrain.core.step import Diverged, check_nonfinite, lm_loss, make_train_step
from posttrain.models.decoder import Decoder
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from tests.support.paths import ROOT
from tests.support.typed_configs import run_cfg


def strict_loads(line: str):
    def reject(token):
        raise ValueError(f"non-standard JSON token {token}")

    return json.loads(line, parse_constant=reject)


def scaled_loss(model, batch, moe_cfg):
    """lm_loss times batch["scale"]: a NaN scale poisons the loss and every gradient."""
    loss, metrics = lm_loss(model, batch, moe_cfg)
    return loss * batch["scale"], {**metrics, "loss": loss * batch["scale"]}


def test_nonfinite_batch_is_skipped_and_training_continues():
    cfg = run_cfg({"model.num_layers": 1, "model.vocab_size": 64})  # the smallest compile
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1])  # one device: the fastest compile
    tx = make_optimizer(cfg.optim, 10)
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (8, 17))
    batch = {
        "inputs": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.ones((8, 16), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(16), (8, 16)),
        "segment_ids": jnp.ones((8, 16), jnp.int32),
    }
    with use_sharding(mesh, DEFAULT_RULES):
        graphdef, state, shardings = create_train_state(
            lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, DEFAULT_RULES
        )
        step = jax.jit(
            make_train_step(graphdef, tx, functools.partial(scaled_loss, moe_cfg=cfg.model.moe)),
            out_shardings=(shardings, None),
        )
        good, bad = {**batch, "scale": jnp.float32(1.0)}, {**batch, "scale": jnp.float32(np.nan)}
        state, m = step(state, good)
        before = jax.device_get((state.params, state.opt_state, state.rest))
        state, m = step(state, bad)
        assert not np.isfinite(m["loss"]) and int(m["nonfinite_skipped"]) == 1 and int(m["nonfinite_longest_run"]) == 1
        after = jax.device_get((state.params, state.opt_state, state.rest))
        for a, b in zip(jax.tree.leaves(before), jax.tree.leaves(after)):
            np.testing.assert_array_equal(a, b)  # params, Adam moments and router biases untouched
        assert int(state.step) == 2
        state, m = step(state, bad)
        assert int(m["nonfinite_longest_run"]) == 2
        state, m = step(state, good)  # training continues from the last good weights
        assert np.isfinite(m["loss"]) and int(m["nonfinite_skipped"]) == 2 and int(state.nonfinite["run"]) == 0
        assert int(m["nonfinite_longest_run"]) == 2
        changed = jax.device_get(state.params)
        assert all(np.isfinite(x).all() for x in jax.tree.leaves(changed))
        assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(before[0]), jax.tree.leaves(changed)))
    check_nonfinite({"nonfinite_longest_run": 2}, 2, 3)
    with pytest.raises(Diverged, match="train.max_nonfinite_steps=1"):
        check_nonfinite({"nonfinite_longest_run": 2}, 1, 3)


def test_metrics_jsonl_is_strict_json(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    row = writer.write(
        0, {"loss": np.float32(np.nan), "grad_norm": np.inf, "moe/load": np.array([0.5, -np.inf]), "tokens": 3}
    )
    assert np.isnan(row["loss"])  # the caller still sees the float
    writer.write(1, {"loss": 1.5})
    writer.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    rows = [strict_loads(l) for l in lines]
    assert rows[0] == {"step": 0, "loss": None, "grad_norm": None, "moe/load": [0.5, None], "tokens": 3}
    back = read_metrics(str(tmp_path))
    assert np.isnan(back[0]["loss"]) and np.isnan(back[0]["moe/load"][1]) and back[1]["loss"] == 1.5


def test_checkpointer_refuses_nonfinite_weights(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3, async_save=False)
    ckpt.save(1, {"params": {"w": jnp.ones(3)}})
    with pytest.raises(NonFiniteCheckpoint, match=r"checkpoint 2 .*params/w holds NaN/inf.*\(1\)"):
        ckpt.save(2, {"params": {"w": jnp.array([1.0, np.nan, 0.0])}, "opt_state": {"count": jnp.int32(3)}})
    ckpt.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]


def test_diverging_run_stops_with_clear_error_and_finite_checkpoints(tmp_path):
    """The issue's command: lr=1e6 without warmup or clipping, checkpoints every 6 steps."""
    cmd = [
        sys.executable,
        "-m",
        "posttrain.main",
        "--config",
        str(ROOT / "configs/sft_tiny.py"),
        f"--config.workdir={tmp_path}/W",
        "--config.sft.eval_files=",
        "--config.sft.gate=",
        "--config.data.synthetic_size=100",
        "--config.train.steps=40",
        "--config.train.log_every=1",
        "--config.train.batch_size=8",
        "--config.train.seq_len=64",
        "--config.train.progress=False",
        "--config.optim.lr=1e6",
        "--config.optim.warmup_steps=0",
        "--config.optim.grad_clip=0",
        "--config.checkpoint.every=6",
        "--config.model.num_layers=1",
        "--config.model.moe.num_experts=0",
    ]  # a cheaper compile
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 2, out.stderr[-3000:]
    last = out.stderr.strip().splitlines()[-1]
    # the default train.max_nonfinite_steps=10: the 11th skipped update in a row stops the run
    assert last.startswith("error: training diverged: 11 updates in a row") and "train.max_nonfinite_steps=10" in last
    rows = [strict_loads(l) for l in (tmp_path / "W" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["step"] < 39 and rows[-1]["nonfinite_longest_run"] == 11
    assert rows[-1]["grad_norm"] is None or rows[-1]["loss"] is None  # NaN/inf written as null
    steps = sorted(int(p.name) for p in (tmp_path / "W" / "checkpoints").iterdir() if p.name.isdigit())
    assert steps, "no checkpoint was written"
    from posttrain.core.checkpoint import first_nonfinite

    ckpt = Checkpointer(str(tmp_path / "W" / "checkpoints"), every=0, keep=1, create=False)
    restored = ckpt.manager.restore(steps[-1])
    assert first_nonfinite({k: restored[k] for k in ("params", "opt_state")}) is None
    ckpt.close()
