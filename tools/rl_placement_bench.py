"""Steps/s of `rl.placement` colocated vs split vs disaggregated on a generation-heavy RLVR run,
on simulated CPU devices. Overhead measurements: the simulated devices share the host's cores, so
generation and learning on "separate" devices still take turns on the same CPUs and no speed-up
of a split can show here; what shows is what each placement adds (the publish, the threads and
the queue, the processes and the transfer server).

    PYTHONPATH=. nice -n 19 python tools/rl_placement_bench.py [--rounds 3] [--steps 10] [--skip 3]
        [--max_new_tokens 96] [--max_staleness 1] [--devices 8] [--sampler-devices 4]

Every run is `python -m posttrain.main` on configs/rlvr_tiny.py (a random policy, so every sample
runs to max_new_tokens; prompts 4 × 4 samples; no evaluations, checkpoints or init_from):
colocated on all `--devices` devices; split with the last `--sampler-devices` of them sampling;
disaggregated as a learner process group on devices - sampler-devices devices and one sampler
process group on the rest, over the transfer server on 127.0.0.1 (as
tests/rl/rollout/test_remote.py launches them). A step's time is the learner's loop iteration,
`rl/wait_s + rl/update_s` from metrics.jsonl (waiting for rollouts, the update, the publish);
steps/s is (steps - skip) over their sum for steps >= skip, so compiles and start-up are out.
Each round runs the three in turn; the ratios to the first placement listed are per round,
reported as the median (range) over rounds. `--placements colocated@4,split` runs colocated on 4
devices instead: as many devices per program as the split's learner and sampler have (on
simulated devices a program over fewer devices has less per-device overhead).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLACEMENTS = ("colocated", "split", "disaggregated")


def overrides(args, workdir: Path) -> dict:
    """The run's --config.* keys (every placement alike): no evaluations (their sizes back to the
    defaults, which the config requires without rl.eval_every)."""
    sys.path.insert(0, str(ROOT))
    from posttrain.config import RLConfig

    defaults = RLConfig()
    return {
        "rl.eval_size": defaults.eval_size,
        "rl.eval_samples": defaults.eval_samples,
        "workdir": str(workdir),
        "rl.steps": args.steps,
        "rl.prompts_per_step": 4,
        "rl.group_size": 4,
        "rl.max_new_tokens": args.max_new_tokens,
        "rl.max_staleness": args.max_staleness,
        "rl.eval_every": 0,
        "rl.gate": "",
        "rl.arithmetic_size": 100,
        "rl.kl_coef": 0.05,
        "checkpoint.every": 0,
        "train.log_every": 1,
        "train.progress": False,
    }


def launch(flat: dict, devices: int, log: Path, cache: str) -> subprocess.Popen:
    """`python -m posttrain.main` on rlvr_tiny with `flat` overrides, on `devices` simulated devices."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
        "JAX_PLATFORMS": "cpu",
        "POSTTRAIN_RL_HOST": "127.0.0.1",  # rl/rollout/transfer.HOST_ENV: the learner's server on loopback
        "POSTTRAIN_COMPILATION_CACHE": cache,  # later rounds compile less (compiles are not timed anyway)
    }
    cmd = [sys.executable, "-m", "posttrain.main", "--config", str(ROOT / "configs" / "rlvr_tiny.py")]
    cmd += [f"--config.{k}={v}" for k, v in flat.items()]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT)


def finish(proc: subprocess.Popen, log: Path, timeout: float) -> None:
    try:
        code = proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise SystemExit(f"{log}: timed out\n" + log.read_text()[-3000:]) from None
    if code:
        raise SystemExit(f"{log}: exit {code}\n" + log.read_text()[-3000:])


