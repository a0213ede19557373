"""The rollout side of the RL loop without a model: the overlapped producer's error path and its
scheduler snapshots, dynamic sampling's bookkeeping, the verifier-error metric, and the start-up
checks of the rl.* keys."""

import concurrent.futures
import json
import random
import time
import traceback
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from posttrain.config import RunConfig
from posttrain.rl.checks import check_episode_cohorts, check_rlvr_stage
from posttrain.rl.envs import Task
from posttrain.rl.rollout.worker import RolloutBatch, RolloutWorker, collect_batch
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.tasks.scheduler import Group, TaskScheduler
from posttrain.rl.verifiers import MathTask
from posttrain.stages import rlvr as loop
from tests.support.producer import LP, TRAJ, FakeWorker, VerifierCrashed, producer, scheduler
from tests.support.typed_configs import run_cfg


def test_a_verifier_exception_reaches_the_learner_with_its_traceback():
    p = producer(FakeWorker(fail_at=2), scheduler())
    try:
        for step in (0, 1):  # batch 2 waits for version 1: the crash cannot come earlier
            rollouts, _ = p.take(step)
            assert len(rollouts) == 2
        p.publish(1, (None, None))
        t0 = time.perf_counter()
        with pytest.raises(VerifierCrashed, match="batch 2") as err:
            p.take(2)
        assert time.perf_counter() - t0 < 5
        assert "in verify" in "".join(traceback.format_tb(err.value.__traceback__))
    finally:
        p.close(timeout=10)
    assert not p._thread.is_alive()


def test_the_checkpointed_scheduler_state_is_that_of_the_last_trained_batch():
    sched = scheduler()
    p = producer(FakeWorker(), sched, max_staleness=2)
    try:
        deadline = time.time() + 10
        while sched.batches_drawn < 3 and time.time() < deadline:  # the producer ran ahead
            time.sleep(0.01)
        assert sched.batches_drawn == 3
        for step in range(2):
            _, batch = p.take(step)
            state = batch.scheduler_state
            assert state["batches"] == step + 1
            assert state["counters"]["a"]["groups"] == 2 * (step + 1)
            assert sum(a for a, _ in state["stats"]["a"].values()) == 4 * (step + 1)
            p.publish(step + 1, (None, None))
    finally:
        p.close(timeout=10)


class JitteryWorker(FakeWorker):
    """Results that steer a curriculum (task a<i> is solved when i % 3 == 0), after random delays
    in generation and verification: only thread timing differs between runs."""

    def __init__(self):
        super().__init__()
        self.jitter = random.Random()

    def generate(self, params, rest, tasks, key, **kw):
        time.sleep(self.jitter.uniform(0, 0.004))
        return tasks

    def verify(self, tasks):
        time.sleep(self.jitter.uniform(0, 0.02))
        rewards = lambda t: [float(int(t.id[1:]) % 3 == 0)] * 2
        return RolloutBatch(
            [Group(d, t, rewards(t), [TRAJ, TRAJ]) for d, t in tasks], [[LP, LP]] * len(tasks), {"verifier_errors": 0}
        )


def curriculum():
    tasks = [Task(f"a{i}", ({"role": "user", "content": str(i)},), MathTask(str(i))) for i in range(12)]
    return TaskScheduler(
        {"a": Domain("a", tasks, make_env=lambda: None)},
        seed=3,
        band_weights={"new": 4.0, "hard": 1.0, "easy": 1.0},
        retire_above=0.9,
        retire_after=4,
    )


def produced_ids(sched, start, steps, max_staleness=2):
    """Task ids of batches start..steps−1 from the overlapped producer, and each batch's scheduler state."""
    p = producer(JitteryWorker(), sched, max_staleness=max_staleness, start=start, num_groups=3)
    out, states = [], []
    try:
        for step in range(start, steps):
            rollouts, batch = p.take(step)
            out.append([ro.group.task.id for ro in rollouts])
            states.append(batch.scheduler_state)
            p.publish(step + 1, (None, None))
    finally:
        p.close(timeout=10)
    return out, states


def test_the_task_sequence_does_not_depend_on_thread_timing_and_a_resume_continues_it():
    """Issue 25 item 9: with a curriculum (bands, retirement) the producer's draws are those of the
    synchronous loop, whatever the delays in generation and verification, and a producer resumed
    from batch 3's checkpointed scheduler state draws what the uninterrupted run drew."""
    assert curriculum().draws_use_results and not scheduler().draws_use_results  # a plain mixture keeps the overlap
    sched, sync = curriculum(), []
    for _ in range(10):
        batch = collect_batch(
            JitteryWorker(), sched, None, None, jax.random.key(0), num_groups=3, filter_groups=False, max_rounds=1
        )
        sync.append([g.task.id for g in batch.groups])
    assert sched.metrics()["tasks/a/band_retired"] > 0  # the results steered the draws
    first, states = produced_ids(curriculum(), 0, 10)
    second, _ = produced_ids(curriculum(), 0, 10)
    assert first == second == sync
    resumed = curriculum()
    resumed.set_state(json.loads(json.dumps(states[3])))  # what the checkpoint after step 3 holds
    assert produced_ids(resumed, 4, 10)[0] == sync[4:]


