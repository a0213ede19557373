"""Expert feed-forward networks computed as grouped matmuls (`jax.lax.ragged_dot`) on tokens sorted
by expert: every expert sees exactly the tokens routed to it, none is padded (dropless, MegaBlocks).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int | None:
    """Per-expert capacity ceil(factor * tokens * k / E) of a token group; None when dropless."""
    if factor <= 0:
        return None
    return max(1, math.ceil(factor * num_tokens * top_k / num_experts))


def sort_by_expert(expert_ids: jax.Array, num_experts: int,
                   capacity: int | None = None) -> tuple[jax.Array, jax.Array]:
    """Order assignments by expert, keeping token order within an expert.

    expert_ids: [A] expert of each (token, slot) assignment, token-major. Returns `order` [A], the
    assignment indices sorted by expert, and `group_sizes` [E] int32, the kept assignments per
    expert. With a capacity, an expert keeps its first `capacity` assignments in token order and
    the rest are dropped: they are moved behind all kept ones and left out of `group_sizes`.
    """
    order = jnp.argsort(expert_ids, stable=True)
    counts = jnp.bincount(expert_ids, length=num_experts).astype(jnp.int32)
    if capacity is None:
        return order, counts
    starts = jnp.cumsum(counts) - counts
    rank = jnp.arange(expert_ids.shape[0]) - starts[expert_ids[order]]
    keep = jnp.zeros(expert_ids.shape, bool).at[order].set(rank < capacity)
    order = jnp.argsort(jnp.where(keep, expert_ids, num_experts), stable=True)
    return order, jnp.minimum(counts, capacity)


def expert_ffn(rows: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array) -> jax.Array:
    """SwiGLU of each expert on its rows: down(silu(x @ gate) * (x @ up)), as grouped matmuls.

    rows: [M, D] in compute dtype, sorted by expert; group_sizes: [G] rows per expert (rows past
    their sum are padding); w_gate, w_up: [G, D, F]; w_down: [G, F, D]. Returns [M, D] float32,
    zero on padding rows. Matmuls accumulate in float32.
    """
    dtype = rows.dtype
    def mm(a, w):
        return jax.lax.ragged_dot(a, w.astype(dtype), group_sizes, preferred_element_type=jnp.float32)
    h = (jax.nn.silu(mm(rows, w_gate)) * mm(rows, w_up)).astype(dtype)
    out = mm(h, w_down)
    valid = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, 0.0)


def grouped_ffn(rows: jax.Array, expert_ids: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                w_down: jax.Array) -> jax.Array:
    """`expert_ffn` on rows in any order: sort by expert, compute, restore the order.

    rows: [M, D]; expert_ids: [M] in [0, G], where G (= w_gate.shape[0]) marks a padding row whose
    output is zero. Returns [M, D] float32.
    """
    num_groups = w_gate.shape[0]
    order = jnp.argsort(expert_ids, stable=True)
    group_sizes = jnp.bincount(expert_ids, length=num_groups).astype(jnp.int32)
    out = expert_ffn(rows[order], group_sizes, w_gate, w_up, w_down)
    return jnp.zeros_like(out).at[order].add(out, unique_indices=True)
