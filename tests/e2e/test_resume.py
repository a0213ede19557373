"""Reliability: a run killed with SIGKILL resumes to the same metrics; checkpoints reshard."""

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.core.checkpoint import Checkpointer
from posttrain.core.init import load_model_state
from posttrain.core.state import init_model_state
from posttrain.models.decoder import Decoder
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from tests.support.cli_runs import SFT_EVERY, SFT_STEPS, sft_command
from tests.support.paths import ROOT

STEPS, EVERY = SFT_STEPS, SFT_EVERY


def metrics(workdir: Path) -> list[dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows]


def assert_same_metrics(a: list[dict], b: list[dict]) -> None:
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(STEPS))
    for ra, rb in zip(a, b):
        assert ra.keys() == rb.keys()
        for k in ra:
            np.testing.assert_allclose(rb[k], ra[k], rtol=1e-5, atol=1e-6, err_msg=f"step {ra['step']} {k}")


def test_sigkill_then_resume_equals_uninterrupted(tmp_path, sft_cli_run):
    full = sft_cli_run

    workdir = tmp_path / "killed"
    kill_at = random.randint(EVERY + 1, STEPS - 3)
    proc = subprocess.Popen(sft_command(workdir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while time.time() < deadline:
        path = workdir / "metrics.jsonl"
        # kill past step kill_at, once a checkpoint has committed (saves are async: orbax renames a
        # step's temporary folder to its number when it is complete)
        committed = (workdir / "checkpoints").is_dir() and any(
            p.name.isdigit() for p in (workdir / "checkpoints").iterdir()
        )
        if (
            committed
            and path.exists()
            and any(json.loads(l)["step"] >= kill_at for l in path.read_text().splitlines() if l.strip())
        ):
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    assert max(r["step"] for r in metrics(workdir)) < STEPS - 1, "run finished before the kill"

    resumed = subprocess.run(sft_command(workdir), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored checkpoint" in resumed.stderr
    assert_same_metrics(metrics(full), metrics(workdir))


@pytest.mark.slow
def test_sigterm_saves_at_the_current_step_then_resume_equals_uninterrupted(tmp_path, sft_cli_run):
    """Preemption: SIGTERM mid-run finishes the step, checkpoints it (between the periodic saves),
    says how to resume and exits 143; the rerun continues to the uninterrupted run's losses."""
    full = sft_cli_run
    workdir = tmp_path / "stopped"
    signal_at = random.randint(EVERY + 1, STEPS - 4)
    proc = subprocess.Popen(
        sft_command(workdir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    deadline = time.time() + 600
    while time.time() < deadline:
        path = workdir / "metrics.jsonl"
        if path.exists() and any(
            json.loads(l)["step"] >= signal_at for l in path.read_text().splitlines() if l.strip()
        ):
            break
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)
    err = proc.communicate(timeout=600)[1]
    assert proc.returncode == 143, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    done = max(r["step"] for r in metrics(workdir)) + 1  # the step running at the signal finished
    assert done < STEPS, "run finished before the signal"
    assert f"checkpoint saved at step {done}" in err.strip().splitlines()[-1], err[-3000:]
    assert "run the same command again" in err.strip().splitlines()[-1]
    assert (workdir / "checkpoints" / str(done)).is_dir()
    resumed = subprocess.run(sft_command(workdir), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"restored checkpoint {done}" in resumed.stderr
    assert_same_metrics(metrics(full), metrics(workdir))


def test_checkpoint_restores_onto_another_mesh(tmp_path):
    from posttrain.config import base_config

    cfg = base_config().model
    cfg.moe.num_experts = 4
    make = lambda: Decoder(cfg, rngs=nnx.Rngs(3))
    save_mesh = make_mesh(dict(data=8))
    with use_sharding(save_mesh, DEFAULT_RULES):
        params, rest = init_model_state(make, save_mesh, DEFAULT_RULES)
    ckpt = Checkpointer(str(tmp_path), every=1, keep=1)
    ckpt.save(1, {"params": params, "rest": rest})
    ckpt.close()
    mesh = make_mesh(dict(data=1, fsdp=2, expert=2, tensor=2))
    loaded, _, step = load_model_state(str(tmp_path), make, mesh, DEFAULT_RULES)
    assert step == 1
    w = loaded["stacks"][0]["blocks"][0]["mlp"]["w_gate"]
    assert w.sharding.mesh.shape == mesh.shape and w.sharding.spec == jax.sharding.PartitionSpec(
        None, "expert", "fsdp", "tensor"
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loaded)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def rl_command(workdir: Path) -> list[str]:
    """An overlapped (max_staleness=1) RLVR run on the tiny config, small enough for a test."""
    return [
        sys.executable,
        "-m",
        "posttrain.main",
        "--config",
        str(ROOT / "configs/rlvr_tiny.py"),
        f"--config.workdir={workdir}",
        "--config.init_from=",
        "--config.rl.steps=12",
        "--config.checkpoint.every=4",
        "--config.rl.max_staleness=1",
        "--config.rl.prompts_per_step=2",
        "--config.rl.group_size=4",
        "--config.rl.max_new_tokens=12",
        "--config.rl.eval_every=0",
        "--config.rl.eval_size=128",
        "--config.rl.gate=",
        "--config.train.progress=False",
    ]


@pytest.mark.slow
def test_sigkill_an_overlapped_rl_run_then_resume_finishes(tmp_path):
    """An overlapped run killed after a checkpoint resumes and finishes (the producer's position
    used to be restored ahead of the learner's, and both then waited on each other forever)."""
    workdir = tmp_path / "rl"
    proc = subprocess.Popen(rl_command(workdir), cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 600
    while time.time() < deadline:
        path = workdir / "metrics.jsonl"
        committed = (workdir / "checkpoints").is_dir() and any(
            p.name.isdigit() for p in (workdir / "checkpoints").iterdir()
        )
        if (
            committed
            and path.exists()
            and any(json.loads(l)["step"] >= 6 for l in path.read_text().splitlines() if l.strip())
        ):
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-3000:]
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert max(r["step"] for r in metrics(workdir)) < 11, "run finished before the kill"
    resumed = subprocess.run(rl_command(workdir), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "restored checkpoint" in resumed.stderr
    assert [r["step"] for r in metrics(workdir)] == list(range(12))
