"""Advantages for the RL learner: group-relative baselines, GAE with a critic, and the KL penalty.

Estimators are registered by name (`config.registry.ADVANTAGES`, `rl.advantage`). Critic-free:
rewards come one per sample, the G samples of a prompt contiguous. The advantage of a sample is its
reward against a baseline from its own group (no value network):

- grpo (Shao et al. 2024): (r − mean) / (std + eps), std unbiased as in TRL / verl;
- drgrpo (Liu et al. 2025, Dr. GRPO): r − mean, no std (which up-weights near-solved prompts);
- rloo (Ahmadian et al. 2024): r − mean of the *other* G − 1 rewards = G/(G−1) · (r − mean).

A KL penalty paid as reward is applied before (sequence form) or on top of (per-token form) these.

With a critic (PPO, Schulman et al. 2017; RLHF as in Ouyang et al. 2022): token-level rewards (the
outcome reward at the last generated token, optionally −β·kl_t on every token) and per-token values
give generalised advantage estimates (GAE, Schulman et al. 2016) and the critic's returns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain.config.registry import ADVANTAGES


@dataclasses.dataclass(frozen=True)
class AdvantageEstimator:
    """An advantage estimator (`config.registry.ADVANTAGES`, `rl.advantage`). A group estimator has
    `scale(adv, r, judged, n, eps)`: the centred rewards adv = r − mean [groups, G] rescaled
    (`judged` [groups, G] bool and the judged count n [groups, 1], or None when every sample has a
    verdict); a `critic` one (GAE) is computed from the critic's values instead."""

    scale: Callable | None = None
    critic: bool = False


def _grpo(adv, r, judged, n, eps):
    if judged is None:
        return adv / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    var = jnp.where(judged, adv**2, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)
    return adv / (jnp.sqrt(var) + eps)


def _rloo(adv, r, judged, n, eps):
    if judged is None:
        return adv * r.shape[1] / (r.shape[1] - 1)
    return adv * n / jnp.maximum(n - 1.0, 1.0)


ADVANTAGES.register("grpo", AdvantageEstimator(_grpo))
ADVANTAGES.register("drgrpo", AdvantageEstimator(lambda adv, r, judged, n, eps: adv))
ADVANTAGES.register("rloo", AdvantageEstimator(_rloo))
ADVANTAGES.register("gae", AdvantageEstimator(critic=True))


def uses_critic(method: str) -> bool:
    """Whether advantage estimator `method` needs the critic's values (PPO with GAE)."""
    return ADVANTAGES[method].critic


def group_advantages(
    rewards: jax.Array, group_size: int, *, method: str = "grpo", eps: float = 1e-6, valid: jax.Array | None = None
) -> jax.Array:
    """Group-relative advantages: rewards [num_groups * group_size] → [same], float32.

    Each group's samples are contiguous. A group whose rewards are all equal carries no signal
    and gets exactly zero (also under grpo, where rounding could otherwise leave (r − mean)/eps).
    `valid` [same] (bool) marks the samples with a verdict: the others (a verifier error is not a
    wrong answer) get zero advantage and stay out of their group's mean, std and size (rloo's
    G/(G−1) uses the judged count); a group with fewer than 2 judged samples gets zero.
    """
    estimator = ADVANTAGES[method]
    if estimator.scale is None:
        group = [name for name in ADVANTAGES if ADVANTAGES[name].scale is not None]
        raise ValueError(f"method={method!r}: expected one of {tuple(group)}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group-relative baseline needs at least 2 samples")
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {rewards.shape}: expected [num_groups * group_size={group_size}]")
    r = rewards.astype(jnp.float32).reshape(-1, group_size)
    if valid is not None:
        return _judged_group_advantages(r, valid.astype(bool).reshape(r.shape), estimator, eps).reshape(-1)
    adv = estimator.scale(r - r.mean(axis=1, keepdims=True), r, None, None, eps)
    informative = r.max(axis=1, keepdims=True) > r.min(axis=1, keepdims=True)
    return jnp.where(informative, adv, 0.0).reshape(-1)


def _judged_group_advantages(r: jax.Array, v: jax.Array, estimator: AdvantageEstimator, eps: float) -> jax.Array:
    """`group_advantages` over the judged samples `v` of each group (rows of r [groups, G])."""
    n = v.sum(axis=1, keepdims=True).astype(jnp.float32)
    mean = jnp.where(v, r, 0.0).sum(axis=1, keepdims=True) / jnp.maximum(n, 1.0)
    adv = estimator.scale(r - mean, r, v, n, eps)
    hi = jnp.where(v, r, -jnp.inf).max(axis=1, keepdims=True)
    lo = jnp.where(v, r, jnp.inf).min(axis=1, keepdims=True)
    return jnp.where(v & (n >= 2) & (hi > lo), adv, 0.0)


