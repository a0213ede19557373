"""The platform a run uses: on a machine with neither a TPU nor a GPU, with `JAX_PLATFORMS` unset,
posttrain tells JAX to use the CPU before importing it, so an installed libtpu prints nothing, and
one line names the platform."""

import os
import subprocess
import sys

import pytest

from posttrain import platform
from tests.support.cli_runs import ROOT


@pytest.mark.skipif(
    platform.accelerator_present(platform.TPU_DEVICE_FILES, platform.TPU_VENDOR)
    or platform.accelerator_present(platform.GPU_DEVICE_FILES),
    reason="this machine has an accelerator: JAX chooses it, posttrain does not",
)
@pytest.mark.parametrize("program", ["posttrain.main", "posttrain.eval.lm_eval_cli"])
def test_cpu_machine_starts_quietly_and_names_the_platform(program, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    env["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"  # libtpu would initialise even while another process holds its lock
    if program == "posttrain.main":  # no checkpoint there: an error, after the platform line
        args = ["--config", str(ROOT / "configs/sft_tiny.py"), f"--config.workdir={tmp_path / 'run'}"]
        args += ["--config.stage=eval", f"--config.eval.checkpoint={tmp_path}"]
    else:
        pytest.importorskip("lm_eval")
        args = ["run", "--help"]
    out = subprocess.run([sys.executable, "-m", program, *args], capture_output=True, text=True, cwd=ROOT, env=env)
    assert out.returncode == (1 if program == "posttrain.main" else 0), out.stderr[-2000:]
    assert "INVALID_ARGUMENT" not in out.stderr and "TPU_WORKER_HOSTNAMES" not in out.stderr, out.stderr[:2000]
    first = out.stderr.splitlines()[0]
    assert first.startswith("platform: cpu, ") and "JAX_PLATFORMS=cpu" in first, out.stderr[:2000]


def test_platform_is_left_to_jax_when_named_or_an_accelerator_is_present():
    assert platform.quiet_platform(env := {}, tpu=False, gpu=False) == "cpu" and env == {"JAX_PLATFORMS": "cpu"}
    for env, tpu, gpu in (({"JAX_PLATFORMS": ""}, False, False), ({}, True, False), ({}, False, True)):
        before = dict(env)
        assert platform.quiet_platform(env, tpu=tpu, gpu=gpu) is None and env == before