def test_dynamic_sampling_records_each_group_once_and_an_empty_batch_skips_the_update():
    sched = scheduler()
    batch = collect_batch(
        FakeWorker(informative=False),
        sched,
        None,
        None,
        jax.random.key(0),
        num_groups=2,
        filter_groups=True,
        max_rounds=3,
    )
    assert batch.groups == [] and batch.info["kept_groups"] == 0
    assert sched.metrics()["tasks/a/groups"] == 6 and sched.metrics()["tasks/a/samples"] == 12  # 3 rounds × 2
    assert batch.scheduler_state["counters"]["a"]["groups"] == 6
    kept = collect_batch(
        FakeWorker(), scheduler(), None, None, jax.random.key(0), num_groups=2, filter_groups=False, max_rounds=1
    )
    assert kept.task_metrics["tasks/a/groups"] == 2

    c = SimpleNamespace(cfg=RunConfig())
    rl = loop.RLState(train=None, step=3)
    rl, metrics = loop.learn_step(c, rl, [])
    assert rl.skipped_updates == 1 and metrics == {"rl/skipped_updates": 1}


def test_rewards_with_an_error_are_counted_as_verifier_errors_and_behaviour_logprobs_are_the_sampled_ones():
    class Env:
        def __init__(self, error):
            self.error = error

        def step(self, action):
            return SimpleNamespace(reward=SimpleNamespace(score=0.0, correct=0.0, error=self.error))

        def trajectory(self):
            return TRAJ

    samples = SimpleNamespace(
        completion=lambda i: [2, 3],
        logprobs=np.full((4, 2), -9.0, np.float32),
        sampling_logprobs=np.arange(8, dtype=np.float32).reshape(4, 2) / -10,
        lengths=np.full(4, 2),
        stop_reason=np.zeros(4, np.int32),
        routing=None,  # (`Samples.routing`: none recorded)
        versions=None,  # (`Samples.versions`: no in-flight updates)
    )
    pending = SimpleNamespace(
        envs=[[Env(None), Env("timeout")], [Env("SympifyError"), Env(None)]],
        samples=samples,
        tasks=[("a", SimpleNamespace(id="a0"))] * 2,
        gen_s=0.0,
        done=None,
    )
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        worker = RolloutWorker(None, {}, None, 0, pool)
        batch = worker.verify(pending)
    assert batch.info["verifier_errors"] == 2
    # the behaviour log-probs are those of the distribution sampled, placed at the generated tokens
    np.testing.assert_allclose(batch.behav[1][1], [0.0, -0.6, -0.7])


# Each rl.* key that declares when it takes effect (its field's `inert_unless`, and the two keys the
# stage's start-up checks judge: verifier_timeout_s, episode_cohorts), with a value other than its
# default that the defaults (and rl.eval_every = 0) leave without effect.
INERT_VALUES = {
    "clip_low": 0.1,
    "clip_high": 0.5,
    "ratio_level": "sequence",
    "kl_estimator": "k1",
    "max_resample_rounds": 5,
    "eval_samples": 8,
    "eval_size": 16,
    "arithmetic_size": 10,
    "instruction": "Answer with a number.",
    "critic": "separate",
    "gamma": 0.9,
    "lam": 0.5,
    "value_coef": 1.0,
    "value_clip": 0.1,
    "kl_in_reward": True,
    "reward_model_weight": 2.0,
    "reward_model_normalize": False,
    "eval_files": "held_out.jsonl",
    "verifier_timeout_s": 5.0,
    "rollouts_fraction": 0.5,
    "max_turns": 3,
    "tool_timeout_s": 2.0,
    "invalid_tool_call_penalty": 0.1,
    "redundant_tool_call_penalty": 0.1,
    "episode_cohorts": 2,
    "loss_type": "cispo",
    "is_mask_low": 0.1,
    "is_mask_high": 5.0,
}


def check_rlvr_start(cfg):
    """The rl.* checks of an rlvr run's start: the stage's own, and the cohorts' (`stages.checks`)."""
    check_rlvr_stage(cfg)
    check_episode_cohorts(cfg)


@pytest.mark.parametrize("key", sorted(INERT_VALUES))
def test_an_rl_key_that_cannot_take_effect_is_an_error(key):
    cfg = run_cfg({"rl.eval_every": 0}, stage="rlvr")
    check_rlvr_start(cfg)
    cfg = cfg.replace({f"rl.{key}": INERT_VALUES[key]})
    if key in ("arithmetic_size", "instruction"):
        cfg = cfg.replace({"rl.domains": "gsm8k"})
    with pytest.raises(ValueError, match=f"rl.{key}="):
        check_rlvr_start(cfg)


def test_rl_config_errors_name_the_key():
    cfg = run_cfg({"rl.prompts_per_step": 3, "rl.group_size": 4, "rl.minibatches": 5}, stage="rlvr")
    with pytest.raises(ValueError, match="rl.minibatches=5 must divide .* 12"):
        check_rlvr_start(cfg)
    cfg = cfg.replace({"rl.minibatches": 4, "rl.temperature": 0.0})
    with pytest.raises(ValueError, match="rl.temperature=0.0"):
        check_rlvr_start(cfg)
    cfg = cfg.replace({"rl.temperature": 1.0, "rl.updates_per_batch": 2})
    check_rlvr_start(cfg)
    with pytest.raises(ValueError, match="rl.updates_per_batch=0"):
        cfg.replace({"rl.updates_per_batch": 0})
