"""A damaged newest checkpoint: resume falls back to the newest readable one, naming the bad one;
an error naming each when none can be read; a differently shaped model is named, not guessed."""

import logging
import runpy
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.core.checkpoint import Checkpointer, ShapeMismatch
from posttrain.errors import UserError
from tests.support.paths import ROOT


def truncate_largest_file(step_dir: Path, item: str = "params") -> Path:
    """Cut the largest file of a checkpoint item in half (what a full disk or a killed copy leaves)."""
    victim = max((p for p in (step_dir / item).rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    return victim


def tree(value: float) -> dict:
    noise = np.random.default_rng(0).normal(size=(256, 256)).astype(np.float32)  # incompressible
    return {"params": {"w": jnp.asarray(noise) + value, "b": jnp.full((256,), value)}}


def abstract() -> dict:
    return {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree(0.0)["params"])}


def test_restore_newest_skips_a_truncated_checkpoint_and_names_it(tmp_path, caplog):
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3, async_save=False)
    for step in (1, 2):
        ckpt.save(step, tree(float(step)), data={"step": step})
    ckpt.close()
    assert "/d/" in str(truncate_largest_file(tmp_path / "2"))  # an array data file
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3, async_save=False)
    with caplog.at_level(logging.WARNING):
        step, trees, data, _ = ckpt.restore_newest(abstract())
    assert step == 1 and data == {"step": 1} and float(trees["params"]["b"][0]) == 1.0
    assert f"checkpoint {tmp_path}/2 cannot be read" in caplog.text
    assert (tmp_path / "2.unreadable").is_dir() and not (tmp_path / "2").exists()  # set aside, kept
    ckpt.save(2, tree(2.0))  # the step saves again
    ckpt.wait()
    truncate_largest_file(tmp_path / "1")
    truncate_largest_file(tmp_path / "2")
    with pytest.raises(UserError, match=rf"no readable checkpoint in {tmp_path}: 2 \(.*\); 1 \(.*\)"):
        ckpt.restore_newest(abstract())
    ckpt.close()


def test_shape_mismatch_names_the_parameter_and_both_shapes(tmp_path):
    ckpt = Checkpointer(str(tmp_path), every=1, keep=3, async_save=False)
    ckpt.save(1, tree(1.0))
    other = {
        "params": {"w": jax.ShapeDtypeStruct((256, 32), jnp.float32), "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
    }
    with pytest.raises(ShapeMismatch, match=r"params/w has shape \(256, 256\), the model expects \(256, 32\)"):
        ckpt.restore_newest(other)
    ckpt.close()


def test_resume_after_corrupt_newest_checkpoint_continues_from_the_previous(tmp_path, caplog):
    from posttrain.core.metrics import read_metrics
    from posttrain.main import run

    def config(steps):
        cfg = runpy.run_path(str(ROOT / "configs/sft_tiny.py"))["get_config"]()
        cfg.workdir, cfg.sft.eval_files, cfg.sft.gate = str(tmp_path / "W"), "", ""
        cfg.data.synthetic_size, cfg.train.steps, cfg.train.log_every, cfg.checkpoint.every = 64, steps, 1, 2
        cfg.train.batch_size, cfg.train.seq_len, cfg.train.progress, cfg.checkpoint.async_save = 8, 64, False, False
        cfg.model.num_layers, cfg.model.moe.num_experts = 1, 0
        return cfg

    run(config(6))
    first = {r["step"]: r["loss"] for r in read_metrics(str(tmp_path / "W"))}
    truncate_largest_file(tmp_path / "W" / "checkpoints" / "6")
    with caplog.at_level(logging.INFO):
        run(config(6))
    assert f"checkpoint {tmp_path}/W/checkpoints/6 cannot be read" in caplog.text
    assert "restored checkpoint 4 " in caplog.text
    rows = read_metrics(str(tmp_path / "W"))
    assert [r["step"] for r in rows] == list(range(6))  # steps 4, 5 retrained once, no duplicates
    np.testing.assert_allclose([rows[4]["loss"], rows[5]["loss"]], [first[4], first[5]], rtol=1e-5)
    assert sorted(p.name for p in (tmp_path / "W" / "checkpoints").iterdir()) == ["2", "4", "6", "6.unreadable"]
