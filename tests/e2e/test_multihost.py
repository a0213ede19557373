"""Multi-process runs: several Python processes × simulated CPU devices form one mesh (gloo).

Each run starts fresh Pythons (`tests/support/multihost_worker.py`) that compile on their own, so the
runs are few and tiny (a dense 2-layer model, 4 steps) and shared through module-scoped fixtures.
"""

import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from posttrain.data.pipeline import sft_batches
from posttrain.data.reshard import state_for_process
from posttrain.data.synthetic import ensure_arithmetic_file
from posttrain.data.tokenizer import load_tokenizer
from posttrain.errors import UserError
from posttrain.parallel.distributed import distributed_settings
from tests.support import paths
from tests.support.typed_configs import typed

ROOT = str(paths.ROOT)
WORKER = os.path.join(ROOT, "tests", "support", "multihost_worker.py")
SFT_CONFIG = os.path.join(ROOT, "configs", "sft_tiny.py")
STEPS = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(out: str, config: str, overrides: dict, *, processes: int, devices: int) -> list[subprocess.Popen]:
    """Start `processes` workers (each with `devices` CPU devices) writing into `out`."""
    os.makedirs(out, exist_ok=True)
    port, env = free_port(), {**os.environ, "PYTHONPATH": ROOT}
    return [
        subprocess.Popen(
            [
                sys.executable,
                WORKER,
                out,
                config,
                str(devices),
                str(i),
                str(processes),
                str(port),
                json.dumps(overrides),
            ],
            env=env,
            stdout=open(os.path.join(out, f"log{i}.txt"), "w"),
            stderr=subprocess.STDOUT,
        )
        for i in range(processes)
    ]


def finish(out: str, procs: list[subprocess.Popen], timeout: float = 900) -> list[dict]:
    """Wait for a started run; each process's record (rows, lines read)."""
    for i, p in enumerate(procs):
        if p.wait(timeout=timeout) != 0:
            for q in procs:
                q.kill()
            raise AssertionError(
                f"process {i} exited with {p.returncode}:\n" + open(os.path.join(out, f"log{i}.txt")).read()[-4000:]
            )
    return [json.load(open(os.path.join(out, f"process{i}.json"))) for i in range(len(procs))]


def launch(out: str, config: str, overrides: dict, *, processes: int, devices: int, timeout: float = 900) -> list[dict]:
    """Run to completion; each process's record (rows, lines read)."""
    return finish(out, start(out, config, overrides, processes=processes, devices=devices), timeout)


def launch_together(config: str, runs: list[tuple[str, dict, int, int]]) -> list[list[dict]]:
    """Several independent runs (out, overrides, processes, devices) started at once: XLA compiles
    on one core per process, so the runs' compiles overlap instead of queueing."""
    started = [(out, start(out, config, overrides, processes=n, devices=d)) for out, overrides, n, d in runs]
    try:
        return [finish(out, procs) for out, procs in started]
    finally:
        for _, procs in started:
            for p in procs:
                if p.poll() is None:
                    p.kill()


def losses(record: dict) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in record["rows"] if "loss" in r}


def params(out: str) -> dict[str, np.ndarray]:
    with np.load(os.path.join(out, "params.npz")) as f:
        return dict(f)


@pytest.fixture(scope="module")
def sft_setup(tmp_path_factory):
    """A folder with the training data, and the tiny SFT job's overrides for a workdir."""
    root = tmp_path_factory.mktemp("multihost_sft")
    data = str(root / "train.jsonl")
    ensure_arithmetic_file(data, "sft", 256, seed=1, split="train", max_value=20)
    ensure_arithmetic_file(str(root / "eval.jsonl"), "sft", 16, seed=2, split="test", max_value=20)

    def overrides(workdir, evaluate=False):
        return {
            "workdir": workdir,
            "sft.train_files": data,
            "sft.gate": "",
            "sft.sample_tokens": 8,
            "sft.eval_files": str(root / "eval.jsonl") if evaluate else "",
            "data.synthetic": "",
            "model.moe.num_experts": 0,
            "train.steps": STEPS,
            "train.batch_size": 8,
            "train.seq_len": 64,
            "train.log_every": 1,
            "train.progress": False,
            "data.packing": False,
            "checkpoint.every": 2,
            "checkpoint.keep": 5,
            "checkpoint.async_save": True,
        }

    return root, overrides


FSDP_ACROSS = {"mesh.data": 1, "mesh.fsdp": 8}  # weights sharded over both processes' devices


@pytest.fixture(scope="module")
def sft_runs(sft_setup):
    """The same tiny SFT job as 1 process × 8 devices (data parallel) and as 2 processes × 4
    devices with the weights sharded over `fsdp` across both processes (each writes its own
    shards of a checkpoint)."""
    root, overrides = sft_setup
    one, two = launch_together(
        SFT_CONFIG,
        [
            (str(root / "one"), overrides(str(root / "one" / "wd"), True), 1, 8),
            (str(root / "two"), {**overrides(str(root / "two" / "wd"), True), **FSDP_ACROSS}, 2, 4),
        ],
    )
    return root, overrides, one, two


