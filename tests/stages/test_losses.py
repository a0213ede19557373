"""Stage losses against hand-computed references on fixed inputs."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.stages.losses import bradley_terry_loss, dpo_loss, sequence_logprobs, token_logprobs


def test_token_logprobs_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(2, 3, 5))
    targets = rng.integers(0, 5, (2, 3))
    p = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    expected = np.log(np.take_along_axis(p, targets[..., None], -1)[..., 0])
    np.testing.assert_allclose(
        token_logprobs(jnp.asarray(logits, jnp.float32), jnp.asarray(targets)), expected, atol=1e-5
    )
    mask = np.array([[1, 0, 1], [0, 0, 1]])
    np.testing.assert_allclose(
        sequence_logprobs(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), jnp.asarray(mask)),
        (expected * mask).sum(-1),
        atol=1e-5,
    )


def test_dpo_sigmoid_matches_hand_computation():
    pc, pr, rc, rr = map(jnp.asarray, ([-3.0, -5.0], [-4.0, -4.0], [-3.5, -5.0], [-3.5, -4.5]))
    beta = 0.1
    loss, m = dpo_loss(pc, pr, rc, rr, beta=beta)
    h = np.array([(-3.0 + 3.5) - (-4.0 + 3.5), (-5.0 + 5.0) - (-4.0 + 4.5)])  # [1.0, -0.5]
    expected = np.mean([math.log1p(math.exp(-beta * x)) for x in h])
    assert float(loss) == pytest.approx(expected, rel=1e-6)
    assert float(m["dpo/reward_accuracy"]) == 0.5
    ranked = dpo_loss(pc, jnp.asarray([-4.0, -6.0]), rc, jnp.asarray([-5.0, -7.0]), beta=beta)[1]
    assert (float(ranked["dpo/policy_accuracy"]), float(ranked["dpo/reward_accuracy"])) == (1.0, 0.0)
    assert float(m["dpo/margin"]) == pytest.approx(beta * h.mean(), rel=1e-6)
    assert float(m["dpo/chosen_reward"]) == pytest.approx(beta * np.mean([0.5, 0.0]), rel=1e-6)


def test_dpo_at_start_is_log2_with_zero_margin():
    lp = jnp.asarray([-7.0, -2.0, -9.5])
    loss, m = dpo_loss(lp, lp - 1, lp, lp - 1, beta=0.5)
    assert float(loss) == pytest.approx(math.log(2), rel=1e-6)
    assert float(m["dpo/margin"]) == 0.0


def test_dpo_label_smoothing_and_ipo():
    pc, pr, rc, rr = map(jnp.asarray, ([-1.0], [-2.0], [-1.5], [-1.5]))  # h = 0.5 - (-0.5) = 1.0
    beta, eps = 0.2, 0.1
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, label_smoothing=eps)
    ls = lambda x: -math.log1p(math.exp(-x))
    assert float(loss) == pytest.approx(-(1 - eps) * ls(0.2) - eps * ls(-0.2), rel=1e-6)
    loss, _ = dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="ipo")
    assert float(loss) == pytest.approx((1.0 - 1 / (2 * beta)) ** 2, rel=1e-6)
    with pytest.raises(ValueError, match="loss_type"):
        dpo_loss(pc, pr, rc, rr, beta=beta, loss_type="hinge2")


def test_bradley_terry():
    loss, m = bradley_terry_loss(jnp.asarray([2.0, 0.0]), jnp.asarray([1.0, 1.0]))
    assert float(loss) == pytest.approx((math.log1p(math.exp(-1.0)) + math.log1p(math.exp(1.0))) / 2, rel=1e-6)
    assert float(m["rm/accuracy"]) == 0.5 and float(m["rm/margin"]) == 0.0
    g = jax.grad(lambda c: bradley_terry_loss(c, jnp.zeros(1))[0])(jnp.zeros(1))
    assert float(g[0]) == pytest.approx(-0.5)
