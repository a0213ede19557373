"""Compile a run's programs for a TPU slice on this host and report per-chip memory and costs.

    python tools/compile_plan.py --config configs/qwen3_moe_sft_lora_tpu.py --topology v5p-128 \
        [--programs sft,rl_learner,sampler] [--prompt_len 256] [--json plan.json] [--config.a.b=v ...]

Needs libtpu (`pip install -e '.[tpu]'`), not a TPU. Topologies: 'v5p:4x4x4' or Cloud TPU slice
names ('v5p-128' = 64 chips, 'v5e-256' = 256 chips). See posttrain/plan/compile_plan.py.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")  # this host runs nothing; libtpu only compiles

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from posttrain import main as cli  # noqa: E402  (defines --config, checks --config.* overrides)

_TOPOLOGY = flags.DEFINE_string("topology", "v5p:2x2x1", "TPU slice: 'v5p:2x2x1', 'v5p-128', 'v5e-256', ...")
_PROGRAMS = flags.DEFINE_string(
    "programs",
    "sft,dpo,rl_learner,sampler",
    "Programs to compile; 'restore' adds the checkpoint restore target (not compiled).",
)
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 256, "Sampler prompt bucket (RL rows: prompt + rl.max_new_tokens).")
_JSON = flags.DEFINE_string("json", "", "Also write the reports to this JSON file.")

GB = 1e9


def table(reports: list[dict]) -> str:
    """A markdown table: per-device GB by category, fit, executed FLOPs, collective GB (a decode
    loop's for every step), the roofline's time floor, the bound that sets it, and MFU."""
    head = (
        "| program | params | opt | ref/frozen | args | temps | total | fits | executed TFLOP/dev | "
        "AG/RS/A2A/AR/CP GB | est. s | bound | MFU |"
    )
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in reports:
        if r["program"] == "restore":
            continue
        p = r["parts"]
        c = r["collectives"]
        coll = "/".join(
            f"{c[k] / GB:.1f}"
            for k in ("all-gather", "reduce-scatter", "all-to-all", "all-reduce", "collective-permute")
        )
        rows.append(
            f"| {r['program']} | {p.get('params', 0) / GB:.2f} | {p.get('optimizer', 0) / GB:.2f} | "
            f"{(p.get('reference', 0) + p.get('frozen base', 0)) / GB:.2f} | {r['arguments'] / GB:.2f} | "
            f"{r['temporaries'] / GB:.2f} | {r['total'] / GB:.2f} | {'yes' if r['fits'] else 'NO'} | "
            f"{max(r['xla_flops'], r['executed_flops_per_device']) / 1e12:.2f} | {coll} | "
            f"{r['step_s']:.3g} | {r['bound']} | {r['mfu']:.1%} |"
        )
    return "\n".join(rows)


def restore_line(r: dict) -> str:
    """The checkpoint restore's per-chip bytes by item, and its problems (none when it fits)."""
    parts = ", ".join(f"{k} {v / GB:.2f}" for k, v in r["parts"].items())
    verdict = "fits" if r["fits"] else "DOES NOT FIT" if not r["problems"] else "; ".join(r["problems"][:5])
    return (
        f"restore: {r['arrays']} arrays, {r['total'] / GB:.2f} GB/chip ({parts}; replicated "
        f"{r['replicated'] / GB:.3f}): {verdict}"
    )


def context_parallel_line(r: dict) -> str | None:
    """The context-parallel strategy a program traced (what `model.context_parallel` resolves to in
    a real run: `auto` from the gathered K/V it keeps against 1/16 of the chip's memory)."""
    if not r.get("context_parallel"):
        return None
    parts = []
    for c in r["context_parallel"]:
        numbers = f"gathered K/V {c['kv_bytes'] / GB:.3g} GB, {c['layers']} live layer(s)"
        if c["mode"] == "auto":
            device = f"1/16 of {c['device_bytes'] / GB:.3g} GB, {c['device_source']}"
            numbers += f" vs budget {c['budget_bytes'] / GB:.3g} GB ({device})"
        parts.append(f"{c['mode']} -> {c['strategy']} ({numbers})")
    return f"{r['program']}: context parallelism " + "; ".join(parts)


def main(argv: list[str]) -> None:
    del argv
    from posttrain.config import run_config
    from posttrain.plan import aot
    from posttrain.plan.compile_plan import plan

    if not aot.libtpu_available():
        raise SystemExit("error: libtpu is not installed; pip install -e '.[tpu]'")
    cfg = run_config(cli._CONFIG.value)
    reports = plan(
        cfg,
        _TOPOLOGY.value,
        tuple(n.strip() for n in _PROGRAMS.value.split(",") if n.strip()),
        _PROMPT_LEN.value,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    print(f"## {cfg.model.num_layers}-layer model on {_TOPOLOGY.value}, mesh {reports[0]['mesh']}")
    print(table(reports))
    for r in reports:
        if r["program"] == "restore":
            print(restore_line(r))
        elif line := context_parallel_line(r):
            print(line)
    if _JSON.value:
        with open(_JSON.value, "w") as f:
            json.dump(reports, f, indent=1)


if __name__ == "__main__":
    cli.entry(main)