def test_sft_two_processes_match_one_process(sft_runs):
    """Losses and final weights of 2 processes × 4 devices (fsdp over both) equal 1 process × 8
    devices (data parallel; same seed and global batch; unpacked rows, so each global batch holds
    the same records); each process read only its own records, and only process 0 wrote the shared
    outputs."""
    root, _, (one,), two = sft_runs
    assert [r["process_count"] for r in two] == [2, 2]
    ref = losses(one)
    assert sorted(ref) == list(range(STEPS))
    for record in two:
        got = losses(record)
        assert sorted(got) == sorted(ref)
        np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], rtol=1e-5)
    evals = [[r["eval/loss"] for r in rec["rows"] if "eval/loss" in r] for rec in (one, *two)]
    assert len(evals[0]) == 1 and evals[1] == evals[2]
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)  # each process evaluated its share
    samples = [open(root / run / "wd" / "samples.jsonl").read() for run in ("one", "two")]
    assert samples[0] and samples[1] == samples[0]  # sampled on every process, written by one
    a, b = ({x for x in r["read_lines"] if x.startswith("train.jsonl")} for r in two)
    assert a and b and not a & b, f"records read by both processes: {sorted(a & b)[:5]}"
    assert len(a | b) < 256  # neither read the whole file
    p1, p2 = params(str(root / "one")), params(str(root / "two"))
    assert p1.keys() == p2.keys()
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    wd = root / "two" / "wd"
    assert sorted(os.listdir(wd / "checkpoints")) == ["2", "4"]
    assert len(open(wd / "metrics.jsonl").readlines()) == STEPS + 1  # one writer, not two (+ the eval row)


def test_two_process_checkpoint_resumes_on_one_process_other_mesh(sft_runs):
    """The 2-process checkpoint at step 2 resumes in 1 process × 8 devices on another mesh
    (data=2, fsdp=4): steps 2-3 read the same records (global data position) from the same weights,
    so their losses and the final weights equal the 2-process run's."""
    root, overrides, _, two = sft_runs
    wd = root / "resumed" / "wd"
    shutil.copytree(root / "two" / "wd", wd)
    shutil.rmtree(wd / "checkpoints" / "4")
    os.remove(wd / "metrics.jsonl")
    (resumed,) = launch(
        str(root / "resumed"),
        SFT_CONFIG,
        {**overrides(str(wd)), "mesh.data": 2, "mesh.fsdp": 4},
        processes=1,
        devices=8,
    )
    got, ref = losses(resumed), losses(two[0])
    assert sorted(got) == [2, 3]
    np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in got], rtol=1e-5)
    p_two, p_resumed = params(str(root / "two")), params(str(root / "resumed"))
    for k in p_two:
        np.testing.assert_allclose(p_resumed[k], p_two[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_checkpoint_damaged_for_one_process_resumes_both_from_the_newest_common_step(sft_runs):
    """Truncate the data files process 1 wrote (its fsdp shards) in the newest checkpoint (4): only
    process 1 reads them, so only it fails to restore step 4. Both agree to resume from step 2
    (the newest both can read), set 4 aside, log the losses the first run logged for steps 2-3 and
    save step 4 again. (On main process 0 restored 4, process 1 fell back: a barrier mismatch.)"""
    root, overrides, _, two = sft_runs
    wd = root / "damaged" / "wd"
    shutil.copytree(root / "two" / "wd", wd)
    os.remove(wd / "metrics.jsonl")
    damaged = [
        os.path.join(folder, name)
        for item in ("params", "opt_state")
        for folder, _, names in os.walk(wd / "checkpoints" / "4" / item)
        if "ocdbt.process_1" in folder
        for name in names
    ]
    assert damaged, sorted(os.listdir(wd / "checkpoints" / "4" / "params"))
    for path in damaged:
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) // 2)
    resumed = launch(str(root / "damaged"), SFT_CONFIG, {**overrides(str(wd)), **FSDP_ACROSS}, processes=2, devices=4)
    ref = losses(two[0])
    for record in resumed:
        got = losses(record)
        assert sorted(got) == [2, 3]
        np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in got], rtol=1e-5)
    assert sorted(os.listdir(wd / "checkpoints")) == ["2", "4", "4.unreadable"]
    logs = [open(root / "damaged" / f"log{i}.txt").read() for i in range(2)]
    assert "unreadable on another process" in logs[0] and "cannot be read" in logs[1]


def small_memory_on_process_1():
    """multihost_worker hook: process 1's devices report a 512 KiB memory limit (process 0's, CPU
    devices, report none: 16 GiB assumed), so `auto` context parallelism would choose ring there
    and all-gather on process 0 unless they agree."""
    if sys.argv[4] == "1":
        from posttrain.ops import context_parallel

        context_parallel.reported_memory_bytes = lambda device: 2**19


