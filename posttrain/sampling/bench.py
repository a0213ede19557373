"""Sampler benchmarks, measured side by side in one run (called from `tools/bench.py`).

- decode: KV-cached generation vs naive recomputation (a full forward pass per new token, also
  in one compiled loop), in new tokens/s; and the decode steps' feed-forward blocks alone (MLP or
  MoE), which bound how close MoE decode can come to dense on this machine;
- groups: G samples of a prompt with one shared prefill vs G prefills of the repeated prompt;
- continuous vs static batching on a skewed length distribution, in useful tokens/s;
- quantised sampler weights (w8a16, w4a16) vs float32, new tokens/s (`quant_bench`);
- speculative decoding vs plain decoding: acceptance rate and speed-up (`speculative_bench`).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.config import ModelConfig
from posttrain.models.decoder import Decoder
from posttrain.models.quant import QArray, quantize_params
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.sampling.continuous import ContinuousBatcher
from posttrain.sampling.generate import generate
from posttrain.sampling.rules import SamplingParams, sample_token


def qwen3_tiny_configs() -> dict[str, ModelConfig]:
    """Tiny Qwen3-style model configs: 4 layers, width 256, 8 heads of 32, 4 KV heads, QK-norm,
    MLP 512, vocab 512; dense and 8 experts top-2 (expert MLP 512)."""
    shape = dict(vocab_size=512, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=512)
    return {
        name: ModelConfig(**shape, qk_norm=True).replace(
            {"moe.num_experts": experts, "moe.top_k": 2, "moe.expert_mlp_dim": 512}
        )
        for name, experts in (("dense", 0), ("moe-8x2", 8))
    }


@dataclasses.dataclass(frozen=True)
class TinyRun:
    """What the sampler benchmarks share: `batch` prompts of `prompt_len` random tokens, up to
    `max_new` new tokens at temperature 1, on each tiny config of `kinds` (`qwen3_tiny_configs`,
    random weights), one device."""

    batch: int = 16
    prompt_len: int = 32
    max_new: int = 64
    kinds: tuple[str, ...] = ("dense", "moe-8x2")

    def sampling(self) -> SamplingParams:
        """Temperature 1, `max_new` new tokens."""
        return SamplingParams(temperature=1.0, max_new_tokens=self.max_new)

    def prompts(self, rng: np.random.Generator, rows: int | None = None) -> np.ndarray:
        """`rows` (default: `batch`) prompts of random token ids, int32 [rows, prompt_len]."""
        return rng.integers(3, 512, (self.batch if rows is None else rows, self.prompt_len)).astype(np.int32)

    def models(self):
        """Each kind and its tiny model split (graphdef, params, rest), yielded under the sharding
        of one device."""
        mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
        for kind in self.kinds:
            model = nnx.split(Decoder(qwen3_tiny_configs()[kind], rngs=nnx.Rngs(0)), nnx.Param, ...)
            with use_sharding(mesh, rules):
                yield kind, model


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "prompt_len"))
def recompute_program(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    prompts: jax.Array,
    key: jax.Array,
    *,
    sampling: SamplingParams,
    prompt_len: int,
) -> jax.Array:
    """Generation without a cache: prompts [B, P + M] (prompt in the first P) → tokens [B, P + M],
    each new token from a full forward pass over the whole buffer, in one `fori_loop`."""
    model = nnx.merge(graphdef, params, rest)
    b, width = prompts.shape

    def step(n, tokens):
        length = prompt_len + n
        segment_ids = jnp.broadcast_to(jnp.arange(width) < length, (b, width)).astype(jnp.int32)
        logits = model(tokens, None, segment_ids)[0][:, length - 1]
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.fold_in(key, i), n))(jnp.arange(b))
        new = jax.vmap(sample_token, in_axes=(0, 0, None))(keys, logits, sampling)[0]
        return jax.lax.dynamic_update_slice_in_dim(tokens, new[:, None].astype(tokens.dtype), length, 1)

    return jax.lax.fori_loop(0, sampling.max_new_tokens, step, prompts)


@functools.partial(jax.jit, static_argnames=("graphdef", "steps"))
def feed_forward_program(
    graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, x: jax.Array, *, steps: int
) -> jax.Array:
    """The feed-forward half of `steps` decode steps alone: x [B, 1, D] through every layer's MLP or
    MoE block (norm and residual included), the layers hoisted as the sampler hoists them."""
    layers = nnx.merge(graphdef, params, rest).layers()

    def step(_, x):
        for block in layers:
            x = block.feed_forward(x, inference=True)[0]
        return x

    return jax.lax.fori_loop(0, steps, step, x)


def _best_seconds(fns: dict, iters: int) -> dict:
    """Best wall seconds of each blocking `fn()` over `iters` rounds, after a warm-up
    (compilation). Rounds interleave the functions, so load from other work on the machine
    falls on all of them alike, and the best time is the least disturbed."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def skewed_limits(num: int, short: tuple[int, int], long: int, long_fraction: float, seed: int = 0) -> list[int]:
    """New-token limits: most uniform in `short` (inclusive), a `long_fraction` at `long`."""
    rng = np.random.default_rng(seed)
    limits = rng.integers(short[0], short[1] + 1, num)
    limits[rng.permutation(num)[: max(1, round(num * long_fraction))]] = long
    return limits.tolist()


