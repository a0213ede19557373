"""The RL learner on a tiny dense model: PPO epochs and minibatches make the ratio move (clipping
and GSPO act), batches of different group counts share one compiled step, and the learner's
log-probs are those of the distribution the sampler drew from (temperature, top-k, top-p)."""

import contextlib
import dataclasses
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.config import base_config
from posttrain.core.batch import put_batch
from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state
from posttrain.models.decoder import Decoder
from posttrain.models.logprobs import token_logprobs
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.parallel.zigzag import zigzag
from posttrain.rl.algo.learner import batch_rows, compute_advantages, learner_logprobs, rl_batch
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.tasks.scheduler import Group
from posttrain.sampling.generate import generate
from posttrain.sampling.rules import SamplingParams, policy_logprobs
from posttrain.stages import rlvr
from tests.support.learner import NEW, PROMPT_LEN, PROMPTS, SAMPLING, G, make_learner, model_cfg, rl_cfg, update
from tests.support.typed_configs import run_cfg


@pytest.fixture(scope="module")
def setup():
    """(mesh, rules, graphdef, initial state, shardings, optim cfg) on one device."""
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    cfg = run_cfg({"optim.lr": 3e-3, "optim.warmup_steps": 0})
    with use_sharding(mesh, rules):
        tx = make_optimizer(cfg.optim, 100)
        graphdef, state, shardings = create_train_state(lambda: Decoder(model_cfg(), rngs=nnx.Rngs(0)), tx, mesh, rules)
    return mesh, rules, graphdef, state, shardings, cfg.optim, tx


def rollouts(num_groups, seed=0, new=NEW):
    """Random groups: prompts of PROMPT_LEN tokens, 2..new generated ones, rewards 0/1 (informative)."""
    rng = np.random.default_rng(seed)
    out = []
    for j in range(num_groups):
        lengths = [new] + rng.integers(2, new + 1, G - 1).tolist()  # generated tokens per sample
        trajs = [
            Trajectory(
                f"t{j}", rng.integers(3, 64, PROMPT_LEN + m).tolist(), [False] * PROMPT_LEN + [True] * m, PROMPT_LEN
            )
            for m in lengths
        ]
        rewards = [1.0, 0.0] + rng.integers(0, 2, G - 2).astype(float).tolist()
        out.append(
            Rollout(Group("arithmetic", None, rewards, trajs), 0, [np.zeros(len(t.tokens), np.float32) for t in trajs])
        )
    return out


def learner_batch(setup, learner, num_groups, seed=0):
    """A host batch whose behaviour log-probs are the starting policy's (on-policy)."""
    mesh, rules, graphdef, state, *_ = setup
    r = learner.rl_cfg
    batch = rl_batch(rollouts(num_groups, seed), pad_id=0, num_rows=batch_rows(num_groups, r, r.minibatches))
    batch["advantages"] = compute_advantages(batch, r)
    batch.pop("rewards")
    with use_sharding(mesh, rules):
        batch["behav_logp"] = np.asarray(learner.old_logprobs_fn(state.params, state.rest, put_batch(batch)))
    return batch


def test_ppo_epochs_move_the_ratio_so_the_clip_acts_and_minibatches_set_the_step_count(setup):
    learner = make_learner(setup, updates_per_batch=3, minibatches=2, clip_low=0.02, clip_high=0.02)
    state, m = update(setup, learner, learner_batch(setup, learner, PROMPTS), PROMPTS * G)
    assert m["rl/optimizer_steps"] == 6 and int(state.step) == 6
    assert m["rl/ratio_max"] > 1.0 + 1e-3 and m["rl/ratio_min"] < 1.0 - 1e-3
    assert m["rl/clip_frac_low"] > 0 and m["rl/clip_frac_high"] > 0


def test_sequence_ratios_train_differently_from_token_ratios_once_the_ratio_moves(setup):
    params = {}
    for level in ("token", "sequence"):
        learner = make_learner(setup, updates_per_batch=2, ratio_level=level, clip_low=0.9, clip_high=5.0)
        state, m = update(setup, learner, learner_batch(setup, learner, PROMPTS), PROMPTS * G)
        assert m["rl/optimizer_steps"] == 2 and int(state.step) == 2  # one minibatch: a step per epoch
        params[level] = jax.tree.leaves(state.params)
    diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(params["token"], params["sequence"]))
    assert diff > 1e-6, "GSPO and token-level ratios gave the same update"


