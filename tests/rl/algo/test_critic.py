"""The critic's numerics against float64 numpy references: GAE over ragged and gapped masks,
whitening, terminal rewards, and PPO's clipped value loss with its gradient."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.rl.algo.advantages import gae_advantages, terminal_rewards, whiten
from posttrain.rl.algo.losses import value_loss
from tests.support.typed_configs import model, rl, run_cfg, typed


def _random_batch(seed, b=6, t=11):
    rng = np.random.default_rng(seed)
    rewards, values = rng.normal(size=(b, t)), rng.normal(size=(b, t))
    mask = np.zeros((b, t), bool)
    mask[0, 3:9] = True  # a prompt, then a response, then padding
    mask[1, 2:] = True  # a response up to the end of the row
    mask[2, [4, 5, 8, 9, 10]] = True  # two turns with environment tokens between (not steps)
    mask[3, 7] = True  # one generated token
    mask[5, :] = True  # row 4 stays empty (a padding row)
    return rewards, values, mask


def gae_reference(rewards, values, mask, gamma, lam):
    """Plain float64 loops over each row's masked tokens."""
    adv, ret = np.zeros_like(rewards), np.zeros_like(rewards)
    for i in range(rewards.shape[0]):
        idx = np.flatnonzero(mask[i])
        next_v = next_a = 0.0
        for t in idx[::-1]:
            delta = rewards[i, t] + gamma * next_v - values[i, t]
            next_a = delta + gamma * lam * next_a
            next_v = values[i, t]
            adv[i, t], ret[i, t] = next_a, next_a + values[i, t]
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (1.0, 0.95), (0.9, 0.0), (0.99, 0.7)])
def test_gae_matches_numpy_reference(gamma, lam):
    rewards, values, mask = _random_batch(0)
    adv, ret = gae_advantages(
        jnp.asarray(rewards, jnp.float32), jnp.asarray(values, jnp.float32), jnp.asarray(mask), gamma=gamma, lam=lam
    )
    ref_adv, ref_ret = gae_reference(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(adv, ref_adv, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ret, ref_ret, atol=2e-5, rtol=1e-5)


def test_gae_special_cases_and_terminal_rewards():
    rewards, values, mask = _random_batch(1)
    scores = np.array([1.0, -2.0, 0.5, 3.0, 7.0, -1.0])
    r = np.asarray(terminal_rewards(jnp.asarray(scores, jnp.float32), jnp.asarray(mask)))
    assert r[0, 8] == 1.0 and r[1, 10] == -2.0 and r[2, 10] == 0.5 and r[3, 7] == 3.0 and r[5, 10] == -1.0
    assert np.count_nonzero(r) == 5  # nothing on the empty row 4
    # γ = λ = 1 with a terminal reward: every token's return is the outcome, its advantage R − V_t.
    adv, ret = gae_advantages(jnp.asarray(r), jnp.asarray(values, jnp.float32), jnp.asarray(mask), gamma=1.0, lam=1.0)
    np.testing.assert_allclose(ret, np.where(mask, scores[:, None], 0), atol=1e-5)
    np.testing.assert_allclose(adv, np.where(mask, scores[:, None] - values, 0), atol=1e-5)


def test_whiten_matches_numpy():
    x, _, mask = _random_batch(2)
    sel = x[mask]
    expected = np.where(mask, (x - sel.mean()) / np.sqrt(sel.var() + 1e-8), 0.0)
    np.testing.assert_allclose(whiten(jnp.asarray(x, jnp.float32), jnp.asarray(mask)), expected, atol=1e-5)


def value_loss_reference(v, old, ret, mask, clip):
    """float64 loss (token-mean) and its gradient in v."""
    unclipped = (v - ret) ** 2
    if not clip:
        per, grad = unclipped, 2 * (v - ret)
    else:
        vc = old + np.clip(v - old, -clip, clip)
        clipped = (vc - ret) ** 2
        inside = np.abs(v - old) < clip
        per = np.maximum(unclipped, clipped)
        grad = np.where(clipped > unclipped, 2 * (vc - ret) * inside, 2 * (v - ret))
    n = mask.sum()
    return (
        0.5 * (per * mask).sum() / n,
        0.5 * grad * mask / n,
        ((clipped > unclipped) & mask).sum() / n if clip else 0.0,
    )


@pytest.mark.parametrize("clip", [0.0, 0.2])
def test_clipped_value_loss_and_gradient_match_numpy(clip):
    rng = np.random.default_rng(3)
    _, _, mask = _random_batch(3)
    v, old, ret = (rng.normal(size=mask.shape) for _ in range(3))
    old = v + rng.normal(scale=0.3, size=v.shape)  # some tokens inside the clip range, some outside
    f = lambda x: value_loss(
        x, jnp.asarray(old, jnp.float32), jnp.asarray(ret, jnp.float32), jnp.asarray(mask), clip=clip
    )
    (loss, metrics), grad = jax.value_and_grad(f, has_aux=True)(jnp.asarray(v, jnp.float32))
    ref_loss, ref_grad, ref_frac = value_loss_reference(v, old, ret, mask, clip)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
    np.testing.assert_allclose(grad, ref_grad, atol=1e-6)
    np.testing.assert_allclose(metrics["rl/value_clip_frac"], ref_frac, atol=1e-6)
    if clip:
        assert 0 < ref_frac < 1
    err = (ret - v)[mask]
    np.testing.assert_allclose(metrics["rl/value_explained_var"], 1 - err.var() / ret[mask].var(), rtol=1e-4)


def test_value_loss_rejects_negative_clip():
    z = jnp.zeros((1, 2))
    with pytest.raises(ValueError, match="value_clip"):
        value_loss(z, z, z, z > -1, clip=-0.1)


def test_value_decoder_is_the_decoder_plus_a_value_per_position():
    from flax import nnx

    from posttrain.models.decoder import Decoder
    from posttrain.rl.algo.critic import ValueDecoder

    cfg = model(num_layers=1, embed_dim=32, mlp_dim=64)
    critic, plain = ValueDecoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, rngs=nnx.Rngs(0))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 256, size=(2, 7)))
    forward = nnx.jit(lambda a, b, t: (a.logits_and_values(t), b(t)[0], a.hidden_states(t)[0]))
    (logits, values, _), plain_logits, hidden = forward(critic, plain, tokens)
    np.testing.assert_allclose(logits, plain_logits, rtol=1e-5, atol=1e-5)  # the head changes nothing else
    np.testing.assert_allclose(
        values, np.asarray(hidden, np.float64) @ np.asarray(critic.value_head[...], np.float64), rtol=1e-5, atol=1e-5
    )