@pytest.mark.slow
def test_auto_context_parallelism_agrees_when_one_process_has_less_memory(sft_runs, monkeypatch):
    """`model.context_parallel = "auto"` over `mesh.sequence = 2` with process 1's devices reporting
    512 KiB: both processes choose ring (the smallest memory, agreed), log it with the numbers, and
    train to the losses of the 1-process run. (~2 min at load 4: slow.)

    On main process 0 traced all-gather and process 1 the ring: their collectives mismatched
    (process 1: "Gloo context initialization failed ... GetKeyValue() timed out"; process 0:
    "Gloo AllGather failed"), and neither exited until killed (300 s)."""
    root, overrides, (one,), _ = sft_runs
    monkeypatch.setenv("POSTTRAIN_TEST_HOOK", "tests.e2e.test_multihost:small_memory_on_process_1")
    out = root / "cp_auto"
    cfg = {
        **overrides(str(out / "wd")),
        "mesh.data": 1,
        "mesh.fsdp": 4,
        "mesh.sequence": 2,
        "model.attention": "blockwise",
        "model.context_parallel": "auto",
    }
    records = launch(str(out), SFT_CONFIG, cfg, processes=2, devices=4, timeout=600)
    ref = losses(one)
    for record in records:
        got = losses(record)
        assert sorted(got) == sorted(ref)
        np.testing.assert_allclose([got[s] for s in ref], [ref[s] for s in ref], rtol=1e-4)
    logs = [open(out / f"log{i}.txt").read() for i in range(2)]
    assert all("context parallelism auto over 2 devices: ring" in log for log in logs)
    assert "another process" in logs[0] and "all_gather" not in logs[0] + logs[1]


@pytest.mark.slow
def test_two_process_checkpoint_resumes_on_two_processes_other_mesh(sft_runs):
    """The same resume onto 2 processes with another mesh (data=2, fsdp=2, tensor=2: weights
    sharded over a tensor axis inside each host)."""
    root, overrides, _, two = sft_runs
    wd = root / "resumed2" / "wd"
    shutil.copytree(root / "two" / "wd", wd)
    shutil.rmtree(wd / "checkpoints" / "4")
    os.remove(wd / "metrics.jsonl")
    resumed = launch(
        str(root / "resumed2"),
        SFT_CONFIG,
        {**overrides(str(wd)), "mesh.data": 2, "mesh.fsdp": 2, "mesh.tensor": 2},
        processes=2,
        devices=4,
    )
    got, ref = losses(resumed[0]), losses(two[0])
    assert sorted(got) == [2, 3]
    np.testing.assert_allclose([got[s] for s in got], [ref[s] for s in got], rtol=1e-5)
    p_two, p_resumed = params(str(root / "two")), params(str(root / "resumed2"))
    for k in p_two:
        np.testing.assert_allclose(p_resumed[k], p_two[k], rtol=1e-4, atol=1e-6, err_msg=k)


BYTE = load_tokenizer("byte")


def test_data_state_reshards_to_another_process_count(tmp_path):
    """Per-process iterator states of 2 processes resume 1 process (and back) at the global
    position: the next global batch holds the records the 2 processes would have read next."""
    path = str(tmp_path / "d.jsonl")
    ensure_arithmetic_file(path, "sft", 64, seed=1, split="train", max_value=20)
    make = lambda p, n: sft_batches(
        path, BYTE, batch_size=8, seq_len=64, seed=3, packing=False, process_index=p, process_count=n
    )
    rows = lambda batch: sorted(map(tuple, batch["inputs"].tolist()))
    two = [make(p, 2) for p in range(2)]
    for it in two:
        for _ in range(3):
            next(it)
    states = [it.get_state() for it in two]
    expected = [rows({"inputs": np.concatenate([next(it)["inputs"] for it in two])}) for _ in range(2)]
    one = make(0, 1)
    one.set_state(state_for_process(states, 0, 1))
    assert [rows(next(one)) for _ in range(2)] == expected
    back = [make(p, 2) for p in range(2)]  # 1 → 2 processes, from the 1-process state
    single = make(0, 1)
    for _ in range(3):
        next(single)
    for p, it in enumerate(back):
        it.set_state(state_for_process([single.get_state()], p, 2))
    assert rows({"inputs": np.concatenate([next(it)["inputs"] for it in back])}) == rows(next(single))
    assert state_for_process(states, 1, 2) is states[1]  # same count: each its own state


