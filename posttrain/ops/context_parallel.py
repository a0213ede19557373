"""Context parallelism: attention over a length sharded on the mesh axes the `length` rule names.

`model.context_parallel` picks the strategy when those axes have more than one device:
  all_gather  gather K/V over the axis, then local blockwise attention (fast at moderate lengths),
  ring        pass K/V blocks around the ring (`ops.ring`); per-device K/V memory stays L/n,
  auto        all_gather while the gathered K/V (and their float32 gradients) that live at once fit
              in 1/16 of a device's memory (`AUTO_GATHER_FRACTION`), ring beyond.

`auto`'s estimate (`auto_estimate`): one layer's gathered K/V under a remat policy (the backward
regathers them layer by layer), every layer's with `model.remat = "none"` (the backward keeps each
layer's residuals). The device memory is the smallest `bytes_limit` the processes' own devices of
the mesh report, agreed across processes (`parallel.agree`, min): a process cannot ask another's
device, and processes that chose differently would trace different collectives. Where no device
reports one (ahead-of-time compiles for abstract TPU devices, CPU) it comes from the device kind
(`DEVICE_MEMORY`), else `DEFAULT_DEVICE_BYTES`. The choice is logged once with its numbers, and
recorded for `compile_plan` (`recorded`), so a pod plan shows what a real run chooses.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import re
from collections.abc import Iterator

import jax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from posttrain.config import CONTEXT_PARALLEL
from posttrain.ops.ring import shard_attention
from posttrain.parallel.agreement import agree
from posttrain.parallel.sharding import current, logical_spec
from posttrain.parallel.zigzag import sequence_shards

AUTO_GATHER_FRACTION = 1 / 16
GiB = 2**30
DEFAULT_DEVICE_BYTES = 16 * GiB
# HBM per device by `device_kind` (first substring match; a GPU kind naming its size, e.g.
# "NVIDIA A100-SXM4-40GB", is read from the name first): used where a device cannot be asked.
DEVICE_MEMORY = (
    ("TPU v5 lite", 16 * GiB),  # v5e
    ("TPU v5", 95 * GiB),  # v5p
    ("TPU v6 lite", 32 * GiB),  # v6e
    ("TPU v4", 32 * GiB),
    ("TPU v3", 16 * GiB),
    ("TPU7x", 192 * GiB),
    ("H200", 141 * 10**9),
    ("H100", 80 * GiB),
    ("H800", 80 * GiB),
    ("B200", 180 * 10**9),
    ("A100", 40 * GiB),
    ("L4", 24 * GiB),
)
_LOGGED: set = set()
_RECORDS: list[list[dict]] = []


def check_mode(mode: str) -> None:
    """Raise naming `model.context_parallel` for an unknown strategy."""
    if mode not in CONTEXT_PARALLEL:
        raise ValueError(f"model.context_parallel={mode!r}: expected one of {CONTEXT_PARALLEL}")


def sequence_axes() -> tuple[tuple[str, ...], int]:
    """The mesh axes (of size > 1) the `length` rule maps to under `use_sharding`, and their size
    (`parallel.zigzag.sequence_shards`: the zig-zag layout's shard count is the ring's)."""
    ctx = current()
    return ((), 1) if ctx is None else sequence_shards(*ctx)


def gathered_kv_bytes(local_kv_shape: tuple[int, ...], n: int, itemsize: int, layers: int = 1) -> int:
    """Bytes one device holds under all_gather for `layers` layers at once: K and V of the whole
    length ([B, s·n, K, Dh] each) plus their float32 gradients in the backward pass."""
    full = math.prod(local_kv_shape) * n
    return 2 * full * (itemsize + 4) * layers


def live_layers(remat: str, num_layers: int) -> int:
    """How many layers' gathered K/V are alive at once in a training step: every layer's with
    `model.remat = "none"` (kept for the backward), one under a remat policy (regathered per layer)."""
    return num_layers if remat == "none" else 1


def kind_memory_bytes(kind: str) -> int | None:
    """HBM bytes of a device of `device_kind` `kind` (`DEVICE_MEMORY`), or None if unknown."""
    sized = re.search(r"(\d+)\s*GB", kind)
    if sized and not kind.startswith("TPU"):
        return int(sized.group(1)) * GiB
    return next((b for name, b in DEVICE_MEMORY if name in kind), None)


def reported_memory_bytes(device) -> int | None:
    """The `bytes_limit` `device` reports, or None (not this process's device, an abstract
    device, a backend without memory stats)."""
    try:
        stats = device.memory_stats() or {}
    except Exception:  # noqa: BLE001 - abstract / non-addressable devices and some backends raise
        return None
    return int(stats["bytes_limit"]) if "bytes_limit" in stats else None


def local_memory_bytes(mesh) -> tuple[int, str]:
    """(bytes, source) as this process sees them: the smallest `bytes_limit` its own devices of
    `mesh` report; else the device kind's (`DEVICE_MEMORY`); else `DEFAULT_DEVICE_BYTES`."""
    here = jax.process_index()
    mine = [d for d in mesh.devices.flat if getattr(d, "process_index", here) == here] or [mesh.devices.flat[0]]
    reported = [b for b in map(reported_memory_bytes, mine) if b is not None]
    if reported:
        return min(reported), "reported"
    kind = mesh.devices.flat[0].device_kind
    known = kind_memory_bytes(kind)
    return (known, f"table ({kind})") if known is not None else (DEFAULT_DEVICE_BYTES, "default")


