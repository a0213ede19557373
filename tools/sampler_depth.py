"""Sampler compile time vs depth for a TPU slice: the unrolled decode (the CPU's layer path)
against the stacked one (layers under `lax.scan`, what accelerators run), for BENCHMARKS.md.

    python tools/sampler_depth.py --model qwen3_30b_a3b --topology v5p-128 unrolled:4 unrolled:8 stacked:8

Each spec is PATH:NUM_LAYERS; reports the CPU seconds of the compile (the shared host's wall
time says more about its load than about the program), the optimized HLO's size and memory.
Needs libtpu (`pip install -e '.[tpu]'`).
"""

from __future__ import annotations

import argparse
import os
import resource
import runpy
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process so far (all its threads)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("specs", nargs="+", help="unrolled:N or stacked:N")
    ap.add_argument("--model", default="qwen3_30b_a3b")
    ap.add_argument("--topology", default="v5p-128")
    ap.add_argument("--prompt_len", type=int, default=1024)
    args = ap.parse_args()
    from posttrain.config import run_config
    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import aot
    from posttrain.plan import compile_plan as cp
    from posttrain.sampling import engine
    from posttrain.sampling.generate import generate_program

    configure = runpy.run_path(os.path.join(ROOT, "tools", "pod_plan.py"))["configure"]
    devices = aot.tpu_devices(args.topology)  # one set: meshes over new device objects clash
    gen, _ = aot.parse_topology(args.topology)
    for spec in args.specs:
        path, _, layers = spec.partition(":")
        if path not in ("unrolled", "stacked") or not layers.isdigit():
            raise SystemExit(f"spec {spec!r}: expected unrolled:N or stacked:N")
        cfg = configure(args.model, "rl", len(devices), 1)
        cfg.model.num_layers = int(layers)
        cfg = run_config(cfg)
        engine.decode_layers = (lambda m: m.layers()) if path == "unrolled" else (lambda m: None)
        generate_program.clear_cache()  # its trace depends on the layer path
        mesh, rules = make_mesh(cfg.mesh.to_dict(), devices), parse_rules(cfg.sharding.rules)
        with use_sharding(mesh, rules):
            (program,) = cp.build_programs(cfg, mesh, rules, ("sampler",), args.prompt_len)
        start = cpu_seconds()
        compiled, wall = cp.compile_program(program, mesh, rules)
        report = cp.program_report(program, compiled, aot.CHIPS[gen], mesh.size)
        print(
            f"| {path} | {layers} | {cpu_seconds() - start:.0f} | {wall:.0f} | {len(compiled.as_text()) / 1e6:.1f} | "
            f"{report['total'] / 1e9:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