def test_distributed_settings_from_config_and_environment():
    from posttrain.config import DistributedConfig

    assert distributed_settings(DistributedConfig(), {}) is None
    d = DistributedConfig(coordinator="h:1234", num_processes=4, process_id=3, heartbeat_timeout_s=7)
    s = distributed_settings(d, {})
    assert (s.coordinator, s.num_processes, s.process_id, s.heartbeat_timeout_s) == ("h:1234", 4, 3, 7)
    with pytest.raises(UserError, match="process_id=4 and num_processes=4"):
        distributed_settings(dataclasses.replace(d, process_id=4), {})
    env = {"JAX_COORDINATOR_ADDRESS": "10.0.0.1:8476", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"}
    s = distributed_settings(None, env)
    assert (s.coordinator, s.num_processes, s.process_id) == ("10.0.0.1:8476", 2, 1)
    with pytest.raises(UserError, match="JAX_PROCESS_ID"):
        distributed_settings(None, {**env, "JAX_PROCESS_ID": "x"})
    assert distributed_settings(None, {"JAX_COORDINATOR_ADDRESS": "h:1"}).num_processes is None
    tpu = distributed_settings(None, {"TPU_WORKER_HOSTNAMES": "a,b"})
    assert tpu.coordinator is None and tpu.num_processes is None  # jax detects the pod
    assert distributed_settings(None, {"TPU_WORKER_HOSTNAMES": "a"}) is None
    for env in ({}, {"JAX_COORDINATOR_ADDRESS": "h:1", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}):
        with pytest.raises(UserError, match="need distributed.coordinator"):
            distributed_settings(DistributedConfig(num_processes=2), env)


RL_CONFIG = os.path.join(ROOT, "configs", "rlvr_tiny.py")


def rl_overrides(workdir: str) -> dict:
    """The 2-step RLVR job of `rl_runs` (rlvr_tiny, dense) writing into `workdir`."""
    return {
        "workdir": workdir,
        "model.moe.num_experts": 0,
        "rl.steps": 2,
        "rl.prompts_per_step": 4,
        "rl.group_size": 4,
        "rl.max_new_tokens": 8,
        "rl.eval_every": 2,
        "rl.eval_size": 6,
        "rl.eval_samples": 2,
        "rl.entropy_coef": 0.01,
        "rl.gate": "",
        "rl.verifier_workers": 2,
        "rl.overlong_buffer": 7,  # samples that stop early score higher: groups with signal
        "train.progress": False,
        "checkpoint.every": 2,
    }


@pytest.fixture(scope="module")
def rl_runs(tmp_path_factory):
    """A 2-step RLVR job (with a final held-out evaluation) as 1 × 8 and as 2 × 4 devices."""
    root = tmp_path_factory.mktemp("multihost_rl")

    one, two = launch_together(
        RL_CONFIG,
        [
            (str(root / "one"), rl_overrides(str(root / "one" / "wd")), 1, 8),
            (str(root / "two"), rl_overrides(str(root / "two" / "wd")), 2, 4),
        ],
    )
    return root, one, two


def test_rlvr_two_processes_match_one_process(rl_runs):
    """RLVR with 2 processes (each verifying its own groups) logs the losses, rewards and held-out
    accuracies of the 1-process run and ends at the same weights."""
    root, (one,), two = rl_runs
    keys = (
        "loss",
        "rl/reward_mean",
        "rl/reward_std",
        "rl/responses",
        "rl/new_tokens",
        "eval/accuracy",
        "eval/mean_accuracy",
        "eval/response_len",
    )
    by_step = lambda rec: {(r["step"], k): r[k] for r in rec["rows"] for k in keys if k in r}
    ref = by_step(one)
    assert {k for _, k in ref} >= {"loss", "rl/reward_mean", "rl/responses"} and len(ref) > 4
    got = by_step(two[0])
    assert got.keys() == ref.keys()
    np.testing.assert_allclose([got[k] for k in ref], [ref[k] for k in ref], rtol=1e-5, atol=1e-7)
    assert got[(0, "rl/responses")] == 16  # both processes' groups counted
    assert ref[(0, "rl/reward_std")] > 0  # some group has non-zero advantages
    p1, p2 = params(str(root / "one")), params(str(root / "two"))
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-6, err_msg=k)
    assert sorted(os.listdir(root / "two" / "wd" / "checkpoints")) == ["2"]


@pytest.mark.slow
def test_rlvr_two_processes_with_continuous_batching_match_one_static_process(rl_runs):
    """sampling.continuous_batching across 2 processes (one program on the global mesh, its outputs
    on every process) gives the 1-process static run's rollouts: the same losses, rewards, new
    tokens and final weights. (Measured ~4 min at load 20: slow.)"""
    root, (one,), _ = rl_runs
    out = str(root / "two_continuous")
    cfg = {
        **rl_overrides(out + "/wd"),
        "sampling.continuous_batching": True,
        "sampling.num_slots": 4,
        "sampling.refill_batch": 2,
    }
    two = launch(out, RL_CONFIG, cfg, processes=2, devices=4)
    keys = ("loss", "rl/reward_mean", "rl/reward_std", "rl/responses", "rl/new_tokens")
    by_step = lambda rec: {(r["step"], k): r[k] for r in rec["rows"] for k in keys if k in r}
    ref, got = by_step(one), by_step(two[0])
    assert got.keys() == ref.keys() and len(ref) >= 8
    np.testing.assert_allclose([got[k] for k in ref], [ref[k] for k in ref], rtol=1e-5, atol=1e-7)
    p1, p2 = params(str(root / "one")), params(out)
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-6, err_msg=k)


