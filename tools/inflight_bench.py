"""Overhead of in-flight weight updates (`python tools/bench.py --section inflight`).

Static generation vs `generate_inflight` with weights that never change, so both draw the same
tokens (checked) and the difference is the cost of cutting the decode loop into chunks of `every`
steps: one host round trip (the `latest()` call, the slots' step counters and done flags) per
chunk. The tiny Qwen3-style dense model (random weights, one device), B prompts × max_new tokens
at temperature 1. Each round times static and every chunk size back to back, so the per-round
ratios (in-flight seconds / static seconds) see the same machine load: median and range.
"""

from __future__ import annotations

import time

import jax
import numpy as np
from flax import nnx

from posttrain.models.decoder import Decoder
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.sampling.bench import qwen3_tiny_configs
from posttrain.sampling.generate import generate
from posttrain.sampling.inflight import generate_inflight
from posttrain.sampling.rules import SamplingParams


def _timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def inflight_bench(*, prompts: int = 32, max_new: int = 64, everies=(1, 4, 16), rounds: int = 5) -> list[dict]:
    """Rows per chunk size: median seconds per call and the per-round slowdown vs static (median,
    min, max), plus the static row itself."""
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    cfg = qwen3_tiny_configs()["dense"]
    graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng = np.random.default_rng(0)
    batch = [rng.integers(3, cfg.vocab_size, rng.integers(16, 33)).tolist() for _ in range(prompts)]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=max_new)
    latest = lambda: (0, params, rest)  # noqa: E731 (weights never change: the same tokens as static)
    times = {"static": [], **{e: [] for e in everies}}
    with use_sharding(mesh, rules):
        for r in range(rounds + 1):  # round 0: compilation, not counted
            key = jax.random.key(r)
            s, ref = _timed(lambda: generate(graphdef, params, rest, batch, sampling, key))
            if r:
                times["static"].append(s)
            for every in everies:
                s, out = _timed(lambda: generate_inflight(graphdef, latest, batch, sampling, key, every=every))
                if not np.array_equal(out.tokens, ref.tokens):
                    raise AssertionError(f"every={every}: in-flight generation changed the tokens")
                if r:
                    times[every].append(s)
    static = np.array(times["static"])
    rows = [{"name": f"static, {prompts} prompts x {max_new} new", "s (median)": float(np.median(static))}]
    for every in everies:
        ratio = np.array(times[every]) / static
        rows.append(
            {
                "name": f"in-flight, every {every} steps ({-(-max_new // every)} chunks)",
                "s (median)": float(np.median(times[every])),
                "x static per round (median)": float(np.median(ratio)),
                "min": float(ratio.min()),
                "max": float(ratio.max()),
            }
        )
    return rows
