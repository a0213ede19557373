"""In-flight weight updates (issue 27 item 2, `rl.inflight_update_every`): the sampler switches to
newer weights between decode steps without dropping the sequences in flight, each token records
the policy version that drew it, and the learner enforces `rl.max_staleness` per token."""

import concurrent.futures
import threading

import jax
import numpy as np
import pytest

from posttrain.config import RLConfig
from posttrain.errors import UserError
from posttrain.parallel import use_sharding
from posttrain.rl.algo.learner import rl_batch
from posttrain.rl.envs.base import Task, Trajectory
from posttrain.rl.rollout.buffer import Rollout, RolloutBuffer
from posttrain.rl.rollout.inflight import check_inflight, token_version_metrics, token_versions
from posttrain.rl.rollout.worker import RolloutBatch, RolloutWorker
from posttrain.rl.tasks.scheduler import Group
from posttrain.sampling.generate import generate
from posttrain.sampling.inflight import generate_inflight, record_versions
from posttrain.sampling.rules import SamplingParams
from tests.support.typed_configs import run_cfg

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, num_samples=2, stop_ids=(2,))  # ByteTokenizer eos
PROMPTS = [[5, 6, 7, 8], [9, 10, 11]]


@jax.jit
def perturbed(params, seed, scale=0.5):
    """Other weights of the same shapes (one compiled program for every seed)."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [x + scale * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)])


class Scripted:
    """`latest()` returning version 0's weights for the first `switch_at` calls, then version 1's."""

    def __init__(self, w0, w1, switch_at):
        self.w, self.calls, self.switch_at = (w0, w1), 0, switch_at

    def __call__(self):
        self.calls += 1
        v = int(self.calls > self.switch_at)
        return (v, *self.w[v])


def test_record_versions_gives_the_first_token_of_a_chunk_the_logits_version():
    versions, logits_version = np.full((3, 6), -1, np.int32), np.array([0, 0, 0], np.int32)
    record_versions(versions, logits_version, np.array([0, 0, 0]), np.array([2, 1, 0]), 0)
    record_versions(versions, logits_version, np.array([2, 1, 0]), np.array([5, 1, 3]), 1)
    assert versions.tolist() == [[0, 0, 0, 1, 1, -1], [0, -1, -1, -1, -1, -1], [0, 1, 1, -1, -1, -1]]
    assert logits_version.tolist() == [1, 0, 1]


def test_inflight_sampler_switches_weights_mid_sequence(tiny_rl_policy):
    """Unchanged weights: static `generate`'s samples. A switch after the prefill and two chunks of
    3 steps: tokens 0..6 carry version 0 (token 6 is drawn from logits the old weights computed)
    and are the old weights' own, the rest carry version 1 and follow the new weights."""
    graphdef, params, rest, mesh, rules = tiny_rl_policy
    key = jax.random.key(3)
    new = perturbed(params, 1)
    with use_sharding(mesh, rules):
        plain = generate(graphdef, params, rest, PROMPTS, SAMPLING, key)
        same = generate_inflight(graphdef, Scripted((params, rest), None, 99), PROMPTS, SAMPLING, key, every=3)
        switched = generate_inflight(
            graphdef, Scripted((params, rest), (new, rest), 3), PROMPTS, SAMPLING, key, every=3
        )
    np.testing.assert_array_equal(same.tokens, plain.tokens)
    np.testing.assert_allclose(same.sampling_logprobs, plain.sampling_logprobs, rtol=1e-5, atol=1e-5)
    m = np.arange(SAMPLING.max_new_tokens)[None, :]
    live = m < switched.lengths[:, None]
    assert (switched.versions[~live] == -1).all()
    assert (switched.versions[live & (m <= 6)] == 0).all() and (switched.versions[live & (m > 6)] == 1).all()
    mixed = [len(set(v[v >= 0].tolist())) > 1 for v in switched.versions]
    assert any(mixed)
    np.testing.assert_array_equal(switched.tokens[:, :7], plain.tokens[:, :7])
    assert not np.array_equal(switched.tokens, plain.tokens)


def inflight_cfg(**overrides):
    return run_cfg({"rl.inflight_update_every": 4, "rl.max_staleness": 1, **overrides}, stage="rlvr")


