"""The sampler's KV cache: per layer keys and values, stacked like the decoder's scanned layers.

A cache is `Decoder.prefill`'s kv structure — cache[segment][block] = (k, v), each
[repeats, B, T, K, Dh] — with T the capacity (prompt bucket + max new tokens). Rows are
left-aligned: a token's cache index is its position, so a row with a prompt of n tokens holds it
at 0..n-1 and its i-th new token at n+i. Sharded like the activations: batch over the data-like
mesh axes, kv heads over `tensor`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.parallel.sharding import constrain

CACHE_NAMES = ("layers", "batch", None, "kv_heads", "head_dim")


def shard(cache):
    """Constrain every cache array to the cache layout (a no-op outside `use_sharding`)."""
    return jax.tree.map(lambda a: constrain(a, CACHE_NAMES), cache)


def allocate(prompt_kv, capacity: int):
    """A cache of `capacity` entries per row holding a prefill's keys and values at 0..S-1.

    prompt_kv: arrays [repeats, B, S, K, Dh] → [repeats, B, capacity, K, Dh].
    """
    def one(a):
        if a.shape[2] > capacity:
            raise ValueError(f"prompt of {a.shape[2]} tokens does not fit a cache of {capacity}")
        return jnp.pad(a, ((0, 0), (0, 0), (0, capacity - a.shape[2]), (0, 0), (0, 0)))
    return shard(jax.tree.map(one, prompt_kv))


def empty_like(prompt_kv, batch: int, capacity: int):
    """A zero cache with `batch` rows of `capacity` entries, shaped like a prefill's kv."""
    return shard(jax.tree.map(lambda a: jnp.zeros((a.shape[0], batch, capacity) + a.shape[3:], a.dtype),
                              prompt_kv))


def repeat_rows(cache, n: int):
    """Each row n times in a row (a prompt's cache shared by its group): [R, B, ...] → [R, B*n, ...]."""
    return shard(jax.tree.map(lambda a: jnp.repeat(a, n, axis=1), cache))


def insert_rows(cache, prompt_kv, rows: jax.Array):
    """Write prefill kv [repeats, C, S, K, Dh] into cache rows `rows` [C] at entries 0..S-1.

    Rows equal to the cache's batch size (out of range) are skipped.
    """
    def one(c, kv):
        return c.at[:, rows, :kv.shape[2]].set(kv.astype(c.dtype), mode="drop")
    return shard(jax.tree.map(one, cache, prompt_kv))
