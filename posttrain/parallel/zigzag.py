"""Zig-zag placement of sequence chunks for causally balanced context parallelism.

A row of length L is cut into 2n chunks; device i of the `sequence` axis holds chunks i and
2n-1-i (Brandon et al. 2023, "striped"/zig-zag ring attention). Under a causal mask early
chunks see few keys and late chunks many, so each device gets one of each and the same work.
The permutation is applied once when the batch is built, to every per-token array together
(tokens, targets, loss mask, positions, segment ids); attention then masks by positions and
segment ids, never by index, so results equal the unpermuted row's, permuted.

A right-padded row zig-zags over its own extent (up to its last real token), not over L: the
2n chunks of its real tokens are placed as above, each shard's slot filled up with padding.
Zig-zagging the padding along with the tokens would balance nothing: a row of 0.6 L real tokens
over 2 shards leaves the second shard ~5× the first's work (the RL learner's rows, preference
pairs), where the natural order gave the first ~2×. Full rows get the plain layout.

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


def row_zigzag_indices(segment_ids: np.ndarray, n: int) -> np.ndarray:
    """[B, L] gather indices, each row zig-zagged over its extent m (its last real token + 1):
    [0, m) cut into 2n chunks of near-equal size, shard i's slot of L/n holding chunks i and
    2n-1-i then padding from [m, L); rows as long as L get `zigzag_indices`."""
    b, length = segment_ids.shape
    zigzag_indices(length, n)  # the divisibility check
    slot, real = length // n, np.asarray(segment_ids) != 0
    extent = np.where(real.any(axis=1), length - np.argmax(real[:, ::-1], axis=1), 0)
    out = np.empty((b, length), np.int64)
    for m in np.unique(extent):
        bounds = np.arange(2 * n + 1) * m // (2 * n)
        chunk = lambda k: np.arange(bounds[k], bounds[k + 1])
        parts = [np.concatenate([chunk(i), chunk(2 * n - 1 - i)]) for i in range(n)]
        filler = np.split(np.arange(m, length), np.cumsum([slot - len(p) for p in parts])[:-1])
        out[extent == m] = np.concatenate([np.concatenate([p, f]) for p, f in zip(parts, filler)])
    return out


def zigzag(x, n: int, axis: int = 1):
    """x with its `axis` (the sequence) permuted to zig-zag order for n shards (numpy or jax)."""
    return x.take(zigzag_indices(x.shape[axis], n), axis=axis) if n > 1 else x


def unzigzag(x, n: int, axis: int = 1):
    """The inverse of `zigzag`: back to the original token order."""
    return x.take(np.argsort(zigzag_indices(x.shape[axis], n)), axis=axis) if n > 1 else x


def _take_rows(x, index: np.ndarray):
    """x [B, L, ...] gathered along L by per-row indices [B, L]."""
    x = np.asarray(x)
    return np.take_along_axis(x, index.reshape(index.shape + (1,) * (x.ndim - 2)), axis=1)


def zigzag_batch(batch: Mapping, n: int, axis: int = 1) -> dict:
    """Every per-token array of a batch ([B, L, ...]: inputs, targets, loss_mask, positions,
    segment_ids, ...) in zig-zag order for n sequence shards; other entries (with fewer dims)
    pass through. Arrays that share a prefix with a `segment_ids` array (`segment_ids`,
    `chosen_segment_ids`, ...) follow its rows' own extents (`row_zigzag_indices`), the others
    the plain layout. Call once when the batch is built, before it is placed on the mesh."""
    lengths = {v.shape[axis] for v in batch.values() if getattr(v, "ndim", 0) > axis}
    if len(lengths) > 1:
        raise ValueError(f"zigzag_batch: per-token arrays of different lengths {sorted(lengths)}")
    if n == 1:
        return dict(batch)
    prefixes = [k.removesuffix("segment_ids") for k, v in batch.items() if k.endswith("segment_ids")]
    index = {p: row_zigzag_indices(batch[p + "segment_ids"], n) for p in prefixes if axis == 1}

    def one(k, v):
        if getattr(v, "ndim", 0) <= axis:
            return v
        group = max((p for p in index if k.startswith(p)), key=len, default=None)
        return zigzag(v, n, axis) if group is None else _take_rows(v, index[group])

    return {k: one(k, v) for k, v in batch.items()}


def unzigzag_rows(x, segment_ids: np.ndarray, n: int):
    """The inverse of `zigzag_batch` for an array x [B, L, ...] of rows whose (token-order)
    segment ids are `segment_ids`: back to token order."""
    return x if n == 1 else _take_rows(x, np.argsort(row_zigzag_indices(segment_ids, n), axis=1))


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
    of min(block, L/n) tokens as `ops.blockwise.flash_forward` cuts them, counting the tiles its
    `lax.cond` does not skip (some query sees some key: same segment, key not padding, key
    position <= query position). The backward pass skips the same tiles, so this is a shard's
    share of the attention work, ring or all-gather alike."""
    b, length = positions.shape
    s = length // n
    t = min(block, s)
    nb = -(-s // t)

    def tiles(x, fill):  # [B, L] -> [B, n shards, nb tiles, t]
        x = x.reshape(b, n, s)
        pad = np.full((b, n, nb * t - s), fill, x.dtype)
        return np.concatenate([x, pad], axis=2).reshape(b, n, nb, t)

    pos, seg = tiles(positions, 0), tiles(segment_ids, 0)
    out = np.zeros(n, np.int64)
    for r in range(b):  # one row at a time: [q tile, q token, kv shard, kv tile, kv token] per shard
        kp, ks = pos[r, None, None], seg[r, None, None]
        for i in range(n):
            qp, qs = pos[r, i, :, :, None, None, None], seg[r, i, :, :, None, None, None]
            out[i] += ((qs == ks) & (ks != 0) & (kp <= qp)).any(axis=(1, 4)).sum()
    return out