@pytest.mark.parametrize(
    "overrides, words",
    [
        ({"rl.max_staleness": 0}, "no newer ones can arrive"),
        ({"sampling.continuous_batching": True}, "continuous_batching"),
        ({"sampling.speculative_k": 2}, "speculative_k"),
        ({"sampling.prefix_cache": 64}, "prefix_cache"),
        ({"rl.env": "tool"}, "multi-turn"),
        ({"rl.env": "screen"}, "multi-turn"),
        ({"model.moe.routing_replay": "sampler", "model.moe.num_experts": 4}, "routing_replay"),  # (MoE: replayable)
    ],
)
def test_inflight_updates_are_refused_where_they_cannot_act(overrides, words):
    check_inflight(inflight_cfg())  # the supported cases pass: in-process, split, a disaggregated sampler group
    check_inflight(inflight_cfg(**{"rl.placement": "split", "rl.sampler_devices": 4}))
    check_inflight(inflight_cfg(**{"rl.placement": "disaggregated", "rl.role": "sampler"}))
    with pytest.raises(UserError, match=words) as e:
        check_inflight(inflight_cfg(**overrides))
    assert e.value.key == "rl.inflight_update_every"


def test_several_processes_switch_in_flight_only_as_a_sampler_group(monkeypatch):
    """A disaggregated sampler group of several processes agrees on each switch (its lead decides,
    rl/rollout/group.py); several processes of one colocated program are refused."""
    from posttrain.rl.rollout import inflight

    monkeypatch.setattr(inflight.jax, "process_count", lambda: 2)
    check_inflight(inflight_cfg(**{"rl.placement": "disaggregated", "rl.role": "sampler"}))
    with pytest.raises(UserError, match="agree on each switch") as e:
        check_inflight(inflight_cfg())
    assert e.value.key == "rl.inflight_update_every"


def test_the_staleness_bound_is_per_sequence_and_the_learner_checks_it():
    """A rollout's version is its oldest token's: the buffer drops a long sequence whose first tokens
    lag past the bound whole, though its last tokens are fresh (no per-token bound keeps them). The
    learner (version 5, bound 2) logs the lags of what reaches it (a row whose tokens carry two
    versions counts as mixed; padding and prompt positions are not looked at), and refuses a token
    past the bound (before: masked silently, `rl/tokens_stale_dropped`, which could never act)."""
    group = Group("d", Task("t", (), "a"), [1.0], [Trajectory("t", [1, 2, 3], [False, True, True], 1)], [1.0])
    versions = [[np.asarray([2, 2, 5], np.int32)]]  # drawn by versions 2 then (in flight) 5
    (rollout,) = RolloutBatch([group], [[np.zeros(3, np.float32)]], {}, versions=versions).rollouts(2)
    buffer = RolloutBuffer(capacity_groups=4, max_staleness=2)
    buffer.put(rollout)
    with pytest.raises(TimeoutError):
        buffer.get(1, current_version=5, timeout=0.0)
    assert rollout.version == 2 and buffer.stats()["rl/buffer_dropped_stale"] == 1
    versions = np.array([[-1, 3, 3, 4, 5], [-1, 4, 4, 3, 3], [-1, 5, 5, 5, -1], [-1, -1, -1, -1, -1]])
    mask = np.array([[0, 1, 1, 1, 1], [0, 1, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]], np.int32)
    assert token_version_metrics({"versions": versions, "loss_mask": mask}, 5, 2) == {
        "rl/version_lag_max": 2.0,
        "rl/version_lag_mean": pytest.approx(np.mean([2, 2, 1, 0, 1, 1, 2, 2, 0, 0, 0])),
        "rl/mixed_version_frac": pytest.approx(2 / 3),
    }
    versions[1, 1] = 2
    with pytest.raises(ValueError, match="version 2 reached the learner at version 5: past rl.max_staleness=2"):
        token_version_metrics({"versions": versions, "loss_mask": mask}, 5, 2)