def test_critic_settings_that_cannot_take_effect_are_refused():
    # (the critic's rules, RLConfig.check_rules and RunConfig._check_rlvr, apply with rl.advantage='gae')
    from posttrain.rl.checks import check_rlvr_stage

    with pytest.raises(ValueError, match="rl.critic='separate'.*not implemented"):
        check_rlvr_stage(run_cfg({"rl.advantage": "gae", "rl.critic": "separate"}, stage="rlvr"))
    with pytest.raises(ValueError, match="lora.rank=4"):
        check_rlvr_stage(run_cfg({"rl.advantage": "gae", "rl.critic": "shared", "lora.rank": 4}, stage="rlvr"))


def test_advantage_targets_gae_with_kl_paid_as_reward():
    from posttrain.rl.algo.learner import advantage_targets

    rewards, values, mask = _random_batch(4)
    rng = np.random.default_rng(4)
    scores, logp, ref = rng.normal(size=6), -rng.random(mask.shape), -rng.random(mask.shape)
    batch = {
        "rewards": scores.astype(np.float32),
        "loss_mask": mask.astype(np.int32),
        "old_values": values.astype(np.float32),
        "rollout_logp": logp.astype(np.float32),
        "ref_logp": ref.astype(np.float32),
    }
    r = rl(advantage="gae", gamma=0.9, lam=0.8, kl_coef=0.1, kl_in_reward=True, kl_estimator="k1")
    out = advantage_targets(batch, r)
    token_rewards = np.where(mask, -0.1 * (logp - ref), 0.0)
    for i in range(6):
        if mask[i].any():
            token_rewards[i, np.flatnonzero(mask[i])[-1]] += scores[i]
    adv, ret = gae_reference(token_rewards, values, mask, 0.9, 0.8)
    sel = adv[mask]
    np.testing.assert_allclose(out["returns"], ret, atol=1e-5)
    np.testing.assert_allclose(
        out["advantages"], np.where(mask, (adv - sel.mean()) / np.sqrt(sel.var() + 1e-8), 0), atol=1e-4
    )
    without = advantage_targets(batch, rl(advantage="gae", gamma=0.9, lam=0.8))  # the switch matters
    assert not np.allclose(without["returns"], out["returns"])


