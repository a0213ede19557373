"""The roofline of a train step from its shapes and a compiled program's collective bytes, without
compiling again: for rows whose compile took 20-30 minutes (BENCHMARKS.md "Long context" and the
compiled "Pod plan" rows), restated by `posttrain.plan.roofline`.

    python tools/roofline.py --config configs/pod/moe_shapes.py:llama3_8b:sft_full --topology v5p-128 \
        --rows 1 --length 1048576 --collectives all-reduce=47.7,collective-permute=1358 \
        [--hbm_gb 0] [--config.model.attention=blockwise ...]

Executed FLOPs from `cost_model.train_flops` (remat and attention recompute), collective GB per
chip as the compiled program's HLO counted them, HBM GB per chip a floor (default: none, i.e. the
row is timed by compute and collectives only). Prints per-chip model and executed TFLOP, the three
floors, the bound and MFU.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from absl import flags

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from posttrain import main as cli  # noqa: E402  (defines --config, checks --config.* overrides)

_TOPOLOGY = flags.DEFINE_string("topology", "v5p-128", "TPU slice: its chip count and chip facts")
_ROWS = flags.DEFINE_integer("rows", 1, "rows per step (all chips)")
_LENGTH = flags.DEFINE_integer("length", 4096, "tokens per row")
_COLLECTIVES = flags.DEFINE_string("collectives", "", "kind=GB per chip, comma separated (compiled counts)")
_HBM_GB = flags.DEFINE_float("hbm_gb", 0.0, "HBM bytes per chip (GB), a floor")


def main(argv: list[str]) -> None:
    del argv
    from posttrain.config import run_config
    from posttrain.plan import aot, cost_model
    from posttrain.plan.roofline import roofline

    gen, name = aot.parse_topology(_TOPOLOGY.value)
    chip = aot.CHIPS[gen]
    chips = 1
    for d in name.split(":")[1].split("x"):
        chips *= int(d)
    model, executed = (
        x / chips for x in cost_model.train_flops(run_config(cli._CONFIG.value), _ROWS.value, _LENGTH.value)
    )
    coll = dict.fromkeys(aot.COLLECTIVES, 0.0)
    for item in filter(None, _COLLECTIVES.value.split(",")):
        kind, gb = item.split("=")
        if kind not in coll:
            raise SystemExit(f"--collectives: {kind!r} is not one of {aot.COLLECTIVES}")
        coll[kind] = float(gb) * 1e9
    r = roofline(model, executed, _HBM_GB.value * 1e9, coll, chip)
    print(
        f"{_TOPOLOGY.value} ({chips} chips), {_ROWS.value} × {_LENGTH.value} tokens: model {model / 1e12:.1f} / "
        f"executed {executed / 1e12:.1f} TFLOP per chip (ceiling {r['ceiling']:.1%}); compute {r['compute_s']:.3g} s, "
        f"HBM {r['hbm_s']:.3g} s, collectives {r['comm_s']:.3g} s -> step >= {r['step_s']:.3g} s, "
        f"{r['bound']}-bound, MFU <= {r['mfu']:.1%}"
    )


if __name__ == "__main__":
    cli.entry(main)
