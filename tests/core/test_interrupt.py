"""SIGINT/SIGTERM during training: the loop finishes the step, saves a checkpoint there, says how to
resume and exits 128 + signal; a second signal aborts at once; handlers are restored afterwards."""

import dataclasses
import json
import os
import runpy
import signal
from pathlib import Path

import pytest

from posttrain.core import interrupt
from posttrain.core.interrupt import Interrupted
from posttrain.data.synthetic import arithmetic_records
from posttrain.main import run_cli
from tests.support.paths import ROOT


class FakeCheckpointer:
    def __init__(self):
        self.saved, self.waited = [], 0

    def wait(self):
        self.waited += 1


def test_first_signal_sets_the_flag_second_aborts_and_handlers_come_back():
    before = {s: signal.getsignal(s) for s in interrupt.SIGNALS}
    ckpt = FakeCheckpointer()
    with pytest.raises(Interrupted) as info:
        with interrupt.on_signal() as stop:
            assert signal.getsignal(signal.SIGTERM) == stop.handle
            interrupt.stop_if_requested(1, saved=False, save=lambda: ckpt.saved.append(1), ckpt=ckpt, workdir="W")
            assert ckpt.saved == []  # no signal: nothing happens
            os.kill(os.getpid(), signal.SIGTERM)
            assert stop.signum == signal.SIGTERM  # the step goes on
            interrupt.stop_if_requested(2, saved=False, save=lambda: ckpt.saved.append(2), ckpt=ckpt, workdir="W")
    assert ckpt.saved == [2] and ckpt.waited == 1
    assert info.value.step == 2 and info.value.exit_code == 143 and "SIGTERM" in str(info.value)
    assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before

    with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
        with interrupt.on_signal():
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)  # aborts here
            raise AssertionError("not reached")
    assert {s: signal.getsignal(s) for s in interrupt.SIGNALS} == before

    with pytest.raises(Interrupted) as info:  # a signal after the last step's check
        with interrupt.on_signal():
            os.kill(os.getpid(), signal.SIGINT)
    assert info.value.step is None and info.value.exit_code == 130
    interrupt.stop_if_requested(3, saved=False, save=lambda: ckpt.saved.append(3), ckpt=ckpt, workdir="W")
    assert ckpt.saved == [2]  # outside a block nothing is requested


def sft_config(tmp_path: Path, steps: int):
    data = tmp_path / "train.jsonl"
    if not data.exists():
        data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records("sft", 200, 1, max_value=20)))
    cfg = runpy.run_path(str(ROOT / "configs/sft_tiny.py"))["get_config"]()
    cfg.workdir, cfg.sft.train_files, cfg.sft.eval_files, cfg.sft.gate = str(tmp_path / "W"), str(data), "", ""
    cfg.data.synthetic, cfg.train.progress, cfg.train.log_every = "", False, 1
    cfg.model.num_layers, cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 1, steps, 8, 64
    cfg.checkpoint.every, cfg.checkpoint.async_save = 0, True  # the only checkpoint is the interrupt's
    return cfg


def test_sigterm_in_sft_saves_at_the_step_and_the_rerun_resumes(tmp_path, monkeypatch, capsys):
    from posttrain.core import loop

    put_batch, calls = loop.put_batch, []

    def put_batch_and_signal(*args, **kwargs):  # SIGTERM while step 2 is being prepared
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return put_batch(*args, **kwargs)

    monkeypatch.setattr(loop, "put_batch", put_batch_and_signal)
    before = signal.getsignal(signal.SIGTERM)
    cfg = sft_config(tmp_path, steps=5)
    assert run_cli(cfg) == 143
    err = capsys.readouterr().err
    assert "SIGTERM received: finishing the current step" in err and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert f"checkpoint saved at step 3 in {cfg.workdir}" in last and "run the same command again" in last
    assert signal.getsignal(signal.SIGTERM) == before
    workdir = Path(cfg.workdir)
    assert sorted(p.name for p in (workdir / "checkpoints").iterdir() if p.name.isdigit()) == ["3"]
    assert [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert not (workdir / "error.log").exists()

    monkeypatch.setattr(loop, "put_batch", put_batch)
    assert run_cli(sft_config(tmp_path, steps=5)) == 0
    assert [json.loads(l)["step"] for l in (workdir / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2, 3, 4]


def test_sigint_in_the_rl_loop_saves_at_the_step(monkeypatch):
    """`stages.rlvr.train_loop` with its phases replaced by fakes: the flag → save → stop logic alone."""
    from posttrain.config import base_config
    from posttrain.core.alerts import AlertMonitor
    from posttrain.core.harness import Harness
    from posttrain.stages import rlvr as rl_loop

    cfg = base_config()
    cfg.train.progress, cfg.workdir, cfg.rl.eval_every = False, "W", 0

    @dataclasses.dataclass
    class Produced:
        scheduler_state: dict
        info: dict
        task_metrics: dict

    def rollout_step(c, rl):
        if rl.step == 2:
            os.kill(os.getpid(), signal.SIGINT)
        return [], Produced({"drawn": rl.step}, {}, {})

    saved = []
    monkeypatch.setattr(rl_loop, "rollout_step", rollout_step)
    monkeypatch.setattr(rl_loop, "learn_step", lambda c, rl, rollouts: (rl, {}))
    monkeypatch.setattr(rl_loop, "save", lambda c, ckpt, rl: saved.append((rl.step, rl.scheduler_state)))
    clock = type("Clock", (), {"total": 0.0})()
    c = type("C", (), {"cfg": cfg, "clock": clock, "producer": None, "rollout_log": None})()
    ckpt = FakeCheckpointer()
    ckpt.should_save = lambda step, last: step % 4 == 0
    flushed = []
    writer = type(
        "W",
        (),
        {
            "write": lambda self, step, m: {"step": step, **m},
            "flush": lambda self: flushed.append(True),
            "close": lambda self: None,
        },
    )()
    harness = Harness(
        "rlvr", 10, ckpt, writer, workdir="W", progress=False, alerts=AlertMonitor.from_config(cfg.alerts)
    )
    with pytest.raises(Interrupted) as info, interrupt.on_signal():
        rl_loop.train_loop(c, rl_loop.RLState(None, 0), harness)
    assert info.value.step == 3 and info.value.exit_code == 130
    assert saved == [(3, {"drawn": 2})] and ckpt.waited == 1  # the step finished, then saved
    assert flushed  # metrics rows reach the (maybe gs://) file before that checkpoint

    saved.clear()
    ckpt.should_save = lambda step, last: step % 3 == 0  # the loop's own save at that step: not twice
    with pytest.raises(Interrupted), interrupt.on_signal():
        rl_loop.train_loop(c, rl_loop.RLState(None, 0), harness)
    assert saved == [(3, {"drawn": 2})]


def test_hosts_agree_to_stop_at_the_same_step(monkeypatch):
    """Multi-host: a host without a signal stops too when another got one, at the agreed steps only."""
    import jax

    from posttrain.parallel import agreement

    gathered = []
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    # the exchange (`parallel.agree` over `allgather_json`): this host's flag, then the other's SIGTERM
    monkeypatch.setattr(agreement, "allgather_json", lambda x: gathered.append(int(x)) or [int(x), int(signal.SIGTERM)])
    assert interrupt.agreed(None, step=3, every=2) is None and gathered == []  # not an agreed step
    assert interrupt.agreed(None, step=4, every=2) == signal.SIGTERM and gathered == [0]
    monkeypatch.setattr(jax, "process_count", lambda: 1)
    assert interrupt.agreed(None, step=4, every=1) is None and gathered == [0]