def test_rollouts_carry_token_versions_into_the_learner_batch():
    """A rollout's version is its oldest token's; rl_batch aligns versions with the targets."""
    traj = Trajectory("t", [7, 8, 9, 10, 11], [False, False, True, True, True], prompt_len=2)
    group = Group("d", Task("t", (), None), [1.0], [traj], [1.0])
    versions = token_versions(np.array([3, 3, 4, -1], np.int32), traj)
    assert versions.tolist() == [3, 3, 3, 3, 4]
    batch = RolloutBatch([group], [[np.zeros(5, np.float32)]], {}, versions=[[versions]])
    (ro,) = batch.rollouts(2)
    assert ro.version == 3
    out = rl_batch([ro], pad_id=0, num_rows=2)
    assert out["versions"][0, :4].tolist() == [3, 3, 3, 4] and (out["versions"][1] == -1).all()
    with pytest.raises(ValueError, match="versions of"):
        Rollout(group, 3, [np.zeros(5, np.float32)], versions=[versions[:4]])


def test_the_rlvr_stage_checks_inflight_updates_at_start_up():
    from posttrain.rl.checks import check_rlvr_stage

    with pytest.raises(UserError, match="no newer ones can arrive") as e:
        check_rlvr_stage(inflight_cfg(**{"rl.max_staleness": 0}))
    assert e.value.key == "rl.inflight_update_every"


def test_the_producer_samples_in_flight_within_the_staleness_bound(tiny_rl_policy, monkeypatch):
    """The overlapped producer (rl.max_staleness = 1) with in-flight updates every 2 decode steps,
    the test acting as the learner (take batch s, publish version s + 1, new weights each time):
    every generated token of batch s was drawn by a version in [s − 1, s], a rollout's version is
    its oldest token's, and batch 1's sequences carry two versions (version 1 is published only
    after batch 1's sampler has drawn with version 0, and the sampler is held after two chunks until
    it is published, so the switch lands mid-sequence whatever the timing)."""
    from posttrain.rl.envs.chat import SingleTurnEnv
    from posttrain.rl.rollout.producer import AsyncProducer
    from posttrain.rl.tasks.domains import Domain
    from posttrain.rl.tasks.scheduler import TaskScheduler
    from tests.support.episodes import REWARD, TOK, tasks

    graphdef, params, rest, mesh, rules = tiny_rl_policy
    latest, calls, drawn_at_0 = AsyncProducer._latest, [], threading.Event()

    def gated(self):
        if self._produced == 1:  # generating batch 1: the prefill's call, then one per chunk
            calls.append(1)
            if len(calls) == 2:
                drawn_at_0.set()
            if len(calls) == 3:
                with self._cv:
                    assert self._cv.wait_for(lambda: self._version >= 1, timeout=120)
        return latest(self)

    monkeypatch.setattr(AsyncProducer, "_latest", gated)
    domain = Domain("add", tasks(4), lambda: SingleTurnEnv(TOK, REWARD, max_turn_tokens=24))
    weights = [(params, rest)] + [(perturbed(params, seed=v), rest) for v in (1, 2)]
    taken = []
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        worker = RolloutWorker(graphdef, {"add": domain}, SAMPLING, TOK.pad_id, pool, inflight_every=2)
        sched = TaskScheduler({"add": domain}, seed=0)
        p = AsyncProducer(
            worker,
            sched,
            num_groups=2,
            max_staleness=1,
            base_key=jax.random.key(0),
            start=0,
            weights=weights[0],
            mesh=mesh,
            rules=rules,
            poll_s=0.05,
        ).start()
        try:
            for step in range(3):
                taken.append(p.take(step)[0])
                if step == 0:  # else batch 1 may start after version 1 is out, and draw with it alone
                    assert drawn_at_0.wait(timeout=120)
                if step < 2:
                    p.publish(step + 1, weights[step + 1])
        finally:
            p.close(timeout=60)
    mixed = []
    for step, rollouts in enumerate(taken):
        for ro in rollouts:
            generated = [v[t.prompt_len :] for v, t in zip(ro.versions, ro.group.trajectories)]
            assert ro.version == min(int(g.min()) for g in generated)
            assert all(0 <= step - v <= 1 for g in generated for v in g.tolist()), (step, generated)
            if step == 1:
                mixed += [len(set(g.tolist())) > 1 for g in generated]
    assert any(mixed)


