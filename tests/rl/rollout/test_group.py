"""Sampler groups and a learner of several processes (rl/rollout/group.py): a 2-process learner and a
2-process sampler group, each process in a folder of its own, share only a gs:// workdir (the GCS
emulator: queue, learner.json, checkpoints, metrics) and train `rlvr_tiny` as the colocated run."""

import os

import pytest

from posttrain.config import RLConfig
from posttrain.rl.rollout.workqueue import WorkQueue
from tests.support.rl_processes import free_port, golden_rows, spawn_group, wait
from tests.test_golden import TIMING_SUFFIXES

NO_EVAL = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}


def train_in_groups(folder, run: str, **overrides) -> tuple[list[dict], dict[str, str]]:
    """Start a 2-process sampler group, then a 2-process learner, on `run`; wait for all four to
    exit 0. The learner's logged rows (timings aside) and each process's log text."""
    from posttrain.core.metrics import read_metrics

    samplers = spawn_group(run, "sampler", str(folder), processes=2, port=free_port(), **NO_EVAL, **overrides)
    learners = spawn_group(run, "learner", str(folder), processes=2, port=free_port(), **NO_EVAL, **overrides)
    names = ("learner0", "learner1", "sampler0", "sampler1")
    for name, proc in zip(names, learners + samplers):
        wait(proc, os.path.join(folder, name, "log.txt"), timeout=600)
    rows = [{k: v for k, v in r.items() if not k.endswith(TIMING_SUFFIXES)} for r in read_metrics(run)]
    return rows, {name: open(os.path.join(folder, name, "log.txt")).read() for name in names}


def test_a_two_process_learner_and_a_two_process_sampler_group_train_rlvr_tiny(tmp_path, gcs):
    """Each group is one JAX program over 2 processes x 4 CPU devices (the 8-device mesh of the
    golden run); only the lead processes talk to the queue, sampler process i pulls its shards from
    learner process i. The learner logs the colocated run's golden rows (on-policy, the seed's tasks
    and keys) and every sampler process exits 0 once the learner has finished."""
    run = f"{gcs}/{tmp_path.name}"
    rows, logs = train_in_groups(tmp_path, run)
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4] and WorkQueue(run).finished()
    assert all(r["rl/staleness_max"] == 0 and r["rl/buffer_dropped_stale"] == r["rl/reissued"] == 0 for r in rows)
    golden_rows(rows, evals=False)
    addresses = WorkQueue(run).read("learner.json")["addresses"]
    assert len(set(addresses)) == 2  # a transfer server per learner process
    assert all("5 batches delivered" in logs[f"sampler{i}"] for i in (0, 1))  # (the lead's decisions: both)
    assert os.listdir(tmp_path / "sampler1") == ["log.txt"]  # its own folder: nothing written there


@pytest.mark.slow
def test_a_sampler_group_of_two_processes_switches_weights_in_flight_together(tmp_path, gcs):
    """rl.max_staleness = 1 with in-flight updates every 2 decode steps: both processes of the
    group pull each newer version at the same decode step (the lead's decision), the tokens'
    versions travel with the batch, and no token trained on lags the learner by more than 1."""
    rows, _ = train_in_groups(
        tmp_path, f"{gcs}/{tmp_path.name}", **{"rl.max_staleness": 1, "rl.inflight_update_every": 2}
    )
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert all(r["rl/version_lag_max"] <= 1 and 0 <= r["rl/staleness_max"] <= 1 for r in rows)
    assert all(r["rl/buffer_dropped_stale"] == 0 for r in rows)