def test_advantage_targets_group_advantages_with_kl_reward_to_go():
    from posttrain.rl.algo.learner import advantage_targets

    _, _, mask = _random_batch(5)
    mask = mask[:4]
    rng = np.random.default_rng(5)
    logp, ref = -rng.random(mask.shape), -rng.random(mask.shape)
    batch = {
        "rewards": np.array([1.0, 0.0, 0.5, 0.5], np.float32),
        "loss_mask": mask.astype(np.int32),
        "rollout_logp": logp.astype(np.float32),
        "ref_logp": ref.astype(np.float32),
    }
    out = advantage_targets(
        batch, rl(advantage="drgrpo", group_size=2, kl_coef=0.2, kl_in_reward=True, kl_estimator="k1")
    )
    kl = np.where(mask, logp - ref, 0.0)
    to_go = np.cumsum(kl[:, ::-1], axis=1)[:, ::-1]
    expected = (np.array([0.5, -0.5, 0.0, 0.0])[:, None] - 0.2 * to_go) * mask
    np.testing.assert_allclose(out["advantages"], expected, atol=1e-5)
    plain = advantage_targets(batch, rl(advantage="drgrpo", group_size=2))
    np.testing.assert_allclose(plain["advantages"], [0.5, -0.5, 0.0, 0.0])


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(gamma=0.9), r"rl.gamma=0.9 cannot take effect"),
        (dict(value_clip=0.1), r"rl.value_clip=0.1 cannot take effect"),
        (dict(kl_in_reward=True), r"rl.kl_in_reward=True cannot take effect"),
        (dict(reward_model_weight=2.0), r"rl.reward_model_weight=2.0 cannot take effect"),
        (dict(verifier_weight=0.0), r"rl.verifier_weight=0"),
        (dict(reward_model="runs/rm", filter_groups=True), r"rl.filter_groups with rl.reward_model"),
        (dict(advantage="gae", critic="separate"), r"rl.critic='separate'"),
        (dict(advantage="gae", lam=1.5), r"rl.lam=1.5"),
        (dict(advantage="ppo"), r"rl.advantage='ppo'"),
    ],
)
def test_rl_checks_refuse_critic_and_reward_settings_that_cannot_take_effect(kw, match):
    from posttrain.rl.checks import check_rlvr_stage

    with pytest.raises(ValueError, match=match):
        check_rlvr_stage(run_cfg({f"rl.{k}": v for k, v in kw.items()}, stage="rlvr"))


def test_gae_allows_single_sample_groups():
    from posttrain.rl.checks import check_rlvr_stage

    check_rlvr_stage(run_cfg({"rl.advantage": "gae", "rl.group_size": 1}, stage="rlvr"))


