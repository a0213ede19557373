"""Off-policy corrections between the behaviour policy (the sampler that drew the rollout: an older
policy version, or other numerics such as a quantised sampler) and the proximal policy (the
learner's weights before the update), and metrics of the gap between the two.

All inputs are per response token, [B, T], with `mask` [B, T] set on the generated tokens. With
log r_t = log π_prox(y_t) − log π_behav(y_t) (0 off the mask), S_i = Σ_t log r_t the log of the
sequence's importance ratio and S_i / |y_i| the log of its geometric mean:

- truncated IS (IMPALA, decoupled PPO; Yao et al. 2025's TIS): a weight w = min(r, cap) per token
  (level "token"), or every token of sequence i weighted by min(exp(S_i), cap) (level "sequence",
  the sequence's own importance ratio, truncated);
- masked IS (Liu et al. 2025's MIS, IcePop): drop the tokens (mask "token"), or whole sequences
  (mask "sequence": by exp(S_i); "geometric": by exp(S_i / |y_i|)), whose ratio lies outside
  [low, high]; dropped tokens leave the loss mask (they train nothing), kept ones keep their
  truncated weight.

Every weight and mask is computed without gradient: they correct the sampling distribution, they
are not part of what is optimised.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from posttrain.config import IS_LEVELS, IS_MASKS


def truncated_is_weights(prox_logp: jax.Array, behav_logp: jax.Array, cap: float) -> jax.Array:
    """Off-policy correction w = min(π_prox / π_behav, cap) per token, no gradient: [B, T] → [B, T].

    Rollouts sampled by an older policy version (or by a sampler whose numerics differ from the
    learner's) are reweighted towards the proximal policy; the cap bounds the variance (truncated
    IS, as in IMPALA / decoupled PPO).
    """
    if not cap > 0:
        raise ValueError(f"is_cap={cap}: the truncation of importance weights must be > 0")
    w = jnp.exp(prox_logp.astype(jnp.float32) - behav_logp.astype(jnp.float32))
    return jax.lax.stop_gradient(jnp.minimum(w, cap))


def sequence_log_ratio(log_r: jax.Array, mask: jax.Array, *, geometric: bool = False) -> jax.Array:
    """S_i = Σ_t log r_t over each row's masked tokens, or its mean (geometric) : [B, T] → [B, 1]."""
    m = mask.astype(jnp.float32)
    total = jnp.where(mask, log_r, 0.0).sum(axis=-1, keepdims=True)
    return total / jnp.maximum(m.sum(axis=-1, keepdims=True), 1.0) if geometric else total


def offpolicy_correction(
    prox_logp: jax.Array,
    behav_logp: jax.Array,
    mask: jax.Array,
    *,
    cap: float,
    level: str = "token",
    mask_mode: str = "off",
    low: float = 0.0,
    high: float = math.inf,
) -> tuple[jax.Array, jax.Array, dict]:
    """(weights [B, T], keep [B, T] bool, metrics): the truncated IS weight of each token at `level`
    (cap: rl.is_cap, level: rl.is_level), and the tokens that survive masked IS (mask_mode:
    rl.is_mask; bounds low, high: rl.is_mask_low / high, 0 ≤ low < 1 < high; low = 0: no lower
    bound). keep is `mask` with the dropped tokens removed; weights are 1 off the mask.

    Metrics, over the generated tokens: `rl/behav_gap_abs` and `rl/behav_gap_max` (mean and max
    |log r_t|), `rl/behav_kl` (k3 estimate of KL(π_behav ‖ π_prox) from the behaviour's samples:
    (r − 1) − log r), `rl/is_masked_frac` (dropped tokens; only with a mask); over the kept ones:
    `rl/is_weight_{mean,min,max}` and `rl/is_truncated_frac` (tokens whose weight the cap lowered).
    """
    if level not in IS_LEVELS:
        raise ValueError(f"is_level={level!r}: expected one of {IS_LEVELS}")
    if mask_mode not in IS_MASKS:
        raise ValueError(f"is_mask={mask_mode!r}: expected one of {IS_MASKS}")
    if not cap > 0:
        raise ValueError(f"is_cap={cap}: the truncation of importance weights must be > 0")
    if mask_mode != "off" and not 0 <= low < 1 < high:
        raise ValueError(f"is_mask_low={low}, is_mask_high={high}: expected 0 <= is_mask_low < 1 < is_mask_high")
    mask = mask.astype(bool)
    log_r = jnp.where(mask, prox_logp.astype(jnp.float32) - behav_logp.astype(jnp.float32), 0.0)
    log_r = jax.lax.stop_gradient(log_r)
    log_cap = math.log(cap)
    if level == "token":
        w, truncated = truncated_is_weights(prox_logp, behav_logp, cap), log_r > log_cap
    else:
        s = sequence_log_ratio(log_r, mask)
        w = jnp.broadcast_to(jnp.exp(jnp.minimum(s, log_cap)), mask.shape)
        truncated = jnp.broadcast_to(s > log_cap, mask.shape)
    keep = mask
    metrics = {
        "rl/behav_gap_abs": _masked_mean(jnp.abs(log_r), mask),
        "rl/behav_gap_max": jnp.where(mask, jnp.abs(log_r), 0.0).max(),
        "rl/behav_kl": _masked_mean(jnp.expm1(log_r) - log_r, mask),
    }
    if mask_mode != "off":
        x = log_r if mask_mode == "token" else sequence_log_ratio(log_r, mask, geometric=mask_mode == "geometric")
        log_low = math.log(low) if low > 0 else -math.inf
        keep = mask & (x >= log_low) & (x <= math.log(high))
        metrics["rl/is_masked_frac"] = _masked_mean(~keep, mask)
    w = jnp.where(mask, w, 1.0)
    metrics.update(
        {
            "rl/is_weight_mean": _masked_mean(w, keep),
            "rl/is_weight_min": jnp.where(keep, w, jnp.inf).min(),
            "rl/is_weight_max": jnp.where(keep, w, -jnp.inf).max(),
            "rl/is_truncated_frac": _masked_mean(truncated, keep),
        }
    )
    return w, keep, metrics


def _masked_mean(x: jax.Array, mask: jax.Array) -> jax.Array:
    """Mean of x [B, T] over the masked tokens, float32."""
    return jnp.where(mask, x, 0).astype(jnp.float32).sum() / jnp.maximum(mask.sum(), 1)
