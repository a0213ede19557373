"""Policy-gradient loss of the RLVR learner: PPO-style clipped surrogate and its switches.

All inputs are per response token, [B, T] (B sequences padded to T), with `mask` [B, T] set on
the tokens the policy generated. Log-probs are `models.logprobs.token_logprobs` of those tokens:
`logp` under the policy being updated, `old_logp` under the proximal policy (the learner's weights
before this update), `behav_logp` as recorded by the sampler that generated the rollout (possibly
an older version), `ref_logp` under the frozen reference policy.

- Clipped surrogate (Schulman et al. 2017) with separate low/high clip ranges (DAPO's clip-higher);
  the ratio per token, or per sequence as the geometric mean of token ratios (GSPO).
- The policy losses are registered by name (`config.registry.POLICY_LOSSES`, `rl.loss_type`): PPO's
  clipped surrogate and CISPO (`cispo_surrogate`: a clipped, stop-gradient importance weight on a
  REINFORCE term) here; a module of yours adds one with `@POLICY_LOSSES.register(name)`.
- KL to the reference as a loss term or a reward penalty (`kl.py`).
- Off-policy correction between behaviour and proximal policies (`offpolicy.offpolicy_correction`):
  truncated importance weights per token or sequence, masked IS (tokens, sequences, geometric mean).
- Entropy bonus; loss aggregation token-mean | seq-mean-token-sum | seq-mean-token-mean.
- The critic's clipped value loss (PPO with GAE, `advantages.gae_advantages`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from posttrain.config import AGGREGATIONS, RATIO_LEVELS, RLConfig
from posttrain.config.registry import POLICY_LOSSES
from posttrain.rl.algo.kl import kl_estimate, kl_loss_terms
from posttrain.rl.algo.offpolicy import offpolicy_correction


def entropy_from_logprobs(logprobs: jax.Array) -> jax.Array:
    """Entropy of next-token distributions given as log-probs (−inf off their support), float32:
    [B, T, V] → [B, T]. With `sampling.rules.support_logprobs` it is the entropy of the distribution
    the sampler draws from after temperature, top-k and top-p (renormalised on what they keep)."""
    lp = logprobs.astype(jnp.float32)
    finite = jnp.isfinite(lp)
    safe = jnp.where(finite, lp, 0.0)
    return -jnp.where(finite, jnp.exp(safe) * safe, 0.0).sum(axis=-1)


def entropy_from_logits(logits: jax.Array) -> jax.Array:
    """Entropy of the full softmax of `logits`, float32: [B, T, V] → [B, T]."""
    return entropy_from_logprobs(jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1))


def importance_ratio(logp: jax.Array, old_logp: jax.Array, mask: jax.Array, level: str = "token") -> jax.Array:
    """π / π_old per token, [B, T] → [B, T] (1 off the mask).

    level="sequence" (GSPO, Zheng et al. 2025): every token of sequence i carries the geometric
    mean of its token ratios, s_i = exp(mean_t (logp − old_logp)), in GSPO-token form
    sg[s_i] · π_t / sg[π_t]: the value is s_i and the gradient s_i · ∇logp_t, so with sequence
    advantages and seq-mean-token-mean aggregation the loss is GSPO's.
    """
    if level not in RATIO_LEVELS:
        raise ValueError(f"ratio_level={level!r}: expected one of {RATIO_LEVELS}")
    mask = mask.astype(bool)
    logp, old_logp = logp.astype(jnp.float32), old_logp.astype(jnp.float32)
    log_ratio = jnp.where(mask, logp - old_logp, 0.0)
    if level == "sequence":
        m = mask.astype(jnp.float32)
        seq = log_ratio.sum(axis=-1, keepdims=True) / jnp.maximum(m.sum(axis=-1, keepdims=True), 1.0)
        log_ratio = jnp.where(mask, jax.lax.stop_gradient(seq) + logp - jax.lax.stop_gradient(logp), 0.0)
    return jnp.exp(log_ratio)


def clipped_surrogate(ratio: jax.Array, advantages: jax.Array, *, clip_low: float, clip_high: float) -> jax.Array:
    """PPO clipped objective as a per-token loss: −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A).

    ratio [B, T]; advantages [B, T] (or broadcastable) → [B, T]. clip_high > clip_low is DAPO's
    clip-higher, which leaves room for unlikely tokens to gain probability.
    """
    clipped = jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return -jnp.minimum(ratio * advantages, clipped * advantages)


def cispo_surrogate(
    logp: jax.Array, ratio: jax.Array, advantages: jax.Array, *, clip_low: float, clip_high: float
) -> jax.Array:
    """CISPO (MiniMax-M1, 2025) as a per-token loss: −sg(clip(r, 1 − clip_low, 1 + clip_high))·A·log π.

    logp, ratio, advantages [B, T] → [B, T]. A REINFORCE term whose importance weight is clipped
    and carries no gradient: unlike PPO's clip, which zeroes the gradient of tokens whose ratio
    left the trust region, every token keeps a gradient, bounded by the clipped weight. The value
    is the literal −w·A·log π (not comparable with PPO's −r·A); its gradient is −w·A·∇log π.
    """
    w = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    return -w * advantages * logp.astype(jnp.float32)


def aggregate(values: jax.Array, mask: jax.Array, mode: str, max_len_norm: float | None = None) -> jax.Array:
    """Reduce a per-token loss [B, T] to a scalar over the masked tokens.

    token-mean (DAPO): Σ_{i,t} v / Σ_{i,t} 1 — every token weighs the same.
    seq-mean-token-mean (GRPO): mean_i (Σ_t v / |y_i|) — every sequence weighs the same.
    seq-mean-token-sum (Dr. GRPO): mean_i Σ_t v / max_len_norm — no length normalisation per
    sequence; the constant (the learner passes rl.loss_norm_tokens, by default rl.max_new_tokens)
    only sets the scale, so it does not grow with response lengths (default 1).
    Sequences are the rows with at least one masked token (padding rows do not count).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"aggregation={mode!r}: expected one of {AGGREGATIONS}")
    if max_len_norm is not None and mode != "seq-mean-token-sum":
        raise ValueError(f"max_len_norm={max_len_norm} applies to aggregation='seq-mean-token-sum' only, not {mode!r}")
    mask = mask.astype(bool)
    m = mask.astype(jnp.float32)
    total = jnp.where(mask, values, 0.0)
    if mode == "token-mean":
        return total.sum() / jnp.maximum(m.sum(), 1.0)
    tokens = m.sum(axis=-1)
    per_seq = total.sum(axis=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / jnp.maximum(tokens, 1.0)
    elif max_len_norm is not None:
        per_seq = per_seq / max_len_norm
    return per_seq.sum() / jnp.maximum((tokens > 0).sum(), 1)


@dataclasses.dataclass(frozen=True)
class Surrogate:
    """What a policy loss (`config.registry.POLICY_LOSSES`) gives per token, [B, T] each: the loss
    before the off-policy weight, and the tokens its clip changed below (`low`) and above (`high`)
    (the `rl/clip_frac_*` metrics)."""

    per_token: jax.Array
    low: jax.Array
    high: jax.Array


@POLICY_LOSSES.register("ppo")
def ppo_loss(logp: jax.Array, ratio: jax.Array, adv: jax.Array, rl: RLConfig) -> Surrogate:
    """PPO's clipped surrogate (`clipped_surrogate`); clipped: the tokens whose gradient the clip
    zeroes (r < 1 − clip_low with A < 0, r > 1 + clip_high with A > 0)."""
    lo, hi = rl.clip_low, rl.clip_high
    per_token = clipped_surrogate(ratio, adv, clip_low=lo, clip_high=hi)
    return Surrogate(per_token, (ratio < 1.0 - lo) & (adv < 0), (ratio > 1.0 + hi) & (adv > 0))


@POLICY_LOSSES.register("cispo")
def cispo_loss(logp: jax.Array, ratio: jax.Array, adv: jax.Array, rl: RLConfig) -> Surrogate:
    """CISPO (`cispo_surrogate`); clipped: the tokens whose weight the clip changed."""
    lo, hi = rl.clip_low, rl.clip_high
    per_token = cispo_surrogate(logp, ratio, adv, clip_low=lo, clip_high=hi)
    return Surrogate(per_token, ratio < 1.0 - lo, ratio > 1.0 + hi)


def loss_norm(rl: RLConfig) -> float | None:
    """seq-mean-token-sum's constant divisor: rl.loss_norm_tokens, or rl.max_new_tokens when 0
    (Dr. GRPO: a constant, so the loss scale does not follow response lengths); None otherwise."""
    if rl.aggregation != "seq-mean-token-sum":
        return None
    return float(rl.loss_norm_tokens or rl.max_new_tokens)


def policy_loss(
    logp: jax.Array,
    old_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    rl: RLConfig,
    *,
    ref_logp: jax.Array | None = None,
    behav_logp: jax.Array | None = None,
    entropy: jax.Array | None = None,
    positions: jax.Array | None = None,
) -> tuple[jax.Array, dict]:
    """The learner's loss: the registered policy loss `rl.loss_type` (PPO's clipped surrogate,
    CISPO, ...), × the off-policy IS weight, + β·KL − α·entropy, every term reduced with
    `rl.aggregation`; the hyper-parameters are the `rl` section's (Python values, static under jit).

    The KL term (rl.kl_coef, unless rl.kl_in_reward paid it as reward) is `kl.kl_loss_terms`
    (k2 or k3; its gradient estimates ∇KL(π ‖ π_ref) over whole sequences) with ρ = π/π_old × the
    truncated IS weight; `rl/kl` is the mean per-token estimate.

    logp, old_logp, mask [B, T]; advantages [B] (one per sequence) or [B, T] (per token, e.g.
    `kl_penalized_advantages`). Optional, all [B, T]: ref_logp (needed when the KL is a loss term;
    otherwise it only feeds the `rl/kl` metric), behav_logp (the IS weight π_old / π_behav,
    truncated at rl.is_cap per token or sequence (rl.is_level), multiplies the surrogate and the
    KL's ρ; rl.is_mask drops tokens or sequences whose ratio is out of [is_mask_low, is_mask_high]
    from every term: `offpolicy.offpolicy_correction`), entropy (`entropy_from_logprobs` of the
    policy's logits; needed when rl.entropy_coef > 0), positions (the tokens' positions: the KL
    term's "later tokens" follow them, so a permuted token order gives the same loss).

    Returns (loss, metrics): `rl/loss`, `rl/pg_loss`, `rl/clip_frac_low` / `_high` (the tokens the
    loss's clip changed), `rl/ratio_*`, `rl/adv_*` (mean/min/max), `rl/kl`, `rl/entropy`, over the
    tokens that train; with behav_logp the gap metrics of `offpolicy_correction` (`rl/behav_gap_abs`
    |max, `rl/behav_kl`, `rl/is_weight_*`, `rl/is_truncated_frac`, with a mask `rl/is_masked_frac`).
    """
    kl_coef = 0.0 if rl.kl_in_reward else rl.kl_coef
    if kl_coef and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logp (reference policy log-probs)")
    if rl.entropy_coef and entropy is None:
        raise ValueError(f"entropy_coef={rl.entropy_coef} needs entropy (entropy_from_logprobs of the policy)")
    if behav_logp is None and rl.is_mask != "off":
        raise ValueError(f"is_mask={rl.is_mask!r} needs behav_logp (the behaviour policy's log-probs)")
    surrogate_of = POLICY_LOSSES[rl.loss_type]
    mask = mask.astype(bool)
    metrics = {}
    w = jnp.ones(mask.shape, jnp.float32)
    if behav_logp is not None:
        w, mask, metrics = offpolicy_correction(
            old_logp,
            behav_logp,
            mask,
            cap=rl.is_cap,
            level=rl.is_level,
            mask_mode=rl.is_mask,
            low=rl.is_mask_low,
            high=rl.is_mask_high,
        )
    adv = advantages[:, None] if advantages.ndim == 1 else advantages
    adv = jnp.broadcast_to(adv.astype(jnp.float32), mask.shape)
    ratio = importance_ratio(logp, old_logp, mask, rl.ratio_level)
    surrogate = surrogate_of(logp, ratio, adv, rl)
    per_token = w * surrogate.per_token
    metrics.update(
        {
            "rl/clip_frac_low": _masked_mean(surrogate.low, mask),
            "rl/clip_frac_high": _masked_mean(surrogate.high, mask),
            **_masked_stats("rl/ratio", ratio, mask),
            **_masked_stats("rl/adv", adv, mask),
        }
    )
    pg_loss = aggregate(per_token, mask, rl.aggregation, loss_norm(rl))
    metrics["rl/pg_loss"] = pg_loss
    loss = pg_loss
    for term in regularizers(logp, old_logp, w, mask, rl, kl_coef, ref_logp, entropy, positions, metrics):
        loss = loss + term  # (in this order: the sum's rounding is part of the logged loss)
    metrics["rl/loss"] = loss
    return loss, metrics


def regularizers(
    logp, old_logp, w, mask, rl: RLConfig, kl_coef: float, ref_logp, entropy, positions, metrics: dict
) -> list[jax.Array]:
    """The terms β·KL and −α·entropy of `policy_loss` (those that apply), reduced as the surrogate
    is; adds the `rl/kl` and `rl/entropy` metrics to `metrics`."""
    norm, terms = loss_norm(rl), []
    if ref_logp is not None:
        kl = kl_estimate(logp, ref_logp, rl.kl_estimator)
        metrics["rl/kl"] = _masked_mean(jax.lax.stop_gradient(kl), mask)
        if kl_coef:
            rho = w * jnp.exp(jnp.where(mask, logp.astype(jnp.float32) - jax.lax.stop_gradient(old_logp), 0.0))
            per_token = kl_loss_terms(logp, ref_logp, rho, mask, rl.kl_estimator, positions)
            terms.append(kl_coef * aggregate(per_token, mask, rl.aggregation, norm))
    if entropy is not None:
        metrics["rl/entropy"] = _masked_mean(entropy, mask)
        if rl.entropy_coef:
            terms.append(-(rl.entropy_coef * aggregate(entropy, mask, rl.aggregation, norm)))
    return terms


def value_loss(
    values: jax.Array,
    old_values: jax.Array,
    returns: jax.Array,
    mask: jax.Array,
    *,
    clip: float,
    aggregation: str = "token-mean",
    max_len_norm: float | None = None,
) -> tuple[jax.Array, dict]:
    """The critic's loss: PPO's clipped value loss ½·max((V − R)², (V_clip − R)²).

    values [B, T] (the critic now), old_values [B, T] (the critic when the rollout's returns were
    computed), returns [B, T] (GAE returns), mask [B, T]. V_clip = V_old + clip(V − V_old, ±clip)
    keeps the critic near the values its targets came from; clip = 0 turns clipping off (plain
    ½(V − R)²); aggregation and max_len_norm as in `aggregate`. Returns (loss, metrics):
    `rl/value_loss`, `rl/value_clip_frac` (tokens where the clipped term is the larger: its
    gradient is zero), `rl/value_mean`, `rl/return_mean`, `rl/value_explained_var`
    (1 − Var(R − V) / Var(R), over the masked tokens).
    """
    if clip < 0:
        raise ValueError(f"value_clip={clip}: expected >= 0 (0: unclipped)")
    mask = mask.astype(bool)
    v, returns = values.astype(jnp.float32), jax.lax.stop_gradient(returns.astype(jnp.float32))
    loss_unclipped = (v - returns) ** 2
    per_token = loss_unclipped
    clipped_frac = jnp.zeros(())
    if clip:
        old = jax.lax.stop_gradient(old_values.astype(jnp.float32))
        loss_clipped = (old + jnp.clip(v - old, -clip, clip) - returns) ** 2
        per_token = jnp.maximum(loss_unclipped, loss_clipped)
        clipped_frac = _masked_mean(loss_clipped > loss_unclipped, mask)
    loss = 0.5 * aggregate(per_token, mask, aggregation, max_len_norm)
    sg_v = jax.lax.stop_gradient(v)
    ret_mean = _masked_mean(returns, mask)
    var_ret = _masked_mean((returns - ret_mean) ** 2, mask)
    err = returns - sg_v
    var_err = _masked_mean((err - _masked_mean(err, mask)) ** 2, mask)
    return loss, {
        "rl/value_loss": loss,
        "rl/value_clip_frac": clipped_frac,
        "rl/value_mean": _masked_mean(sg_v, mask),
        "rl/return_mean": ret_mean,
        "rl/value_explained_var": 1.0 - var_err / jnp.maximum(var_ret, 1e-8),
    }


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x [B, T] over the masked tokens, float32."""
    return jnp.where(mask, x, 0).astype(jnp.float32).sum() / jnp.maximum(mask.sum(), 1)


def _masked_stats(name: str, x: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:
    """`{name}_mean`, `_min`, `_max` of x [B, T] over the masked tokens (no gradient)."""
    x = jax.lax.stop_gradient(x)
    return {
        f"{name}_mean": _masked_mean(x, mask),
        f"{name}_min": jnp.where(mask, x, jnp.inf).min(),
        f"{name}_max": jnp.where(mask, x, -jnp.inf).max(),
    }
