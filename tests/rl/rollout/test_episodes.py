"""Multi-turn episodes in pipelined cohorts (`rl.episode_cohorts`, rl/episodes.py): a valid learner
batch (loss mask exactly on the model's turns, behaviour log-probs equal to the learner's), the
same episodes for the same seed whatever the timing and with continuous batching, one cohort's
environment steps running while another cohort samples, and the key checked at start-up."""

from __future__ import annotations

import dataclasses
import threading

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.errors import UserError
from posttrain.parallel import use_sharding
from posttrain.rl.algo.learner import learner_logprobs, rl_batch
from posttrain.rl.checks import check_episode_cohorts, check_rlvr_stage
from posttrain.rl.rollout.episodes import rollout_episodes, turn_key
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.sampling.generate import SlotConfig
from posttrain.sampling.prefix_cache import PrefixCache
from tests.support.episodes import SAMPLING, TOK, assert_same_rollouts, episodes, runs
from tests.support.typed_configs import run_cfg


@pytest.fixture(scope="module")
def policy(tiny_rl_policy):
    return tiny_rl_policy  # conftest: `tiny_policy()`, made once per session


def test_cohort_episodes_mask_model_tokens_and_their_behaviour_logprobs_equal_the_learners(policy):
    batch, envs, worker, _ = episodes(policy, 2, jax.random.key(3))
    trajs = [t for g in batch.groups for t in g.trajectories]
    assert len(trajs) == 8 and {t.turns for t in trajs} >= {1, 3}, "episodes should end at different turns"
    # groups stay whole although their samples are spread over the cohorts (episodes 0, 2, .. and 1, 3, ..)
    for j, g in enumerate(batch.groups):
        assert g.task.id == f"t{j}" and all(f"say {j}" in TOK.decode(t.tokens[: t.prompt_len]) for t in g.trajectories)
    assert max(n for _, _, n in worker.calls) == 4  # a sampler call serves one cohort of 4 episodes
    for env, traj in zip(envs, trajs):
        assert runs(traj.tokens, traj.loss_mask) == env.actions  # exactly the sampled turns are masked in
    assert batch.info["turns_per_episode"] == np.mean([t.turns for t in trajs])
    assert batch.info["episodes_s"] > 0 and batch.info["env_frac"] == pytest.approx(
        batch.info["env_s"] / (batch.info["env_s"] + batch.info["model_s"])
    )
    graphdef, params, rest, mesh, rules = policy
    with use_sharding(mesh, rules):
        learner_batch = rl_batch(batch.rollouts(0), pad_id=TOK.pad_id)
        logp, _, _ = learner_logprobs(nnx.merge(graphdef, params, rest), learner_batch, SAMPLING, update_bias=False)
    mask = learner_batch["loss_mask"].astype(bool)
    assert mask.sum() == sum(t.num_generated for t in trajs)
    np.testing.assert_allclose(np.asarray(logp)[mask], learner_batch["behav_logp"][mask], atol=1e-5)
    assert not learner_batch["behav_logp"][~mask].any()


def test_cohort_episodes_are_keyed_by_seed_cohort_and_turn_not_by_timing(policy):
    key = jax.random.key(5)
    first, envs2, w1, _ = episodes(policy, 2, key)
    # environment steps of random duration on a wider pool: cohorts finish their steps in other orders
    again, _, w2, _ = episodes(policy, 2, key, jitter=0.05, workers=4)
    assert [n for *_, n in w1.calls] == [n for *_, n in w2.calls]
    assert_same_rollouts(first, again)
    for b1, b2 in zip(first.behav, again.behav):
        for x, y in zip(b1, b2):
            np.testing.assert_array_equal(x, y)
    # cohort 0's first call is keyed fold_in(key, 0) like the lockstep round 0, row 0 = episode 0 in both
    _, envs1, _, _ = episodes(policy, 1, key)
    assert envs1[0].actions[0] == envs2[0].actions[0]
    assert [e.actions for e in envs1] != [e.actions for e in envs2]  # other keys: other episodes
    assert (
        jax.random.key_data(turn_key(key, 0, 3, 1)).tolist() == jax.random.key_data(jax.random.fold_in(key, 3)).tolist()
    )  # C = 1: the rounds' keys
    # continuous batching: each cohort's call through the slots, the same episodes; so with the prefix cache
    cont, _, _, _ = episodes(policy, 2, key, slots=SlotConfig(num_slots=3, refill_batch=2))
    assert_same_rollouts(first, cont)
    cache = PrefixCache(4096)
    cached, _, _, _ = episodes(policy, 2, key, prefix_cache=cache)
    assert_same_rollouts(first, cached)
    assert cache.stats.hits > 0  # later turns of a cohort hit its earlier turns' KV


