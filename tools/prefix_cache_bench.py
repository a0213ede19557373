"""Prefix cache on a multi-turn workload (`python tools/bench.py --section prefix-cache`).

E episodes × T turns with the tiny Qwen3-style dense model (random weights, one device): every
episode starts with the same system prompt and its own user prompt; each turn samples a completion
(temperature 1) and appends it and a tool output of random tokens, so turn t's prompt is turn t−1's
context + completion + tool output. Each round runs the whole workload without and with a prefix
cache (fresh at the start of the round, as after an RL update), back to back, so per-round ratios
see the same machine load. Rows: seconds per round, the hit rate (prompt tokens served from the
cache / prompt tokens), the per-round speed-up (median and range) and the seconds saved.
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
from posttrain.sampling.prefix_cache import PrefixCache
from posttrain.sampling.rules import SamplingParams


def run_workload(
    policy, first: list[list[int]], tools: list[list[list[int]]], sampling: SamplingParams, cache: PrefixCache | None
) -> tuple[float, list[list[int]]]:
    """All turns of the episodes (first prompts `first`, tools[t][e] the tool output after turn t):
    (seconds, final contexts)."""
    contexts, t0 = [list(p) for p in first], time.perf_counter()
    for turn, outputs in enumerate(tools):
        samples = generate(*policy, contexts, sampling, jax.random.key(turn), prefix_cache=cache)
        contexts = [c + samples.completion(e) + outputs[e] for e, c in enumerate(contexts)]
    return time.perf_counter() - t0, contexts


def prefix_cache_bench(
    *,
    episodes: int = 8,
    turns: int = 4,
    rounds: int = 5,
    workloads: tuple[tuple[int, int, int], ...] = ((64, 32, 24), (448, 8, 24)),
) -> list[dict]:
    """Rows per workload (system prompt tokens, new tokens per turn, tool output tokens): plain vs
    cached seconds per round, hit rate, per-round speed-up (median, min, max), seconds saved."""
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    cfg = qwen3_tiny_configs()["dense"]
    policy = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    rng, rows = np.random.default_rng(0), []
    for system_len, new, tool_len in workloads:
        system = rng.integers(3, cfg.vocab_size, system_len).tolist()
        first = [system + rng.integers(3, cfg.vocab_size, rng.integers(16, 33)).tolist() for _ in range(episodes)]
        tools = [[rng.integers(3, cfg.vocab_size, tool_len).tolist() for _ in range(episodes)] for _ in range(turns)]
        sampling = SamplingParams(temperature=1.0, max_new_tokens=new)
        times, stats = {"plain": [], "cached": []}, []
        with use_sharding(mesh, rules):
            for r in range(rounds + 1):  # round 0: compilation, not counted
                plain_s, plain_ctx = run_workload(policy, first, tools, sampling, None)
                cache = PrefixCache(1 << 20)
                cached_s, cached_ctx = run_workload(policy, first, tools, sampling, cache)
                if cached_ctx != plain_ctx:
                    raise AssertionError("the prefix cache changed the sampled tokens")
                if r:
                    times["plain"].append(plain_s)
                    times["cached"].append(cached_s)
                    stats.append(cache.stats)
        ratios = np.array(times["plain"]) / np.array(times["cached"])
        name = f"{episodes} episodes x {turns} turns, system {system_len}, new {new}, tool {tool_len}"
        rows.append(
            {
                "name": name,
                "plain s": float(np.median(times["plain"])),
                "cached s": float(np.median(times["cached"])),
                "hit rate": stats[-1].hit_rate,
                "prompt tokens": stats[-1].prompt_tokens,
                "from cache": stats[-1].hit_tokens,
                "x per round (median)": float(np.median(ratios)),
                "min": float(ratios.min()),
                "max": float(ratios.max()),
                "s saved (median)": float(np.median(np.array(times["plain"]) - np.array(times["cached"]))),
            }
        )
    return rows
