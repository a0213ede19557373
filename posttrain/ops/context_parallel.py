"""Context parallelism: attention over a length sharded on the mesh axes the `length` rule names.

`model.context_parallel` picks the strategy when those axes have more than one device:
  all_gather  gather K/V over the axis, then local blockwise attention (fast at moderate lengths),
  ring        pass K/V blocks around the ring (`ops.ring`); per-device K/V memory stays L/n,
  auto        all_gather while one layer's gathered K/V and their float32 gradients fit in
              1/16 of a device's memory (`AUTO_GATHER_FRACTION`; 16 GiB assumed where the backend
              does not report it), ring beyond.
"""

from __future__ import annotations

import math

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from posttrain.config import CONTEXT_PARALLEL
from posttrain.ops.ring import all_gather_attention, ring_attention
from posttrain.parallel.sharding import current, logical_spec
from posttrain.parallel.zigzag import sequence_shards

AUTO_GATHER_FRACTION = 1 / 16
DEFAULT_DEVICE_BYTES = 16 * 2**30


def check_mode(mode: str) -> None:
    """Raise naming `model.context_parallel` for an unknown strategy."""
    if mode not in CONTEXT_PARALLEL:
        raise ValueError(f"model.context_parallel={mode!r}: expected one of {CONTEXT_PARALLEL}")


def sequence_axes() -> tuple[tuple[str, ...], int]:
    """The mesh axes (of size > 1) the `length` rule maps to under `use_sharding`, and their size
    (`parallel.zigzag.sequence_shards`: the zig-zag layout's shard count is the ring's)."""
    ctx = current()
    return ((), 1) if ctx is None else sequence_shards(*ctx)


def gathered_kv_bytes(local_kv_shape: tuple[int, ...], n: int, itemsize: int) -> int:
    """Bytes one device holds for one layer under all_gather: K and V of the whole length
    ([B, s·n, K, Dh] each) plus their float32 gradients in the backward pass."""
    full = math.prod(local_kv_shape) * n
    return 2 * full * (itemsize + 4)


def device_memory_bytes(mesh) -> int:
    """The first device's memory limit, or `DEFAULT_DEVICE_BYTES` where the backend has none."""
    try:
        stats = mesh.devices.flat[0].memory_stats() or {}
    except Exception:  # noqa: BLE001 - backends without memory stats raise various errors
        stats = {}
    return int(stats.get("bytes_limit", DEFAULT_DEVICE_BYTES))


def choose(mode: str, kv_bytes: int, device_bytes: int) -> str:
    """The strategy `mode` resolves to: `auto` → all_gather while kv_bytes fits the budget."""
    check_mode(mode)
    if mode != "auto":
        return mode
    return "all_gather" if kv_bytes <= AUTO_GATHER_FRACTION * device_bytes else "ring"


def _specs(mesh, rules, k_shape) -> tuple[P, P]:
    """(q/k/v spec, positions spec): batch and length as the rules say, heads as kv heads (so
    each device holds whole GQA groups)."""
    spec = tuple(logical_spec(("batch", "length", "kv_heads", "head_dim"), mesh, rules, k_shape))
    spec = spec + (None,) * (4 - len(spec))
    return P(*spec), P(*spec[:2])


def context_parallel_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array,
    *,
    mode: str,
    causal: bool = True,
    block_size: int = 512,
) -> jax.Array:
    """Self-attention over a sequence-sharded length (global arrays under `use_sharding`):
    q [B, L, H, Dh], k, v [B, L, K, Dh], positions and segment ids [B, L] → [B, L, H, Dh]."""
    mesh, rules = current()
    axes, n = sequence_axes()
    if q.shape[1] % n:
        raise ValueError(
            f"context parallelism over {axes} ({n} devices) needs a length divisible by {n}, got {q.shape[1]}"
        )
    spec, tok = _specs(mesh, rules, k.shape)
    if spec[1] is None:
        raise ValueError(
            f"context parallelism: the `length` rule {rules.get('length')} does not shard "
            f"length {q.shape[1]} over {axes}"
        )
    local = NamedSharding(mesh, spec).shard_shape(k.shape)
    strategy = choose(mode, gathered_kv_bytes(local, n, k.dtype.itemsize), device_memory_bytes(mesh))
    axis = axes if len(axes) > 1 else axes[0]
    if strategy == "ring":
        fn = lambda *a: ring_attention(*a, axis_name=axis, axis_size=n, causal=causal, block_size=block_size)
    else:
        fn = lambda *a: all_gather_attention(*a, axis_name=axis, causal=causal, block_size=block_size)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, spec, spec, tok, tok, tok, tok), out_specs=spec, check_vma=False
    )(q, k, v, positions, positions, segment_ids, segment_ids)