def kl_penalized_rewards(rewards: jax.Array, kl: jax.Array, mask: jax.Array, *, kl_coef: float) -> jax.Array:
    """Sequence-form KL reward penalty: r − β · Σ_t kl_t, before group advantages.

    rewards [B]; kl [B, T] per-token estimates (`losses.kl_estimate` of the rollout log-probs
    against the reference; k1 keeps the penalty's gradient unbiased); mask [B, T] → [B].
    """
    return rewards.astype(jnp.float32) - kl_coef * (kl * mask.astype(jnp.float32)).sum(axis=-1)


def kl_penalized_advantages(advantages: jax.Array, kl: jax.Array, mask: jax.Array, *, kl_coef: float) -> jax.Array:
    """Per-token-form KL reward penalty: A_t = A − β · Σ_{s ≥ t} kl_s.

    Each response token pays −β·kl_t as reward; with no discount its return from token t on is the
    outcome advantage plus the penalties still to come (the reward-to-go, as in PPO-RLHF and
    REINFORCE++). With kl = k1 the policy gradient of this penalty, β·E[Σ_t ∇log π_t Σ_{s≥t} k1_s],
    is exactly β·∇KL(π ‖ π_ref) over sequences; k2 / k3 are biased here (refused by the start-up
    checks). advantages [B] (group advantages of the outcome reward); kl, mask [B, T] → [B, T],
    zero off the mask.
    """
    m = mask.astype(jnp.float32)
    to_go = jnp.flip(jnp.cumsum(jnp.flip(kl * m, axis=-1), axis=-1), axis=-1)
    return (advantages.astype(jnp.float32)[:, None] - kl_coef * to_go) * m


def terminal_rewards(scores: jax.Array, mask: jax.Array) -> jax.Array:
    """Token-level rewards with each sequence's outcome score at its last generated token.

    scores [B]; mask [B, T] (generated tokens) → [B, T] float32, zero elsewhere (and all zero for a
    row without generated tokens).
    """
    m = mask.astype(bool)
    t = jnp.arange(m.shape[-1])
    last = jnp.where(m, t, -1).max(axis=-1, keepdims=True)
    return jnp.where(t == last, scores.astype(jnp.float32)[:, None], 0.0)


def gae_advantages(
    rewards: jax.Array, values: jax.Array, mask: jax.Array, *, gamma: float, lam: float
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimates and returns per generated token (Schulman et al. 2016).

    rewards, values, mask [B, T]: r_t and V(s_t) on the tokens the policy generated (mask set).
    Over the masked tokens t < t' (t' the next masked token; positions off the mask — padding,
    tool output in a multi-turn episode — are part of the transition, not steps of their own):
        δ_t = r_t + γ·V_t' − V_t,   A_t = δ_t + γλ·A_t',
    with V and A zero after a row's last masked token (the episode ends there). Returns
    (advantages, returns = A + V), both [B, T] float32 and zero off the mask; rewards off the mask
    do not count (put the outcome reward on a generated token with `terminal_rewards`).
    """
    m = mask.astype(bool)
    r = jnp.where(m, rewards.astype(jnp.float32), 0.0)
    v = jnp.where(m, values.astype(jnp.float32), 0.0)

    def step(carry, x):
        next_value, next_adv = carry
        r_t, v_t, m_t = x
        adv = r_t + gamma * next_value - v_t + gamma * lam * next_adv
        carry = (jnp.where(m_t, v_t, next_value), jnp.where(m_t, adv, next_adv))
        return carry, jnp.where(m_t, adv, 0.0)

    zeros = jnp.zeros(r.shape[:1], jnp.float32)
    _, adv = jax.lax.scan(step, (zeros, zeros), (r.T, v.T, m.T), reverse=True)
    adv = adv.T
    return adv, jnp.where(m, adv + v, 0.0)


def whiten(x: jax.Array, mask: jax.Array, eps: float = 1e-8) -> jax.Array:
    """x [B, T] minus its mean over the masked tokens, over their std; zero off the mask.

    PPO normalises GAE advantages over the batch this way (as TRL and verl do) so the policy
    step's scale does not follow the reward's.
    """
    m = mask.astype(bool)
    n = jnp.maximum(m.sum(), 1)
    mean = jnp.where(m, x, 0.0).sum() / n
    var = jnp.where(m, (x - mean) ** 2, 0.0).sum() / n
    return jnp.where(m, (x - mean) * jax.lax.rsqrt(var + eps), 0.0)
