"""Start-up time with and without JAX's persistent compilation cache.

`python tools/bench_startup.py [--config configs/sft_tiny.py] [--repeats 3] [--steps 3]`

Each repeat uses a fresh, empty cache folder and runs the same command twice (fresh workdirs):
run 1 compiles and fills the cache, run 2 reads it. Time to first step = from process start to
the step-0 row in metrics.jsonl; total = the whole run (with its final eval and samples).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def timed_run(config: str, workdir: Path, cache: str, steps: int) -> tuple[float, float]:
    """(seconds to the first metrics row, seconds for the whole run) of one `posttrain.main` run."""
    cmd = [
        sys.executable,
        "-m",
        "posttrain.main",
        "--config",
        config,
        f"--config.workdir={workdir}",
        f"--config.compilation_cache={cache}",
        f"--config.train.steps={steps}",
        "--config.train.log_every=1",
        "--config.train.progress=False",
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first, metrics = None, workdir / "metrics.jsonl"
    while proc.poll() is None:
        if first is None and metrics.exists() and metrics.read_text().strip():
            first = time.perf_counter() - t0
        time.sleep(0.02)
    total = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"run failed ({proc.returncode}): {proc.stderr.read()[-2000:]}")
    return first if first is not None else total, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=str(ROOT / "configs/sft_tiny.py"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"{'repeat':>6} {'cache':>6} {'first step s':>13} {'total s':>8}")
    for r in range(args.repeats):
        with tempfile.TemporaryDirectory() as tmp:
            cache = os.path.join(tmp, "cache")
            for label in ("cold", "warm"):
                first, total = timed_run(args.config, Path(tmp) / label, cache, args.steps)
                print(f"{r:>6} {label:>6} {first:>13.1f} {total:>8.1f}", flush=True)
        off_first, off_total = timed_run(args.config, Path(tempfile.mkdtemp()) / "off", "off", args.steps)
        print(f"{r:>6} {'off':>6} {off_first:>13.1f} {off_total:>8.1f}", flush=True)


if __name__ == "__main__":
    main()
