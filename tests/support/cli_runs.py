"""Runs through the real entry point (`python -m posttrain.main`) that several test files share:
each costs a fresh Python and its compiles, so one run serves every test that only reads it
(the session fixture `sft_cli_run` in conftest.py)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SFT_STEPS, SFT_EVERY = 30, 10  # steps of the tiny SFT run, and its checkpoint interval


def sft_command(workdir: Path) -> list[str]:
    """The tiny SFT run (sft_tiny, MoE with 4 experts) logging every step into `workdir`."""
    return [
        sys.executable,
        "-m",
        "posttrain.main",
        "--config",
        str(ROOT / "configs/sft_tiny.py"),
        f"--config.workdir={workdir}",
        "--config.sft.eval_files=",
        "--config.sft.gate=",
        f"--config.train.steps={SFT_STEPS}",
        "--config.train.log_every=1",
        "--config.train.batch_size=8",
        "--config.train.seq_len=64",
        f"--config.checkpoint.every={SFT_EVERY}",
        "--config.train.progress=False",
        "--config.data.synthetic_size=300",
    ]


def run_sft(workdir: Path) -> Path:
    """Run `sft_command(workdir)` to the end; the workdir."""
    out = subprocess.run(sft_command(workdir), capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return workdir


def run_as_user(args: list[str], cwd: Path = ROOT, devices: int = 1) -> None:
    """`python ARGS` in `cwd` as a user runs a recipe: one device (this session's XLA_FLAGS dropped),
    or `devices` simulated CPU devices as a recipe that splits its sequence asks, and the optimised
    build; configs/ importable from any folder. Raises if it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    if devices > 1:
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    env["PYTHONPATH"] = str(ROOT)
    subprocess.run([sys.executable, *args], check=True, env=env, cwd=cwd)