def _decode_rows(
    kind, graphdef, params, rest, prompts, sampling, key, *, batch, iters
) -> tuple[list[dict], float, float]:
    """Decode rows of one model kind: KV cache vs recomputation, and the feed-forward blocks alone;
    with the cached decode's and the feed-forward blocks' best seconds."""
    max_new, prompt_len = sampling.max_new_tokens, prompts.shape[1]
    buffer = np.pad(prompts[:batch], ((0, 0), (0, max_new)))
    naive = recompute_program.lower(
        graphdef, params, rest, buffer, key, sampling=sampling, prompt_len=prompt_len
    ).compile()
    x = jax.random.normal(key, (batch, 1, qwen3_tiny_configs()[kind].embed_dim))
    t = _best_seconds(
        {
            "cache": lambda: generate(graphdef, params, rest, prompts[:batch], sampling, key),
            "ffn": lambda: jax.block_until_ready(feed_forward_program(graphdef, params, rest, x, steps=max_new)),
        },
        iters,
    )
    t0 = time.perf_counter()  # once: it is slow, and already compiled
    jax.block_until_ready(naive(params, rest, buffer, key))
    t_naive = time.perf_counter() - t0
    new_tokens = batch * max_new
    rows = [
        {"name": f"decode {kind} kv-cache", "new tokens/s": new_tokens / t["cache"], "ms": t["cache"] * 1e3},
        {"name": f"decode {kind} recompute", "new tokens/s": new_tokens / t_naive, "ms": t_naive * 1e3},
        {"name": f"decode {kind} cache speed-up", "x": t_naive / t["cache"]},
        {
            "name": f"decode {kind} feed-forward blocks alone",
            "ms": t["ffn"] * 1e3,
            "share of decode": t["ffn"] / t["cache"],
        },
    ]
    return rows, t["cache"], t["ffn"]


def _group_rows(kind, graphdef, params, rest, heads, sampling, key, *, group, iters) -> list[dict]:
    """G samples of each prompt with one shared prefill vs G prefills of the repeated prompt."""
    rows = []
    for new in (1, sampling.max_new_tokens):
        grouped = dataclasses.replace(sampling, max_new_tokens=new, num_samples=group)
        single = dataclasses.replace(grouped, num_samples=1)
        t = _best_seconds(
            {
                "shared": lambda: generate(graphdef, params, rest, heads, grouped, key),
                "each": lambda: generate(graphdef, params, rest, np.repeat(heads, group, 0), single, key),
            },
            iters,
        )
        rows.append(
            {
                "name": f"group G={group} {kind} {new} new",
                "shared prefill ms": t["shared"] * 1e3,
                "prefill per sample ms": t["each"] * 1e3,
                "x": t["each"] / t["shared"],
            }
        )
    return rows


def _skewed_rows(kind, graphdef, params, rest, prompts, sampling, key, *, batch, iters) -> list[dict]:
    """Static vs continuous batching of `prompts` under skewed new-token limits, in useful tokens/s."""
    requests = len(prompts)
    limits = skewed_limits(requests, (2, 12), sampling.max_new_tokens, 1 / 8)

    def static():
        for i in range(0, requests, batch):
            generate(
                graphdef, params, rest, prompts[i : i + batch], sampling, key, max_new_tokens=limits[i : i + batch]
            )

    fns = {"static": static}
    for chunk in (4, 8):  # requests prefilled together on a refill
        batcher = ContinuousBatcher(graphdef, sampling, num_slots=batch, prefill_batch=chunk)

        def continuous(batcher=batcher):
            for p, limit in zip(prompts, limits):
                batcher.submit(p, limit)
            return batcher.run(params, rest, key)

        fns[f"continuous, refill by {chunk}"] = continuous
    t = _best_seconds(fns, iters)
    useful = sum(limits)
    return [
        {
            "name": f"skewed {kind} {name}",
            "useful tokens/s": useful / t[name],
            "ms": t[name] * 1e3,
            "x vs static": t["static"] / t[name],
        }
        for name in fns
    ]


