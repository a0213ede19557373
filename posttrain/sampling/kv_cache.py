"""The sampler's KV cache: one (keys, values) pair per layer, in layer order.

A cache is `Decoder.prefill`'s kv structure: cache[layer] = (k [B, K, Dh, T], v [B, K, T, Dh]),
T the capacity (prompt bucket + max new tokens). Each (row, kv head) is one contiguous matrix
laid out as its attention matmul reads it: keys transposed for q·kᵀ, values as they are for p·v.
Rows are left-aligned: a token's cache index is its position, so a row with a prompt of n
tokens holds it at 0..n-1 and its i-th new token at n+i. Sharded like the activations: batch
over the data-like mesh axes, kv heads over `tensor`, and the time axis like `length` (over
`sequence` when T divides; decoding then combines per-device parts, `ops.decode`).

A *stacked* cache (`Decoder.prefill(stacked=True)`, decoded by `Decoder.decode_stacked` under a
scan over layers) holds one pair per block of each scanned stack, with the stack's repeats as a
leading axis: (k [R, B, K, Dh, T], v [R, B, K, T, Dh]). Every function here takes either layout;
`to_stacked` / `to_layers` convert between them given the stacks' shapes (`engine.stack_segments`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.models.attention import K_TIME_AXIS, V_TIME_AXIS
from posttrain.parallel.sharding import constrain

K_NAMES = ("activation_batch", "activation_kv_heads", "head_dim", "activation_length")
V_NAMES = ("activation_batch", "activation_kv_heads", "activation_length", "head_dim")
TIME_AXES = (K_TIME_AXIS, V_TIME_AXIS)


def _lead(a: jax.Array) -> int:
    """Leading (stacked-layer) axes before the batch axis: 0, or 1 in a stacked cache."""
    return a.ndim - 4


def _per_layer(fn, *caches):
    """fn(array, time_axis, *others) on the k and v of every layer → a cache."""
    return tuple(
        tuple(fn(a, axis + _lead(a), *rest) for a, axis, *rest in zip(kv, TIME_AXES, *others))
        for kv, *others in zip(*caches)
    )


def shard(cache):
    """Constrain every cache array to the cache layout (a no-op outside `use_sharding`)."""
    lead = lambda a: (None,) * _lead(a)
    return tuple((constrain(k, lead(k) + K_NAMES), constrain(v, lead(v) + V_NAMES)) for k, v in cache)


def capacity(cache) -> int:
    """Entries per row (T)."""
    return cache[0][1].shape[TIME_AXES[1] - 4]


def allocate(prompt_kv, size: int):
    """A cache of `size` entries per row holding a prefill's keys and values at 0..S-1."""

    def one(a, axis):
        if a.shape[axis] > size:
            raise ValueError(f"prompt of {a.shape[axis]} tokens does not fit a cache of {size}")
        return jnp.pad(a, [(0, size - a.shape[axis]) if d == axis else (0, 0) for d in range(a.ndim)])

    return shard(_per_layer(one, prompt_kv))


def empty_like(prompt_kv, batch: int, size: int):
    """A zero cache with `batch` rows of `size` entries, shaped like a prefill's kv."""

    def one(a, axis):
        shape = list(a.shape)
        shape[_lead(a)], shape[axis] = batch, size
        return jnp.zeros(shape, a.dtype)

    return shard(_per_layer(one, prompt_kv))


def repeat_rows(cache, n: int):
    """Each row n times in a row (a prompt's cache shared by its group): [B, ...] → [B*n, ...]."""
    return shard(jax.tree.map(lambda a: jnp.repeat(a, n, axis=_lead(a)), cache))


def insert_rows(cache, prompt_kv, rows: jax.Array):
    """Write a prefill's kv (C rows of S entries) into cache rows `rows` [C] at entries 0..S-1.

    Rows equal to the cache's batch size (out of range) are skipped.
    """

    def one(c, axis, kv):
        lead = _lead(c)
        index = (slice(None),) * lead + (rows,) + (slice(None),) * (axis - lead - 1) + (slice(0, kv.shape[axis]),)
        return c.at[index].set(kv.astype(c.dtype), mode="drop")

    return shard(_per_layer(one, cache, prompt_kv))


def to_layers(cache, segments):
    """A stacked cache as one (k, v) pair per layer, in layer order; segments: (blocks per unit,
    repeats) of each stack. Indexes only (numpy views on the host)."""
    if sum(w for w, _ in segments) != len(cache) or any(
        cache[sum(w for w, _ in segments[:i])][0].shape[0] != r for i, (_, r) in enumerate(segments)
    ):
        raise ValueError(f"stacked KV cache of {len(cache)} (k, v) pairs does not match the stacks {tuple(segments)}")
    out, first = [], 0
    for width, repeats in segments:
        out += [tuple(a[r] for a in cache[first + j]) for r in range(repeats) for j in range(width)]
        first += width
    return tuple(out)


def to_stacked(cache, segments, stack=jnp.stack):
    """A per-layer cache in the stacked layout (`to_layers` undone); `stack`: np.stack for host arrays."""
    out, first = [], 0
    for width, repeats in segments:
        for j in range(width):
            layers = [cache[first + r * width + j] for r in range(repeats)]
            out.append(tuple(stack([kv[i] for kv in layers]) for i in (0, 1)))
        first += width * repeats
    if first != len(cache):
        raise ValueError(f"KV cache of {len(cache)} layers for stacks {tuple(segments)}")
    return tuple(out)