def test_pipeline_resolves_the_reward_model_stage_and_keeps_the_policy_chain(tmp_path, monkeypatch):
    from configs.rlhf_tiny import get_config
    from posttrain.core.harness import Result
    from posttrain.stages import pipeline

    seen = {}

    def fake(name):
        def run(cfg):
            seen[name] = (cfg.init_from, cfg.rl.reward_model)
            return Result(None, None, [], {})

        return run

    monkeypatch.setattr(pipeline, "run_stage", lambda name, cfg, baseline=None: fake(name)(cfg))
    monkeypatch.setattr(pipeline, "plot", lambda *a: "")
    cfg = get_config()
    cfg.workdir, cfg.init_from = str(tmp_path), "base"
    cfg.sft.gate = cfg.reward_model.gate = ""
    cfg = typed(cfg)
    pipeline.run(cfg)
    assert seen["reward_model"][0] == str(tmp_path / "0_sft")
    assert seen["rlvr"] == (str(tmp_path / "0_sft"), str(tmp_path / "1_reward_model"))  # policy from SFT
    cfg = cfg.replace({"pipeline.stages": ("sft", "rlvr")})
    with pytest.raises(ValueError, match=r"rl.reward_model='@reward_model': no stage 'reward_model'"):
        pipeline.run(cfg)


def test_rl_loss_with_gae_adds_the_weighted_value_loss_and_trains_the_head():
    """value_coef weighs the critic's loss in the learner's loss; value_clip changes its gradient."""
    from flax import nnx

    from posttrain.rl.algo.critic import ValueDecoder
    from posttrain.rl.algo.learner import rl_loss
    from posttrain.sampling.rules import SamplingParams

    m = model(num_layers=1, embed_dim=32, mlp_dim=64)
    graphdef, params, rest = nnx.split(ValueDecoder(m, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(6)
    tokens = rng.integers(3, 256, size=(4, 8))
    mask = np.zeros((4, 8), np.int32)
    mask[:, 3:] = 1
    batch = {
        "inputs": tokens,
        "targets": np.roll(tokens, -1, axis=1),
        "loss_mask": mask,
        "positions": np.broadcast_to(np.arange(8), (4, 8)),
        "segment_ids": np.ones((4, 8), np.int32),
        "behav_logp": np.zeros((4, 8), np.float32),
        "advantages": rng.normal(size=(4, 8)).astype(np.float32),
        "returns": rng.normal(size=(4, 8)).astype(np.float32),
        "old_values": rng.normal(scale=2.0, size=(4, 8)).astype(np.float32),
    }
    batch = jax.tree.map(jnp.asarray, batch)
    sampling = SamplingParams(temperature=1.0)

    def loss_and_head_grad(p, **kw):
        r = rl(**{"advantage": "gae", "is_cap": 1e6, **kw})
        f = lambda p: rl_loss(
            nnx.merge(graphdef, p, rest), batch, graphdef=graphdef, rl_cfg=r, moe_cfg=m.moe, sampling=sampling
        )
        (loss, metrics), grads = jax.value_and_grad(f, has_aux=True)(p)
        return loss, metrics, grads["value_head"][...]

    variants = {
        "off": dict(value_coef=0.0),
        "on": dict(value_coef=0.5),
        "unclipped": dict(value_coef=0.5, value_clip=0.0),
    }
    out = jax.device_get(jax.jit(lambda p: {k: loss_and_head_grad(p, **kw) for k, kw in variants.items()})(params))
    (loss0, _, head0), (loss1, metrics1, head1), (_, _, head_unclipped) = out["off"], out["on"], out["unclipped"]
    assert np.abs(head0).max() == 0 and np.abs(head1).max() > 0
    np.testing.assert_allclose(loss1 - loss0, 0.5 * float(metrics1["rl/value_loss"]), rtol=1e-4)
    assert float(metrics1["rl/value_clip_frac"]) > 0
    assert np.abs(head_unclipped - head1).max() > 1e-6
