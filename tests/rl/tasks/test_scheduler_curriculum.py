"""Curriculum from the config (issue 16 item 2): `rl.curriculum.*` band weights shift which tasks are
drawn as configured, pass-rate windows, solved / hopeless tasks retire, per-band pass rates are
reported, and the state survives a checkpoint. Pure: no model."""

from __future__ import annotations

import collections
import json

import pytest

from posttrain.rl.checks import check_rlvr_stage
from posttrain.rl.envs.base import Task
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.tasks.registry import curriculum_options
from posttrain.rl.tasks.scheduler import TaskScheduler
from tests.support.typed_configs import run_cfg


def rlvr_cfg(**curriculum):
    """The rlvr run config with `rl.curriculum` keys changed (raises as the stage's start would)."""
    cfg = run_cfg({f"rl.curriculum.{k}": v for k, v in curriculum.items()}, stage="rlvr")
    check_rlvr_stage(cfg)
    return cfg


def scheduler(n=4, **curriculum):
    cfg = rlvr_cfg(**curriculum)
    tasks = [Task(f"t{i}", ({"role": "user", "content": str(i)},), None) for i in range(n)]
    return TaskScheduler({"a": Domain("a", tasks, lambda: None)}, seed=3, **curriculum_options(cfg.rl.curriculum))


def settle(sched):
    """t0 hard (0 of 4 pass), t1 medium (2 of 4), t2 easy (4 of 4), t3 never sampled (new)."""
    for task, rewards in (("t0", [0, 0, 0, 0]), ("t1", [1, 0, 1, 0]), ("t2", [1, 1, 1, 1])):
        sched.record("a", task, rewards)


def draws(sched, n=4000):
    return collections.Counter(t.id for _, t in sched.next_batch(n))


def test_band_weights_shift_sampling_as_configured():
    uniform = scheduler()
    settle(uniform)
    assert all(900 < c < 1100 for c in draws(uniform).values())  # no weights: uniform
    weighted = scheduler(band_weights="medium:3,hard:1")
    settle(weighted)
    got = draws(weighted)
    assert set(got) == {"t0", "t1"} and got["t1"] / 4000 == pytest.approx(0.75, abs=0.03)
    edges = scheduler(band_weights="easy:1", easy_above=0.4)  # t1's 0.5 is "easy" now
    settle(edges)
    assert set(draws(edges)) == {"t1", "t2"}
    fresh = scheduler(band_weights="new:1", min_attempts=8)  # 4 samples: all still new
    settle(fresh)
    assert set(draws(fresh)) == {"t0", "t1", "t2", "t3"}


def test_solved_and_hopeless_tasks_retire_and_windows_forget_early_failures():
    sched = scheduler(retire_above=1.0, retire_below=0.1, retire_after=4)
    settle(sched)
    m = sched.metrics()
    assert (m["tasks/a/band_retired"], m["tasks/a/band_medium"], m["tasks/a/band_new"]) == (2, 1, 1)
    assert set(draws(sched)) == {"t1", "t3"}  # t0, t2 never again
    sched.record("a", "t1", [1, 1, 1, 1])  # 6 of 8: stays
    sched.record("a", "t3", [1] * 4)
    assert set(draws(sched)) == {"t1"}
    sched.record("a", "t1", [1] * 8)  # 14 of 16: still < 1.0
    assert sched.pass_rate("a", "t1") < 1.0 and set(draws(sched, 50)) == {"t1"}

    windowed = scheduler(retire_above=1.0, retire_after=4, window=4)  # the last 4 samples all pass
    windowed.record("a", "t1", [0, 0, 0, 0])
    windowed.record("a", "t1", [1, 1, 1, 1])
    assert windowed.metrics()["tasks/a/band_retired"] == 1
    for t in ("t0", "t2", "t3"):
        windowed.record("a", t, [1] * 4)
    assert windowed.metrics()["tasks/a/exhausted_draws"] == 0
    assert len(draws(windowed, 10)) > 0 and windowed.metrics()["tasks/a/exhausted_draws"] == 10


def test_per_band_pass_rates_and_state_round_trip():
    sched = scheduler(band_weights="new:1,medium:1", window=2)
    sched.record("a", "t1", [1, 0, 0, 0])  # drawn while new: 1 of 4 → hard (window: 0 of 2)
    sched.record("a", "t1", [1, 1])  # drawn while hard: window 2 of 2 → easy
    sched.record("a", "t2", [1, 0])  # new → medium
    m = sched.metrics()
    assert (m["tasks/a/band_new/samples"], m["tasks/a/band_new/pass_rate"]) == (6, pytest.approx(2 / 6))
    assert (m["tasks/a/band_hard/samples"], m["tasks/a/band_hard/pass_rate"]) == (2, 1.0)
    assert (m["tasks/a/band_easy"], m["tasks/a/band_medium"]) == (1, 1)
    restored = scheduler(band_weights="new:1,medium:1", window=2)
    restored.set_state(json.loads(json.dumps(sched.get_state())))
    assert restored.metrics() == m and restored.next_batch(20) == sched.next_batch(20)


def test_curriculum_keys_that_cannot_take_effect_or_are_wrong_raise():
    for key, value, message in [
        ("hard_below", 0.1, "needs|without rl.curriculum.band_weights"),
        ("window", 4, "without rl.curriculum.band_weights or retirement"),
        ("retire_after", 4, "only retirement uses it"),
        ("band_weights", "medium:1,solved:2", "unknown \\['solved'\\]"),
        ("band_weights", "medium:x", "band_weights='medium:x': 'medium:x' is not name\\[:weight\\]"),
        ("easy_above", 1.5, "rl.curriculum.easy_above=1.5: expected >= 0 and <= 1"),  # its bound, before the rules
    ]:
        with pytest.raises(ValueError, match=message):
            rlvr_cfg(**{key: value})


def test_pass_threshold_decides_what_passes():
    lenient, strict = scheduler(), scheduler(pass_threshold=0.9)
    for sched in (lenient, strict):
        sched.record("a", "t0", [0.8, 0.8, 1.0, 0.0])
    assert (lenient.pass_rate("a", "t0"), strict.pass_rate("a", "t0")) == (0.75, 0.25)
