"""A sample whose verifier reached no verdict (`Reward.error`: a symbolic timeout, a sandbox ERROR)
is not a wrong answer: zero advantage and no loss, out of its group's statistics and of the
scheduler's pass rates, counted in `rl/verifier_errors` (an alert past `alerts.verifier_error_rate`)."""

import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from posttrain.rl.algo.advantages import group_advantages
from posttrain.rl.algo.learner import compute_advantages, rl_batch
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.reward import Reward
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.tasks.scheduler import Group


@pytest.mark.parametrize("method", ["grpo", "drgrpo", "rloo"])
def test_group_statistics_are_over_the_judged_samples(method):
    rewards = np.array([1.0, 0.0, 0.0, 0.5, 0.0, 0.0, 1.0, 1.0, 0.3, 0.0, 0.0, 0.0], np.float32)  # 3 groups of 4
    valid = np.array([1, 1, 0, 1, 0, 1, 1, 1, 1, 0, 0, 0], bool)  # group 3: one judged sample, no baseline
    got = np.asarray(group_advantages(jnp.asarray(rewards), 4, method=method, valid=jnp.asarray(valid)))
    want = np.zeros(12)
    for j in range(2):
        idx = [i for i in range(4 * j, 4 * j + 4) if valid[i]]
        r = rewards[idx].astype(np.float64)
        a = r - r.mean()
        a = a / (r.std(ddof=1) + 1e-6) if method == "grpo" else a * len(r) / (len(r) - 1) if method == "rloo" else a
        want[idx] = a
    np.testing.assert_allclose(got, want, atol=1e-5)
    assert np.all(got[~valid] == 0)
    # all judged: the plain group advantages, to the bit
    plain = group_advantages(jnp.asarray(rewards), 4, method=method)
    np.testing.assert_array_equal(
        np.asarray(group_advantages(jnp.asarray(rewards), 4, method=method, valid=jnp.ones(12, bool))),
        np.asarray(plain),
    )


def _traj(error=None):
    return Trajectory("t", [5, 6, 7, 8, 9], [False, False, False, True, True], 3, Reward(0.0, {}, error=error))


def test_a_sample_without_a_verdict_trains_nothing_and_leaves_the_pass_rate_alone():
    trajs = [_traj(), _traj(), _traj("symbolic check timed out"), _traj()]
    group = Group("arithmetic", None, [1.0, 0.0, 0.0, 0.0], trajs)
    assert group.verdicts == [1.0, 0.0, None, 0.0]
    batch = rl_batch([Rollout(group, 0, [np.zeros(5, np.float32)] * 4)], pad_id=0, num_rows=8)
    assert batch["judged"].tolist() == [True, True, False, True] + [True] * 4
    assert batch["loss_mask"][2].sum() == 0 and batch["loss_mask"][0].sum() == 2  # no loss on it
    adv = compute_advantages(batch, ml_collections.ConfigDict(dict(group_size=4, advantage="drgrpo")))
    np.testing.assert_allclose(adv, [2 / 3, -1 / 3, 0.0, -1 / 3, 0, 0, 0, 0], atol=1e-6)  # baseline of 3

    from posttrain.rl.envs.base import Task
    from posttrain.rl.tasks.domains import Domain
    from posttrain.rl.tasks.scheduler import TaskScheduler

    domain = Domain("arithmetic", [Task("t", ({"role": "user", "content": "1+1"},), None)], lambda: None)
    sched = TaskScheduler({"arithmetic": domain}, seed=0)
    sched.record("arithmetic", "t", group.verdicts)
    assert sched.pass_rate("arithmetic", "t") == pytest.approx(1 / 3)
    # a group whose judged samples agree carries no signal, whatever the errored one scored
    split = Group("arithmetic", None, [0.0, 0.0, 1.0, 0.0], [_traj(), _traj(), _traj("sandbox ERROR"), _traj()])
    kept, dropped = sched.filter_groups([split])
    assert kept == [] and dropped == [split]


def test_verifier_errors_are_counted_and_alerted_in_a_run_whose_eval_rows_sit_at_their_update(tmp_path, monkeypatch):
    """Responses of even length (text, or tokens when truncated) get a verifier error: counted, out
    of the pass rates, and the verifier_error_rate alert fires; the held-out evals sit at the
    number of updates they measure
    (0: the start, then 1; the one after the update used to be written at step 0 too)."""
    import json

    from posttrain.rl.envs import chat
    from posttrain.rl.reward import RewardFunction, compose
    from posttrain.stages import rlvr as loop
    from tests.support.rl_runs import rows, tiny
    from tests.support.typed_configs import typed

    verify = RewardFunction.verify

    def flaky(self, task, response, **kw):
        if len(response) % 2 == 0:
            return Reward(0.0, {"correct": 0.0}, error="sandbox ERROR")
        return verify(self, task, response, **kw)

    def flaky_truncated(verdict, config, **kw):  # truncated responses are composed, not verified
        if kw["num_tokens"] % 2 == 0:
            return Reward(0.0, {"correct": 0.0}, error="sandbox ERROR")
        return compose(verdict, config, **kw)

    monkeypatch.setattr(RewardFunction, "verify", flaky)
    monkeypatch.setattr(chat, "compose", flaky_truncated)
    loop.run(typed(tiny(tmp_path, steps=1, eval_every=1, eval_size=2, eval_samples=2)))
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in rows(tmp_path) if "rl/responses" in r]
    errors = [r["rl/verifier_errors"] for r in train]
    assert [r["rl/responses"] for r in train] == [8] and sum(errors) > 0
    assert train[-1]["tasks/arithmetic/samples"] == 8 - sum(errors)  # judged samples only
    alerts = [r["step"] for r in lines if r.get("event") == "alert" and r.get("rule") == "verifier_error_rate"]
    assert alerts == [r["step"] for r, e in zip(train, errors) if e / 8 > 0.1]
    assert [r["step"] for r in lines if "eval/accuracy" in r] == [0, 1]


def test_a_batch_without_a_single_verdict_skips_its_update(tmp_path, monkeypatch):
    """Every verifier call fails (say the sandbox is down): nothing to train on, so the update is
    skipped and counted (an all-masked batch used to step the optimizer on a zero loss, weight
    decay included, and log infinite advantage extremes)."""
    from posttrain.rl.envs import chat
    from posttrain.rl.reward import RewardFunction
    from posttrain.stages import rlvr as loop
    from tests.support.rl_runs import rows, tiny
    from tests.support.typed_configs import typed

    monkeypatch.setattr(RewardFunction, "verify", lambda self, task, response, **kw: Reward(0.0, {}, error="down"))
    monkeypatch.setattr(chat, "compose", lambda *a, **kw: Reward(0.0, {}, error="down"))  # truncated responses
    loop.run(typed(tiny(tmp_path, steps=1)))
    (row,) = [r for r in rows(tmp_path) if "event" not in r]  # and the verifier_error_rate alert
    assert row["rl/skipped_updates"] == 1 and row["rl/verifier_errors"] == row["rl/responses"] == 8
    assert "loss" not in row and row["tasks/arithmetic/samples"] == 0