@functools.cache
def _agreed_memory(devices: tuple, local: tuple[int, str]) -> tuple[int, str]:
    agreed = agree(local[0], name="device memory (context parallelism)", reduce="min")  # at trace time
    return agreed, local[1] if agreed == local[0] else "another process"


def device_memory_bytes(mesh) -> tuple[int, str]:
    """(bytes, source): the per-device memory every process uses for `auto` (module docstring):
    the smallest any process sees; one exchange per mesh (cached)."""
    return _agreed_memory(tuple(d.id for d in mesh.devices.flat), local_memory_bytes(mesh))


def choose(mode: str, kv_bytes: int, device_bytes: int) -> str:
    """The strategy `mode` resolves to: `auto` → all_gather while kv_bytes fits the budget."""
    check_mode(mode)
    if mode != "auto":
        return mode
    return "all_gather" if kv_bytes <= AUTO_GATHER_FRACTION * device_bytes else "ring"


def auto_estimate(mode: str, local_kv_shape, n: int, itemsize: int, layers: int, mesh) -> dict:
    """The strategy `mode` resolves to on `mesh` with its numbers (gathered K/V bytes of `layers`
    live layers, agreed device bytes and where they come from), logged once per distinct choice
    and recorded for `recorded` blocks."""
    kv = gathered_kv_bytes(tuple(local_kv_shape), n, itemsize, layers)
    if mode != "auto":
        return {"mode": mode, "strategy": choose(mode, kv, 0), "kv_bytes": kv, "layers": layers}
    device, source = device_memory_bytes(mesh)
    choice = {
        "mode": mode,
        "strategy": choose(mode, kv, device),
        "kv_bytes": kv,
        "layers": layers,
        "device_bytes": device,
        "device_source": source,
        "budget_bytes": int(AUTO_GATHER_FRACTION * device),
    }
    key = tuple(choice.values())
    if key not in _LOGGED:
        _LOGGED.add(key)
        logging.info(
            "context parallelism auto over %d devices: %s (gathered K/V %.3g GB for %d live layer(s) vs "
            "budget %.3g GB = 1/16 of %.3g GB per device, %s)",
            n,
            choice["strategy"],
            kv / 1e9,
            layers,
            choice["budget_bytes"] / 1e9,
            device / 1e9,
            source,
        )
    for seen in _RECORDS:
        if choice not in seen:
            seen.append(choice)
    return choice


@contextlib.contextmanager
def recorded() -> Iterator[list[dict]]:
    """The distinct choices (`auto_estimate`'s dicts) made while the block traces programs."""
    seen: list[dict] = []
    _RECORDS.append(seen)
    try:
        yield seen
    finally:
        _RECORDS.remove(seen)


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
    layers: int = 1,
) -> jax.Array:
    """Self-attention over a sequence-sharded length (global arrays under `use_sharding`):
    q [B, L, H, Dh], k, v [B, L, K, Dh], positions and segment ids [B, L] → [B, L, H, Dh].
    `layers`: layers whose gathered K/V live at once (`live_layers`), for `auto`."""
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
    strategy = auto_estimate(mode, local, n, k.dtype.itemsize, layers, mesh)["strategy"]
    axis = axes if len(axes) > 1 else axes[0]
    fn = shard_attention(strategy, axis_name=axis, axis_size=n, causal=causal, block_size=block_size)
    return jax.shard_map(
        fn, mesh=mesh, in_specs=(spec, spec, spec, tok, tok, tok, tok), out_specs=spec, check_vma=False
    )(q, k, v, positions, positions, segment_ids, segment_ids)
