"""Attention of one new token per row against the sampler's KV cache, and writing its key and
value into the cache; with the cache's time axis sharded over `sequence`, each device attends to
its part and the parts are combined by a log-sum-exp reduction (`sequence_sharded_decode`)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from posttrain.ops.blockwise import NEG
from posttrain.parallel.sharding import current, logical_spec

# The KV-cache layout (`sampling.kv_cache`): keys [B, K, Dh, T], values [B, K, T, Dh], so that each
# (row, kv head) is one matrix laid out as its attention matmul reads it. The cache-index axes:
K_TIME_AXIS, V_TIME_AXIS = 3, 2


def write_cache_rows(cache: jax.Array, new: jax.Array, positions: jax.Array, time_axis: int) -> jax.Array:
    """cache [B, K, ...] with the entry of row b at index positions[b] of `time_axis` set to new[b]
    (new: [B, K, Dh]; `K_TIME_AXIS` for keys, `V_TIME_AXIS` for values). Out-of-range indices
    write nothing.

    One scatter whose batch dimension is b (`operand_batching_dims`): it partitions along a
    sharded batch without gathering and updates a loop-carried cache in place.
    """
    dims = jax.lax.ScatterDimensionNumbers(
        update_window_dims=(1, 2),
        inserted_window_dims=(time_axis,),
        scatter_dims_to_operand_dims=(time_axis,),
        operand_batching_dims=(0,),
        scatter_indices_batching_dims=(0,),
    )
    return jax.lax.scatter(
        cache,
        positions[:, None].astype(jnp.int32),
        new.astype(cache.dtype),
        dims,
        indices_are_sorted=True,
        unique_indices=True,
        mode=jax.lax.GatherScatterMode.FILL_OR_DROP,
    )


def decode_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> jax.Array:
    """One query per row against its cache entries 0..positions[b]; softmax in float32.

    q: [B, H, Dh]; k_cache [B, K, Dh, T] and v_cache [B, K, T, Dh] (the cache layout: neither is
    copied per token). Returns [B, H, Dh].
    """
    b, h, d = q.shape
    kv = k_cache.shape[1]
    q = q.reshape(b, kv, h // kv, d)
    logits = jnp.einsum("bkgd,bkdt->bkgt", q, k_cache.astype(q.dtype), preferred_element_type=jnp.float32) / jnp.sqrt(d)
    visible = (jnp.arange(k_cache.shape[3])[None, :] <= positions[:, None])[:, None, None]  # [B, 1, 1, T]
    probs = jax.nn.softmax(jnp.where(visible, logits, jnp.finfo(jnp.float32).min), axis=-1)
    return jnp.einsum("bkgt,bktd->bkgd", probs.astype(q.dtype), v_cache.astype(q.dtype)).reshape(b, h, d)


def write_cache_span(cache: jax.Array, new: jax.Array, positions: jax.Array, time_axis: int) -> jax.Array:
    """`write_cache_rows` for S entries per row: row b's entries at indices positions[b, s] of
    `time_axis` set to new[b, s] (new: [B, S, K, Dh], as `project_qkv` returns keys and values;
    positions [B, S], distinct within a row). Out-of-range indices write nothing."""
    rows = jnp.arange(cache.shape[0])[:, None]
    index = (
        (rows, slice(None), slice(None), positions)
        if time_axis == K_TIME_AXIS
        else (rows, slice(None), positions, slice(None))
    )
    return cache.at[index].set(new.astype(cache.dtype), mode="drop")  # non-adjacent indices: [B, S, K, Dh]


def extend_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array, positions: jax.Array) -> jax.Array:
    """`decode_attention` for S queries per row: q [B, S, H, Dh] at positions [B, S], each against
    its row's cache entries 0..its position; softmax in float32. Returns [B, S, H, Dh]."""
    b, s, h, d = q.shape
    kv = k_cache.shape[1]
    q = q.reshape(b, s, kv, h // kv, d)
    logits = jnp.einsum("bskgd,bkdt->bkgst", q, k_cache.astype(q.dtype), preferred_element_type=jnp.float32) / jnp.sqrt(
        d
    )
    visible = (jnp.arange(k_cache.shape[3])[None, None, :] <= positions[:, :, None])[:, None, None]  # [B,1,1,S,T]
    probs = jax.nn.softmax(jnp.where(visible, logits, jnp.finfo(jnp.float32).min), axis=-1)
    out = jnp.einsum("bkgst,bktd->bskgd", probs.astype(q.dtype), v_cache.astype(q.dtype))
    return out.reshape(b, s, h, d)


def _local_decode(q, k_new, v_new, k_cache, v_cache, positions, *, axis, n):
    """`sequence_sharded_decode` on one device's shard: cache entries offset..offset+T/n-1."""
    t = k_cache.shape[K_TIME_AXIS]
    offset = jax.lax.axis_index(axis) * t
    index = positions - offset
    index = jnp.where((index >= 0) & (index < t), index, t)  # t: not here, dropped
    k_cache = write_cache_rows(k_cache, k_new, index, K_TIME_AXIS)
    v_cache = write_cache_rows(v_cache, v_new, index, V_TIME_AXIS)
    b, h, d = q.shape
    kv = k_cache.shape[1]
    qg = q.reshape(b, kv, h // kv, d)
    logits = jnp.einsum("bkgd,bkdt->bkgt", qg, k_cache.astype(q.dtype), preferred_element_type=jnp.float32) / math.sqrt(
        d
    )
    visible = ((offset + jnp.arange(t))[None, :] <= positions[:, None])[:, None, None]  # [B, 1, 1, t]
    m = jax.lax.pmax(jnp.where(visible, logits, NEG).max(-1), axis)  # global row max
    p = jnp.where(visible, jnp.exp(logits - m[..., None]), 0.0)
    denom = jax.lax.psum(p.sum(-1), axis)
    out = jax.lax.psum(
        jnp.einsum("bkgt,bktd->bkgd", p.astype(q.dtype), v_cache.astype(q.dtype), preferred_element_type=jnp.float32),
        axis,
    )
    return (out / denom[..., None]).astype(q.dtype).reshape(b, h, d), k_cache, v_cache


def sequence_sharded_decode(
    q: jax.Array,
    k_new: jax.Array,
    v_new: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    positions: jax.Array,
    axes: tuple[str, ...],
    n: int,
):
    """Write one token's key and value and attend to the cache when its time axis is sharded over
    the mesh axes `axes` (n devices, under `use_sharding`): each device writes the token if its
    position falls in its part and attends to that part; the row max, the softmax denominator
    and the weighted values are reduced over `axes` (pmax, psum, psum), so the result is exact
    and no device gathers the cache. (GSPMD partitions the unsharded `decode_attention` without a
    gather too (its decode step's HLO has only all-reduces, one more than this form, which
    reduces the sum and the values together); this form does not depend on the partitioner.)

    q [B, H, Dh]; k_new, v_new [B, K, Dh]; caches [B, K, Dh, T] / [B, K, T, Dh]; positions [B].
    Returns (out [B, H, Dh], k_cache, v_cache).
    """
    mesh, rules = current()
    lead = tuple(logical_spec(("batch", "kv_heads"), mesh, rules, k_cache.shape[:2]))
    lead = lead + (None,) * (2 - len(lead))
    axis = axes if len(axes) > 1 else axes[0]
    specs = (P(*lead), P(*lead), P(*lead), P(*lead, None, axis), P(*lead, axis, None), P(lead[0]))
    fn = lambda *a: _local_decode(*a, axis=axis, n=n)
    return jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=specs[:1] + specs[3:5], check_vma=False)(
        q, k_new, v_new, k_cache, v_cache, positions
    )