def metric_rows(workdir) -> dict[int, float]:
    rows = [json.loads(line) for line in open(os.path.join(workdir, "metrics.jsonl")) if line.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


@pytest.mark.slow
def test_lost_process_stops_the_other_and_rerun_resumes(sft_setup):
    """Kill process 1 mid-run: process 0 exits within 60 s with an error naming the lost task (jax's
    heartbeat, distributed.heartbeat_timeout_s); rerunning both resumes from the last checkpoint and
    logs the losses the interrupted run logged for the same steps."""
    root, overrides = sft_setup
    out, wd = str(root / "killed"), str(root / "killed" / "wd")
    cfg = {**overrides(wd), "train.steps": 200, "checkpoint.every": 50, "distributed.heartbeat_timeout_s": 10}
    procs = start(out, SFT_CONFIG, cfg, processes=2, devices=4)
    deadline = time.time() + 900
    while not (os.path.exists(os.path.join(wd, "metrics.jsonl")) and max(metric_rows(wd), default=0) >= 60):
        assert time.time() < deadline and procs[0].poll() is None, open(os.path.join(out, "log0.txt")).read()[-3000:]
        time.sleep(0.05)
    procs[1].kill()
    killed_at = time.time()
    try:
        procs[0].wait(timeout=60)
    except subprocess.TimeoutExpired:
        procs[0].kill()
        raise AssertionError("process 0 still running 60 s after process 1 died") from None
    log = open(os.path.join(out, "log0.txt")).read()
    assert procs[0].returncode != 0 and time.time() - killed_at < 60
    assert "stopped sending heartbeats" in log and "\n1\n" in log, log[-3000:]
    before = metric_rows(wd)
    latest = max(int(s) for s in os.listdir(os.path.join(wd, "checkpoints")) if s.isdigit())
    assert 50 <= latest < max(before)
    launch(out, SFT_CONFIG, cfg, processes=2, devices=4)
    after = metric_rows(wd)
    assert sorted(after) == list(range(200))
    overlap = [s for s in before if s >= latest]
    np.testing.assert_allclose([after[s] for s in overlap], [before[s] for s in overlap], rtol=1e-5)


def test_rl_across_processes_refuses_what_it_cannot_split(monkeypatch):
    """With several processes, RL keys whose work cannot be split by groups fail at start, naming
    the key; groups are shared out whole and evenly (training) or nearly so (evaluation)."""
    import jax

    from posttrain.rl.rollout import hosts

    cfg = runpy_config(RL_CONFIG)
    hosts.check_multihost_rl(typed(cfg))  # one process: anything goes
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(jax, "process_index", lambda: 1)
    hosts.check_multihost_rl(typed(cfg))
    for key, value in (
        ("filter_groups", True),
        ("max_staleness", 1),
        ("rollouts_every", 5),
        ("prompts_per_step", 7),
        ("reward_model", "runs/rm"),
        ("advantage", "gae"),
    ):
        bad = cfg.copy_and_resolve_references()
        bad.rl[key] = value
        with pytest.raises(UserError, match=f"rl.{key}"):
            hosts.check_multihost_rl(typed(bad))
    # a pipeline is refused before its first stage trains (the start-up checks)
    from posttrain.config import run_config
    from posttrain.stages.checks import check_run

    def check_config(cfg):
        check_run(run_config(cfg))

    pipe = runpy_config(os.path.join(ROOT, "configs", "quickstart.py"))  # (sft, rlvr, eval)
    pipe.rl.rollouts_every, pipe.rl.rollouts_fraction = 0, 1.0
    check_config(pipe)
    pipe.rl.max_staleness = 1
    with pytest.raises(UserError, match="rl.max_staleness=1 is not supported with 2 processes"):
        check_config(pipe)
    assert hosts.group_share(8, exact=True) == slice(4, 8)
    assert hosts.group_share(5, exact=False) == slice(2, 5)
    with pytest.raises(ValueError, match="5 groups cannot be split evenly over 2 processes"):
        hosts.group_share(5, exact=True)


def scripted_turns_by_sample():
    """multihost_worker hook: `scripted_turns(by_sample=True)`."""
    scripted_turns(by_sample=True)


@pytest.mark.slow
def test_multi_turn_rlvr_two_processes_match_one_process(tmp_path, monkeypatch):
    """RLVR on repo_fix episodes (real sandboxed calls; real sampler calls on the global mesh, turns
    scripted by their first sampled token, so a group's rewards differ) with 2 processes × 4
    devices logs the 1-process run's losses, rewards and episode metrics and ends at its weights.
    (~4 min at load 5: slow.)"""
    overrides = {
        "model.moe.num_experts": 0,
        "rl.env": "tool",
        "rl.domains": "repo_fix",
        "rl.steps": 2,
        "rl.prompts_per_step": 2,
        "rl.group_size": 4,
        "rl.max_new_tokens": 64,
        "rl.eval_every": 2,
        "rl.eval_size": 4,
        "rl.eval_samples": 2,
        "rl.gate": "",
        "rl.verifier_workers": 2,
        "rl.invalid_tool_call_penalty": 0.1,
        "rl.episode_cohorts": 2,
        "train.progress": False,
        "checkpoint.every": 2,
    }
    monkeypatch.setenv("POSTTRAIN_TEST_HOOK", "tests.e2e.test_multihost:scripted_turns_by_sample")
    runs = [
        (str(tmp_path / n), {**overrides, "workdir": str(tmp_path / n / "wd")}, p, d)
        for n, p, d in (("one", 1, 8), ("two", 2, 4))
    ]
    launch_together(RL_CONFIG, runs)
    keys = (
        "loss",
        "rl/reward_mean",
        "rl/reward_std",
        "rl/responses",
        "rl/new_tokens",
        "rl/tool_success_rate",
        "rl/turns_per_episode",
        "rl/calls_per_turn",
        "rl/tool_call_ok_rate",
        "eval/accuracy",
        "eval/tool_success_rate",
        "eval/tool_success_rate_sampled",
        "eval/turns_per_episode",
    )
    logged = lambda n: {
        (r["step"], k): r[k]
        for r in map(json.loads, open(tmp_path / n / "wd" / "metrics.jsonl"))
        for k in keys
        if k in r
    }
    ref, got = logged("one"), logged("two")
    assert got.keys() == ref.keys() and {k for _, k in ref} == set(keys)
    np.testing.assert_allclose([got[k] for k in ref], [ref[k] for k in ref], rtol=1e-5, atol=1e-7)
    assert ref[(0, "rl/reward_std")] > 0 and ref[(0, "rl/responses")] == 8
    assert 3 < ref[(0, "rl/turns_per_episode")] < 4  # some episodes start with the failing call, some not
    p1, p2 = params(str(tmp_path / "one")), params(str(tmp_path / "two"))
    for k in p1:
        np.testing.assert_allclose(p2[k], p1[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_episode_rates_combine_from_every_process_counts(monkeypatch):
    """Across processes the multi-turn rates are the ratios of the summed counts (not process 0's
    rates, nor a mean of rates), and a batch of episodes is already this process's share."""
    import jax

    from posttrain.rl.rollout import hosts
    from posttrain.rl.rollout import worker as rollout

    parts = [
        {
            "responses": 2,
            "episode_turns": 6,
            "episode_calls": 4,
            "episode_calls_ok": 4,
            "episodes_solved": 2,
            "episode_calls_invalid": 0,
            "turns_per_episode": 3.0,
            "response_len_mean": 10.0,
        },
        {
            "responses": 4,
            "episode_turns": 16,
            "episode_calls": 12,
            "episode_calls_ok": 8,
            "episodes_solved": 0,
            "episode_calls_invalid": 4,
            "turns_per_episode": 4.0,
            "response_len_mean": 40.0,
        },
    ]
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    monkeypatch.setattr(hosts, "allgather_json", lambda info: parts)
    out = hosts.combine_info(parts[0], rollout.SUMMED_INFO)
    assert out["turns_per_episode"] == 22 / 6 and out["calls_per_turn"] == 16 / 22
    assert out["tool_call_ok_rate"] == 12 / 16 and out["invalid_call_rate"] == 4 / 16
    assert out["tool_success_rate"] == 2 / 6 and out["response_len_mean"] == 30.0 and out["responses"] == 6
    done = rollout.Pending([("d", None)] * 4, [], None, 0.0, done=object())
    assert rollout.local_share(done, exact=False) is done


def runpy_config(path: str):
    import runpy

    return runpy.run_path(path)["get_config"]()


class TaskScript:
    """The turns of a repo_fix episode by task, so that episodes of different tasks differ in
    turns and calls (per-process shares of a suite have different episode metrics): a module name
    of even length: cat the test, write the fix, "Done." (3 turns, 2 calls, both ok); odd: cat the
    test and a missing file first (a failing call), then the same (4 turns, 3 calls, 2 ok). The
    fix is right only when the asserted value is a multiple of 3."""

    def __init__(self):
        self.tok = load_tokenizer("byte")

    @staticmethod
    def turns(module: str, name: str = "", value: int = 0, failing: bool | None = None) -> list[str]:
        fix = f"<tool>sh\necho '{name} = {value if value % 3 == 0 else value + 1}' > {module}.py\n</tool>"
        failing = len(module) % 2 == 1 if failing is None else failing
        first = [f"<tool>sh\ncat test_{module}.py missing.txt\n</tool>"] if failing else []
        return first + [f"<tool>sh\ncat test_{module}.py\n</tool>", fix, "Done."]

    def turn(self, context: str, failing: bool | None = None) -> str:
        """The next turn; `failing` (default: by the module name) whether the episode starts with
        the failing call (later turns read it from the context)."""
        import re

        module = re.search(r"Fix (\w+)\.py\.", context).group(1)
        shown = re.search(r"assert (\w+) == (\d+)", context.split("<output>", 1)[-1]) if "<output>" in context else None
        name, value = (shown.group(1), int(shown.group(2))) if shown else ("", 0)
        if shown:
            failing = "missing.txt" in context
        return self.turns(module, name, value, failing)[context.count("<output>")]


def scripted_turns(by_sample: bool = False):
    """multihost_worker hook: every sampler call runs for real (one program on the global mesh over
    every process's contexts, which must therefore agree), then the script replaces its tokens;
    `by_sample`: an episode starts with the failing call when its first real token is even (so the
    samples of one task differ, and so do their rewards)."""
    from posttrain.rl.rollout.worker import RolloutWorker

    script, real = TaskScript(), RolloutWorker.sample

    def sample(worker, params, rest, contexts, sampling, key):
        samples = real(worker, params, rest, contexts, sampling, key)
        firsts = [samples.completion(j)[:1] or [0] for j in range(len(contexts))]
        failing = [first[0] % 2 == 0 if by_sample else None for first in firsts]
        turns = [
            script.tok.encode(script.turn(script.tok.decode(c), f)) + [script.tok.stop_ids[0]]
            for c, f in zip(contexts, failing)
        ]
        logprobs = np.zeros((len(turns), max(map(len, turns))), np.float32)
        return type("Scripted", (), {"sampling_logprobs": logprobs, "completion": staticmethod(lambda j: turns[j])})()

    RolloutWorker.sample = sample


def saved_rl_checkpoint(tmp_path, overrides: dict):
    """The RL config with `overrides`, and a step-1 checkpoint of its freshly initialised model in
    `tmp_path/run/checkpoints` for the eval stage to read."""
    from flax import nnx

    from posttrain.core.checkpoint import Checkpointer
    from posttrain.core.state import init_model_state
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import mesh_and_rules, use_sharding

    cfg = runpy_config(RL_CONFIG)
    for key, value in overrides.items():
        *parents, leaf = key.split(".")
        node = cfg
        for p in parents:
            node = node[p]
        node[leaf] = value
    mesh, rules = mesh_and_rules(cfg)
    ckpt = Checkpointer(str(tmp_path / "run" / "checkpoints"), every=1, keep=1, async_save=False)
    with use_sharding(mesh, rules):
        ckpt.save(
            1,
            dict(zip(("params", "rest"), init_model_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), mesh, rules))),
        )
    ckpt.close()
    return cfg


@pytest.mark.slow
def test_multi_turn_eval_two_processes_match_one_process(tmp_path, monkeypatch):
    """Stage eval on repo_fix (real sandboxed episodes; the sampler's calls run on the global mesh,
    their turns scripted by task) with 2 processes × 4 devices reports what 1 process × 8 reports,
    and what the script implies, although the two processes' shares of the suite differ in turns,
    calls and successes; the episodes run in 2 cohorts. (~70-100 s at load 5: slow.)"""

    from posttrain.rl.tasks import repo_domain, suites

    overrides = {
        "stage": "eval",
        "model.moe.num_experts": 0,
        "eval.checkpoint": str(tmp_path / "run"),
        "eval.suites": "repo_fix",
        "eval.size": 6,
        "eval.samples": 2,
        "eval.pass_k": "1,2",
        "rl.max_new_tokens": 64,
        "rl.invalid_tool_call_penalty": 0.1,
        "rl.verifier_workers": 2,
        "rl.episode_cohorts": 2,
        "train.progress": False,
    }
    cfg = saved_rl_checkpoint(tmp_path, overrides)
    tasks = suites.make_suites(cfg, load_tokenizer("byte"))["repo_fix"].tasks
    fields = [repo_domain.task_fields(t) for t in tasks]
    turns = [len(TaskScript.turns(m)) for m, *_ in fields]
    solved = [r % 3 == 0 for *_, r in fields]
    assert np.mean(turns[:3]) != np.mean(turns[3:]), f"the processes' shares should differ in turns: {turns}"
    monkeypatch.setenv("POSTTRAIN_TEST_HOOK", "tests.e2e.test_multihost:scripted_turns")
    runs = [
        (str(tmp_path / n), {**overrides, "workdir": str(tmp_path / n / "wd")}, p, d)
        for n, p, d in (("one", 1, 8), ("two", 2, 4))
    ]
    launch_together(RL_CONFIG, runs)
    (one,), (two,) = (
        [json.loads(line) for line in open(tmp_path / n / "wd" / "eval" / "repo_fix.jsonl")] for n in ("one", "two")
    )
    keys = (
        "accuracy",
        "mean_accuracy",
        "pass@1",
        "pass@2",
        "response_len",
        "greedy_response_len",
        "verifier_errors",
        "tool_success_rate",
        "tool_success_rate_sampled",
        "turns_per_episode",
        "calls_per_turn",
        "tool_call_ok_rate",
    )
    assert {k: two[k] for k in keys} == pytest.approx({k: one[k] for k in keys})
    assert one["problems"] == 6 and one["accuracy"] == pytest.approx(np.mean(solved))
    assert one["turns_per_episode"] == pytest.approx(np.mean(turns))
    assert one["calls_per_turn"] == pytest.approx(sum(t - 1 for t in turns) / sum(turns))
    assert one["tool_call_ok_rate"] == pytest.approx(2 * len(turns) / sum(t - 1 for t in turns))


def test_evaluation_with_fewer_tasks_than_processes_gives_an_empty_share(monkeypatch):
    """1 held-out task on 2 processes: process 0's share is empty and verifies to an empty batch
    (on main: IndexError, and process 1 waited for the heartbeat timeout); the combined info is
    process 1's alone (means weighted by responses)."""
    import concurrent.futures

    import jax

    from posttrain.rl.rollout import hosts
    from posttrain.rl.rollout import worker as rollout
    from posttrain.sampling.generate import Samples

    class Env:
        def step(self, completion):
            return type("Step", (), {"reward": type("R", (), {"score": 1.0, "correct": 1.0, "error": None})()})()

        def trajectory(self):
            return type("T", (), {"tokens": [1, 2, 3], "prompt_len": 1})()

    rows = 2  # one task × 2 samples
    samples = Samples(
        tokens=np.ones((rows, 4), np.int32),
        logprobs=np.zeros((rows, 4), np.float32),
        sampling_logprobs=np.zeros((rows, 4), np.float32),
        lengths=np.asarray([2, 4]),
        stop_reason=np.asarray([0, 1]),
        prompt_index=np.zeros(rows, np.int32),
    )
    pending = rollout.Pending([("arithmetic", object())], [[Env(), Env()]], samples, 0.5)
    worker = rollout.RolloutWorker(None, {}, None, 0, concurrent.futures.ThreadPoolExecutor(1))
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    shares = {}
    for i in range(2):
        monkeypatch.setattr(jax, "process_index", lambda i=i: i)
        shares[i] = worker.verify(rollout.local_share(pending, exact=False))
    assert len(shares[0].groups) == 0 and len(shares[1].groups) == 1
    assert shares[0].info["responses"] == 0 and shares[0].info["new_tokens"] == 0
    monkeypatch.setattr(hosts, "allgather_json", lambda info: [shares[0].info, shares[1].info])
    combined = hosts.combine_info(shares[0].info, rollout.SUMMED_INFO)
    assert combined["responses"] == 2 and combined["new_tokens"] == 6
    assert combined["response_len_mean"] == 3.0 and combined["truncated_frac"] == 0.5
    assert combined["response_len_max"] == 4


@pytest.mark.slow
def test_one_task_evaluation_on_two_processes_matches_one_process(tmp_path):
    """Stage eval of 1 arithmetic problem on 2 processes × 4 devices: process 0's share is empty
    (on main it raised IndexError and process 1 waited for the heartbeat timeout); the suite's
    numbers equal the 1-process run's. (~2 min at load 4: slow.)"""

    overrides = {
        "stage": "eval",
        "model.moe.num_experts": 0,
        "eval.checkpoint": str(tmp_path / "run"),
        "eval.suites": "arithmetic",
        "eval.size": 1,
        "eval.samples": 2,
        "eval.pass_k": "1,2",
        "rl.max_new_tokens": 8,
        "rl.verifier_workers": 1,
        "train.progress": False,
    }
    saved_rl_checkpoint(tmp_path, overrides)
    runs = [
        (str(tmp_path / n), {**overrides, "workdir": str(tmp_path / n / "wd")}, p, d)
        for n, p, d in (("one", 1, 8), ("two", 2, 4))
    ]
    launch_together(RL_CONFIG, runs)
    (one,), (two,) = (
        [json.loads(line) for line in open(tmp_path / n / "wd" / "eval" / "arithmetic.jsonl")] for n in ("one", "two")
    )
    keys = ("accuracy", "mean_accuracy", "pass@1", "pass@2", "score_mean", "response_len", "greedy_response_len")
    assert one["problems"] == two["problems"] == 1
    assert {k: two[k] for k in keys} == pytest.approx({k: one[k] for k in keys})
    assert two["response_len"] > 0 and two["verifier_errors"] == one["verifier_errors"]
