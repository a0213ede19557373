"""Off-policy corrections (truncated IS per token / sequence, masked IS per token / sequence /
geometric mean) and the CISPO loss: loss, gradient and gap metrics against a float64 numpy
reference written from the definitions, on random ragged inputs with a padding row."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import IS_LEVELS, IS_MASKS
from posttrain.config.registry import POLICY_LOSSES
from posttrain.rl.algo.losses import cispo_surrogate, policy_loss
from posttrain.rl.algo.offpolicy import offpolicy_correction, truncated_is_weights
from tests.support.typed_configs import rl

B, T = 6, 7
LENGTHS = [7, 3, 5, 1, 0, 6]  # ragged responses and a padding row
MASK = np.arange(T)[None, :] < np.array(LENGTHS)[:, None]
LO, HI, CAP, BETA, ALPHA = 0.2, 0.28, 1.5, 0.05, 0.01
BOUNDS = {"token": (0.5, 2.0), "sequence": (0.45, 2.0), "geometric": (0.8, 1.25)}


def inputs(seed=0):
    rng = np.random.default_rng(seed)
    old = rng.normal(-1.5, 0.5, (B, T))
    logp = old + rng.normal(0, 0.3, (B, T))  # the policy moved from the proximal one
    behav = old + rng.normal(0, 0.5, (B, T))  # the sampler's gap: some ratios past every bound
    adv = rng.normal(0, 1, B)
    ref, ent = old + rng.normal(0, 0.2, (B, T)), rng.uniform(0.5, 2.0, (B, T))
    return logp, old, behav, adv, ref, ent


def reference(logp, old, behav, adv, ref, ent, *, level, mask_mode, loss_type, aggregation):
    """(loss, d loss / d logp with the KL off, metrics) in float64, from the definitions."""
    lr = np.where(MASK, old - behav, 0.0)  # log π_prox / π_behav
    seq = lr.sum(1, keepdims=True)
    lengths = np.maximum(MASK.sum(1, keepdims=True), 1)
    if level == "token":
        w, trunc = np.minimum(np.exp(lr), CAP), np.exp(lr) > CAP
    else:
        w, trunc = np.broadcast_to(np.minimum(np.exp(seq), CAP), lr.shape), np.broadcast_to(np.exp(seq) > CAP, lr.shape)
    keep = MASK.copy()
    if mask_mode != "off":
        lo, hi = BOUNDS[mask_mode]
        x = {"token": np.exp(lr), "sequence": np.exp(seq), "geometric": np.exp(seq / lengths)}[mask_mode]
        keep &= np.broadcast_to((x >= lo) & (x <= hi), lr.shape)
    r, a = np.exp(logp - old), np.broadcast_to(adv[:, None], lr.shape)
    c = np.clip(r, 1 - LO, 1 + HI)
    if loss_type == "ppo":
        per_token = -np.minimum(r * a, c * a)
        dper = -np.where(r * a <= c * a, r * a, 0.0)  # the unclipped branch carries the gradient
    else:
        per_token, dper = -c * a * logp, -c * a
    rows = keep.any(1)
    if aggregation == "token-mean":
        coef = keep / keep.sum()
    else:
        coef = keep / np.maximum(keep.sum(1, keepdims=True), 1) / rows.sum()
    kl = np.exp(ref - logp) - 1 - (ref - logp)
    loss = (coef * (w * per_token + BETA * r * w * kl - ALPHA * ent)).sum()
    metrics = {
        "rl/behav_gap_abs": np.abs(lr)[MASK].mean(),
        "rl/behav_gap_max": np.abs(lr)[MASK].max(),
        "rl/behav_kl": (np.exp(lr) - 1 - lr)[MASK].mean(),
        "rl/is_weight_mean": w[keep].mean(),
        "rl/is_weight_min": w[keep].min(),
        "rl/is_weight_max": w[keep].max(),
        "rl/is_truncated_frac": trunc[keep].mean(),
        "rl/kl": kl[keep].mean(),
        "rl/entropy": ent[keep].mean(),
    }
    if mask_mode != "off":
        metrics["rl/is_masked_frac"] = 1 - keep.sum() / MASK.sum()
    return loss, coef * w * dper, metrics


def run(logp, old, behav, adv, ref, ent, *, kl=True, **kw):
    """policy_loss in float32 on the same inputs (kl: with the k3 KL and entropy terms)."""
    level, mask_mode = kw["level"], kw["mask_mode"]
    lo, hi = BOUNDS.get(mask_mode, (0.5, 2.0))
    f32 = lambda x: jnp.asarray(x, jnp.float32)

    def loss(lp):
        return policy_loss(
            lp,
            f32(old),
            f32(adv),
            jnp.asarray(MASK),
            rl(
                clip_low=LO,
                clip_high=HI,
                aggregation=kw["aggregation"],
                kl_coef=BETA if kl else 0.0,
                is_cap=CAP,
                is_level=level,
                is_mask=mask_mode,
                is_mask_low=lo,
                is_mask_high=hi,
                loss_type=kw["loss_type"],
                entropy_coef=ALPHA if kl else 0.0,
            ),
            ref_logp=f32(ref),
            behav_logp=f32(behav),
            entropy=f32(ent),
        )

    (value, metrics), grad = jax.value_and_grad(loss, has_aux=True)(f32(logp))
    return value, grad, metrics


CASES = [
    (level, mask, loss, agg)
    for (level, mask), loss, agg in itertools.product(
        itertools.product(IS_LEVELS, IS_MASKS), POLICY_LOSSES.names(), ("token-mean", "seq-mean-token-mean")
    )
    if (loss, agg) != ("cispo", "seq-mean-token-mean") or mask == "off"  # one aggregation suffices per mask
]


@pytest.mark.parametrize("level, mask_mode, loss_type, aggregation", CASES)
def test_correction_loss_gradient_and_metrics_match_float64(level, mask_mode, loss_type, aggregation):
    x = inputs()
    kw = dict(level=level, mask_mode=mask_mode, loss_type=loss_type, aggregation=aggregation)
    want_loss, want_grad, want_metrics = reference(*x, **kw)
    got_loss, _, metrics = run(*x, **kw)
    np.testing.assert_allclose(float(got_loss), want_loss, rtol=1e-5, atol=1e-6)
    _, got_grad, _ = run(*x, kl=False, **kw)
    np.testing.assert_allclose(np.asarray(got_grad), want_grad, rtol=1e-5, atol=1e-6)
    for key, value in want_metrics.items():
        np.testing.assert_allclose(float(metrics[key]), value, rtol=1e-5, atol=1e-6, err_msg=key)
    assert ("rl/is_masked_frac" in metrics) == (mask_mode != "off")


def test_the_inputs_exercise_every_bound():
    """The random inputs truncate and mask something at every level, and keep something."""
    logp, old, behav, *_ = inputs()
    lr = np.where(MASK, old - behav, 0.0)
    seq, lengths = lr.sum(1), np.maximum(MASK.sum(1), 1)
    assert (np.exp(lr)[MASK] > CAP).any() and (np.exp(seq[MASK.any(1)]) > CAP).any()
    for mode, x in {"token": np.exp(lr)[MASK], "sequence": np.exp(seq), "geometric": np.exp(seq / lengths)}.items():
        lo, hi = BOUNDS[mode]
        x = x if mode == "token" else x[MASK.any(1)]
        assert ((x < lo) | (x > hi)).any() and ((x >= lo) & (x <= hi)).any(), mode


def test_every_choice_changes_the_gradient():
    x = inputs()
    base = dict(level="token", mask_mode="off", loss_type="ppo", aggregation="token-mean")
    g0 = np.asarray(run(*x, kl=False, **base)[1])
    for key, values in (("level", IS_LEVELS), ("mask_mode", IS_MASKS), ("loss_type", POLICY_LOSSES.names())):
        for value in values[1:]:
            g = np.asarray(run(*x, kl=False, **{**base, key: value})[1])
            assert np.abs(g - g0).max() > 1e-4, (key, value)


def test_on_policy_every_correction_is_the_identity():
    """behaviour = proximal: weight 1 everywhere, nothing truncated or masked, whatever the switches."""
    rng = np.random.default_rng(1)
    old = jnp.asarray(rng.normal(-1.5, 0.5, (B, T)), jnp.float32)
    for level, mode in itertools.product(IS_LEVELS, IS_MASKS):
        w, keep, m = offpolicy_correction(
            old, old, jnp.asarray(MASK), cap=1.01, level=level, mask_mode=mode, low=0.99, high=1.01
        )
        assert (np.asarray(w) == 1).all() and (np.asarray(keep) == MASK).all()
        assert float(m["rl/behav_kl"]) == float(m["rl/behav_gap_max"]) == float(m["rl/is_truncated_frac"]) == 0


def test_sequence_weights_stay_finite_past_float32_range():
    """A long sequence's product of ratios overflows float32; its truncated weight is computed in logs."""
    mask = jnp.ones((1, 400), bool)
    w, keep, _ = offpolicy_correction(jnp.zeros((1, 400)), jnp.full((1, 400), -1.0), mask, cap=3.0, level="sequence")
    np.testing.assert_allclose(np.asarray(w), 3.0)
    assert np.asarray(keep).all()


