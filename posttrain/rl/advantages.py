"""Critic-free advantages for RLVR: group-relative baselines and the KL-to-reference reward penalty.

Rewards come one per sample, the G samples of a prompt contiguous. The advantage of a sample is
its reward against a baseline from its own group (no value network):

- grpo (Shao et al. 2024): (r − mean) / (std + eps), std unbiased as in TRL / verl;
- drgrpo (Liu et al. 2025, Dr. GRPO): r − mean, no std (which up-weights near-solved prompts);
- rloo (Ahmadian et al. 2024): r − mean of the *other* G − 1 rewards = G/(G−1) · (r − mean).

A KL penalty paid as reward is applied before (sequence form) or on top of (per-token form) these.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ADVANTAGE_METHODS = ("grpo", "drgrpo", "rloo")


def group_advantages(rewards: jax.Array, group_size: int, *, method: str = "grpo",
                     eps: float = 1e-6) -> jax.Array:
    """Group-relative advantages: rewards [num_groups * group_size] → [same], float32.

    Each group's samples are contiguous. A group whose rewards are all equal carries no signal
    and gets exactly zero (also under grpo, where rounding could otherwise leave (r − mean)/eps).
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"method={method!r}: expected one of {ADVANTAGE_METHODS}")
    if group_size < 2:
        raise ValueError(f"group_size={group_size}: a group-relative baseline needs at least 2 samples")
    if rewards.ndim != 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of shape {rewards.shape}: expected [num_groups * group_size={group_size}]")
    r = rewards.astype(jnp.float32).reshape(-1, group_size)
    adv = r - r.mean(axis=1, keepdims=True)
    if method == "grpo":
        adv = adv / (r.std(axis=1, ddof=1, keepdims=True) + eps)
    elif method == "rloo":
        adv = adv * group_size / (group_size - 1)
    informative = r.max(axis=1, keepdims=True) > r.min(axis=1, keepdims=True)
    return jnp.where(informative, adv, 0.0).reshape(-1)


def kl_penalized_rewards(rewards: jax.Array, kl: jax.Array, mask: jax.Array, *, kl_coef: float) -> jax.Array:
    """Sequence-form KL reward penalty: r − β · Σ_t kl_t, before group advantages.

    rewards [B]; kl [B, T] per-token estimates (`losses.kl_estimate` of the rollout log-probs
    against the reference; k1 keeps the penalty's gradient unbiased); mask [B, T] → [B].
    """
    return rewards.astype(jnp.float32) - kl_coef * (kl * mask.astype(jnp.float32)).sum(axis=-1)


def kl_penalized_advantages(advantages: jax.Array, kl: jax.Array, mask: jax.Array, *,
                            kl_coef: float) -> jax.Array:
    """Per-token-form KL reward penalty: A_t = A − β · Σ_{s ≥ t} kl_s.

    Each response token pays −β·kl_t as reward; with no discount its return from token t on is the
    outcome advantage plus the penalties still to come (the reward-to-go, as in PPO-RLHF and
    REINFORCE++). advantages [B] (group advantages of the outcome reward); kl, mask [B, T] → [B, T],
    zero off the mask.
    """
    m = mask.astype(jnp.float32)
    to_go = jnp.flip(jnp.cumsum(jnp.flip(kl * m, axis=-1), axis=-1), axis=-1)
    return (advantages.astype(jnp.float32)[:, None] - kl_coef * to_go) * m
