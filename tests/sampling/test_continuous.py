"""RL rollouts through continuous batching (`sampling.continuous_batching`): the same rollouts per
request as static batching with the same seeds (tokens exactly, behaviour log-probs to float
rounding), group by group, single-turn and multi-turn, on a skewed length distribution; the loop
trains with the switch on; its keys are checked at start-up."""

from __future__ import annotations

import concurrent.futures
import json

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.config import run_config
from posttrain.parallel import use_sharding
from posttrain.rl.algo.learner import learner_logprobs, rl_batch
from posttrain.rl.envs.base import Task
from posttrain.rl.envs.chat import SingleTurnEnv
from posttrain.rl.rollout import worker as rollout_worker
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.verifiers import MathTask
from posttrain.sampling.generate import SlotConfig
from posttrain.sampling.rules import SamplingParams
from posttrain.stages import rlvr as loop
from tests.support.episodes import REWARD, TOK, CountingEnv, assert_same_rollouts, tasks
from tests.support.rl_runs import rows, tiny
from tests.support.typed_configs import run_cfg, typed

SLOTS = SlotConfig(num_slots=4, refill_batch=2)
# Every byte below 48 ends a response: most stop within a few tokens, a few run to the limit.
SKEWED = SamplingParams(
    temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=24, stop_ids=(TOK.eos_id, *range(48)), num_samples=4
)


@pytest.fixture(scope="module")
def policy(tiny_rl_policy):
    return tiny_rl_policy  # conftest: `tiny_policy()`, made once per session


def rollout(policy, domain, sampling, slots, key, *, episodes=None):
    graphdef, params, rest, mesh, rules = policy
    with use_sharding(mesh, rules), concurrent.futures.ThreadPoolExecutor(2) as pool:
        worker = RolloutWorker(
            graphdef, {domain.name: domain}, sampling, TOK.pad_id, pool, episodes=episodes, continuous=slots
        )
        return worker.rollout(params, rest, [(domain.name, t) for t in domain.tasks], key)


def test_continuous_rollouts_equal_static_ones_group_by_group(policy, monkeypatch):
    domain = Domain("add", tasks(5), lambda: SingleTurnEnv(TOK, REWARD, max_turn_tokens=24))
    key = jax.random.key(7)
    static = rollout(policy, domain, SKEWED, None, key)
    calls = []
    real = rollout_worker.generate
    monkeypatch.setattr(rollout_worker, "generate", lambda *a, **kw: calls.append(kw["slots"]) or real(*a, **kw))
    cont = rollout(policy, domain, SKEWED, SLOTS, key)
    assert calls == [SLOTS]  # the switch routes the rollouts through the slots
    lengths = np.array([t.num_generated for g in static.groups for t in g.trajectories])
    assert np.median(lengths) <= 4 and lengths.max() >= 3 * np.median(lengths), lengths  # skewed
    assert_same_rollouts(static, cont)
    assert cont.info["new_tokens"] == static.info["new_tokens"] == lengths.sum()


def test_continuous_episodes_equal_static_ones_and_align_with_the_learner(policy):
    sampling = SamplingParams(
        temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=6, stop_ids=(TOK.eos_id,), num_samples=4
    )
    # tests/rl/tasks/test_repo_domain.py's episodes (the static sampler's programs are shared with it)
    say = [Task(f"t{i}", ({"role": "user", "content": f"say {i}"},), MathTask(str(i))) for i in range(2)]
    domain = Domain("count", say, lambda: CountingEnv(TOK, REWARD, max_turn_tokens=6))
    key = jax.random.key(3)
    static = rollout(policy, domain, sampling, None, key, episodes=rollout_episodes)
    cont = rollout(policy, domain, sampling, SlotConfig(num_slots=3, refill_batch=2), key, episodes=rollout_episodes)
    trajs = [t for g in cont.groups for t in g.trajectories]
    assert {t.turns for t in trajs} >= {1, 3}, "episodes should end at different turns"
    assert_same_rollouts(static, cont)
    graphdef, params, rest, mesh, rules = policy
    with use_sharding(mesh, rules):
        batch = rl_batch(cont.rollouts(0), pad_id=TOK.pad_id)
        logp, _, _ = learner_logprobs(nnx.merge(graphdef, params, rest), batch, sampling, update_bias=False)
    mask = batch["loss_mask"].astype(bool)
    assert mask.sum() == sum(t.num_generated for t in trajs)
    np.testing.assert_allclose(np.asarray(logp)[mask], batch["behav_logp"][mask], atol=1e-5)


def test_rl_loop_trains_with_continuous_batching(tmp_path, monkeypatch):
    calls = []
    real = rollout_worker.generate
    monkeypatch.setattr(rollout_worker, "generate", lambda *a, **kw: calls.append(kw["slots"]) or real(*a, **kw))
    changes = {"sampling.continuous_batching": True, "sampling.num_slots": 4, "sampling.refill_batch": 2}
    cfg = typed(tiny(tmp_path, steps=2)).replace(changes)
    loop.run(cfg)
    out = rows(tmp_path)
    assert [r["step"] for r in out] == [0, 1] and all(np.isfinite(r["loss"]) for r in out)
    assert len(calls) == 2 and all(slots == SlotConfig(4, 2) for slots in calls)
    assert out[0]["rl/is_weight_mean"] == pytest.approx(1.0, abs=1e-3)  # sampler and learner agree
    assert json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[0])["rl/responses"] == 8


def sampling_run(keys: dict, stages: tuple[str, ...]):
    """The run config of the one stage in `stages` with sampling `keys`, checked as a run starts."""
    (stage,) = stages
    return run_config(run_cfg({f"sampling.{k}": v for k, v in keys.items()}, stage=stage))


@pytest.mark.parametrize(
    "keys, stages, match",
    [
        (
            dict(continuous_batching=True, speculative_k=2),
            ("rlvr",),
            "sampling.continuous_batching with sampling.speculative_k=2",
        ),
        (
            dict(continuous_batching=True, num_slots=2, refill_batch=4),
            ("rlvr",),
            "sampling.refill_batch=4: expected 1..sampling.num_slots",
        ),
        (
            dict(num_slots=8),
            ("rlvr",),
            "sampling.num_slots=8 cannot take effect.* without sampling.continuous_batching",
        ),
        (dict(refill_batch=2), ("rlvr",), "sampling.refill_batch=2 cannot take effect"),
        (dict(continuous_batching=True), ("sft",), "sampling.continuous_batching=True: .* no rlvr stage"),
        (dict(quantize="int8"), ("rejection_sampling",), "rejection_sampling stage takes only continuous_batching"),
    ],
)
def test_continuous_batching_keys_take_effect_or_raise(keys, stages, match):
    with pytest.raises(ValueError, match=match):
        sampling_run(keys, stages)


def test_continuous_batching_keys_pass_for_rl_and_rejection_sampling():
    keys = dict(continuous_batching=True, num_slots=8, refill_batch=8)
    sampling_run(keys, ("rlvr",))
    sampling_run(keys, ("rejection_sampling",))
