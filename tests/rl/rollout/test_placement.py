"""`rl.placement` / `rl.sampler_devices` (rl/rollout/placement.py): the refusals, the meshes of a
split run, and `split` training `rlvr_tiny` as the colocated run does (the golden metrics)."""

import json

import jax
import numpy as np
import pytest

from posttrain.config import RLConfig, RunConfig
from posttrain.errors import UserError
from posttrain.rl.rollout import placement
from tests.support.typed_configs import run_cfg
from tests.test_golden import GOLDEN, config, logged


def split_cfg(n, **mesh):
    return run_cfg(
        {"rl.placement": "split", "rl.sampler_devices": n, **{f"mesh.{k}": v for k, v in mesh.items()}}, stage="rlvr"
    )


@pytest.mark.parametrize(
    "placement_, n, key, words",
    [
        ("disaggregated", 0, "rl.role", "set rl.role='learner'"),
        ("split", 0, "rl.sampler_devices", "needs rl.sampler_devices >= 1"),
        ("colocated", 2, "rl.sampler_devices", "only used with rl.placement='split'"),
    ],
)
def test_the_config_refuses_placements_that_cannot_work(placement_, n, key, words):
    cfg = run_cfg({"rl.placement": placement_, "rl.sampler_devices": n}, stage="rlvr")
    with pytest.raises(UserError, match=words) as e:
        cfg.check_stages()  # the rl section's rules: a run that reaches the rlvr stage
    assert e.value.key == key


def test_split_divides_the_devices_into_a_learner_and_a_sampler_mesh():
    devices = jax.devices()
    assert placement.place_devices(RunConfig()).sampler is None  # colocated: one mesh, every device
    learner, _, sampler = placement.place_devices(split_cfg(4, data=-1, tensor=2))
    assert list(learner.devices.flat) == devices[:4] and list(sampler.devices.flat) == devices[4:]
    assert dict(learner.shape) == dict(data=2, fsdp=1, expert=1, tensor=2, sequence=1)
    assert dict(sampler.shape) == dict(data=2, fsdp=1, expert=1, tensor=2, sequence=1)  # tensor kept, rest data
    learner, _, sampler = placement.place_devices(split_cfg(4, data=1, fsdp=-1, sequence=2))
    assert dict(learner.shape) == dict(data=1, fsdp=2, expert=1, tensor=1, sequence=2)
    assert dict(sampler.shape) == dict(data=2, fsdp=2, expert=1, tensor=1, sequence=1)  # decode: no sequence split


@pytest.mark.parametrize(
    "cfg, words",
    [
        (split_cfg(8), "split needs 1 … 7 sampler devices"),
        (split_cfg(2, data=1, fsdp=-1), r"not a multiple of the learner's model-parallel group"),
        (split_cfg(2, data=4, tensor=2), "leaves 6 devices for the learner"),
    ],
)
def test_split_refuses_device_counts_that_cannot_work(cfg, words):
    with pytest.raises(UserError, match=words) as e:
        placement.place_devices(cfg)
    assert e.value.key == "rl.sampler_devices"


def test_split_refuses_several_processes(monkeypatch):
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(UserError, match="one process for now") as e:
        placement.place_devices(split_cfg(4))
    assert e.value.key == "rl.placement"


def golden_split_run(name, tmp_path, monkeypatch, n, **overrides):
    """The golden run `name` (tests/test_golden.py) with the last `n` devices sampling; its logged rows."""
    from posttrain.main import run
    from tests.test_golden import ROOT

    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    cfg = config(name, tmp_path / name)
    cfg.update_from_flattened_dict({"rl.placement": "split", "rl.sampler_devices": n, **overrides})
    run(cfg)
    return logged(tmp_path / name)


def test_split_on_policy_trains_as_colocated(tmp_path, monkeypatch):
    """rlvr_tiny on 4 learner + 4 sampler devices, max_staleness = 0: every training metric of the
    colocated run's golden rows (losses, ratios, rewards, lengths) within 1e-5: the sampler on its
    own mesh draws the same tokens with the published copy, and the learner trains on them as on
    every device. (Without the held-out evaluations, which only cost time here: the slow test
    below compares the first one.)"""
    no_eval = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
    rows = golden_split_run("rlvr_tiny_sync", tmp_path, monkeypatch, 4, **no_eval)
    expected = [r for r in json.loads(GOLDEN.read_text())["rlvr_tiny_sync"] if not any("eval/" in k for k in r)]
    assert [sorted(r) for r in rows] == [sorted(r) for r in expected]
    for got, want in zip(rows, expected):
        for key, value in want.items():
            np.testing.assert_allclose(got[key], value, rtol=1e-5, atol=1e-6, err_msg=f"step {want['step']} {key}")


@pytest.mark.slow
def test_split_overlapped_never_trains_past_the_staleness_bound(tmp_path, monkeypatch):
    """rlvr_tiny overlapped (rl.max_staleness = 2) on 4 learner + 4 sampler devices: every sequence
    the learner takes at step s was sampled by policy version v with s − 2 <= v <= s."""
    from posttrain.rl.rollout.producer import AsyncProducer

    taken, take = [], AsyncProducer.take

    def recording(self, step):
        rollouts, batch = take(self, step)
        taken.append((step, [ro.version for ro in rollouts for _ in ro.group.trajectories]))  # per sequence
        return rollouts, batch

    monkeypatch.setattr(AsyncProducer, "take", recording)
    rows = golden_split_run("rlvr_tiny_async", tmp_path, monkeypatch, 4, **{"rl.max_staleness": 2})
    assert [step for step, _ in taken] == list(range(5)) and all(len(v) == 16 for _, v in taken)
    assert all(0 <= step - v <= 2 for step, versions in taken for v in versions)
    assert all(r["rl/staleness_max"] <= 2 for r in rows if "rl/staleness_max" in r)
    # the held-out evaluation before any update, sampled on the sampler mesh: the colocated run's
    first_eval = json.loads(GOLDEN.read_text())["rlvr_tiny_async"][0]
    assert rows[0].keys() == first_eval.keys()
    for key, value in first_eval.items():
        np.testing.assert_allclose(rows[0][key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def test_the_producer_resolves_published_weights_on_its_own_thread_once_per_version():
    """rl.placement = split publishes the weights as a callable (the copy onto the sampler's
    devices): the producer calls it on its thread when it next samples, once per version."""
    import threading

    from tests.support.producer import FakeWorker, producer, scheduler

    calls = []

    def weights(version):
        calls.append((version, threading.current_thread().name))
        return (f"params{version}", None)

    class Recording(FakeWorker):
        def generate(self, params, rest, tasks, key, **kw):
            seen.append(params)
            return tasks

    seen = []
    p = producer(Recording(), scheduler(), max_staleness=1)
    try:
        for step in range(4):
            p.take(step)
            p.publish(step + 1, lambda v=step + 1: weights(v))
        p.take(4)
    finally:
        p.close(timeout=10)
    assert all(name == "rollouts" for _, name in calls)  # the producer thread, not the learner's
    assert sorted({v for v, _ in calls}) == [v for v, _ in calls]  # each version resolved at most once
    assert seen[0] is None and all(s is None or s.startswith("params") for s in seen)
    assert any(s is not None for s in seen)
