"""The platform a run uses: on a machine with neither a TPU nor a GPU, with `JAX_PLATFORMS` unset,
posttrain tells JAX to use the CPU before importing it, so an installed libtpu prints nothing, and
one line names the platform."""

import os
import subprocess
import sys

import pytest

from posttrain import main
from tests.support.cli_runs import ROOT


@pytest.mark.skipif(
    main.accelerator_present(main.TPU_DEVICE_FILES, main.TPU_VENDOR) or main.accelerator_present(main.GPU_DEVICE_FILES),
    reason="this machine has an accelerator: JAX chooses it, posttrain does not",
)
def test_cpu_machine_starts_quietly_and_names_the_platform(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # libtpu would initialise even while another process holds its lock
    command = [sys.executable, "-m", "posttrain.main", "--config", str(ROOT / "configs/sft_tiny.py")]
    command += [f"--config.workdir={tmp_path / 'run'}", "--config.stage=eval", f"--config.eval.checkpoint={tmp_path}"]
    out = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 1 and "error: " in out.stderr  # no checkpoint there: an error, after the line
    assert "INVALID_ARGUMENT" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr, out.stderr[:2000]
    first = out.stderr.splitlines()[0]
    assert first.startswith("platform: cpu, ") and "JAX_PLATFORMS=cpu" in first, out.stderr[:2000]


def test_platform_is_left_to_jax_when_named_or_an_accelerator_is_present():
    assert main.quiet_platform(env := {}, tpu=False, gpu=False) == "cpu" and env == {"JAX_PLATFORMS": "cpu"}
    for env, tpu, gpu in (({"JAX_PLATFORMS": ""}, False, False), ({}, True, False), ({}, False, True)):
        before = dict(env)
        assert main.quiet_platform(env, tpu=tpu, gpu=gpu) is None and env == before
