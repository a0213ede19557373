"""RL advantages and policy loss against hand-computed (numpy) references on fixed inputs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.models.logprobs import token_logprobs
from posttrain.rl.algo.advantages import group_advantages, kl_penalized_advantages, kl_penalized_rewards
from posttrain.rl.algo.losses import (
    AGGREGATIONS,
    aggregate,
    clipped_surrogate,
    entropy_from_logits,
    importance_ratio,
    kl_estimate,
    policy_loss,
)
from posttrain.rl.algo.offpolicy import truncated_is_weights
from tests.support.typed_configs import rl

REWARDS = np.array([1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5, 0.2, 0.9, 0.4, 0.0], np.float32)  # 3 groups of 4
MASK = np.array(
    [
        [1, 1, 1, 0, 0],  # ragged response lengths 3, 5, 1, and a padding row
        [1, 1, 1, 1, 1],
        [0, 1, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ],
    bool,
)


def _close(actual, expected, atol=1e-5):
    np.testing.assert_allclose(np.asarray(actual), expected, atol=atol, rtol=1e-5)


def test_group_advantages_grpo_drgrpo_rloo():
    r = REWARDS.astype(np.float64).reshape(3, 4)
    centred = r - r.mean(1, keepdims=True)
    _close(group_advantages(jnp.asarray(REWARDS), 4, method="drgrpo"), centred.reshape(-1))
    _close(
        group_advantages(jnp.asarray(REWARDS), 4, method="grpo", eps=1e-6),
        (centred / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1),
    )
    loo = np.array([[g[i] - np.delete(g, i).mean() for i in range(4)] for g in r])  # RLOO by its definition
    _close(group_advantages(jnp.asarray(REWARDS), 4, method="rloo"), loo.reshape(-1))


@pytest.mark.parametrize("method", ["grpo", "drgrpo", "rloo"])
def test_all_equal_group_gets_exactly_zero(method):
    rewards = jnp.asarray([0.1, 0.1, 0.1, 0.7, 0.7, 0.7, 0.0, 1.0, 0.0], jnp.float32)
    adv = np.asarray(group_advantages(rewards, 3, method=method))
    assert (adv[:6] == 0).all() and np.abs(adv[6:]).min() > 0


def test_group_advantages_rejects_bad_input():
    with pytest.raises(ValueError, match="advantage='ppo': no such advantage estimator"):
        group_advantages(jnp.zeros(4), 2, method="ppo")
    with pytest.raises(ValueError, match="method='gae': expected one of"):  # a critic's estimator has no group form
        group_advantages(jnp.zeros(4), 2, method="gae")
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(jnp.zeros(5), 2)


def test_kl_estimators():
    logp = np.array([[-1.0, -2.0, -0.5]], np.float32)
    ref = np.array([[-1.5, -1.0, -0.5]], np.float32)
    log_r = ref.astype(np.float64) - logp
    expected = {"k1": -log_r, "k2": 0.5 * log_r**2, "k3": np.exp(log_r) - 1 - log_r}
    for name, value in expected.items():
        _close(kl_estimate(jnp.asarray(logp), jnp.asarray(ref), name), value)
    assert (np.asarray(kl_estimate(jnp.asarray(logp), jnp.asarray(ref), "k3")) >= 0).all()
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_estimate(jnp.asarray(logp), jnp.asarray(ref), "k4")


def test_kl_reward_penalties():
    kl = np.arange(20, dtype=np.float32).reshape(4, 5) / 10
    rewards, adv, beta = np.array([1.0, 0.0, 0.5, 2.0]), np.array([0.3, -0.3, 1.0, 0.0]), 0.1
    _close(
        kl_penalized_rewards(jnp.asarray(rewards), jnp.asarray(kl), jnp.asarray(MASK), kl_coef=beta),
        rewards - beta * (kl * MASK).sum(1),
    )
    expected = np.zeros((4, 5))
    for i in range(4):
        for t in range(5):
            if MASK[i, t]:
                expected[i, t] = adv[i] - beta * sum(kl[i, s] for s in range(t, 5) if MASK[i, s])
    _close(kl_penalized_advantages(jnp.asarray(adv), jnp.asarray(kl), jnp.asarray(MASK), kl_coef=beta), expected)


def test_entropy_from_logits():
    logits = np.random.default_rng(0).normal(size=(2, 3, 7))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    _close(entropy_from_logits(jnp.asarray(logits, jnp.float32)), -(p * np.log(p)).sum(-1))


def test_aggregation_modes_on_ragged_masks():
    v = np.arange(20, dtype=np.float64).reshape(4, 5)
    m = MASK
    rows = [i for i in range(4) if m[i].any()]  # the padding row is not a sequence
    expected = {
        "token-mean": v[m].mean(),
        "seq-mean-token-mean": np.mean([v[i][m[i]].mean() for i in rows]),
        "seq-mean-token-sum": np.mean([v[i][m[i]].sum() for i in rows]),
    }
    for mode in AGGREGATIONS:
        _close(aggregate(jnp.asarray(v, jnp.float32), jnp.asarray(m), mode), expected[mode])
    _close(
        aggregate(jnp.asarray(v, jnp.float32), jnp.asarray(m), "seq-mean-token-sum", max_len_norm=5.0),
        expected["seq-mean-token-sum"] / 5,
    )
    with pytest.raises(ValueError, match="max_len_norm"):
        aggregate(jnp.asarray(v), jnp.asarray(m), "token-mean", max_len_norm=5.0)


def test_clipped_surrogate_and_clip_fractions():
    # ratios and advantages chosen so that one token is clipped low and two high
    ratio = np.array([[0.7, 0.7, 1.0, 1.3, 1.5], [1.5, 0.9, 1.1, 1.3, 1.0]], np.float32)
    adv = np.array([[-1.0, 1.0, 2.0, 1.0, -1.0], [1.0, -1.0, 1.0, -2.0, 0.0]], np.float32)
    lo, hi = 0.2, 0.28
    expected = -np.minimum(ratio * adv, np.clip(ratio, 1 - lo, 1 + hi) * adv)
    _close(clipped_surrogate(jnp.asarray(ratio), jnp.asarray(adv), clip_low=lo, clip_high=hi), expected)
    # clipped low: (0.7, A<0); clipped high: (1.3, A>0) and (1.5, A>0). Not clipped: (0.7, A>0), (1.5, A<0), ...
    mask = np.ones_like(ratio, bool)
    logp = np.log(ratio)
    _, m = policy_loss(
        jnp.asarray(logp), jnp.zeros_like(logp), jnp.asarray(adv), jnp.asarray(mask), rl(clip_low=lo, clip_high=hi)
    )
    assert float(m["rl/clip_frac_low"]) == pytest.approx(1 / 10)
    assert float(m["rl/clip_frac_high"]) == pytest.approx(2 / 10)
    _close(m["rl/ratio_min"], 0.7)
    _close(m["rl/ratio_max"], 1.5)
    _close(m["rl/pg_loss"], expected.mean())


def test_gspo_sequence_ratio():
    rng = np.random.default_rng(1)
    logp, old = rng.normal(size=(2, 4, 5)).astype(np.float32) * 0.1 - 1
    mask = MASK
    ratio = importance_ratio(jnp.asarray(logp), jnp.asarray(old), jnp.asarray(mask), "sequence")
    for i in range(4):
        s = np.exp((logp[i] - old[i])[mask[i]].mean()) if mask[i].any() else 1.0
        _close(np.asarray(ratio)[i][mask[i]], np.full(mask[i].sum(), s))
    _close(np.asarray(ratio)[~mask], 1.0)
    # gradient of a sequence's ratio is s_i · ∇logp_t per token (GSPO-token form)
    grad = jax.grad(lambda lp: importance_ratio(lp, jnp.asarray(old), jnp.asarray(mask), "sequence")[1, 2])(
        jnp.asarray(logp)
    )
    expected = np.zeros_like(logp)
    expected[1, 2] = np.exp((logp[1] - old[1]).mean())
    _close(grad, expected)


@pytest.mark.parametrize("ratio_level", ["token", "sequence"])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
def test_on_policy_gradient_is_policy_gradient(aggregation, ratio_level):
    rng = np.random.default_rng(2)
    logits = jnp.asarray(rng.normal(size=(4, 5, 6)), jnp.float32)
    targets = jnp.asarray(rng.integers(0, 6, (4, 5)))
    adv = np.array([1.5, -0.5, 2.0, 0.7], np.float32)
    old = token_logprobs(logits, targets)

    def loss(lg):
        out, _ = policy_loss(
            token_logprobs(lg, targets),
            old,
            jnp.asarray(adv),
            jnp.asarray(MASK),
            rl(clip_low=0.2, clip_high=0.28, ratio_level=ratio_level, aggregation=aggregation, loss_norm_tokens=1),
        )
        return out

    # −Σ_t c_t A ∇logp_t with ∇_logits logp_t = onehot(target) − softmax, c_t the aggregation's token weight
    lg = np.asarray(logits, np.float64)
    p = np.exp(lg) / np.exp(lg).sum(-1, keepdims=True)
    dlogp = np.eye(6)[np.asarray(targets)] - p
    lengths, seqs = MASK.sum(1), MASK.any(1).sum()
    weight = {
        "token-mean": MASK / MASK.sum(),
        "seq-mean-token-mean": MASK / np.maximum(lengths, 1)[:, None] / seqs,
        "seq-mean-token-sum": MASK / seqs,
    }[aggregation]
    expected = -(weight * adv[:, None])[..., None] * dlogp
    _close(jax.grad(loss)(logits), expected)
    _, metrics = policy_loss(
        old,
        old,
        jnp.asarray(adv),
        jnp.asarray(MASK),
        rl(clip_low=0.2, clip_high=0.28, ratio_level=ratio_level, aggregation=aggregation, loss_norm_tokens=1),
    )
    assert float(metrics["rl/ratio_min"]) == float(metrics["rl/ratio_max"]) == 1.0


def test_truncated_is_weights_formula_and_no_gradient():
    prox = jnp.asarray([[-1.0, -0.5, -2.0]])
    behav = jnp.asarray([[-1.2, -2.0, -1.0]])
    _close(truncated_is_weights(prox, behav, 2.0), np.minimum(np.exp([[0.2, 1.5, -1.0]]), 2.0))
    grad = jax.grad(lambda p, b: truncated_is_weights(p, b, 2.0).sum(), argnums=(0, 1))(prox, behav)
    assert all(float(jnp.abs(g).sum()) == 0 for g in grad)


def test_policy_loss_with_is_weights_kl_and_entropy():
    rng = np.random.default_rng(3)
    logp, old, behav, ref, ent = (rng.normal(size=(4, 5)).astype(np.float32) * 0.3 - 1 for _ in range(5))
    adv = np.array([1.0, -1.0, 0.5, 2.0], np.float32)
    lo, hi, cap, beta, alpha = 0.2, 0.3, 1.5, 0.05, 0.01
    loss, m = policy_loss(
        *map(jnp.asarray, (logp, old, adv, MASK)),
        rl(
            clip_low=lo,
            clip_high=hi,
            aggregation="seq-mean-token-mean",
            kl_coef=beta,
            kl_estimator="k3",
            is_cap=cap,
            entropy_coef=alpha,
        ),
        ref_logp=jnp.asarray(ref),
        behav_logp=jnp.asarray(behav),
        entropy=jnp.asarray(ent),
    )
    r = np.exp(logp.astype(np.float64) - old)
    w_raw = np.exp(old.astype(np.float64) - behav)
    w = np.minimum(w_raw, cap)
    pg = w * -np.minimum(r * adv[:, None], np.clip(r, 1 - lo, 1 + hi) * adv[:, None])
    kl = np.exp(ref.astype(np.float64) - logp) - 1 - (ref - logp)

    def seq_mean(x):
        return np.mean([x[i][MASK[i]].mean() for i in range(4) if MASK[i].any()])

    # the KL loss term is importance weighted (ρ = π/π_old × w; its value ρ·k3, `kl_loss_terms`)
    _close(loss, seq_mean(pg) + beta * seq_mean(r * w * kl) - alpha * seq_mean(ent))
    _close(m["rl/kl"], kl[MASK].mean())
    _close(m["rl/entropy"], ent[MASK].mean())
    _close(m["rl/is_weight_mean"], w[MASK].mean())
    _close(m["rl/is_weight_max"], w[MASK].max())
    _close(m["rl/is_truncated_frac"], (w_raw[MASK] > cap).mean())
    _close(m["rl/behav_gap_abs"], np.abs(old.astype(np.float64) - behav)[MASK].mean())


def test_policy_loss_needs_reference_only_with_kl():
    x = jnp.zeros((1, 2))
    mask = jnp.ones((1, 2), bool)
    loss, m = policy_loss(x, x, jnp.ones(1), mask, rl(clip_low=0.2, clip_high=0.2, kl_coef=0.0))
    assert "rl/kl" not in m and float(loss) == -1.0
    with pytest.raises(ValueError, match="ref_logp"):
        policy_loss(x, x, jnp.ones(1), mask, rl(clip_low=0.2, clip_high=0.2, kl_coef=0.1))
    _, paid = policy_loss(x, x, jnp.ones(1), mask, rl(kl_coef=0.1, kl_in_reward=True))  # paid as reward already
    assert "rl/kl" not in paid
