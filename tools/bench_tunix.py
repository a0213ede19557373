"""Peer comparison (issue 4): our KV-cached sampler vs Tunix's `Sampler` on the tiny Qwen3-style
configs (4 layers, width 256, 8 heads of 32, 4 KV heads, QK-norm, MLP 512, vocab 512; dense and
8 experts top-2 with expert MLP 512), batch 16 x prompt 32 random token ids, 64 new tokens, no
early stop, on one CPU device. Prints new tokens/s (batch * new tokens / best wall seconds of one
whole public-API call: host prep, prefill, decode loop, copy back).

Tunix (`google-tunix`) is not a dependency: it lives in its own virtualenv. One script, three modes:

    # one implementation, in the venv that has it (prints one JSON line per config):
    /tmp/venv/bin/python tools/bench_tunix.py --impl posttrain
    /tmp/tunix-venv/bin/python tools/bench_tunix.py --impl tunix
    # both, back to back, interleaved posttrain, tunix, posttrain, tunix, ... (a driver that runs
    # the two above as subprocesses with the same XLA_FLAGS and reports the best of all rounds):
    /tmp/venv/bin/python tools/bench_tunix.py --impl both --rounds 2 \
        --posttrain-python /tmp/venv/bin/python --tunix-python /tmp/tunix-venv/bin/python

Sampling is the same for both: temperature 1 with top-k and top-p off (default), or greedy
(`--greedy`). Stop tokens: none for ours; for Tunix an id outside the vocabulary (never sampled).
Tunix's Qwen3 weights are re-drawn at random (its dense MLP initialises to zeros; the speed does
not depend on it, but the outputs then look like a real model's).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

DEFAULT_XLA_FLAGS = "--xla_force_host_platform_device_count=1"
KINDS = ("dense", "moe-8x2")
SHAPE = dict(vocab=512, embed=256, layers=4, heads=8, kv_heads=4, head_dim=32, mlp=512, experts=8, top_k=2)


def _set_env():
    os.environ.setdefault("XLA_FLAGS", DEFAULT_XLA_FLAGS)
    os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _best_seconds(fns: dict, iters: int) -> dict:
    """Warm-up (compile) each blocking fn, then best wall seconds over `iters` interleaved rounds."""
    for fn in fns.values():
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(iters):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t)
    return best


def _prompts(batch: int, prompt_len: int):
    import numpy as np

    return np.random.default_rng(0).integers(3, SHAPE["vocab"], (batch, prompt_len)).astype(np.int32)


# ---------------------------------------------------------------------------------------- ours


def run_posttrain(args) -> list[dict]:
    import jax
    from flax import nnx

    from posttrain.models.decoder import Decoder
    from posttrain.models.quant import quantize_params
    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.sampling.bench import qwen3_tiny_configs
    from posttrain.sampling.generate import generate
    from posttrain.sampling.rules import SamplingParams

    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    prompts = _prompts(args.batch, args.prompt_len)
    sampling = SamplingParams(temperature=0.0 if args.greedy else 1.0, max_new_tokens=args.new_tokens, stop_ids=())
    key = jax.random.key(0)
    fns = {}
    for kind in args.kinds:
        cfg = qwen3_tiny_configs()[kind]
        graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
        if args.quantize != "none":  # the RL sampler's weights under sampling.quantize (w8a16 / w4a16)
            params = jax.jit(quantize_params, static_argnums=1)(params, args.quantize)

        def call(graphdef=graphdef, params=params, rest=rest):
            with use_sharding(mesh, rules):
                out = generate(graphdef, params, rest, prompts, sampling, key)
            assert (out.lengths == args.new_tokens).all(), out.lengths  # no early stop
            return out

        fns[kind] = call
    best = _best_seconds(fns, args.iters)
    return [_row("posttrain", kind, best[kind], args) for kind in args.kinds]


# ---------------------------------------------------------------------------------------- Tunix


class _IdTokenizer:
    """Token ids in, token ids out: a prompt is its ids joined by spaces. No BOS; pad 0 (never in a
    prompt: ids are drawn from 3..vocab-1); EOS = vocab (never sampled)."""

    def encode(self, text, **_):
        return [int(t) for t in text.split()]

    def decode(self, ids, **_):
        return " ".join(map(str, ids))

    def bos_id(self):
        return None

    def eos_id(self):
        return SHAPE["vocab"]

    def pad_id(self):
        return 0


def tunix_model(kind: str, seed: int = 0):
    import jax
    from flax import nnx
    from tunix.models.qwen3 import model as qwen3

    moe = kind != "dense"
    cfg = qwen3.ModelConfig(
        num_layers=SHAPE["layers"],
        vocab_size=SHAPE["vocab"],
        embed_dim=SHAPE["embed"],
        hidden_dim=SHAPE["mlp"],
        num_heads=SHAPE["heads"],
        head_dim=SHAPE["head_dim"],
        num_kv_heads=SHAPE["kv_heads"],
        rope_theta=10_000,
        norm_eps=1e-6,
        use_tied_embedding=False,
        num_experts=SHAPE["experts"] if moe else None,
        num_experts_per_tok=SHAPE["top_k"] if moe else None,
    )
    model = qwen3.Qwen3(cfg, rngs=nnx.Rngs(seed))
    state = nnx.state(model, nnx.Param)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    leaves = [jax.random.normal(k, x.shape, x.dtype) * 0.05 if x.ndim >= 2 else x for k, x in zip(keys, leaves)]
    nnx.update(model, jax.tree.unflatten(treedef, leaves))
    return model


def run_tunix(args) -> list[dict]:
    import warnings

    from tunix.generate import sampler as sampler_lib

    warnings.filterwarnings("ignore")  # "donated buffers were not usable" on CPU, etc.
    prompts = [" ".join(map(str, p)) for p in _prompts(args.batch, args.prompt_len)]
    cache = sampler_lib.CacheConfig(
        cache_size=args.prompt_len + args.new_tokens,
        num_layers=SHAPE["layers"],
        num_kv_heads=SHAPE["kv_heads"],
        head_dim=SHAPE["head_dim"],
    )
    sampling = dict(temperature=0.0) if args.greedy else dict(temperature=1.0, top_p=1.0, top_k=None)
    fns = {}
    for kind in args.kinds:
        sampler = sampler_lib.Sampler(tunix_model(kind), _IdTokenizer(), cache)

        def call(sampler=sampler):
            out = sampler(
                prompts,
                max_generation_steps=args.new_tokens,
                max_prompt_length=args.prompt_len,
                echo=False,
                eos_tokens=[SHAPE["vocab"]],
                seed=0,
                **sampling,
            )
            assert all(len(t) == args.new_tokens for t in out.tokens), [len(t) for t in out.tokens]
            return out

        fns[kind] = call
    best = _best_seconds(fns, args.iters)
    return [_row("tunix", kind, best[kind], args) for kind in args.kinds]


# ---------------------------------------------------------------------------------------- driver


def _row(impl: str, kind: str, seconds: float, args) -> dict:
    new = args.batch * args.new_tokens
    return dict(impl=impl, kind=kind, ms=seconds * 1e3, new_tokens_per_s=new / seconds)


def _versions(impl: str) -> dict:
    from importlib import metadata

    names = ["jax", "jaxlib", "flax"] + (["google-tunix"] if impl == "tunix" else [])
    return {n: metadata.version(n) for n in names}


def drive(args) -> None:
    """Run the two implementations as subprocesses, alternating, with one environment."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), env.get("PYTHONPATH", "")])
    )
    pythons = dict(posttrain=args.posttrain_python, tunix=args.tunix_python)
    passthrough = [
        "--batch",
        str(args.batch),
        "--prompt-len",
        str(args.prompt_len),
        "--new-tokens",
        str(args.new_tokens),
        "--iters",
        str(args.iters),
        "--kinds",
        *args.kinds,
        "--quantize",
        args.quantize,
    ] + (["--greedy"] if args.greedy else [])
    best, versions, per_round = {}, {}, []
    for r in range(args.rounds):
        this_round = {}
        for impl in ("posttrain", "tunix"):
            cmd = [pythons[impl], os.path.abspath(__file__), "--impl", impl, *passthrough]
            res = subprocess.run(cmd, env=env, capture_output=True, text=True)
            if res.returncode:
                sys.exit(f"{' '.join(cmd)} failed:\n{res.stderr[-4000:]}")
            for line in res.stdout.splitlines():
                if not line.startswith("{"):
                    continue
                row = json.loads(line)
                if "versions" in row:
                    versions[impl] = row["versions"]
                    continue
                print(
                    f"round {r} {impl:9s} {row['kind']:8s} {row['ms']:8.1f} ms "
                    f"{row['new_tokens_per_s']:9.0f} new tokens/s",
                    flush=True,
                )
                k = (impl, row["kind"])
                this_round[k] = row["new_tokens_per_s"]
                if k not in best or row["ms"] < best[k]["ms"]:
                    best[k] = row
        per_round.append(this_round)
    print(f"\nXLA_FLAGS={env.get('XLA_FLAGS')!r}  versions={json.dumps(versions)}")
    print(
        f"batch {args.batch}, prompt {args.prompt_len}, {args.new_tokens} new tokens, "
        f"{'greedy' if args.greedy else 'temperature 1'}, posttrain weights {args.quantize}; "
        f"best of {args.rounds} rounds x {args.iters} iters"
    )
    print(f"{'config':8s} {'posttrain tok/s':>16s} {'tunix tok/s':>12s} {'ours/tunix':>11s}")
    for kind in args.kinds:
        p, t = best[("posttrain", kind)], best[("tunix", kind)]
        print(
            f"{kind:8s} {p['new_tokens_per_s']:16.0f} {t['new_tokens_per_s']:12.0f} "
            f"{p['new_tokens_per_s'] / t['new_tokens_per_s']:10.2f}x"
        )
    # The machine's speed drifts between rounds; the ratio within a round (the two libraries back
    # to back) is steadier than the ratio of bests.
    for kind in args.kinds:
        ratios = sorted(r[("posttrain", kind)] / r[("tunix", kind)] for r in per_round)
        print(
            f"{kind:8s} per-round ours/tunix: median {ratios[len(ratios) // 2]:.2f}x, "
            f"range {ratios[0]:.2f}-{ratios[-1]:.2f}x over {len(ratios)} rounds"
        )
    if "dense" in args.kinds and "moe-8x2" in args.kinds:
        for impl in ("posttrain", "tunix"):
            print(
                f"{impl}: moe-8x2 / dense = "
                f"{best[(impl, 'moe-8x2')]['new_tokens_per_s'] / best[(impl, 'dense')]['new_tokens_per_s']:.2f}"
            )
    print(json.dumps({f"{i}/{k}": round(v["new_tokens_per_s"], 1) for (i, k), v in best.items()}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("posttrain", "tunix", "both"), required=True)
    ap.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=5, help="timed calls per config after the warm-up")
    ap.add_argument("--rounds", type=int, default=2, help="--impl both: alternations posttrain, tunix")
    ap.add_argument("--greedy", action="store_true", help="argmax for both (default: temperature 1)")
    ap.add_argument(
        "--quantize",
        choices=("none", "int8", "int4"),
        default="none",
        help="posttrain's sampler weights as sampling.quantize sets them (Tunix: unchanged)",
    )
    ap.add_argument("--posttrain-python", default="/tmp/venv/bin/python")
    ap.add_argument("--tunix-python", default="/tmp/tunix-venv/bin/python")
    args = ap.parse_args()
    _set_env()
    if args.impl == "both":
        drive(args)
        return
    rows = (run_posttrain if args.impl == "posttrain" else run_tunix)(args)
    import jax

    print(json.dumps(dict(versions=_versions(args.impl), devices=[str(d) for d in jax.devices()])))
    for row in rows:
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