def sampler_bench(run: TinyRun = TinyRun(), *, group: int = 8, requests: int = 64, iters: int = 3) -> list[dict]:
    """Rows of sampler timings on one device for the tiny Qwen3-style configs (see module doc)."""
    rng, sampling, key = np.random.default_rng(0), run.sampling(), jax.random.key(0)
    rows, decode_s, ffn_s = [], {}, {}
    for kind, model in run.models():
        prompts = run.prompts(rng, requests)
        decode, decode_s[kind], ffn_s[kind] = _decode_rows(
            kind, *model, prompts, sampling, key, batch=run.batch, iters=iters
        )
        heads = prompts[: run.batch // group]
        rows += decode + _group_rows(kind, *model, heads, sampling, key, group=group, iters=iters)
        rows += _skewed_rows(kind, *model, prompts, sampling, key, batch=run.batch, iters=iters)
    if {"dense", "moe-8x2"} <= set(run.kinds):
        dense, moe = decode_s["dense"], decode_s["moe-8x2"]
        rows.append(
            {
                "name": "decode moe-8x2 / dense new tokens/s",
                "x": dense / moe,
                # MoE decode if all but its feed-forward blocks cost what dense decode costs
                "bound from feed-forward alone": dense / (dense - ffn_s["dense"] + ffn_s["moe-8x2"]),
            }
        )
    return rows


def quant_bench(run: TinyRun = TinyRun(), *, rounds: int = 5) -> list[dict]:
    """New tokens/s of the sampler with float32, int8 (w8a16) and int4 (w4a16) weights (`TinyRun`).
    Each round times the modes back to back, so a round's ratios see the same machine load; rows
    give each mode's best and the per-round ratio to float32 (median and range) in wall time and in
    process CPU time (steadier on a shared machine). "int8 values as bf16" holds the int8 values in
    bfloat16, so the matmuls read their operand with no conversion: the bound on any w8a16
    formulation that avoids the per-step int8 → bf16 copy (see BENCHMARKS.md)."""
    prompts, sampling, key, rows = run.prompts(np.random.default_rng(0)), run.sampling(), jax.random.key(0), []
    for kind, (graphdef, params, rest) in run.models():
        quantize = jax.jit(quantize_params, static_argnums=1)
        weights = {mode: quantize(params, mode) for mode in ("none", "int8", "int4")}
        weights["int8 values as bf16"] = jax.tree.map(
            lambda v: dataclasses.replace(v, qvalue=v.qvalue.astype(jnp.bfloat16)) if isinstance(v, QArray) else v,
            weights["int8"],
            is_leaf=lambda v: isinstance(v, QArray),
        )
        wall, cpu = _interleaved(
            {
                mode: functools.partial(generate, graphdef, w, rest, prompts, sampling, key)
                for mode, w in weights.items()
            },
            rounds,
            cpu_too=True,
        )
        for mode in weights:
            ratios, cpu_ratios = (np.array(t["none"]) / np.array(t[mode]) for t in (wall, cpu))
            rows.append(
                {
                    "name": f"quantised sampler {kind} {mode}",
                    "new tokens/s": run.batch * run.max_new / min(wall[mode]),
                    "x vs f32 per round (median)": float(np.median(ratios)),
                    "min": float(ratios.min()),
                    "max": float(ratios.max()),
                    "CPU-time x (median)": float(np.median(cpu_ratios)),
                    "cpu min": float(cpu_ratios.min()),
                    "cpu max": float(cpu_ratios.max()),
                }
            )
    return rows


def _interleaved(calls: dict, rounds: int, cpu_too: bool = False) -> dict | tuple[dict, dict]:
    """Seconds of each blocking call per round, after one warm-up call each (compilation); each
    round runs them back to back, so per-round ratios see the same machine load. `cpu_too`: also
    the process CPU seconds of each call (a second dict)."""
    for call in calls.values():
        call()
    times, cpu = {name: [] for name in calls}, {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            t, c = time.perf_counter(), time.process_time()
            call()
            times[name].append(time.perf_counter() - t)
            cpu[name].append(time.process_time() - c)
    return (times, cpu) if cpu_too else times


def speculative_bench(
    run: TinyRun = TinyRun(),
    *,
    rounds: int = 5,
    variants: tuple[tuple[int, int], ...] = ((2, 1), (4, 1), (2, 2), (4, 4)),
) -> list[dict]:
    """Speculative decoding (k drafted tokens, draft = the first n of the 4 layers) vs plain
    decoding (`TinyRun`): new tokens/s, acceptance rate and the per-round speed-up (median and
    range). n = 4 drafts with the whole policy: every draft is accepted, so that row is the
    mechanism's own overhead."""
    prompts, plain, key, rows = run.prompts(np.random.default_rng(0)), run.sampling(), jax.random.key(0), []
    for kind, (graphdef, params, rest) in run.models():
        modes = {
            "plain": plain,
            **{f"k={k} draft={n}": dataclasses.replace(plain, speculative_k=k, draft_layers=n) for k, n in variants},
        }
        calls = {
            name: functools.partial(generate, graphdef, params, rest, prompts, sp, key) for name, sp in modes.items()
        }
        times = _interleaved(calls, rounds)
        accepted = {name: calls[name]().acceptance_rate for name in modes}
        for name, ts in times.items():
            ratios = np.array(times["plain"]) / np.array(ts)
            rows.append(
                {
                    "name": f"speculative {kind} {name}",
                    "new tokens/s": run.batch * run.max_new / min(ts),
                    "acceptance": accepted[name],
                    "x vs plain per round (median)": float(np.median(ratios)),
                    "min": float(ratios.min()),
                    "max": float(ratios.max()),
                }
            )
    return rows
