"""Benchmarks (`python tools/bench.py [--section train] [--quick]`): numbers for BENCHMARKS.md.

Everything in one run is measured side by side on the same machine; MFU is against the peak of a
plain float32 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.config import base_config
from posttrain.models.decoder import Decoder
from posttrain.models.flops import activated_matmul_params, train_flops_per_token
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.train.optim import make_optimizer
from posttrain.train.state import create_train_state
from posttrain.train.step import lm_loss, make_train_step


def timeit(fn, *, warmup: int = 2, iters: int = 10) -> float:
    """Median seconds per call of `fn` (which must block on its result)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times))


def matmul_peak(n: int = 1024, dtype=jnp.float32) -> float:
    """FLOP/s of a plain [n, n] @ [n, n] matmul: the machine's practical peak for MFU."""
    a = jnp.ones((n, n), dtype)
    f = jax.jit(lambda a, b: a @ b)
    sec = timeit(lambda: f(a, a).block_until_ready(), iters=20)
    return 2 * n ** 3 / sec


def bench_configs():
    """A small dense config and an 8-expert top-2 MoE with the same activated parameters."""
    dense = base_config()
    m = dense.model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 512, 256, 4, 8, 4, 32
    m.mlp_dim = 1024
    moe = base_config()
    moe.model.update(m.to_dict())
    moe.model.moe.num_experts, moe.model.moe.top_k, moe.model.moe.expert_mlp_dim = 8, 2, 512
    return {"dense": dense, "moe-8x2": moe}


def bench_train(batch: int, seq: int, iters: int) -> list[dict]:
    peak = matmul_peak()
    rows = [{"name": "matmul f32 1024^3", "GFLOP/s": peak / 1e9}]
    for name, cfg in bench_configs().items():
        mesh = make_mesh(dict(data=1), devices=jax.devices()[:1])
        rules = parse_rules({})
        tx = make_optimizer(cfg.optim, 1000)
        with use_sharding(mesh, rules):
            graphdef, state, shardings = create_train_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, rules)
            step = jax.jit(make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe)), out_shardings=(shardings, None),
                           donate_argnums=0)
            rng = np.random.default_rng(0)
            tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, seq + 1)))
            b = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": jnp.ones((batch, seq), jnp.int32),
                 "positions": jnp.broadcast_to(jnp.arange(seq), (batch, seq)),
                 "segment_ids": jnp.ones((batch, seq), jnp.int32)}
            box = [state]

            def run():
                box[0], metrics = step(box[0], b)
                metrics["loss"].block_until_ready()
            sec = timeit(run, iters=iters)
        tps = batch * seq / sec
        flops = train_flops_per_token(cfg.model, seq) * tps
        rows.append({"name": f"train {name}", "activated params (M)": activated_matmul_params(cfg.model) / 1e6,
                     "step ms": sec * 1e3, "tokens/s": tps, "MFU": flops / peak})
    rows.append({"name": "moe / dense tokens/s", "ratio": rows[2]["tokens/s"] / rows[1]["tokens/s"]})
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n### {title}  (jax {jax.__version__}, {jax.devices()[0].platform}, {jax.device_count()} devices)")
    for r in rows:
        print("| " + " | ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--section", default="train", choices=["train"])
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if args.section == "train":
        print_rows("train step", bench_train(args.batch, args.seq, args.iters))


if __name__ == "__main__":
    main()
