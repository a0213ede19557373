"""A learner or sampler process of a disaggregated `rlvr_tiny` run (the golden test's small run) on
loopback, for the tests that start them (tests/rl/rollout/test_remote.py, tests/stages/test_rlvr_sampler.py)."""

import json
import os
import socket
import subprocess
import sys

import numpy as np

from posttrain.rl.rollout import transfer
from tests.support import paths
from tests.test_golden import GOLDEN, RUNS, SMALL

ROOT = str(paths.ROOT)


def command(workdir, role, **overrides):
    """`python -m posttrain.main` on rlvr_tiny (the golden test's small run) in `role`."""
    flat = {**SMALL, **RUNS["rlvr_tiny_sync"][1], "workdir": str(workdir), "rl.placement": "disaggregated"}
    flat.update({"rl.role": role, **overrides})
    return [sys.executable, "-m", "posttrain.main", "--config", os.path.join(ROOT, "configs", "rlvr_tiny.py")] + [
        f"--config.{k}={v}" for k, v in flat.items()
    ]


def spawn(workdir, role, log, **overrides):
    """Start `command(workdir, role, **overrides)` with its output in `log`, 8 CPU devices."""
    return start(command(workdir, role, **overrides), log)


def spawn_group(workdir, role, folder, *, processes: int, port: int, **overrides) -> list:
    """A `role` group of `processes` processes (8 CPU devices over them, coordinator on `port`), each
    started in its own folder under `folder` (its cwd, its log: `folder/<role><i>/log.txt`), so
    that what they share is the workdir only."""
    procs = []
    for i in range(processes):
        own = os.path.join(folder, f"{role}{i}")
        os.makedirs(own, exist_ok=True)
        distributed = {"coordinator": f"127.0.0.1:{port}", "num_processes": processes, "process_id": i}
        argv = command(workdir, role, **overrides, **{f"distributed.{k}": v for k, v in distributed.items()})
        procs.append(start(argv, os.path.join(own, "log.txt"), devices=8 // processes, cwd=own))
    return procs


def start(argv: list[str], log, *, devices: int = 8, cwd: str = ROOT):
    """Start `argv` in `cwd` (the repository) with its output in `log`: `devices` CPU devices,
    loopback transfers."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",  # as tests/conftest.py: the golden rows' numerics
        transfer.HOST_ENV: "127.0.0.1",
    }
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait(proc, log, timeout=300):
    """Wait for `proc`; fail with the tail of its `log` unless it exits 0 within `timeout` s."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(open(log).read()[-3000:]) from None
    assert code == 0, open(log).read()[-3000:]


def golden_rows(rows, evals: bool) -> None:
    """On-policy (max_staleness = 0) with the seed's tasks and keys, the run logs the colocated
    run's golden rows (`tests/test_golden.py`, rlvr_tiny_sync) within 1e-5."""
    want_rows = json.loads(GOLDEN.read_text())["rlvr_tiny_sync"]
    want_rows = [r for r in want_rows if evals or not any(k.startswith("eval/") for k in r)]
    for got, want in zip(rows, want_rows, strict=True):
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=f"step {want['step']} {key}")


def free_port() -> int:
    """A free TCP port on 127.0.0.1 (a group's coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
