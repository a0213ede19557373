"""The workdir lock: a second run in a busy workdir fails at once naming the first; stale locks of
dead runs are taken over; a process's own nested workdirs (pipeline stages) never block."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from posttrain.core.workdir import LOCK_NAME, WorkdirBusy, lock_file, workdir_lock
from tests.support.paths import ROOT


def sft_command(workdir: Path, *extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "posttrain.main",
        "--config",
        str(ROOT / "configs/sft_tiny.py"),
        f"--config.workdir={workdir}",
        "--config.sft.eval_files=",
        "--config.sft.gate=",
        "--config.data.synthetic_size=100",
        "--config.train.progress=False",
        *extra,
    ]


def wait_for_holder(path: Path, proc: subprocess.Popen, timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if path.exists() and path.read_text().strip():
            return json.loads(path.read_text())
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    raise AssertionError("the first run never took the lock")


def test_second_run_in_locked_workdir_fails_fast_naming_the_first(tmp_path, caplog):
    workdir = tmp_path / "W"
    first = subprocess.Popen(
        sft_command(workdir, "--config.train.steps=100000"),
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        holder = wait_for_holder(workdir / LOCK_NAME, first)
        assert holder["pid"] == first.pid
        t0 = time.time()
        second = subprocess.run(
            sft_command(workdir, "--config.train.steps=3"), cwd=ROOT, capture_output=True, text=True, timeout=120
        )
        elapsed = time.time() - t0
        err = second.stderr.strip().splitlines()
        assert second.returncode == 2, second.stderr[-3000:]
        assert err[-1].startswith("error: workdir ") and "Traceback" not in second.stderr, second.stderr[-3000:]
        assert f"pid {first.pid} on host {holder['host']}" in err[-1] and str(workdir) in err[-1]
        assert f"started {holder['started']}" in err[-1]
        print(f"second run refused after {elapsed:.1f} s")
        assert first.poll() is None, "the first run must be unaffected"
        assert not (workdir / "error.log").exists()  # the refused run writes nothing there
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # The killed run's lock is stale: the next run takes it over and says whose it was.
    with caplog.at_level(logging.WARNING), workdir_lock(str(workdir)):
        assert json.loads((workdir / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert f"stale lock left by pid {first.pid}" in caplog.text
    assert (workdir / LOCK_NAME).read_text() == ""  # released cleanly: nothing to report next time


HOLD = """
import sys, time
from posttrain.core.workdir import workdir_lock
with workdir_lock(sys.argv[1]):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def held_elsewhere(tmp_path):
    """A workdir `tmp_path/P` whose lock another (live) process holds."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "P")],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert proc.stdout.readline().strip() == "locked"
    yield tmp_path / "P"
    proc.kill()
    proc.wait()


def test_lock_conflicts_with_ancestors_and_stage_subfolders(held_elsewhere, tmp_path):
    with pytest.raises(WorkdirBusy, match=r"in use by pid \d+"):
        with workdir_lock(str(held_elsewhere)):
            pass
    with pytest.raises(WorkdirBusy, match="P/.posttrain.lock"):  # a stage folder of a busy pipeline
        with workdir_lock(str(held_elsewhere / "0_sft")):
            pass
    (tmp_path / "Q" / "0_sft").mkdir(parents=True)
    with workdir_lock(str(tmp_path / "Q" / "0_sft")):  # a pipeline over a busy stage folder
        proc = subprocess.run(
            [sys.executable, "-c", HOLD.replace("time.sleep(600)", "pass"), str(tmp_path / "Q")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
        )
        assert proc.returncode != 0 and "Q/0_sft/.posttrain.lock" in proc.stderr


def test_lock_is_reentrant_for_nested_workdirs_of_this_process(tmp_path):
    with workdir_lock(str(tmp_path)):
        with workdir_lock(str(tmp_path)), workdir_lock(str(tmp_path / "0_sft")), workdir_lock(str(tmp_path / "1_dpo")):
            assert (tmp_path / "0_sft" / LOCK_NAME).exists()
        assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
    assert (tmp_path / LOCK_NAME).read_text() == ""


def test_remote_workdir_is_locked_on_this_machine_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = lock_file("gs://bucket/run")
    assert path.startswith(str(tmp_path / "posttrain" / "locks")) and path == lock_file("gs://bucket/run/")
    with caplog.at_level(logging.WARNING), workdir_lock("gs://bucket/run"):
        assert json.loads(Path(path).read_text())["pid"] == os.getpid()
    assert "locked on this machine only" in caplog.text
