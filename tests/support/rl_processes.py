"""A learner or sampler process of a disaggregated `rlvr_tiny` run (the golden test's small run) on
loopback, for the tests that start them (tests/rl/rollout/test_remote.py, tests/stages/test_rlvr_sampler.py)."""

import os
import subprocess
import sys

from posttrain.rl.rollout import transfer
from tests.support import paths
from tests.test_golden import RUNS, SMALL

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


def start(argv: list[str], log):
    """Start `argv` in the repository with its output in `log`: 8 CPU devices, loopback transfers."""
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
        "JAX_PLATFORMS": "cpu",
        "JAX_DEFAULT_MATMUL_PRECISION": "highest",  # as tests/conftest.py: the golden rows' numerics
        transfer.HOST_ENV: "127.0.0.1",
    }
    return subprocess.Popen(argv, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def wait(proc, log, timeout=300):
    """Wait for `proc`; fail with the tail of its `log` unless it exits 0 within `timeout` s."""
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(open(log).read()[-3000:]) from None
    assert code == 0, open(log).read()[-3000:]
