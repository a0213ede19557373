"""KL to the reference done right: on a toy autoregressive policy of two tokens (exact KL by
enumeration), the mean gradient of every accepted estimator × placement over many samples is
∇KL(π ‖ π_ref); the refused ones are measurably biased. Entropy is that of the distribution the
sampler draws from (after top-k / top-p)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from posttrain.config import base_config
from posttrain.rl.algo.advantages import kl_penalized_advantages
from posttrain.rl.algo.losses import entropy_from_logprobs, kl_estimate, kl_loss_terms, policy_loss
from posttrain.sampling.rules import SamplingParams, support_logprobs
from tests.support.sampling import reference_distribution
from tests.support.typed_configs import checked, rl

V, N = 3, 40_000  # vocabulary, samples
_rng = np.random.default_rng(0)
THETA = {"a": jnp.asarray(_rng.normal(size=V), jnp.float32), "b": jnp.asarray(_rng.normal(size=(V, V)), jnp.float32)}
REF = {"a": jnp.asarray(_rng.normal(size=V), jnp.float32), "b": jnp.asarray(_rng.normal(size=(V, V)), jnp.float32)}
MASK = jnp.ones((1, 2), bool)


def logps(theta, y):
    """log π(y1), log π(y2 | y1) of sequences y [N, 2] → [N, 2]."""
    la, lb = jax.nn.log_softmax(theta["a"]), jax.nn.log_softmax(theta["b"], axis=-1)
    return jnp.stack([la[y[:, 0]], lb[y[:, 0], y[:, 1]]], axis=1)


def exact_kl(theta):
    """KL(π ‖ π_ref) over the V² sequences."""
    la, lb = jax.nn.log_softmax(theta["a"]), jax.nn.log_softmax(theta["b"], axis=-1)
    ra, rb = jax.nn.log_softmax(REF["a"]), jax.nn.log_softmax(REF["b"], axis=-1)
    second = (jnp.exp(lb) * (lb - rb)).sum(-1)  # KL of step 2 given y1
    return (jnp.exp(la) * (la - ra + second)).sum()


def samples():
    p1 = np.exp(np.asarray(jax.nn.log_softmax(THETA["a"]), np.float64))
    p2 = np.exp(np.asarray(jax.nn.log_softmax(THETA["b"], axis=-1), np.float64))
    rng = np.random.default_rng(1)
    y1 = rng.choice(V, N, p=p1 / p1.sum())
    y2 = np.array([rng.choice(V, p=p2[a] / p2[a].sum()) for a in y1])
    return jnp.asarray(np.stack([y1, y2], 1))


AGG_SCALE = {"seq-mean-token-sum": 1.0, "token-mean": 0.5, "seq-mean-token-mean": 0.5}  # 2 tokens per sequence


def loss_fn(placement, estimator, aggregation):
    norm = 1 if aggregation == "seq-mean-token-sum" else 0

    def loss(theta, y):
        lp, ref = logps(theta, y[None]), logps(REF, y[None])
        common = dict(clip_low=0.2, clip_high=0.2, aggregation=aggregation, loss_norm_tokens=norm)
        if placement == "loss":
            out, _ = policy_loss(
                lp,
                jax.lax.stop_gradient(lp),
                jnp.zeros(1),
                MASK,
                rl(kl_coef=1.0, kl_estimator=estimator, **common),
                ref_logp=ref,
            )
        elif placement == "reward":  # rl.kl_in_reward: −β·kl_t per token, as the reward-to-go
            kl = kl_estimate(jax.lax.stop_gradient(lp), ref, estimator)
            adv = kl_penalized_advantages(jnp.zeros(1), kl, MASK, kl_coef=1.0)
            out, _ = policy_loss(lp, jax.lax.stop_gradient(lp), adv, MASK, rl(**common))
        else:  # "per-token": the plain per-token loss term, without the later tokens' terms
            out = kl_estimate(lp, ref, estimator).sum() / 2 / AGG_SCALE[aggregation]
        return out

    return loss


def z_scores(placement, estimator, aggregation, ys):
    """(mean per-sample gradient / aggregation scale − exact ∇KL) / standard error, flat."""
    g = jax.vmap(jax.grad(loss_fn(placement, estimator, aggregation)), in_axes=(None, 0))(THETA, ys)
    g = np.concatenate([np.asarray(x, np.float64).reshape(N, -1) for x in jax.tree.leaves(g)], 1)
    g = g / AGG_SCALE[aggregation]
    exact = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(jax.grad(exact_kl)(THETA))])
    se = g.std(0) / np.sqrt(N) + 1e-6
    return (g.mean(0) - exact) / se


@pytest.fixture(scope="module")
def ys():
    return samples()


@pytest.mark.parametrize(
    "placement, estimator, aggregation",
    [
        ("loss", "k2", "seq-mean-token-sum"),
        ("loss", "k3", "seq-mean-token-sum"),
        ("loss", "k3", "token-mean"),
        ("loss", "k2", "seq-mean-token-mean"),
        ("reward", "k1", "seq-mean-token-sum"),
        ("reward", "k1", "token-mean"),
    ],
)
def test_accepted_kl_gradients_are_unbiased_for_the_sequence_kl(ys, placement, estimator, aggregation):
    z = z_scores(placement, estimator, aggregation, ys)
    assert np.abs(z).max() < 4.5, z


@pytest.mark.parametrize(
    "placement, estimator",
    [("loss", "k1"), ("reward", "k2"), ("reward", "k3"), ("per-token", "k2"), ("per-token", "k3")],
)
def test_refused_or_replaced_kl_gradients_are_biased(ys, placement, estimator):
    """k1 as a loss term is refused (`kl_loss_terms` raises; its gradient has mean zero); k2 / k3
    paid as reward are refused at start-up; the plain per-token k2 / k3 loss terms (what the loss
    used to be) miss the later tokens' KL (and k3's is that of KL(π_ref ‖ π))."""
    if placement == "loss":
        with pytest.raises(ValueError, match="k1"):
            kl_loss_terms(jnp.zeros((1, 2)), jnp.zeros((1, 2)), jnp.ones((1, 2)), MASK, "k1")
        fn = lambda theta, y: kl_estimate(logps(theta, y[None]), logps(REF, y[None]), "k1").sum()
        g = jax.vmap(jax.grad(fn), in_axes=(None, 0))(THETA, ys)
        g = np.concatenate([np.asarray(x, np.float64).reshape(N, -1) for x in jax.tree.leaves(g)], 1)
        assert np.abs(g.mean(0) / (g.std(0) / np.sqrt(N) + 1e-6)).max() < 4.5  # mean zero: no KL pull
        return
    z = z_scores(placement, estimator, "seq-mean-token-sum", ys)
    assert np.abs(z).max() > 10, z


@pytest.mark.parametrize(
    "rl, match",
    [
        (dict(kl_coef=0.1, kl_estimator="k1"), "rl.kl_estimator='k1' cannot take effect: .*expectation 0"),
        (dict(kl_coef=0.1, kl_in_reward=True), "rl.kl_in_reward=True cannot take effect: .*k1 alone"),
        (dict(kl_coef=0.1, kl_in_reward=True, kl_estimator="k2"), "rl.kl_in_reward=True"),
    ],
)
def test_biased_kl_combinations_are_refused_at_start_up(rl, match):
    cfg = base_config()
    cfg.rl.update(rl)
    with pytest.raises(ValueError, match=match):
        checked(cfg, "rlvr")
    for ok in (
        dict(kl_coef=0.1),
        dict(kl_coef=0.1, kl_estimator="k2"),
        dict(kl_coef=0.1, kl_in_reward=True, kl_estimator="k1"),
    ):
        cfg = base_config()
        cfg.rl.update(ok)
        checked(cfg, "rlvr")


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (2.0, 4, 0.6)])
def test_entropy_is_over_the_sampled_support(temperature, top_k, top_p):
    logits = np.random.default_rng(4).normal(size=(2, 3, 10)) * 2
    targets = logits.argmax(-1)  # a sampled token is in the support
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    got = entropy_from_logprobs(support_logprobs(jnp.asarray(logits, jnp.float32), jnp.asarray(targets), params))
    want = np.zeros((2, 3))
    for i in np.ndindex(2, 3):
        p = reference_distribution(logits[i], temperature, top_k, top_p)
        want[i] = -(p[p > 0] * np.log(p[p > 0])).sum()
    np.testing.assert_allclose(np.asarray(got), want, atol=1e-5)
    if top_k or top_p < 1:  # the full tempered softmax (what it used to be) is larger
        full = jax.nn.log_softmax(jnp.asarray(logits, jnp.float32) / temperature, axis=-1)
        assert (np.asarray(entropy_from_logprobs(full)) > want + 1e-3).all()


def test_the_kl_terms_later_tokens_follow_positions_in_any_token_order():
    """With positions, `kl_loss_terms` (value and gradient) is the same on a permuted row (the
    learner's zig-zag layout), permuted: its "later tokens" are by position, not by index."""
    rng = np.random.default_rng(0)
    logp, ref = (jnp.asarray(rng.normal(size=(2, 8)), jnp.float32) for _ in range(2))
    mask = jnp.asarray([[0, 0, 1, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1]], bool)
    pos = jnp.asarray([[0, 1, 2, 3, 4, 5, 0, 0], list(range(8))], jnp.int32)
    perm = rng.permutation(8)

    def terms(logp, ref, mask, pos):
        fn = lambda lp: kl_loss_terms(lp, ref, jnp.exp(lp - jax.lax.stop_gradient(lp)), mask, "k3", pos)
        return np.where(mask, fn(logp), 0), jax.grad(lambda lp: (fn(lp) * mask).sum())(logp)

    value, grad = terms(logp, ref, mask, None)  # by index, in token order
    value_p, grad_p = terms(logp[:, perm], ref[:, perm], mask[:, perm], pos[:, perm])
    np.testing.assert_allclose(value_p, value[:, perm], rtol=1e-6)
    np.testing.assert_allclose(grad_p, np.asarray(grad)[:, perm], rtol=1e-5, atol=1e-7)
    _, grad_index = terms(logp[:, perm], ref[:, perm], mask[:, perm], None)  # the old "later": by index
    assert np.abs(np.asarray(grad_index) - np.asarray(grad)[:, perm]).max() > 1e-2
