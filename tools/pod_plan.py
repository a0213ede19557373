"""The pod plan: large MoE shapes (configs/pod/moe_shapes.py) × TPU slices, per-chip memory, fit,
FLOPs, collective bytes and a roofline step time, for BENCHMARKS.md "Pod plan".

    python tools/pod_plan.py --models kimi_k2 --modes sft_full --topologies v5p-1024 [--compile]
        [--rows_per_chip 1] [--seq_len 4096] [--optim adamw|adafactor] [--moment_dtype bfloat16]
        [--json out.json] [--grid]
    python tools/pod_plan.py --rl-split --models qwen3_30b_a3b --topologies v5p-128 [--slices 1|2]
        [--prompts 256] [--samples 16] [--response_len 4096] [--group 0] [--minibatches 1]
        [--compile [--sampler-chips N]]

Without --compile: the exact argument bytes by part and the analytic cost model
(`posttrain.plan.cost_model`: executed FLOPs, HBM and collective bytes, the roofline's step time, the
bound that sets it and MFU from the shapes, mesh and rules; ~2 minutes for all 80 rows); with it
every program is compiled for the slice (20-30 minutes per large model on a CPU host). --grid
prints the analytic numbers as one row per program with a column per slice (BENCHMARKS.md "Pod
plan"). Needs libtpu (`pip install -e '.[tpu]'`). --rl-split needs no libtpu: every split of the
slice (or of two such slices joined by DCN) between the RL learner and the sampler with its
estimated generation, learning and publish time per step, and the recommended one
(`posttrain.plan.rl_split`); with --compile (needs libtpu, one slice) the recommended split (or
--sampler-chips N) is compiled: the learner program on the learner's chips and the sampler
program on the sampler mesh, their compiled bytes per chip beside the analytic floors, and the
weight bytes per publish (`posttrain.plan.rl_split_compile`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import runpy
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "pod", "moe_shapes.py")
GB = 1e9


def configure(model: str, mode: str, chips: int, rows_per_chip: int, optim: dict | None = None, seq_len: int = 0):
    """The model's config for `chips` chips: expert ways capped at the slice, a batch of
    `rows_per_chip` rows per chip (RL: prompts × group = rows), `optim` keys (name, moment_dtype)
    over the shapes' AdamW and rows of `seq_len` tokens when non-zero."""
    cfg = runpy.run_path(SHAPES)["get_config"](f"{model}:{mode}")
    cfg.mesh.expert = min(cfg.mesh.expert, chips)
    cfg.train.batch_size = chips * rows_per_chip
    cfg.optim.update(optim or {})
    if seq_len:
        cfg.train.seq_len = seq_len
    if mode == "rl":
        cfg.rl.prompts_per_step = max(1, chips * rows_per_chip // cfg.rl.group_size)
    return cfg


def row(model: str, mode: str, r: dict) -> str:
    """One markdown row of a report (compiled or argument-only)."""
    p = r["parts"]
    mesh = "·".join(f"{k[0]}{v}" for k, v in r["mesh"].items() if v > 1)
    held = p.get("reference", 0) + p.get("frozen base", 0)
    if r["program"] == "restore":  # restore_report: the checkpoint's arrays, nothing compiled
        problems = f"{len(r['problems'])} sharding problems" if r["problems"] else "shards evenly"
        return (
            f"| {model} | {mode} | restore | {r['topology']} | {mesh} | {p.get('params', 0) / GB:.1f} | "
            f"{p.get('optimizer', 0) / GB:.1f} | {held / GB:.1f} | – | {r['total'] / GB:.1f} | "
            f"{'yes' if r['fits'] else '**no**'} | – | – ({r['arrays']} arrays, {problems}) | – | – | – |"
        )
    if "total" in r:
        c = r["collectives"]
        coll = f"{sum(c.values()) / GB:.1f} ({', '.join(f'{k} {v / GB:.1f}' for k, v in c.items() if v)})"
        if r.get("loop_iteration_collectives"):  # the sampler's decode loop, per token
            coll += "; per decode step " + ", ".join(
                f"{k} {v / 1e6:.1f} MB" for k, v in r["loop_iteration_collectives"].items() if v
            )
        return (
            f"| {model} | {mode} | {r['program']} | {r['topology']} | {mesh} | {p.get('params', 0) / GB:.1f} | "
            f"{p.get('optimizer', 0) / GB:.1f} | {held / GB:.1f} | {r['temporaries'] / GB:.1f} | "
            f"{r['total'] / GB:.1f} | {'yes' if r['fits'] else '**no**'} | "
            f"{max(r['xla_flops'], r['executed_flops_per_device']) / 1e12:.0f} | {coll} | "
            f"{r['step_s']:.2f} | {r['bound']} | {mfu(r['mfu'])} |"
        )
    a = r["analytic"]
    if a is None:
        return (
            f"| {model} | {mode} | {r['program']} | {r['topology']} | {mesh} | {p.get('params', 0) / GB:.1f} | "
            f"{p.get('optimizer', 0) / GB:.1f} | {held / GB:.1f} | (not compiled) | ≥ {r['arguments'] / GB:.1f} | "
            f"{'no' if r['arguments'] > r['hbm'] else '?'} | – | – (not modelled: compile it) | – | – | – |"
        )
    coll = ", ".join(f"{k} {v / GB:.1f}" for k, v in a["collectives"].items() if v)
    return (
        f"| {model} | {mode} | {r['program']} | {r['topology']} | {mesh} | {p.get('params', 0) / GB:.1f} | "
        f"{p.get('optimizer', 0) / GB:.1f} | {held / GB:.1f} | (not compiled) | ≥ {r['arguments'] / GB:.1f} | "
        f"{'no' if r['arguments'] > r['hbm'] else '?'} | {a['executed_flops_per_device'] / 1e12:.0f} (analytic) | "
        f"{sum(a['collectives'].values()) / GB:.1f} ({coll}) | {a['step_s']:.2f} | {a['bound']} | {mfu(a['mfu'])} |"
    )


def grid_cell(r: dict) -> str:
    """One slice's analytic numbers for the grid: executed TFLOP/chip · collective GB/chip ·
    est. s (the roofline's floor) · its bound · MFU (at most: model FLOPs / (est. × peak))."""
    a = r["analytic"]
    if a is None:
        return "not modelled"
    return (
        f"{a['executed_flops_per_device'] / 1e12:.0f} · {sum(a['collectives'].values()) / GB:.0f} · "
        f"{a['step_s']:.2f} · {a['bound']} · {mfu(a['mfu'])}{' ✗' if r['arguments'] > r['hbm'] else ''}"
    )


def mfu(x: float) -> str:
    """MFU as a percentage, with a decimal below 10% (a decode-bound sampler)."""
    return f"{x:.1%}" if x < 0.1 else f"{x:.0%}"


HEADER = (
    "| model | mode | program | slice | mesh | params GB | opt GB | ref+frozen GB | temps GB | "
    "total GB/chip | fits | executed TFLOP/chip | collective GB/chip | est. s | bound | MFU |\n"
    "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"
)


SPLIT_HEADER = (
    "| sampler chips | learner chips | gen s | learn s | publish s (link) | step s | GB/chip learner · sampler | |\n"
    "|---|---|---|---|---|---|---|---|"
)


def split_tables(args) -> None:
    """--rl-split: the candidate splits of each model × slice and the recommendation (markdown)."""
    from posttrain.config import run_config
    from posttrain.plan import aot, rl_split

    for model in args.models.split(","):
        for topology in args.topologies.split(","):
            gen, name = aot.parse_topology(topology)
            chips = math.prod(int(d) for d in name.split(":")[1].split("x"))
            cfg = configure(
                model, "rl", chips, args.rows_per_chip, dict(name=args.optim, moment_dtype=args.moment_dtype)
            )
            r = cfg.rl
            r.group_size, r.max_new_tokens = args.samples, args.response_len
            r.prompts_per_step = args.prompts or max(1, chips * args.rows_per_chip // args.samples)
            r.minibatches = args.minibatches
            if r.prompts_per_step * r.group_size % r.minibatches:
                raise SystemExit(f"--minibatches {r.minibatches}: must divide prompts × samples")
            cfg = run_config(cfg)
            group = args.group or rl_split.default_group(cfg, aot.CHIPS[gen], chips)
            splits = rl_split.plan_split(cfg, gen, chips, args.slices, group, args.prompt_len)
            best = rl_split.recommend(splits)
            where = f"{args.slices} × {topology} over DCN" if args.slices == 2 else topology
            print(
                f"\n{model} on {where} ({args.slices * chips} chips), model-parallel group {group}: "
                f"{r.prompts_per_step} prompts × {r.group_size} samples × {r.max_new_tokens} new tokens "
                f"(prompt {args.prompt_len}), model {splits[0].publish_bytes / GB:.0f} GB published per step\n"
                + SPLIT_HEADER
            )
            for s in splits:
                mark = "**recommended**" if s is best else s.problem
                print(
                    f"| {s.sampler_chips} | {s.learner_chips} | {s.gen_s:.1f} | {s.learn_s:.1f} | "
                    f"{s.publish_s:.3f} ({s.link}) | {s.step_s:.1f} | "
                    f"{s.learner_gb:.0f} · {s.sampler_gb:.0f} | {mark} |"
                )
            together = None
            if args.slices == 1:
                g, learn = rl_split.colocated(cfg, gen, chips, group, args.prompt_len)
                together = g + learn
                print(f"| colocated: all {chips} | all {chips} | {g:.1f} | {learn:.1f} | 0 | {together:.1f} | | |")
            if best is None:
                print("no split fits: a larger slice or model-parallel group (--group)")
            else:
                # split runs in one process for now (rl.rollout.placement); a sampler slice of its
                # own is the disaggregated placement
                how = (
                    f"rl.placement=split, rl.sampler_devices={best.sampler_chips}"
                    if args.slices == 1
                    else f"rl.placement=disaggregated, {best.sampler_chips} sampler chips"
                )
                print(
                    f"recommended: {how} (learner {best.learner_chips} chips, sampler replicas of {group}): "
                    f"~{best.step_s:.1f} s per step (gen {best.gen_s:.1f}, learn {best.learn_s:.1f}, "
                    f"publish {best.publish_s:.3f} over {best.link}; max_staleness >= 1)"
                )
                if together is not None and together < best.step_s:
                    print(f"(colocated, generation then learning on every chip, is faster here: ~{together:.1f} s)")
            if args.compile:
                chosen = best
                if args.sampler_chips:
                    chosen = next((s for s in splits if s.sampler_chips == args.sampler_chips), None)
                    if chosen is None:
                        raise SystemExit(
                            f"--sampler-chips {args.sampler_chips}: expected one of {[s.sampler_chips for s in splits]}"
                        )
                if chosen is not None:
                    compiled_split(cfg, topology, chosen, group, args.prompt_len)


COMPILED_HEADER = (
    "| program | chips | mesh | args GB/chip | temps GB/chip | compiled GB/chip | analytic floor GB/chip | "
    "fits | compiled est. s | analytic s | compile s |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def compiled_split(cfg, topology: str, split, group: int, prompt_len: int) -> None:
    """--rl-split --compile: compile `split`'s learner and sampler programs (markdown table)."""
    from posttrain.plan import aot, rl_split_compile

    if split.problem:
        print(f"(sampler chips {split.sampler_chips}: {split.problem}; compiled anyway)")
    c = rl_split_compile.compile_split(
        cfg, topology, split, group, prompt_len, log=lambda s: print(s, file=sys.stderr, flush=True)
    )
    hbm = aot.CHIPS[aot.parse_topology(topology)[0]].hbm_bytes
    r = cfg.rl
    per_step = r.minibatches * r.updates_per_batch
    print(
        f"\ncompiled: {split.sampler_chips} sampler chips, {split.learner_chips} learner chips "
        f"({topology}, libtpu on abstract devices)\n" + COMPILED_HEADER
    )
    for rep, total, floor, steps, analytic in (
        (c.learner, c.learner_total, split.learner_gb, per_step, split.learn_s),
        (c.sampler, c.sampler_total, split.sampler_gb, 1, split.gen_s),
    ):
        mesh = "·".join(f"{k[0]}{v}" for k, v in rep["mesh"].items() if v > 1) or "1"
        if total is None:
            print(
                f"| {rep['program']} | {math.prod(rep['mesh'].values())} | {mesh} | – | – | "
                f"**does not compile**: {rep['error'][:160]} | {floor:.1f} | **no** | – | {analytic:.1f} | – |"
            )
            continue
        est = rep["step_s"] * steps
        print(
            f"| {rep['program']} | {math.prod(rep['mesh'].values())} | {mesh} | {rep['arguments'] / GB:.1f} | "
            f"{rep['temporaries'] / GB:.1f} | {total / GB:.1f} | {floor:.1f} | {'yes' if total <= hbm else '**no**'} | "
            f"{est:.1f} | {analytic:.1f} | {rep['compile_s']:.0f} |"
        )
    print(
        f"publish: {c.model_bytes / GB:.2f} GB of weights per step, {c.publish_bytes_per_chip / GB:.2f} GB landing "
        f"on each of {split.sampler_chips} sampler chips ({c.publish_bytes_per_chip * split.sampler_chips / GB:.1f} GB "
        "in all); the sampler's compiled GB/chip counts that incoming copy, the learner's is one minibatch "
        f"(est. s × {per_step} minibatches × updates)"
    )
    if c.learner_total is None:
        print("the learner's minibatch does not fit: more rl.minibatches (--minibatches) make it smaller")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", default="qwen3_30b_a3b,qwen3_235b_a22b,deepseek_v3,kimi_k2")
    ap.add_argument("--modes", default="sft_full,sft_lora,rl")
    ap.add_argument("--topologies", default="v5p-128,v5p-256,v5p-512,v5p-1024,v5e-256")
    ap.add_argument("--rows_per_chip", type=int, default=1)
    ap.add_argument("--prompt_len", type=int, default=1024)
    ap.add_argument("--programs", default="", help="override the mode's programs (e.g. rl_learner)")
    ap.add_argument("--sampling_layout", default="learner", help="sampling.layout of the sampler: learner | tensor")
    ap.add_argument("--seq_len", type=int, default=0, help="tokens per row (0: the shapes' train.seq_len, 4096)")
    ap.add_argument(
        "--optim", default="adamw", help="optim.name: adamw | adafactor (the optimizer state's bytes follow)"
    )
    ap.add_argument(
        "--moment_dtype", default="", help="optim.moment_dtype of adamw: '' (the params') | float32 | bfloat16"
    )
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--json", default="")
    ap.add_argument("--grid", action="store_true", help="analytic numbers, one column per slice")
    ap.add_argument("--rl-split", action="store_true", help="split a slice between the RL learner and sampler")
    ap.add_argument("--slices", type=int, default=1, choices=(1, 2), help="--rl-split: slices joined by DCN")
    ap.add_argument("--prompts", type=int, default=0, help="--rl-split: prompts per step (0: chips × rows / samples)")
    ap.add_argument("--samples", type=int, default=8, help="--rl-split: samples per prompt (rl.group_size)")
    ap.add_argument("--response_len", type=int, default=1024, help="--rl-split: new tokens (rl.max_new_tokens)")
    ap.add_argument("--group", type=int, default=0, help="--rl-split: model-parallel chips (0: smallest that fits)")
    ap.add_argument("--minibatches", type=int, default=1, help="--rl-split: rl.minibatches (optimizer steps per batch)")
    ap.add_argument(
        "--sampler-chips", type=int, default=0, help="--rl-split --compile: the split to compile (0: recommended)"
    )
    args = ap.parse_args()
    if args.sampler_chips and not (args.rl_split and args.compile):
        ap.error("--sampler-chips: only with --rl-split --compile")
    if args.rl_split and args.compile and args.slices != 1:
        ap.error("--rl-split --compile: compiles one slice's split (--slices 1); two slices are planned analytically")
    if args.rl_split:
        split_tables(args)
        return
    from posttrain.config import run_config
    from posttrain.parallel import make_mesh, parse_rules
    from posttrain.plan import aot, cost_model
    from posttrain.plan.compile_plan import plan

    out, grid = [], {}
    topologies = args.topologies.split(",")
    print(HEADER, flush=True)
    for model in args.models.split(","):
        for mode in args.modes.split(","):
            programs = ("rl_learner", "sampler") if mode == "rl" else ("sft",)
            if args.programs:
                programs = tuple(args.programs.split(","))
            for topology in args.topologies.split(","):
                chips = len(aot.tpu_devices(topology))
                cfg = configure(
                    model,
                    mode,
                    chips,
                    args.rows_per_chip,
                    dict(name=args.optim, moment_dtype=args.moment_dtype),
                    args.seq_len,
                )
                cfg.sampling.layout = args.sampling_layout
                cfg = run_config(cfg)
                try:
                    reports = plan(
                        cfg,
                        topology,
                        programs,
                        args.prompt_len,
                        compile=args.compile,
                        log=lambda s: print(s, file=sys.stderr, flush=True),
                    )
                except Exception as e:  # a mesh that cannot be built here is a row too
                    print(
                        f"| {model} | {mode} | – | {topology} | – | error: {type(e).__name__}: "
                        f"{str(e).splitlines()[0][:120]} |",
                        flush=True,
                    )
                    continue
                mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices(topology))
                rules = parse_rules(cfg.sharding.rules)
                chip = aot.CHIPS[aot.parse_topology(topology)[0]]
                for r in reports:
                    if r["program"] == "restore":
                        print(row(model, mode, r), flush=True)
                        out.append({"model": model, "mode": mode, **r})
                        continue
                    try:
                        r["analytic"] = cost_model.program_cost(cfg, mesh, rules, r["program"], args.prompt_len, chip)
                    except ValueError as e:  # not modelled (e.g. the sampler in the decode layout)
                        r["analytic"], r["analytic_error"] = None, str(e)
                    print(row(model, mode, r), flush=True)
                    out.append({"model": model, "mode": mode, **r})
                    grid.setdefault((model, mode, r["program"]), {})[topology] = grid_cell(r)
    if args.grid:
        print(f"\n| model | mode | program | {' | '.join(topologies)} |\n|---|---|---|{'---|' * len(topologies)}")
        for (model, mode, program), cells in grid.items():
            print(f"| {model} | {mode} | {program} | {' | '.join(cells.get(t, '–') for t in topologies)} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
