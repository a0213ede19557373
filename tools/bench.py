"""Benchmarks (`python tools/bench.py [--section train] [--quick]`): numbers for BENCHMARKS.md.

Everything in one run is measured side by side on the same machine; MFU is against the peak of a
plain float32 matmul measured in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.config import RunConfig
from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state
from posttrain.core.step import lm_loss, make_train_step
from posttrain.models.decoder import Decoder
from posttrain.models.flops import activated_matmul_params, train_flops_per_token
from posttrain.parallel import make_mesh, parse_rules, use_sharding


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
    return 2 * n**3 / sec


def bench_configs() -> dict[str, RunConfig]:
    """A small dense config and an 8-expert top-2 MoE with the same activated parameters."""
    shape = dict(vocab_size=512, embed_dim=256, num_layers=4, num_heads=8, num_kv_heads=4, head_dim=32, mlp_dim=1024)
    dense = RunConfig().replace({f"model.{k}": v for k, v in shape.items()})
    moe = dense.replace({"model.moe.num_experts": 8, "model.moe.top_k": 2, "model.moe.expert_mlp_dim": 512})
    return {"dense": dense, "moe-8x2": moe}


def bench_train(batch: int, seq: int, iters: int) -> list[dict]:
    peak = matmul_peak()
    rows = [{"name": "matmul f32 1024^3", "GFLOP/s": peak / 1e9}]
    for name, cfg in bench_configs().items():
        mesh = make_mesh(dict(data=1), devices=jax.devices()[:1])
        rules = parse_rules({})
        tx = make_optimizer(cfg.optim, 1000)
        with use_sharding(mesh, rules):
            graphdef, state, shardings = create_train_state(
                lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, rules
            )
            step = jax.jit(
                make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe)),
                out_shardings=(shardings, None),
                donate_argnums=0,
            )
            rng = np.random.default_rng(0)
            tokens = jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, seq + 1)))
            b = {
                "inputs": tokens[:, :-1],
                "targets": tokens[:, 1:],
                "loss_mask": jnp.ones((batch, seq), jnp.int32),
                "positions": jnp.broadcast_to(jnp.arange(seq), (batch, seq)),
                "segment_ids": jnp.ones((batch, seq), jnp.int32),
            }
            box = [state]

            def run():
                box[0], metrics = step(box[0], b)
                metrics["loss"].block_until_ready()

            sec = timeit(run, iters=iters)
        tps = batch * seq / sec
        flops = train_flops_per_token(cfg.model, seq) * tps
        rows.append(
            {
                "name": f"train {name}",
                "activated params (M)": activated_matmul_params(cfg.model) / 1e6,
                "step ms": sec * 1e3,
                "tokens/s": tps,
                "MFU": flops / peak,
            }
        )
    rows.append({"name": "moe / dense tokens/s", "ratio": rows[2]["tokens/s"] / rows[1]["tokens/s"]})
    return rows


def _train_step(cfg, batch_size: int, seq_len: int):
    """(step_fn, state) for `cfg` on one device."""
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1])
    rules = parse_rules({})
    tx = make_optimizer(cfg.optim, 1000)
    with use_sharding(mesh, rules):
        graphdef, state, shardings = create_train_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, rules)
        step = jax.jit(
            make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe)),
            out_shardings=(shardings, None),
            donate_argnums=0,
        )
    return step, state


def bench_sft_packing(batch: int, seq: int, iters: int) -> list[dict]:
    """SFT on the same conversations with and without packing: useful (loss) tokens per second."""
    import tempfile

    from posttrain.data.pipeline import sft_batches
    from posttrain.data.synthetic import ensure_arithmetic_file
    from posttrain.data.tokenizer import ByteTokenizer

    cfg = bench_configs()["dense"].replace({"model.vocab_size": 512})
    path = os.path.join(tempfile.mkdtemp(), "sft.jsonl")
    ensure_arithmetic_file(path, "sft", 4000, seed=0)
    step, state = _train_step(cfg, batch, seq)
    modes = {}
    for packing in (False, True):
        it = sft_batches(path, ByteTokenizer(), batch_size=batch, seq_len=seq, seed=0, packing=packing)
        modes[packing] = [jax.device_put(next(it)) for _ in range(iters + 2)]
    times = {False: [], True: []}
    for i in range(iters + 2):  # interleaved, so machine noise hits both modes alike
        for packing, batches in modes.items():
            t = time.perf_counter()
            state, m = step(state, batches[i])
            m["loss"].block_until_ready()
            if i >= 2:
                times[packing].append(time.perf_counter() - t)
    rows, peak = [], matmul_peak()
    for packing, batches in modes.items():
        sec = float(np.median(times[packing]))
        useful = np.mean([int(b["loss_mask"].sum()) for b in batches])
        real = np.mean([int((b["segment_ids"] > 0).sum()) for b in batches])
        flops = train_flops_per_token(cfg.model, seq) * batch * seq / sec
        rows.append(
            {
                "name": f"sft packing={packing}",
                "step ms": sec * 1e3,
                "non-pad fraction": real / (batch * seq),
                "tokens/s (incl. pad)": batch * seq / sec,
                "useful tokens/s": useful / sec,
                "MFU": flops / peak,
                "MFU on real tokens": flops / peak * real / (batch * seq),
            }
        )
    rows.append(
        {
            "name": "packed / unpacked useful tokens/s",
            "ratio": rows[1]["useful tokens/s"] / rows[0]["useful tokens/s"],
            "padding ratio": rows[1]["non-pad fraction"] / rows[0]["non-pad fraction"],
        }
    )
    return rows


def bench_checkpoint(iters: int = 3) -> list[dict]:
    """Time the training loop is blocked by a checkpoint save: asynchronous vs synchronous."""
    import tempfile

    from posttrain.core.checkpoint import Checkpointer
    from posttrain.core.harness import CHECKPOINT_ITEMS

    cfg = bench_configs()["dense"].replace({"model.num_layers": 8, "model.embed_dim": 512, "model.mlp_dim": 2048})
    _, state = _train_step(cfg, 1, 8)
    trees = {k: getattr(state, k) for k in CHECKPOINT_ITEMS}
    mbytes = sum(x.nbytes for x in jax.tree.leaves(trees)) / 2**20
    rows = []
    for async_save in (False, True):
        ckpt = Checkpointer(tempfile.mkdtemp(), every=1, keep=2, async_save=async_save)
        blocked, total = [], []
        for i in range(iters):
            t = time.perf_counter()
            ckpt.save(i + 1, trees)
            blocked.append(time.perf_counter() - t)
            ckpt.wait()
            total.append(time.perf_counter() - t)
        ckpt.close()
        rows.append(
            {
                "name": f"checkpoint async={async_save}",
                "state MiB": mbytes,
                "blocked ms": 1e3 * float(np.median(blocked)),
                "until on disk ms": 1e3 * float(np.median(total)),
            }
        )
    return rows


def tiny_rlvr_config(workdir: str, steps: int, changes: dict | None = None) -> RunConfig:
    """The RL benches' run: rlvr with a tiny MoE policy (width 64, 2 layers, 4 experts) on one
    device, `steps` steps logged every step, no checkpoints and no held-out evals; each bench sets
    its own batch shape and the switch it measures (dotted `changes`, applied last)."""
    shape = dict(vocab_size=264, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    return RunConfig(stage="rlvr", workdir=workdir).replace(
        {
            **{f"model.{k}": v for k, v in shape.items()},
            **{"model.moe.num_experts": 4, "model.moe.expert_mlp_dim": 64, "mesh.data": 1},
            **{"train.steps": steps, "train.log_every": 1, "train.progress": False, "checkpoint.every": 0},
            "rl.eval_every": 0,
            **(changes or {}),
        }
    )


def bench_rl(steps: int = 12, delay: float = 0.05, workers: int = 16) -> list[dict]:
    """RLVR steps/s and device-idle fraction, on-policy vs one step of overlap, with a verifier that
    costs `delay` host seconds per response on `workers` threads."""
    import tempfile

    from posttrain.core.metrics import read_metrics
    from posttrain.stages import rlvr as loop

    rows = []
    for staleness in (0, 1):
        shape = {"rl.prompts_per_step": 4, "rl.group_size": 8, "rl.max_new_tokens": 32}
        verify = {"rl.max_staleness": staleness, "rl.verifier_delay": delay, "rl.verifier_workers": workers}
        cfg = tiny_rlvr_config(tempfile.mkdtemp(), steps, {**shape, **verify})
        with jax.default_device(jax.devices()[0]):
            loop.run(cfg)
        m = [r for r in read_metrics(cfg.workdir) if "rl/update_s" in r][2:]  # skip compilation
        per_step = [r["rl/wait_s"] + r["rl/update_s"] for r in m]
        rows.append(
            {
                "name": f"rlvr max_staleness={staleness}",
                "steps/s": 1 / float(np.mean(per_step)),
                "verify s/step": float(np.mean([r.get("rl/verify_s", 0) for r in m])),
                "learner wait s/step": float(np.mean([r["rl/wait_s"] for r in m])),
                "device idle": m[-1]["rl/device_idle_frac"],
            }
        )
    rows.append({"name": "overlapped / on-policy steps/s", "ratio": rows[1]["steps/s"] / rows[0]["steps/s"]})
    return rows


def bench_rl_updates(steps: int = 8, epochs: tuple[int, ...] = (1, 2, 4)) -> list[dict]:
    """RLVR wall time per step and its update part with `rl.updates_per_batch` = 1, 2, 4 PPO epochs
    (one minibatch each) on the same rollout sizes (on-policy)."""
    import tempfile

    from posttrain.core.metrics import read_metrics
    from posttrain.stages import rlvr as loop

    rows = []
    for n in epochs:
        shape = {"rl.prompts_per_step": 4, "rl.group_size": 8, "rl.max_new_tokens": 32}
        cfg = tiny_rlvr_config(tempfile.mkdtemp(), steps, {**shape, "rl.updates_per_batch": n})
        with jax.default_device(jax.devices()[0]):
            loop.run(cfg)
        m = [r for r in read_metrics(cfg.workdir) if "rl/update_s" in r][2:]  # skip compilation
        rows.append(
            {
                "name": f"rlvr updates_per_batch={n}",
                "s/step": float(np.mean([r["rl/wait_s"] + r["rl/update_s"] for r in m])),
                "update s/step": float(np.mean([r["rl/update_s"] for r in m])),
                "clip_frac": float(np.mean([r["rl/clip_frac_low"] + r["rl/clip_frac_high"] for r in m])),
            }
        )
    return rows


def bench_rl_quant(steps: int = 3) -> list[dict]:
    """The learner's truncated importance weights π_learner / π_behav when the rollouts come from a
    quantised sampler (sampling.quantize) and/or speculative decoding, tiny MoE policy, on-policy."""
    import tempfile

    from posttrain.core.metrics import read_metrics
    from posttrain.stages import rlvr as loop

    rows = []
    for quantize, speculative_k in (("none", 0), ("int8", 0), ("int4", 0), ("int8", 2)):
        shape = {"rl.prompts_per_step": 4, "rl.group_size": 8, "rl.max_new_tokens": 16, "rl.arithmetic_size": 50}
        sampler = {"sampling.quantize": quantize, "sampling.speculative_k": speculative_k}
        cfg = tiny_rlvr_config(tempfile.mkdtemp(), steps, {**shape, **sampler})
        with jax.default_device(jax.devices()[0]):
            loop.run(cfg)
        m = [r for r in read_metrics(cfg.workdir) if "rl/update_s" in r]
        rows.append(
            {
                "name": f"rlvr sampler quantize={quantize} speculative_k={speculative_k}",
                "IS weight mean": float(np.mean([r["rl/is_weight_mean"] for r in m])),
                "min": min(r["rl/is_weight_min"] for r in m),
                "max": max(r["rl/is_weight_max"] for r in m),
                "truncated frac": float(np.mean([r["rl/is_truncated_frac"] for r in m])),
            }
        )
    return rows


def print_rows(title: str, rows: list[dict]) -> None:
    print(f"\n### {title}  (jax {jax.__version__}, {jax.devices()[0].platform}, {jax.device_count()} devices)")
    for r in rows:
        print("| " + " | ".join(f"{k}: {v:.4g}" if isinstance(v, float) else f"{k}: {v}" for k, v in r.items()) + " |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--section",
        default="train",
        choices=[
            "train",
            "sft",
            "checkpoint",
            "sandbox",
            "sampler",
            "sampler-quant",
            "speculative",
            "rl-quant",
            "rl",
            "rl-updates",
            "rl-continuous",
            "attention",
            "prefix-cache",
            "inflight",
            "episodes",
            "all",
        ],
    )
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    if args.section in ("train", "all"):
        print_rows("train step", bench_train(args.batch, args.seq, args.iters))
    if args.section in ("sft", "all"):
        print_rows("SFT packing", bench_sft_packing(args.batch, args.seq, args.iters))
    if args.section in ("checkpoint", "all"):
        print_rows("checkpoint save", bench_checkpoint())
    if args.section in ("sampler", "all"):
        from posttrain.sampling.bench import sampler_bench

        print_rows("sampler", sampler_bench(iters=args.iters // 2 or 1))
    if args.section in ("sampler-quant", "all"):
        from posttrain.sampling.bench import quant_bench

        print_rows("quantised sampler weights", quant_bench(rounds=args.iters // 2 or 1))
    if args.section in ("speculative", "all"):
        from posttrain.sampling.bench import speculative_bench

        print_rows("speculative decoding", speculative_bench(rounds=args.iters // 2 or 1))
    if args.section in ("rl-quant", "all"):
        print_rows("rlvr with a quantised / speculative sampler", bench_rl_quant())
    if args.section in ("rl", "all"):
        print_rows("rlvr overlap", bench_rl())
    if args.section in ("rl-continuous", "all"):
        from rl_continuous_bench import rl_continuous_bench

        print_rows("rlvr rollouts: continuous vs static batching, skewed lengths", rl_continuous_bench())
    if args.section in ("rl-updates", "all"):
        print_rows("rlvr PPO epochs", bench_rl_updates())
    if args.section in ("attention", "all"):  # context parallel rows need several devices (see the module)
        from attention_bench import attention_bench

        print_rows("attention", attention_bench(length=args.seq * 8, iters=args.iters // 2 or 1))
    if args.section in ("prefix-cache", "all"):
        from prefix_cache_bench import prefix_cache_bench

        print_rows("prefix cache, multi-turn", prefix_cache_bench(rounds=args.iters // 2 or 1))
    if args.section in ("inflight", "all"):
        from inflight_bench import inflight_bench

        print_rows("in-flight weight updates: chunked decode overhead", inflight_bench(rounds=args.iters // 2 or 1))
    if args.section in ("episodes", "all"):
        from episodes_bench import episodes_bench

        print_rows("multi-turn episodes: 2 cohorts vs lockstep rounds (repo_fix, random policy)", episodes_bench())
    if args.section in ("sandbox", "all"):
        from posttrain.rl.verifiers.bench import sandbox_bench

        print_rows("sandbox", sandbox_bench())


if __name__ == "__main__":
    main()