def steps_per_s(workdir: Path, skip: int) -> tuple[float, float]:
    """(steps/s over steps >= skip, the mean rl/wait_s share of a step) from metrics.jsonl."""
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "rl/update_s" in r and r["step"] >= skip]
    total = sum(r["rl/wait_s"] + r["rl/update_s"] for r in rows)
    return len(rows) / total, sum(r["rl/wait_s"] for r in rows) / total


def run(args, name: str, base: Path, cache: str) -> tuple[float, float, float]:
    """(steps/s, wait share, wall seconds of the whole run) of one placement; `name` is the
    placement, or placement@N for N devices in all instead of --devices (e.g. colocated@4: the
    learner's share of a split, as a baseline with as many devices per program)."""
    placement, _, count = name.partition("@")
    devices = int(count or args.devices)
    work = base / name
    flat = {**overrides(args, work), "rl.placement": placement}
    log = base / f"{name}.log"
    t = time.perf_counter()
    if placement == "colocated":
        finish(launch(flat, devices, log, cache), log, 1200)
    elif placement == "split":
        flat["rl.sampler_devices"] = args.sampler_devices
        finish(launch(flat, devices, log, cache), log, 1200)
    else:
        learners = devices - args.sampler_devices
        sampler = launch({**flat, "rl.role": "sampler"}, args.sampler_devices, base / f"{name}-sampler.log", cache)
        learner = launch({**flat, "rl.role": "learner"}, learners, log, cache)
        finish(learner, log, 1200)
        finish(sampler, base / f"{name}-sampler.log", 120)
    wall = time.perf_counter() - t
    return (*steps_per_s(work, args.skip), wall)


def spread(xs: list[float]) -> str:
    """median (min-max), or the one value."""
    if len(xs) == 1:
        return f"{xs[0]:.2f} (1 round)"
    return f"{statistics.median(xs):.2f} ({min(xs):.2f}-{max(xs):.2f})"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--skip", type=int, default=3, help="first steps left out (compiles, start-up)")
    p.add_argument("--max_new_tokens", type=int, default=96)
    p.add_argument("--max_staleness", type=int, default=1)
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--sampler-devices", type=int, default=4)
    p.add_argument("--placements", default=",".join(PLACEMENTS), help="placement[@devices], comma-separated")
    args = p.parse_args()
    if args.steps <= args.skip:
        p.error("--steps must exceed --skip")
    placements = args.placements.split(",")
    results = {k: [] for k in placements}
    with tempfile.TemporaryDirectory(prefix="rl-placement-bench-") as tmp:
        cache = os.path.join(tmp, "jax-cache")
        for i in range(args.rounds):
            for placement in placements:
                base = Path(tmp) / f"round{i}"
                base.mkdir(exist_ok=True)
                rate, wait, wall = run(args, placement, base, cache)
                results[placement].append((rate, wait))
                print(
                    f"round {i + 1} {placement}: {rate:.3f} steps/s (rollout wait {wait:.0%} of a step), "
                    f"run {wall:.0f} s with start-up",
                    flush=True,
                )
    first = placements[0]
    print(
        f"\nrlvr_tiny, 4 prompts × 4 samples × {args.max_new_tokens} new tokens, max_staleness "
        f"{args.max_staleness}, steps {args.skip}..{args.steps - 1} of {args.steps}, {args.rounds} round(s); "
        f"split / disaggregated: {args.devices - args.sampler_devices} learner + {args.sampler_devices} sampler "
        "devices (overhead measurement: simulated devices share the host's cores)\n"
    )
    print(
        f"| placement | steps/s, median (range) | x {first}, median (range) of per-round ratios | rollout wait share |"
    )
    print("|---|---:|---:|---:|")
    for placement in placements:
        rates = [r for r, _ in results[placement]]
        ratios = [r / c for (r, _), (c, _) in zip(results[placement], results[first])]
        waits = statistics.median(w for _, w in results[placement])
        print(f"| {placement} | {spread(rates)} | {spread(ratios)} | {waits:.0%} |")


if __name__ == "__main__":
    main()