def test_weights_and_masks_carry_no_gradient():
    x = [jnp.asarray(v, jnp.float32) for v in inputs()[:3]]

    def total(prox, behav):
        w, _, _ = offpolicy_correction(
            prox, behav, jnp.asarray(MASK), cap=CAP, level="sequence", mask_mode="geometric", low=0.8, high=1.25
        )
        return w.sum()

    grads = jax.grad(total, argnums=(0, 1))(x[1], x[2])
    assert all(float(jnp.abs(g).sum()) == 0 for g in grads)
    grad = jax.grad(lambda p, b: truncated_is_weights(p, b, 2.0).sum(), argnums=(0, 1))(x[1], x[2])
    assert all(float(jnp.abs(g).sum()) == 0 for g in grad)
    # CISPO: the clipped weight has no gradient, log π does
    lp, r, a = jnp.asarray([[-1.0, -2.0]]), jnp.asarray([[2.0, 0.5]]), jnp.asarray([[1.0, -1.0]])
    g = jax.grad(lambda lp, r: cispo_surrogate(lp, r, a, clip_low=0.2, clip_high=0.3).sum(), argnums=(0, 1))(lp, r)
    np.testing.assert_allclose(np.asarray(g[0]), [[-1.3, 0.8]], rtol=1e-6)
    assert float(jnp.abs(g[1]).sum()) == 0


