"""Ring attention (Liu et al. 2023) and all-gather attention over a sequence-sharded mesh axis.

Both run on one device's shard inside `jax.shard_map`: q, k, v [B, S/n, ., Dh] with the
positions and segment ids of the same tokens. Masks come from positions and segment ids (see
`ops.blockwise`), so the tokens may be in any order; zig-zag order (`parallel.zigzag`) balances
causal work across devices.

Ring: each device keeps its queries and passes key/value blocks to the next device with
`ppermute`; the transfer of the next block is issued before the current block's attention so the
two overlap. Partial outputs are merged with their log-sum-exps. The backward pass (custom_vjp)
rings too: key/value blocks travel with their gradient accumulators and arrive home after n
steps. No device ever holds more than two key/value blocks or any [S, S] tile.

All-gather: gather keys and values over the axis, then local blockwise attention; the gradient
of the gather is a reduce-scatter.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain.ops.blockwise import blockwise_attention, flash_backward, flash_forward, lse_attention


def _merge(out, lse, out_b, lse_b):
    """Softmax outputs over disjoint key sets merged by their log-sum-exps ([B, S, H(, Dh)])."""
    new = jnp.logaddexp(lse, lse_b)
    return (out * jnp.exp(lse - new)[..., None] + out_b * jnp.exp(lse_b - new)[..., None]), new


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, *, axis, n, causal, block):
    """(out float32, lse) of the local queries over every device's keys, ring order."""
    perm = _ring_perm(n)

    def attend(kv):
        k, v, kp, ks = kv
        return flash_forward(q, k, v, q_pos, kp, q_seg, ks, causal=causal, block=block)

    def step(carry, _):
        kv, out, lse = carry
        next_kv = jax.lax.ppermute(kv, axis, perm)  # in flight while this block is computed
        out, lse = _merge(out, lse, *attend(kv))
        return (next_kv, out, lse), None

    own = (k, v, kv_pos, kv_seg)
    if n == 1:
        return attend(own)
    first = jax.lax.ppermute(own, axis, perm)
    out, lse = attend(own)
    (kv, out, lse), _ = jax.lax.scan(step, (first, out, lse), None, length=n - 2)
    return _merge(out, lse, *attend(kv))


def _ring_backward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, lse, delta, dout, *, axis, n, causal, block):
    """(dq, dk, dv) float32: key/value blocks travel the ring with their gradient accumulators and
    arrive home after n steps."""
    perm = _ring_perm(n)

    def grads(kv):
        k, v, kp, ks = kv
        return flash_backward(q, k, v, q_pos, kp, q_seg, ks, lse, delta, dout, causal=causal, block=block)

    def step(carry, _, *, last=False):
        kv, dkv, dq = carry
        next_kv = kv if last else jax.lax.ppermute(kv, axis, perm)  # in flight during the compute
        dq_b, dk_b, dv_b = grads(kv)
        dkv = jax.lax.ppermute((dkv[0] + dk_b, dkv[1] + dv_b), axis, perm)
        return (next_kv, dkv, dq + dq_b), None

    zeros = jnp.zeros(k.shape, jnp.float32)
    carry = ((k, v, kv_pos, kv_seg), (zeros, zeros), jnp.zeros(q.shape, jnp.float32))
    carry, _ = jax.lax.scan(step, carry, None, length=n - 1)
    (_, (dk, dv), dq), _ = step(carry, None, last=True)  # n hops: dk, dv are home
    return dq, dk, dv


_ring = lse_attention(_ring_forward, _ring_backward, ("axis", "n", "causal", "block"))


def shard_attention(
    strategy: str, *, axis_name, axis_size: int, causal: bool = True, block_size: int = 512
) -> Callable[..., jax.Array]:
    """The attention of this device's shard (call it inside `shard_map` over `axis_name`, of
    `axis_size` devices) by `strategy`: "ring" or "all_gather" (module docstring).

    It takes q [B, s, H, Dh], k, v [B, s, K, Dh], then the positions and the segment ids of the
    queries and of the keys [B, s] (the local tokens, as `blockwise_attention` takes them) and
    returns the local queries' attention over every device's keys [B, s, H, Dh].
    """
    if strategy == "ring":
        return lambda q, k, v, *masks: _ring(q, k, v, *masks, axis_name, axis_size, causal, block_size)
    if strategy != "all_gather":
        raise ValueError(f"context parallelism: unknown strategy {strategy!r}; expected 'ring' or 'all_gather'")
    gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)

    def all_gather(q, k, v, q_pos, kv_pos, q_seg, kv_seg):
        k, v, kv_pos, kv_seg = map(gather, (k, v, kv_pos, kv_seg))
        return blockwise_attention(q, k, v, q_pos, kv_pos, q_seg, kv_seg, causal=causal, block_size=block_size)

    return all_gather
