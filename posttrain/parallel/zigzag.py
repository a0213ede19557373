"""Zig-zag placement of sequence chunks for causally balanced context parallelism.

A row of length L is cut into 2n chunks; device i of the `sequence` axis holds chunks i and
2n-1-i (Brandon et al. 2023, "striped"/zig-zag ring attention). Under a causal mask early
chunks see few keys and late chunks many, so each device gets one of each and the same work.
The permutation is applied once when the batch is built, to every per-token array together
(tokens, targets, loss mask, positions, segment ids); attention then masks by positions and
segment ids, never by index, so results equal the unpermuted row's, permuted.

The balance is counted in the kernel's tiles (`tiles_per_shard`): the blockwise kernels skip a
(query tile, key tile) pair only when no row of the device's batch needs it, so right-padded
rows of different lengths cost what their longest row costs, and zig-zag balances them as it
balances full rows (`tools/zigzag_balance.py` prints the counts: the busiest shard of 8 does
1.8-1.9× the mean in token order, 1.0 zig-zagged). Not always: when the longest row ends a
little past the middle, token order can be the lighter layout; `balanced_batch` (what the
train loop, the RL learner and the learned reward's scorer place) picks the one whose busiest
shard computes fewer tiles.

`sequence_shards` is the one source of n: the mesh axes the `length` rule maps to, which is the
ring's size too (`ops.context_parallel.sequence_axes`), so the layout and the ring always agree.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def sequence_shards(mesh, rules: Mapping[str, Sequence[str]]) -> tuple[tuple[str, ...], int]:
    """(mesh axes of size > 1 that the `length` rule maps to, their product): how many context
    shards a row's length is split over. Zig-zag placement (the train loop, the RL learner) and
    the ring (`ops.context_parallel`) both read it here."""
    axes = tuple(a for a in rules.get("length", ()) if mesh.shape[a] > 1)
    return axes, math.prod(mesh.shape[a] for a in axes)


def zigzag_indices(length: int, n: int) -> np.ndarray:
    """[length] gather indices: zigzagged = row[zigzag_indices(length, n)] for n devices."""
    if n < 1 or length % (2 * n):
        raise ValueError(f"zig-zag over {n} sequence shards needs a length divisible by {2 * n}, got {length}")
    chunks = np.arange(length).reshape(2 * n, length // (2 * n))
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * n - 1 - i]]) for i in range(n)])


def zigzag(x, n: int, axis: int = 1):
    """x with its `axis` (the sequence) permuted to zig-zag order for n shards (numpy or jax)."""
    return x.take(zigzag_indices(x.shape[axis], n), axis=axis) if n > 1 else x


def balanced_batch(batch: Mapping, n: int, block: int) -> tuple[dict, bool]:
    """(the batch as it goes to the device, whether zig-zagged): `zigzag_batch(batch, n)` where
    that leaves the busiest of the n context shards fewer attention tiles of `block` tokens than
    token order does (`tiles_per_shard` of the rows of every `*segment_ids` with its `*positions`
    together: a reward model or DPO forward attends over chosen and rejected rows in one batch),
    else the batch as it is. Full rows balance zig-zagged; when the
    longest row ends a little past the middle, token order can leave the busiest shard less (the
    zig-zag puts the middle of the length, the longest row's densest part, on one shard). Each
    process decides on its own rows: attention reads positions, so either layout gives the same
    results."""
    groups = [k.removesuffix("segment_ids") for k in batch if k.endswith("segment_ids")]
    groups = [g for g in groups if g + "positions" in batch]
    if n == 1:
        return dict(batch), False
    if groups:
        rows = lambda key, f: np.concatenate([f(np.asarray(batch[g + key])) for g in groups])
        work = lambda f: tiles_per_shard(rows("positions", f), rows("segment_ids", f), n, block)
        if work(lambda x: zigzag(x, n)).max() >= work(np.asarray).max():
            return dict(batch), False
    return zigzag_batch(batch, n), True


def unzigzag(x, n: int, axis: int = 1):
    """The inverse of `zigzag`: back to the original token order."""
    return x.take(np.argsort(zigzag_indices(x.shape[axis], n)), axis=axis) if n > 1 else x


def zigzag_batch(batch: Mapping, n: int, axis: int = 1) -> dict:
    """Every per-token array of a batch ([B, L, ...]: inputs, targets, loss_mask, positions,
    segment_ids, ...) in zig-zag order for n sequence shards; other entries (with fewer dims)
    pass through. Call once when the batch is built, before it is placed on the mesh."""
    lengths = {v.shape[axis] for v in batch.values() if getattr(v, "ndim", 0) > axis}
    if len(lengths) > 1:
        raise ValueError(f"zigzag_batch: per-token arrays of different lengths {sorted(lengths)}")
    return {k: zigzag(v, n, axis) if getattr(v, "ndim", 0) > axis else v for k, v in batch.items()}


def visible_pairs_per_shard(positions: np.ndarray, n: int) -> np.ndarray:
    """Causal (query, key) pairs each of n contiguous shards computes for rows with these
    positions ([B, L], one segment per row): the work a context-parallel device does."""
    b, length = positions.shape
    per = length // n
    q = positions.reshape(b, n, per)
    return np.array([(q[:, i, :, None] >= positions[:, None, :]).sum() for i in range(n)])


def tiles_per_shard(positions: np.ndarray, segment_ids: np.ndarray, n: int, block: int) -> np.ndarray:
    """[n] attention tiles each context shard computes for a batch laid out as given ([B, L]):
    shard i's queries (its contiguous L/n tokens) against every shard's keys, both cut into tiles
    of min(block, L/n) tokens as the ring's `ops.blockwise.flash_forward` cuts them, counting
    the (query tile, key tile) pairs its `lax.cond` does not skip. That predicate is taken over
    the device's rows together: a pair is computed, for every row, when some query of some row
    sees some key (same segment, key not padding, key position <= query position). The backward
    pass skips the same pairs. `batch` is one device's rows (with data parallelism, call it per
    batch shard). From each (tile, segment)'s first and last position per row: cheap enough to
    lay out every batch."""
    b, length = positions.shape
    s = length // n
    t = min(block, s)
    nb = -(-s // t)
    tile = (np.arange(length) // s) * nb + (np.arange(length) % s) // t  # the tile of each index
    computed = np.zeros((n * nb, n * nb), bool)  # [query tile, key tile], over every row
    for pos, seg in zip(np.asarray(positions), np.asarray(segment_ids)):
        real = seg != 0
        if not real.any():
            continue
        span = int(seg.max()) + 1
        code = tile[real].astype(np.int64) * span + seg[real]
        order = np.argsort(code, kind="stable")
        code, p = code[order], pos[real][order]
        starts = np.flatnonzero(np.r_[True, code[1:] != code[:-1]])
        first, last = np.minimum.reduceat(p, starts), np.maximum.reduceat(p, starts)
        tiles, segs = code[starts] // span, code[starts] % span
        q, k = np.nonzero((segs[:, None] == segs[None, :]) & (first[None, :] <= last[:, None]))
        computed[tiles[q], tiles[k]] = True
    return computed.sum(axis=1).reshape(n, nb).sum(axis=1)