def test_bad_values_are_refused_naming_the_key():
    x = jnp.zeros((1, 2))
    mask = jnp.ones((1, 2), bool)
    with pytest.raises(ValueError, match="is_level='seq'"):
        offpolicy_correction(x, x, mask, cap=2.0, level="seq")
    with pytest.raises(ValueError, match="is_mask='both'"):
        offpolicy_correction(x, x, mask, cap=2.0, mask_mode="both")
    with pytest.raises(ValueError, match="is_mask_low=1.0"):
        offpolicy_correction(x, x, mask, cap=2.0, mask_mode="token", low=1.0, high=2.0)
    with pytest.raises(ValueError, match="loss_type='grpo'"):
        policy_loss(x, x, jnp.ones(1), mask, rl(clip_low=0.2, clip_high=0.2, loss_type="grpo"))
    with pytest.raises(ValueError, match="is_mask='token' needs behav_logp"):
        policy_loss(x, x, jnp.ones(1), mask, rl(clip_low=0.2, clip_high=0.2, is_mask="token"))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("is_mask_low", 1.0, r"config\.rl\.is_mask_low=1\.0: expected >= 0 and < 1"),
        ("is_mask_high", 1.0, r"config\.rl\.is_mask_high=1\.0: expected > 1"),
        ("is_mask", "both", r"config\.rl\.is_mask='both': expected one of 'off', 'token'"),
        ("loss_type", "grpo", r"config\.rl\.loss_type='grpo': no such policy loss; registered: cispo, ppo"),
    ],
)
def test_config_values_out_of_range_name_the_key(key, value, match):
    from posttrain.config import run_config
    from posttrain.errors import UserError
    from posttrain.rl.checks import check_rlvr_stage
    from tests.support.typed_configs import run_cfg

    with pytest.raises(UserError, match=match):
        check_rlvr_stage(run_config(run_cfg({f"rl.{key}": value}, stage="rlvr")))


def test_a_min_or_max_over_no_tokens_is_the_reductions_identity_and_never_logged_as_infinite():
    """A minibatch whose every token rl.is_mask dropped has min +inf / max −inf: other minibatches'
    values win, and when none has tokens the key is left out (no false non-finite alert)."""
    from posttrain.rl.algo.learner import combine_metrics

    x, mask = jnp.ones((1, 2)), jnp.ones((1, 2), bool)
    _, m_empty = policy_loss(
        x,
        x,
        jnp.ones(1),
        mask,
        rl(clip_low=0.2, clip_high=0.2, is_cap=2.0, is_mask="token", is_mask_high=2.0),
        behav_logp=x - 5,
    )
    _, m_full = policy_loss(
        x,
        x,
        jnp.ones(1),
        mask,
        rl(clip_low=0.2, clip_high=0.2, is_cap=2.0, is_mask="token", is_mask_high=2.0),
        behav_logp=x,
    )
    assert float(m_empty["rl/is_masked_frac"]) == 1 and float(m_empty["rl/ratio_min"]) == np.inf
    row = combine_metrics([m_empty, m_full])
    assert row["rl/ratio_min"] == row["rl/is_weight_max"] == 1 and row["rl/is_masked_frac"] == 0.5
    row = combine_metrics([m_empty, m_empty])
    assert "rl/ratio_min" not in row and "rl/is_weight_max" not in row and row["rl/loss"] == 0
    assert all(np.isfinite(v) for v in row.values())