def test_batches_with_fewer_groups_are_padded_to_a_bucket_and_reuse_the_compiled_step(setup):
    learner = make_learner(setup)
    assert batch_rows(3, learner.rl_cfg) == batch_rows(4, learner.rl_cfg) == PROMPTS * G
    assert batch_rows(1, learner.rl_cfg) == G and batch_rows(2, rl_cfg(minibatches=8), 8) == 8
    full = learner_batch(setup, learner, PROMPTS)
    update(setup, learner, full, PROMPTS * G)
    padded = learner_batch(setup, learner, 3, seed=1)
    assert padded["loss_mask"][3 * G :].sum() == 0 and np.all(padded["advantages"][3 * G :] == 0)
    _, m = update(setup, learner, padded, 3 * G)
    assert learner.step_fn._cache_size() == 1
    assert np.isfinite(m["loss"])


def test_learner_logprobs_equal_the_samplers_behaviour_logprobs(setup):
    mesh, rules, graphdef, state, *_ = setup
    sampling = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_new_tokens=NEW, num_samples=2)
    prompts = np.random.default_rng(0).integers(3, 64, (2, PROMPT_LEN))
    with use_sharding(mesh, rules):
        samples = generate(graphdef, state.params, state.rest, prompts, sampling, jax.random.key(1), pad_id=0)
    rows = []
    for i in range(len(samples.tokens)):
        toks = prompts[i // 2].tolist() + samples.completion(i)
        rows.append(Trajectory("t", toks, [False] * PROMPT_LEN + [True] * samples.lengths[i], PROMPT_LEN))
    behav = [
        np.r_[np.zeros(PROMPT_LEN), samples.sampling_logprobs[i, : samples.lengths[i]]].astype(np.float32)
        for i in range(len(rows))
    ]
    batch = rl_batch([Rollout(Group("a", None, [0.0] * len(rows), rows), 0, behav)], pad_id=0)
    model = nnx.merge(graphdef, state.params, state.rest)
    logp, _, _ = learner_logprobs(model, batch, sampling, update_bias=False)
    mask = batch["loss_mask"].astype(bool)
    np.testing.assert_allclose(np.asarray(logp)[mask], batch["behav_logp"][mask], atol=1e-5)
    # the untempered policy is not what was sampled: the test would see a learner that ignores T
    logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
    assert np.abs(np.asarray(token_logprobs(logits, batch["targets"]))[mask] - batch["behav_logp"][mask]).max() > 1e-3
    # nor is the tempered one without the top-k / top-p renormalisation
    tempered = policy_logprobs(logits, batch["targets"], SamplingParams(temperature=sampling.temperature))
    assert np.abs(np.asarray(tempered)[mask] - batch["behav_logp"][mask]).max() > 1e-3


def test_truncated_policy_logprobs_keep_the_target_and_have_finite_gradients():
    logits = jax.random.normal(jax.random.key(0), (2, 3, 16))
    targets = jax.numpy.argsort(logits, axis=-1)[..., 0]  # the least likely token: outside top-k
    params = SamplingParams(temperature=0.5, top_k=4)
    lp, grad = jax.value_and_grad(lambda x: policy_logprobs(x, targets, params).sum())(logits)
    assert np.all(np.isfinite(np.asarray(lp))) and np.all(np.isfinite(np.asarray(grad)))
    with pytest.raises(ValueError, match="temperature 0"):
        policy_logprobs(logits, targets, dataclasses.replace(params, temperature=0.0))


LOSS_SWITCHES = {
    "aggregation": "seq-mean-token-mean",
    "entropy_coef": 0.1,
    "is_cap": 1.01,
    "is_level": "sequence",
    "is_mask": "token",
    "loss_type": "cispo",
    "kl_coef": 0.1,
    "temperature": 0.7,
    "top_k": 8,
    "top_p": 0.8,
}


def test_every_loss_switch_changes_the_gradient(setup):
    """Each rl.* key the learner's loss reads changes the gradient on the same batch (one compile)."""
    from posttrain.rl.algo.learner import rl_loss

    mesh, rules, graphdef, state, *_ = setup
    learner = make_learner(setup)
    batch = learner_batch(setup, learner, PROMPTS)
    on_policy, rng = batch["behav_logp"], np.random.default_rng(0)
    batch["behav_logp"] = on_policy + rng.normal(0, 0.3, on_policy.shape)
    # proximal log-probs off the current ones (as after an update): the ratio moves, so rl.loss_type acts
    batch["old_logp"] = (on_policy + rng.normal(0, 0.1, on_policy.shape)).astype(np.float32)
    ref = (jax.tree.map(lambda x: x * 1.1, state.params), state.rest)

    def grads(params, rest, batch, ref):
        out = {}
        for name, value in [("base", None), *LOSS_SWITCHES.items()]:
            r, sampling = rl_cfg(), SAMPLING
            if name in ("temperature", "top_k", "top_p"):
                sampling = dataclasses.replace(SAMPLING, **{name: value})
            elif name is not None and name != "base":
                r = dataclasses.replace(r, **{name: value})
            extra = ref if name == "kl_coef" else ()
            loss = lambda p: rl_loss(
                nnx.merge(graphdef, p, rest),
                batch,
                *extra,
                graphdef=graphdef,
                rl_cfg=r,
                moe_cfg=model_cfg().moe,
                sampling=sampling,
            )[0]
            out[name] = jax.grad(loss)(params)
        return out

    with use_sharding(mesh, rules):
        out = jax.device_get(jax.jit(grads)(state.params, state.rest, put_batch(batch), ref))
    base = jax.tree.leaves(out.pop("base"))
    for name, g in out.items():
        diff = max(float(np.abs(np.asarray(a) - np.asarray(b)).max()) for a, b in zip(jax.tree.leaves(g), base))
        assert diff > 1e-7, f"rl.{name}={LOSS_SWITCHES[name]!r} did not change the gradient"


def test_filter_groups_keeping_one_group_with_minibatches_that_split_a_group(setup):
    """`prompts_per_step=6, group_size=4, minibatches=3` and dynamic sampling keeps one group: the
    padded batch used to have 6 rows ("rewards of shape (6,)"); it now holds whole groups."""
    learner = make_learner(setup, prompts_per_step=6, minibatches=3, filter_groups=True)
    assert batch_rows(1, learner.rl_cfg, 3) == 12 and batch_rows(6, learner.rl_cfg, 3) == 24
    batch = learner_batch(setup, learner, 1)
    assert len(batch["inputs"]) == 12 and np.all(batch["advantages"][G:] == 0)
    state, m = update(setup, learner, batch, G)
    assert m["rl/optimizer_steps"] == 3 and np.isfinite(m["loss"])


def test_loss_norm_tokens_is_dr_grpos_constant_divisor(setup):
    """seq-mean-token-sum divides each sequence's token sum by rl.loss_norm_tokens (0: rl.max_new_tokens),
    a constant: the loss scale no longer grows with response length."""
    from posttrain.rl.algo.learner import loss_norm, rl_loss

    mesh, rules, graphdef, state, *_ = setup
    batch = learner_batch(setup, make_learner(setup), PROMPTS)
    pg = {}
    for norm in (0, 12):
        r = rl_cfg(aggregation="seq-mean-token-sum", loss_norm_tokens=norm)
        assert loss_norm(r) == (norm or r.max_new_tokens)
        with use_sharding(mesh, rules):
            _, m = rl_loss(
                nnx.merge(graphdef, state.params, state.rest),
                put_batch(batch),
                graphdef=graphdef,
                rl_cfg=r,
                moe_cfg=model_cfg().moe,
                sampling=SAMPLING,
            )
        pg[norm] = float(m["rl/pg_loss"])
    assert pg[0] != 0 and pg[12] == pytest.approx(pg[0] * rl_cfg().max_new_tokens / 12, rel=1e-5)
    assert loss_norm(rl_cfg(loss_norm_tokens=12)) is None  # other aggregations: no constant


def test_a_sequence_sharded_learner_zigzags_its_rows_and_trains_as_one_shard():
    """mesh.sequence = 2 (ring attention, tiles of 4 tokens), rows of 6..15 tokens in 16: the
    learner zig-zags them, every per-token array with them (the busiest shard's attention tiles
    fall from 7 to 5), the per-token outputs of the rollout pass come back in token order (the KL
    paid as reward, a reward-to-go on the host, reads them), and two PPO epochs log the metrics
    and reach the weights of the same batch on one shard. Rows of 5..9 tokens, whose longest
    ends just past the middle, would be busier zig-zagged (3 → 5 tiles): they stay in order."""
    from posttrain.parallel.zigzag import tiles_per_shard
    from posttrain.rl.algo.learner import advantage_targets

    m = model_cfg().replace(attention="blockwise", attention_block=4)
    kw = dict(updates_per_batch=2, kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    ros, out = rollouts(2, new=12), {}
    for shards in (1, 2):
        mesh, rules = make_mesh(dict(data=1, sequence=shards), devices=jax.devices()[:shards]), parse_rules({})
        with use_sharding(mesh, rules):
            cfg = run_cfg({"optim.lr": 3e-3, "optim.warmup_steps": 0})
            tx = make_optimizer(cfg.optim, 100)
            graphdef, state, shardings = create_train_state(lambda: Decoder(m, rngs=nnx.Rngs(0)), tx, mesh, rules)
            ref = (jax.tree.map(lambda x: x * 1.1, state.params), state.rest)
            env = (mesh, rules, graphdef, state, shardings, cfg.optim, tx)
            learner = make_learner(env, context=(shards, 4), **kw)
            batch = rl_batch(ros, pad_id=0, num_rows=batch_rows(2, learner.rl_cfg), sequence_shards=shards)
            batch = learner.prepare(state, batch, ref)
            batch.update(advantage_targets(batch, learner.rl_cfg))
            new, metrics = learner.update(state, batch, ref, 0, 2 * G)
        out[shards] = batch, metrics, jax.device_get(jax.tree.leaves(new.params))
    (batch1, m1, p1), (batch2, m2, p2) = out[1], out[2]
    placed, zigzagged = learner.device_batch(batch2)
    assert zigzagged and (placed["advantages"] == zigzag(batch2["advantages"], 2)).all()  # every per-token array
    tiles = [tiles_per_shard(b["positions"], b["segment_ids"], 2, 4).tolist() for b in (batch2, placed)]
    assert tiles == [[3, 7], [5, 5]], tiles
    short = rl_batch(rollouts(2), pad_id=0, num_rows=batch_rows(2, learner.rl_cfg), sequence_shards=2)
    assert not learner.device_batch(short)[1]
    for k in ("rollout_logp", "ref_logp", "advantages"):  # token order on the host
        np.testing.assert_allclose(batch2[k], batch1[k], rtol=1e-5, atol=1e-6, err_msg=k)
    assert batch1["advantages"].ndim == 2 and np.abs(batch1["advantages"]).max() > 0
    for k in ("loss", "rl/kl", "rl/ratio_max", "rl/pg_loss"):
        assert float(m2[k]) == pytest.approx(float(m1[k]), rel=1e-4, abs=1e-6), k
    for a, b in zip(p2, p1):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)


def test_seq_bucket_trims_the_row_length_and_trains_as_the_power_of_two_rows(setup):
    """rl.seq_bucket: rows of 9 positions are 16 long by default, 10 with seq_bucket=5 (a multiple
    of 5 and of 2 × sequence shards), and the padding changes neither loss nor update."""
    learner, num = make_learner(setup), PROMPTS * G
    pow2 = learner_batch(setup, learner, PROMPTS)
    trimmed = rl_batch(rollouts(PROMPTS), pad_id=0, num_rows=num, seq_bucket=5)
    assert pow2["inputs"].shape == (num, 16) and trimmed["inputs"].shape == (num, 10)
    assert rl_batch(rollouts(PROMPTS), pad_id=0, seq_bucket=3, sequence_shards=2)["inputs"].shape[1] == 12
    trimmed["advantages"] = compute_advantages(trimmed, learner.rl_cfg)
    trimmed.pop("rewards")
    trimmed["behav_logp"] = pow2["behav_logp"][:, :10]
    (s1, m1), (s2, m2) = update(setup, learner, pow2, num), update(setup, learner, trimmed, num)
    np.testing.assert_allclose(m2["loss"], m1["loss"], rtol=1e-5, atol=1e-7)
    for a, b in zip(jax.tree.leaves(s1.params), jax.tree.leaves(s2.params)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-4, atol=1e-6)


def test_the_rl_stage_pads_its_learner_rows_to_rl_seq_bucket():
    """rl.seq_bucket reaches the learner from the RL stage's learn step: 16 positions by default,
    10 with seq_bucket=5 (the rows of `rollouts` hold 10 tokens)."""

    class Prepared(Exception):
        """Raised once the learner has seen its batch: the update itself is not under test."""

    def prepare(state, batch, ref):
        widths.append(batch["inputs"].shape[1])
        raise Prepared

    widths = []
    for bucket in (0, 5):
        cfg = base_config()
        cfg.rl.update(prompts_per_step=PROMPTS, group_size=G, seq_bucket=bucket)
        c = SimpleNamespace(
            cfg=cfg,
            pad_id=0,
            learner=SimpleNamespace(shards=1, prepare=prepare),
            rewards=lambda rows, rewards, unfinished, judged: (rewards, {}),
            clock=SimpleNamespace(busy=contextlib.nullcontext),
            ref=None,
        )
        with pytest.raises(Prepared):
            rlvr.learn_step(c, rlvr.RLState(train=None, step=0), rollouts(PROMPTS))
    assert widths == [16, 10]