def overlaps(calls, steps) -> bool:
    """Whether some sampler call ran while some environment step was running."""
    return any(s0 < e1 and e0 < s1 for s0, s1, _ in calls for e0, e1 in steps)


def test_one_cohorts_environment_steps_run_while_another_cohort_samples(policy):
    """Structural, not a speed assertion: with one cohort the sampler and the environment steps
    alternate; with two, a sampler call runs while the other cohort's (slow) steps are running."""
    key = jax.random.key(3)
    _, _, lockstep, steps1 = episodes(policy, 1, key, delay=0.2)
    assert not overlaps(lockstep.calls, steps1)
    batch, _, piped, steps2 = episodes(policy, 2, key, delay=0.2)
    assert overlaps(piped.calls, steps2)
    # model_s and env_s stay sums of their own work: every call's time, and each cohort turn's steps (>= 0.2 s)
    assert batch.info["model_s"] >= sum(s1 - s0 for s0, s1, _ in piped.calls)
    assert batch.info["env_s"] >= 0.2 * len(piped.calls)


def test_two_processes_step_only_their_share_and_sample_the_same_contexts(policy, monkeypatch):
    """Two processes simulated by two threads (the exchange of observations a barrier): each steps
    the environments of its own task only, both make the same sampler calls on the same contexts,
    and their groups together are the one-process episodes."""
    from posttrain.rl.rollout import episodes as episodes_module

    key = jax.random.key(3)
    whole, _, one, _ = episodes(policy, 2, key)
    local, barrier, slots = threading.local(), threading.Barrier(2, timeout=120), [None, None]

    def allgather(value):
        slots[local.p] = value
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    monkeypatch.setattr(episodes_module, "allgather_json", allgather)
    monkeypatch.setattr(
        episodes_module, "group_share", lambda n, exact: slice(local.p * n // 2, (local.p + 1) * n // 2)
    )
    results, errors = [None, None], []

    def process(p):
        local.p = p
        try:
            results[p] = episodes(policy, 2, key)
        except BaseException as e:  # noqa: BLE001  (re-raised below)
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=process, args=(p,)) for p in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    (b0, envs0, w0, _), (b1, envs1, w1, _) = results
    assert len(envs0) == len(envs1) == 4 and [g.task.id for g in b0.groups + b1.groups] == ["t0", "t1"]
    assert w0.contexts == w1.contexts == one.contexts
    assert_same_rollouts(whole, dataclasses.replace(whole, groups=b0.groups + b1.groups, behav=b0.behav + b1.behav))
    assert b0.info["responses"] == b1.info["responses"] == 4


def test_episode_cohorts_key_is_checked_at_start_up():
    with pytest.raises(UserError, match=r"config.rl.episode_cohorts=0: expected >= 1"):
        run_cfg({"rl.episode_cohorts": 0})
    cfg = run_cfg({"rl.episode_cohorts": 2}, stage="rlvr")
    with pytest.raises(ValueError, match=r"rl.episode_cohorts=2 cannot take effect: only multi-turn"):
        check_episode_cohorts(cfg)  # rl.env = "single"
    cfg = cfg.replace({"rl.env": "tool", "rl.domains": "repo_fix"})
    check_rlvr_stage(cfg)
    check_episode_cohorts(cfg)
    with pytest.raises(ValueError, match=r"rl.episode_cohorts=2 cannot take effect: .* this run \(sft\) has none"):
        check_episode_cohorts(cfg.replace(stage="sft"))
    with pytest.raises(ValueError, match=r"rl.episode_cohorts=2 cannot take effect"):
        check_episode_cohorts(cfg.replace(stage="eval"))  # eval.suites = "arithmetic": single-turn
    cfg = cfg.replace({"eval.suites": "repo_fix"})
    check_episode_cohorts(cfg.replace(stage="eval"))
    check_episode_cohorts(cfg.replace({"stage": "pipeline", "pipeline.stages": ("sft", "rlvr")}))
    with pytest.raises(ValueError, match=r"rl.episode_cohorts=0: expected >= 1"):
        rollout_episodes(RolloutWorker(None, {}, SAMPLING, 0, None), None, None, [], jax.random.key(0), cohorts=0)
