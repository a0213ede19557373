"""Loss formulas shared by the stages: token log-probs, DPO (and IPO, conservative DPO), Bradley–Terry."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.config import DPO_LOSSES
from posttrain.models.logprobs import token_logprobs  # noqa: F401 (re-exported: DPO and tests use it here)


def sequence_logprobs(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> jax.Array:
    """Sum of token log-probs where mask is set: [B, S, V], [B, S], [B, S] → [B]."""
    return (token_logprobs(logits, targets) * mask.astype(jnp.float32)).sum(axis=-1)


def dpo_loss(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    *,
    beta: float,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
) -> tuple[jax.Array, dict]:
    """Direct Preference Optimization (Rafailov et al. 2023) on sequence log-probs [B].

    h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)).
    sigmoid: −(1−ε)·log σ(βh) − ε·log σ(−βh)  (ε = label_smoothing: conservative DPO);
    ipo: (h − 1/(2β))²  (Azar et al. 2023). At the start (π = π_ref) sigmoid gives log 2.
    """
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"dpo.loss_type={loss_type!r}: expected one of {DPO_LOSSES}")
    chosen_ratio = policy_chosen - ref_chosen
    rejected_ratio = policy_rejected - ref_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * jax.nn.log_sigmoid(beta * h) - label_smoothing * jax.nn.log_sigmoid(-beta * h)
    else:
        losses = (h - 1 / (2 * beta)) ** 2
    chosen_reward, rejected_reward = beta * chosen_ratio, beta * rejected_ratio
    metrics = {
        "dpo/loss": losses.mean(),
        "dpo/reward_accuracy": (chosen_reward > rejected_reward).astype(jnp.float32).mean(),
        # the policy's own ranking (no reference): does it give the chosen response the higher log-prob?
        "dpo/policy_accuracy": (policy_chosen > policy_rejected).astype(jnp.float32).mean(),
        "dpo/chosen_reward": chosen_reward.mean(),
        "dpo/rejected_reward": rejected_reward.mean(),
        "dpo/margin": (chosen_reward - rejected_reward).mean(),
        "dpo/policy_chosen_logp": policy_chosen.mean(),
        "dpo/policy_rejected_logp": policy_rejected.mean(),
        "dpo/ref_chosen_logp": ref_chosen.mean(),
        "dpo/ref_rejected_logp": ref_rejected.mean(),
    }
    return losses.mean(), metrics


def bradley_terry_loss(chosen: jax.Array, rejected: jax.Array) -> tuple[jax.Array, dict]:
    """Reward-model loss −log σ(r_chosen − r_rejected) on scalar rewards [B], with accuracy and margin."""
    margin = chosen - rejected
    loss = -jax.nn.log_sigmoid(margin).mean()
    return loss, {
        "rm/loss": loss,
        "rm/accuracy": (margin > 0).astype(jnp.float32).mean(),
        "rm/margin": margin.mean(),
        "rm/chosen": chosen.mean(),
        "rm/rejected": rejected.mean(),
    }
