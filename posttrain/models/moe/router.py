"""Top-k token routing for Mixture-of-Experts layers, and the router's auxiliary losses.

Matches the Hugging Face reference implementations: Mixtral / Qwen3-MoE (softmax over all experts
in float32, top-k, optional renormalisation) and DeepSeek-V3 (sigmoid scores, top-k chosen with a
balancing bias that does not enter the weights).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx


class RouterBias(nnx.Variable):
    """Per-expert bias added to the sigmoid scores when choosing experts, never to the weights.

    Not trained by gradient: it is nudged after each step towards balanced load (DeepSeek-V3
    auxiliary-loss-free balancing, see `update_router_bias`).
    """


class Routing(NamedTuple):
    """What the router decided for T tokens: weights [T, k] f32, experts [T, k] int32, and the
    per-token router distribution probs [T, E] f32 that the load-balancing loss averages."""

    weights: jax.Array
    experts: jax.Array
    probs: jax.Array


def route(
    logits: jax.Array,
    *,
    top_k: int,
    router: str,
    norm_topk_prob: bool,
    routed_scaling: float = 1.0,
    bias: jax.Array | None = None,
    experts: jax.Array | None = None,
) -> Routing:
    """Choose `top_k` experts per token from router logits [T, E] (float32).

    softmax (Mixtral, Qwen3-MoE): probs = softmax over all experts; the k largest are the weights,
    renormalised to sum to one only when `norm_topk_prob` (Mixtral always sets it).
    sigmoid (DeepSeek-V3): scores = sigmoid(logits); the k largest of `scores + bias` are chosen,
    their weights are the scores without bias, renormalised when `norm_topk_prob`; probs for the
    balancing loss are the scores normalised over experts.
    Either way the weights are finally multiplied by `routed_scaling`.

    Routing replay (`model.moe.routing_replay = sampler`): given `experts` [T, k] (the sampler's
    choice) only the choice is replayed; the weights are this router's own probabilities (softmax)
    or scores (sigmoid) of those experts, renormalised exactly as above, so gradients reach the
    router through them as they do through a top-k of its own (R3 / verl's routing replay).
    """
    logits = logits.astype(jnp.float32)
    if router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        if experts is None:
            weights, experts = jax.lax.top_k(probs, top_k)
        else:
            weights = jnp.take_along_axis(probs, experts, axis=-1)
        if norm_topk_prob:
            weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    elif router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        choice = scores if bias is None else scores + bias.astype(jnp.float32)
        if experts is None:
            _, experts = jax.lax.top_k(choice, top_k)
        weights = jnp.take_along_axis(scores, experts, axis=-1)
        if norm_topk_prob:
            weights = weights / (jnp.sum(weights, axis=-1, keepdims=True) + 1e-20)
        probs = scores / jnp.sum(scores, axis=-1, keepdims=True)
    else:
        raise ValueError(f"moe.router={router!r}: expected 'softmax' or 'sigmoid'")
    return Routing(weights * routed_scaling, experts.astype(jnp.int32), probs)


def expert_counts(experts: jax.Array, num_experts: int, mask: jax.Array | None = None) -> jax.Array:
    """How many (token, slot) assignments each expert received: experts [T, k] → [E] float32;
    with `mask` [T] (1 for a real token, 0 for padding) only real tokens count."""
    weights = None if mask is None else jnp.repeat(mask.astype(jnp.float32), experts.shape[1])
    return jnp.bincount(experts.reshape(-1), weights=weights, length=num_experts).astype(jnp.float32)


def load_balancing_loss(mean_probs: jax.Array, load: jax.Array, top_k: int) -> jax.Array:
    """Switch-Transformer load-balancing loss of one layer, normalised exactly like Hugging Face's
    `load_balancing_loss_func` (Mixtral, Qwen3-MoE).

    mean_probs: [E] router probability of each expert averaged over tokens (P_e);
    load: [E] fraction of the T*k assignments that went to each expert (sums to 1).
    HF averages the one-hot mask [T, k, E] over tokens only and sums over the k slots, so its
    f_e = k * load_e (assignments per token, *not* divided by k) and the loss is
    E * sum_e f_e * P_e, which is k for perfectly uniform routing.
    """
    num_experts = mean_probs.shape[-1]
    return num_experts * jnp.sum(top_k * load * mean_probs)


def router_z_loss(logits: jax.Array) -> jax.Array:
    """ST-MoE router z-loss per token: logsumexp(logits)^2, logits [T, E] → [T] (average it)."""
    return jnp.square(jax.nn.logsumexp(logits.astype(jnp.float32), axis=-1))


def update_router_bias(bias: jax.Array, load: jax.Array, rate: float) -> jax.Array:
    """One step of auxiliary-loss-free balancing (DeepSeek-V3): raise the bias of under-loaded
    experts and lower it for over-loaded ones by `rate`. bias, load: [E]."""
    load = jax.lax.stop_gradient(load)
    step = rate * jnp.sign(jnp.mean(load) - load)
    return jax.lax.stop_gradient(bias + step.astype(bias.dtype))
