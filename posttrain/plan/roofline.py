"""The roofline of a program on one chip: a lower bound on its time from the work it must do.

time ≥ max(executed FLOPs / bf16 peak, HBM bytes / HBM bandwidth, collective bytes / the
bandwidth of the links they use), every term a floor and perfect overlap assumed, so no estimate
built on it promises what the chip cannot do. Used by `posttrain.plan.cost_model` (analytic) and
`posttrain.plan.compile_plan` (compiled programs).
"""

from __future__ import annotations

from posttrain.plan.aot import Chip


def collective_seconds(collectives: dict, chip: Chip) -> float:
    """Seconds to move the collective bytes: a collective-permute (a ring's hop to its neighbour)
    over ONE link; the others at best over all of the chip's links (a lower bound: an all-to-all
    is limited by bisection, not by the links); an all-reduce moves its buffer twice
    (reduce-scatter + all-gather)."""
    return sum(
        v
        * (2 if k == "all-reduce" else 1)
        / (chip.link_bytes_per_s if k == "collective-permute" else chip.ici_bytes_per_s)
        for k, v in collectives.items()
    )


BOUNDS = ("compute", "HBM", "collective")


def roofline(model: float, executed: float, hbm: float, collectives: dict, chip: Chip) -> dict:
    """The roofline of one program per chip: time ≥ max(executed FLOPs / peak, HBM bytes / HBM
    bandwidth, collective bytes / link bandwidth), assuming perfect overlap (a lower bound on time);
    `bound` names the term that sets it; MFU = model FLOPs / (time × peak), so never above
    `ceiling` = model / executed (remat and recompute cost FLOPs MFU does not count)."""
    terms = {
        "compute": executed / chip.peak_flops,
        "HBM": hbm / chip.hbm_bytes_per_s if chip.hbm_bytes_per_s else 0.0,
        "collective": collective_seconds(collectives, chip),
    }
    step = max(terms.values())
    return {
        "compute_s": terms["compute"],
        "hbm_s": terms["HBM"],
        "comm_s": terms["collective"],
        "step_s": step,
        "bound": max(terms, key=terms.get) if step else "compute",
        "mfu": model / (step * chip.peak_flops) if step else 0.0,
        "ceiling": model / executed if executed else 1.0,
    }


def phases(parts: list[tuple[int, dict]], model: float, executed: float, chip: Chip) -> dict:
    """A program of phases run one after another (the sampler's prefill, then its decode steps):
    (repetitions, `roofline` of one) each; times and terms summed over the phases (tighter than
    one roofline of the sums, still a floor), `bound` that of the phase taking the most time."""
    out = {k: sum(t * r[k] for t, r in parts) for k in ("compute_s", "hbm_s", "comm_s", "step_s")}
    step = out["step_s"]
    return {
        **out,
        "bound": max(parts, key=lambda tr: tr[0] * tr[1]["step_s"])[1]["bound"],
        "mfu": model / (step * chip.peak_flops) if step else 0.0,
        "ceiling": model / executed if executed else 1.0,
    }
