"""KL to the reference policy: the registered per-token estimators (Schulman's k1, k2, k3) and the
loss terms whose gradient estimates ∇KL(π ‖ π_ref) over whole sequences.

The KL enters the learner as a loss term (`kl_loss_terms`, k2 or k3) or as a reward penalty (k1 only:
`advantages.kl_penalized_advantages`). Those gradients are exact on-policy (π = π_old = π_sample);
off-policy the per-token importance weights correct each token's own term, not the sampling
distribution of the tokens after it (a per-token, not a sequence-level, correction).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain.config.registry import KL_ESTIMATORS


@dataclasses.dataclass(frozen=True)
class KLEstimator:
    """A per-token estimate of KL(π ‖ π_ref) from log r = log π_ref − log π on tokens sampled from π.
    `value(log_r)` is the estimate; `loss_weight`: how `kl_loss_terms` weighs it as a loss term —
    "detached" (sg(ρ)·k: its own gradient is the s = t term), "weighted" (ρ·k: the importance
    weight's gradient is), or "" when it cannot be one (`why`)."""

    value: Callable[[jax.Array], jax.Array]
    loss_weight: str
    why: str = ""


KL_ESTIMATORS.register(
    "k1",
    KLEstimator(
        lambda log_r: -log_r,
        "",
        "its gradient β·∇log π has expectation 0 (noise, no KL pressure); use k2 or k3, or pay k1 as reward "
        "(rl.kl_in_reward)",
    ),
)
KL_ESTIMATORS.register("k2", KLEstimator(lambda log_r: 0.5 * log_r**2, "detached"))
KL_ESTIMATORS.register("k3", KLEstimator(lambda log_r: jnp.expm1(log_r) - log_r, "weighted"))


def kl_estimate(logp: jax.Array, ref_logp: jax.Array, estimator: str = "k3") -> jax.Array:
    """Per-token value estimate of KL(π ‖ π_ref) from tokens sampled from π (Schulman 2020): [B, T] → [B, T].

    With log r = ref_logp − logp: k1 = −log r (unbiased, can be negative), k2 = ½ (log r)²
    (low variance, biased), k3 = (r − 1) − log r (unbiased and ≥ 0); others as registered
    (`config.registry.KL_ESTIMATORS`). These are values (the `rl/kl` metric, the reward penalty);
    what their gradients estimate is another matter: see `kl_loss_terms`.
    """
    log_r = ref_logp.astype(jnp.float32) - logp.astype(jnp.float32)
    return KL_ESTIMATORS[estimator].value(log_r)


def later_sum(x: jax.Array, mask: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """Σ_{s > t} x_s over each row's masked tokens: [B, T] → [B, T] (x is 0 off the mask). "Later"
    is by index, or with `positions` by position, in whatever order the tokens are laid out (the
    learner's rows are zig-zagged along the length under context parallelism): the masked tokens
    sorted by position (the others first: they add nothing), a reverse cumulative sum, and back."""
    suffix = lambda y: jnp.flip(jnp.cumsum(jnp.flip(y, axis=-1), axis=-1), axis=-1) - y
    if positions is None:
        return suffix(x)
    order = jnp.argsort(jnp.where(mask, positions, -1), axis=-1, stable=True)
    later = suffix(jnp.take_along_axis(x, order, axis=-1))
    return jnp.take_along_axis(later, jnp.argsort(order, axis=-1), axis=-1)


def kl_loss_terms(
    logp: jax.Array,
    ref_logp: jax.Array,
    weight: jax.Array,
    mask: jax.Array,
    estimator: str,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Per-token loss terms whose gradient (summed over a sequence) estimates ∇KL(π ‖ π_ref) over
    whole sequences: [B, T] → [B, T]. Unbiased on-policy only (π = π_sample, every ρ_t = 1); off-policy
    the per-token weights ρ_t leave it biased (below).

    The math. For y ~ π (autoregressive), KL(π ‖ π_ref) = E_y[Σ_t k1_t], k1_t = log π(y_t) − log π_ref(y_t),
    and by the score function (the k1 inside is itself differentiable, but E[Σ_t ∇log π_t] = 0)
        ∇KL = E[Σ_t ∇log π_t · Σ_{s ≥ t} k1_s]
    (terms s < t have mean zero). Differentiating a per-token estimator as a loss gives:
    - k1: ∇k1_t = ∇log π_t, of mean zero: no pull towards the reference, only noise (refused in
      the loss; paid as reward, k1 is exactly the form above);
    - k2: ∇k2_t = k1_t ∇log π_t: the s = t term;
    - k3: ∇k3_t = (1 − π_ref/π) ∇log π_t, whose mean Σ_y (π − π_ref) ∇log π = −Σ_y π_ref ∇log π is the
      gradient of KL(π_ref ‖ π) per token, not of KL(π ‖ π_ref). With an importance weight ρ_t =
      π(y_t) / π_sample(y_t) (value 1 on-policy), ∇(ρ_t k3_t) = ρ_t k1_t ∇log π_t: the s = t term again.
    Neither sees the s > t terms: how a token changes the KL of the tokens after it. They are added
    as ρ_t · sg(Σ_{s > t} k1_s) with no value (ρ − sg(ρ)). So the term is
        k2: sg(ρ_t)·k2_t + (ρ_t − sg(ρ_t))·F_t,   k3: ρ_t·k3_t + (ρ_t − sg(ρ_t))·F_t,   F_t = sg(Σ_{s>t} k1_s),
    whose value is the (importance-weighted) KL estimate and whose gradient is ρ_t Σ_{s≥t} k1_s ∇log π_t.
    `weight` is ρ_t (differentiable in logp; the caller's ratio π/π_old times the truncated IS
    weight π_old/π_behav); the future terms use per-token weights only, as the surrogate does.
    Exact on-policy only: off-policy, token t's term is weighted by its own ρ_t, but the prefix y_<t
    and the suffix y_>t (in F_t) were drawn from π_sample, which an unbiased estimate would correct by
    the ratio of whole prefixes and suffixes (Π_s ρ_s) — per-token ratios trade that bias for variance.
    Summed over a sequence and averaged over sequences (seq-mean-token-sum) the gradient is
    ∇KL / loss_norm_tokens; token-mean and seq-mean-token-mean divide by a count of tokens
    (for fixed-length responses a constant; with varying lengths they weight sequences as the
    policy-gradient term does).
    """
    entry = KL_ESTIMATORS[estimator]
    if not entry.loss_weight:
        raise ValueError(f"kl_estimator={estimator!r} as a loss term: {entry.why}")
    m = mask.astype(bool)
    k1 = jax.lax.stop_gradient(jnp.where(m, logp.astype(jnp.float32) - ref_logp.astype(jnp.float32), 0.0))
    future = later_sum(k1, m, positions)  # Σ_{s > t}, t's position order when `positions` are given
    sg_w = jax.lax.stop_gradient(weight)
    value_w = sg_w if entry.loss_weight == "detached" else weight
    return value_w * kl_estimate(logp, ref_logp, estimator) + (weight - sg_w) * future
