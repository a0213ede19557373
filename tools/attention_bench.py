"""Attention benchmarks (`tools/bench.py --section attention`): training tokens/s of each kernel at
equal length, and the longest length whose compiled gradient program fits a per-device memory
budget for `sequence` = 1, 2, 4, 8 (from `memory_analysis`, nothing is run).

Context parallelism needs several devices: on a CPU run with
XLA_FLAGS=--xla_force_host_platform_device_count=8. Simulated devices share the machine's cores,
so there the ring and all-gather rows measure their overhead, not a speed-up.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from posttrain.models.attention import attention_mask, dot_product_attention
from posttrain.ops.blockwise import blockwise_attention
from posttrain.ops.context_parallel import context_parallel_attention
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding

HEADS, KV_HEADS, HEAD_DIM = 8, 4, 64


def reference_attention(q, k, v, pos, seg):
    """The models' xla reference."""
    return dot_product_attention(q, k, v, attention_mask(seg, pos))


def kernels(block: int) -> dict:
    """name → (attend(q, k, v, pos, seg), sequence shards)."""
    blockwise = lambda q, k, v, p, s: blockwise_attention(q, k, v, p, p, s, s, block_size=block)
    cp = lambda mode: lambda q, k, v, p, s: context_parallel_attention(q, k, v, p, s, mode=mode, block_size=block)
    n = min(8, jax.device_count())
    return {
        "xla reference": (reference_attention, 1),
        "blockwise": (blockwise, 1),
        f"ring (sequence={n})": (cp("ring"), n),
        f"all_gather (sequence={n})": (cp("all_gather"), n),
    }


def _grad_program(attend, length: int, n: int):
    """(jitted grad of sum(attention), mesh, argument shapes) at `length`, one row."""
    mesh = make_mesh(dict(data=1, sequence=n), devices=jax.devices()[:n])
    shapes = [(1, length, HEADS, HEAD_DIM), (1, length, KV_HEADS, HEAD_DIM), (1, length, KV_HEADS, HEAD_DIM)]
    fn = jax.jit(jax.grad(lambda q, k, v, p, s: attend(q, k, v, p, s).sum(), argnums=(0, 1, 2)))
    return fn, mesh, shapes


def tokens_per_second(length: int, block: int, iters: int) -> list[dict]:
    """Forward + backward tokens/s of each kernel on one causal row of `length` tokens."""
    rng = np.random.default_rng(0)
    rows = []
    for name, (attend, n) in kernels(block).items():
        fn, mesh, shapes = _grad_program(attend, length, n)
        q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32) for s in shapes)
        pos, seg = jnp.arange(length)[None], jnp.ones((1, length), jnp.int32)
        with use_sharding(mesh, DEFAULT_RULES):
            jax.block_until_ready(fn(q, k, v, pos, seg))
            times = []
            for _ in range(iters):
                t = time.perf_counter()
                jax.block_until_ready(fn(q, k, v, pos, seg))
                times.append(time.perf_counter() - t)
        rows.append({"kernel": name, "length": length, "tokens/s": length / float(np.median(times))})
    for r in rows:
        r["vs reference"] = r["tokens/s"] / rows[0]["tokens/s"]
    return rows


def device_bytes(attend, length: int, n: int) -> int:
    """Per-device bytes (arguments + outputs + temporaries) of the compiled gradient program."""
    fn, mesh, shapes = _grad_program(attend, length, n)
    args = [jax.ShapeDtypeStruct(s, jnp.float32) for s in shapes] + [jax.ShapeDtypeStruct((1, length), jnp.int32)] * 2
    with use_sharding(mesh, DEFAULT_RULES):
        m = fn.lower(*args).compile().memory_analysis()
    return m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes


def longest_fitting(attend, n: int, budget: int, step: int = 1024, limit: int = 2**20) -> int:
    """The longest length (a multiple of `step`) whose program fits `budget` bytes per device:
    doubling, then bisection."""
    fits = lambda length: device_bytes(attend, length, n) <= budget
    low, high = 0, step
    while high <= limit and fits(high):
        low, high = high, high * 2
    while high - low > step:
        mid = (low + high) // 2 // step * step
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def memory_budget_rows(budget_mib: int, block: int) -> list[dict]:
    """Longest fitting length per kernel and `sequence` size under `budget_mib` per device."""
    ks = kernels(block)
    reference, blockwise = ks["xla reference"][0], ks["blockwise"][0]
    budget = budget_mib * 2**20
    rows = [
        {"kernel": "xla reference", "sequence": 1, "longest length": longest_fitting(reference, 1, budget)},
        {"kernel": "blockwise", "sequence": 1, "longest length": longest_fitting(blockwise, 1, budget)},
    ]
    for mode in ("ring", "all_gather"):
        attend = lambda q, k, v, p, s, mode=mode: context_parallel_attention(q, k, v, p, s, mode=mode, block_size=block)
        for n in (2, 4, 8):
            if n <= jax.device_count():
                rows.append({"kernel": mode, "sequence": n, "longest length": longest_fitting(attend, n, budget)})
    for r in rows:
        r["budget MiB/device"] = budget_mib
    return rows


def attention_bench(length: int = 2048, block: int = 512, iters: int = 5, budget_mib: int = 256) -> list[dict]:
    """Both tables, tokens/s first."""
    return tokens_per_second(length, block, iters) + memory_budget_rows(budget_mib, block)
