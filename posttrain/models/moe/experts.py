"""Expert feed-forward networks computed as grouped matmuls on tokens sorted by expert: every expert
sees exactly the tokens routed to it, none is padded (dropless, MegaBlocks). `jax.lax.ragged_dot`
on GPU/TPU; a tiled scan on the CPU, where ragged_dot is not a grouped kernel.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from posttrain.models.quant import COMPUTE_DTYPE, dequantize, is_channelwise, is_quantized
from posttrain.parallel.mesh import accelerator_paths


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int | None:
    """Per-expert capacity ceil(factor * tokens * k / E) of a token group; None when dropless."""
    if factor <= 0:
        return None
    return max(1, math.ceil(factor * num_tokens * top_k / num_experts))


def sort_by_expert(expert_ids: jax.Array, num_experts: int, capacity: int | None = None) -> tuple[jax.Array, jax.Array]:
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
    keep = expert_ranks(expert_ids, order, counts) < capacity
    order = jnp.argsort(jnp.where(keep, expert_ids, num_experts), stable=True)
    return order, jnp.minimum(counts, capacity)


def expert_ranks(expert_ids: jax.Array, order: jax.Array, counts: jax.Array) -> jax.Array:
    """Each assignment's place among its expert's assignments in token order (0 for the first):
    expert_ids [A], with `order` and `counts` from `sort_by_expert` (no capacity) → [A] int32."""
    starts = jnp.cumsum(counts) - counts
    sorted_rank = jnp.arange(expert_ids.shape[0], dtype=jnp.int32) - starts[expert_ids[order]]
    return jnp.zeros_like(sorted_rank).at[order].set(sorted_rank)


TILE_ROWS = 128


def tiled_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array, *, tile: int = TILE_ROWS) -> jax.Array:
    """`ragged_dot` as a scan over row tiles that each lie inside one group (float32 out).

    x: [M, K] rows sorted by group; w: [G, K, N]; group_sizes: [G] (rows past their sum → 0).
    XLA:CPU lowers `ragged_dot` to every row times every group's matrix (G× the work); here each
    group's rows are cut into `tile`-row pieces (at most M/tile + G of them), each multiplied by
    its own group's matrix, so the work is the useful work plus at most one partial tile per group.
    """
    m, k = x.shape
    g = w.shape[0]
    tiles_per = (group_sizes + tile - 1) // tile
    tile_end = jnp.cumsum(tiles_per)
    tile_begin = tile_end - tiles_per
    group_end = jnp.cumsum(group_sizes)
    group_start = group_end - group_sizes
    t = jnp.arange(-(-m // tile) + g)
    tile_group = jnp.minimum(jnp.searchsorted(tile_end, t, side="right"), g - 1)
    tile_start = group_start[tile_group] + (t - tile_begin[tile_group]) * tile
    padded = jnp.concatenate([x, jnp.zeros((tile, k), x.dtype)])

    def one_tile(_, meta):
        start, group = meta
        rows = jax.lax.dynamic_slice_in_dim(padded, start, tile)
        return None, jnp.dot(rows, w[group], preferred_element_type=jnp.float32)

    _, tiles = jax.lax.scan(one_tile, None, (tile_start, tile_group))  # [T, tile, N]
    r = jnp.arange(m)
    row_group = jnp.minimum(jnp.searchsorted(group_end, r, side="right"), g - 1)
    local = r - group_start[row_group]
    out = tiles[tile_begin[row_group] + local // tile, local % tile]
    return jnp.where((r < group_end[-1])[:, None], out, 0.0)


def dense_grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """`ragged_dot` by multiplying every row by every group's matrix and keeping its own: one big
    matmul, the cheapest form when rows are few (decode). x [M, K], w [G, K, N] → [M, N] float32."""
    group_end = jnp.cumsum(group_sizes)
    r = jnp.arange(x.shape[0])
    row_group = jnp.minimum(jnp.searchsorted(group_end, r, side="right"), w.shape[0] - 1)
    every = jnp.einsum("mk,gkn->mgn", x, w, preferred_element_type=jnp.float32)
    out = jnp.take_along_axis(every, row_group[:, None, None], axis=1)[:, 0]
    return jnp.where((r < group_end[-1])[:, None], out, 0.0)


DENSE_MAX_ROW_GROUPS = 4096  # rows × groups up to which the dense form is used on the CPU


def grouped_matmul(x: jax.Array, w: jax.Array, group_sizes: jax.Array) -> jax.Array:
    """Rows of each group times that group's matrix, float32: `ragged_dot` where the backend has a
    grouped kernel (GPU, TPU; on the CPU too under `parallel.accelerator_paths`' test switch). On
    the CPU, where ragged_dot costs every row times every group, the dense form for few rows
    (decode) and the tiled scan otherwise (4× faster than ragged_dot for a 4096-row training step,
    measured)."""
    if accelerator_paths():
        return jax.lax.ragged_dot(x, w, group_sizes, preferred_element_type=jnp.float32)
    if x.shape[0] * w.shape[0] <= DENSE_MAX_ROW_GROUPS:
        return dense_grouped_matmul(x, w, group_sizes)
    return tiled_grouped_matmul(x, w, group_sizes)


def weight_grouped_matmul(x: jax.Array, w, group_sizes: jax.Array, dtype) -> jax.Array:
    """`grouped_matmul` for a float weight (cast to `dtype`) or a quantised one (the sampler's).

    A QArray takes `weight_einsum`'s arithmetic, so that the expert-parallel path gives the
    single-device numbers: bfloat16 inputs, float32 accumulation, per-channel scales applied to
    each row's output by its group, group scales (int4) dequantised first. x [M, K], w [G, K, N]
    → [M, N] float32.
    """
    if not is_quantized(w):
        return grouped_matmul(x, w.astype(dtype), group_sizes)
    x = x.astype(COMPUTE_DTYPE)
    if not is_channelwise(w, (1,)):
        return grouped_matmul(x, dequantize(w, COMPUTE_DTYPE), group_sizes)
    y = grouped_matmul(x, w.qvalue.astype(COMPUTE_DTYPE), group_sizes)
    row_group = jnp.minimum(
        jnp.searchsorted(jnp.cumsum(group_sizes), jnp.arange(x.shape[0]), side="right"), w.shape[0] - 1
    )
    return y * w.scale[:, 0, :].astype(jnp.float32)[row_group]


def expert_ffn(
    rows: jax.Array, group_sizes: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """SwiGLU of each expert on its rows: down(silu(x @ gate) * (x @ up)), as grouped matmuls.

    rows: [M, D] in compute dtype, sorted by expert; group_sizes: [G] rows per expert (rows past
    their sum are padding); w_gate, w_up: [G, D, F]; w_down: [G, F, D]. Returns [M, D] float32,
    zero on padding rows. Matmuls accumulate in float32.
    """
    dtype = rows.dtype
    mm = functools.partial(weight_grouped_matmul, group_sizes=group_sizes, dtype=dtype)
    h = (jax.nn.silu(mm(rows, w_gate)) * mm(rows, w_up)).astype(dtype)
    out = mm(h, w_down)
    valid = jnp.arange(rows.shape[0]) < jnp.sum(group_sizes)
    return jnp.where(valid[:, None], out, 0.0)


def grouped_ffn(
    rows: jax.Array, expert_ids: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array
) -> jax.Array:
    """`expert_ffn` on rows in any order: sort by expert, compute, restore the order.

    rows: [M, D]; expert_ids: [M] in [0, G], where G (= w_gate.shape[0]) marks a padding row whose
    output is zero. Returns [M, D] float32.
    """
    num_groups = w_gate.shape[0]
    order = jnp.argsort(expert_ids, stable=True)
    group_sizes = jnp.bincount(expert_ids, length=num_groups).astype(jnp.int32)
    out = expert_ffn(rows[order], group_sizes, w_gate, w_up, w_down)
    return jnp.zeros_like(out).at[order].add(out, unique_indices=True)