@pytest.mark.slow
def test_rlvr_inflight_token_versions_stay_within_the_staleness_bound(tmp_path, monkeypatch):
    """rlvr_tiny overlapped (rl.max_staleness = 1) with in-flight updates every 2 decode steps on 8
    devices: every generated token the learner takes at step s was drawn by a version v with
    s − 1 <= v <= s, and sequences of batch 1 carry two versions. (Batch 1 is generated while the
    learner trains on batch 0; its sampler is held after two chunks until version 1 is published,
    so that the switch lands mid-sequence whatever the thread timing.)"""
    from posttrain.main import run
    from posttrain.rl.rollout.producer import AsyncProducer
    from tests.test_golden import ROOT, config, logged

    taken, take, latest = [], AsyncProducer.take, AsyncProducer._latest
    held = []

    def recording(self, step):
        rollouts, batch = take(self, step)
        taken.append((step, [(ro.version, ro.versions, ro.group.trajectories) for ro in rollouts]))
        return rollouts, batch

    def gated(self):
        if self._produced == 1:  # generating batch 1: calls are the prefill's, then one per chunk
            held.append(len(held) + 1)
            if len(held) == 3:
                with self._cv:
                    assert self._cv.wait_for(lambda: self._version >= 1 or self._stopping, timeout=300)
        return latest(self)

    monkeypatch.setattr(AsyncProducer, "take", recording)
    monkeypatch.setattr(AsyncProducer, "_latest", gated)
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    cfg = config("rlvr_tiny_async", tmp_path / "run")
    no_eval = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
    cfg.update_from_flattened_dict({"train.steps": 2, "rl.inflight_update_every": 2, **no_eval})
    run(cfg)
    rows = logged(tmp_path / "run")
    assert [step for step, _ in taken] == [0, 1]
    mixed = {}
    for step, groups in taken:
        for version, versions, trajs in groups:
            generated = [v[t.prompt_len :] for v, t in zip(versions, trajs)]
            assert version == min(int(g.min()) for g in generated)
            assert all(0 <= step - v <= 1 for g in generated for v in g.tolist())
            mixed.setdefault(step, []).extend(len(set(g.tolist())) > 1 for g in generated)
    assert any(mixed[1])
    assert all(r["rl/version_lag_max"] <= 1 and "rl/tokens_stale_dropped" not in r for r in rows)
    assert rows[1]["rl/mixed_version_frac"] == pytest.approx(np.mean(mixed[1]))


def test_token_versions_survive_the_workqueue_round_trip():
    """rl.placement = disaggregated: a sampler group's token versions travel in the batch's JSON."""
    import json

    from posttrain.rl.rollout import workqueue

    traj = Trajectory("t", [7, 8, 9], [False, True, True], prompt_len=1)
    group = Group("d", Task("t", (), None), [1.0], [traj], [1.0])
    behav, versions = [np.zeros(3, np.float32)], [np.array([2, 2, 3], np.int32)]
    plain = json.loads(json.dumps(workqueue.encode_batch([group], [behav], {}, 2, "s")))
    assert workqueue.decode_versions(plain) is None
    payload = json.loads(json.dumps(workqueue.encode_batch([group], [behav], {}, 2, "s", versions=[versions])))
    (got,) = workqueue.decode_versions(payload)
    assert [v.tolist() for v in got] == [[2, 2, 3]] and got[0].dtype == np.int32


def test_a_sampler_group_switches_to_weights_the_learner_published_in_flight():
    """`rlvr_sampler.inflight_weights`: the held weights until the learner publishes newer ones
    (pulled between decode steps), then those; the held ones once the learner has finished."""
    from posttrain.stages.rlvr_sampler import inflight_weights

    class Client:
        def __init__(self):
            self.published, self.finished, self.asked = 3, False, []

        def newest(self, min_version, alive=None):
            self.asked.append(min_version)
            return None if self.finished else ((f"p{self.published}", "rest"), self.published)

    client = Client()
    latest = inflight_weights(client, (("p3", "rest"), 3))
    assert latest() == (3, "p3", "rest")
    client.published = 4
    assert latest() == (4, "p4", "rest")
    client.finished = True
    assert latest() == (4, "p4", "rest") and client.asked == [3, 3, 4]
