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

import functools

import jax
import jax.numpy as jnp

from posttrain.ops.blockwise import blockwise_attention, flash_backward, flash_forward


def _merge(out, lse, out_b, lse_b):
    """Softmax outputs over disjoint key sets merged by their log-sum-exps ([B, S, H(, Dh)])."""
    new = jnp.logaddexp(lse, lse_b)
    return (out * jnp.exp(lse - new)[..., None] + out_b * jnp.exp(lse_b - new)[..., None]), new


def _ring_perm(n: int) -> list[tuple[int, int]]:
    return [(i, (i + 1) % n) for i in range(n)]


def _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, causal, block):
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


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9, 10))
def _ring(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, causal, block):
    out, _ = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, causal, block)
    return out.astype(q.dtype)


def _ring_fwd(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, causal, block):
    out, lse = _ring_forward(q, k, v, q_pos, kv_pos, q_seg, kv_seg, axis, n, causal, block)
    out = out.astype(q.dtype)
    return out, (q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse)


def _ring_bwd(axis, n, causal, block, res, dout):
    q, k, v, q_pos, kv_pos, q_seg, kv_seg, out, lse = res
    perm = _ring_perm(n)
    delta = jnp.einsum("bshd,bshd->bsh", dout.astype(jnp.float32), out.astype(jnp.float32))

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
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), None, None, None, None


_ring.defvjp(_ring_fwd, _ring_bwd)


def ring_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    *,
    axis_name,
    axis_size: int,
    causal: bool = True,
    block_size: int = 512,
) -> jax.Array:
    """Ring attention on this device's shard (call inside `shard_map` over `axis_name`).

    q [B, s, H, Dh]; k, v [B, s, K, Dh]; positions, segment ids [B, s]: the local tokens.
    Returns the local queries' attention over all `axis_size` devices' keys [B, s, H, Dh].
    """
    return _ring(
        q, k, v, q_positions, kv_positions, q_segment_ids, kv_segment_ids, axis_name, axis_size, causal, block_size
    )


def all_gather_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_positions: jax.Array,
    kv_positions: jax.Array,
    q_segment_ids: jax.Array,
    kv_segment_ids: jax.Array,
    *,
    axis_name,
    causal: bool = True,
    block_size: int = 512,
) -> jax.Array:
    """All-gather context parallelism on this device's shard (inside `shard_map`): keys, values,
    their positions and segment ids gathered over `axis_name`, then local blockwise attention."""
    gather = lambda x: jax.lax.all_gather(x, axis_name, axis=1, tiled=True)
    return blockwise_attention(
        q,
        gather(k),
        gather(v),
        q_positions,
        gather(kv_positions),
        q_segment_ids,
        gather(kv_segment_ids),
        causal=causal,
        block_size=block_size,
    )
