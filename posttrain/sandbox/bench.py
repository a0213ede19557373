"""Fixed cost of one sandboxed execution (median wall time of small jobs run one at a time).

The verifier-level throughput bench (HumanEval canonical solutions through the code harness)
is `posttrain.rl.verifiers.bench`, which builds on this.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Mapping

from posttrain.sandbox.core import Sandbox
from posttrain.sandbox.job import Job, python_job


def median_ms(sandbox: Sandbox, job: Job, repeats: int) -> float:
    """Median wall milliseconds of running `job` alone, `repeats` times (after one warm-up)."""
    sandbox.run(job)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        sandbox.run(job)
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def overhead_rows(sandbox: Sandbox, extra: Mapping[str, Job] | None = None, repeats: int = 20) -> list[dict]:
    """Rows for tools/bench.py: per-execution overhead of an empty program, of `python -I`,
    and of any `extra` named jobs; then which protections are active and which are missing."""
    jobs = {
        "empty program (/bin/true)": Job(argv=("/bin/true",)),
        "python -I (pass)": python_job("pass"),
        **(extra or {}),
    }
    out = [{"what": f"overhead: {what}", "ms_per_exec": median_ms(sandbox, job, repeats)} for what, job in jobs.items()]
    missing = "; ".join(sandbox.isolation.missing()) or "none"
    out.append({"what": "isolation", "active": str(sandbox.isolation), "missing": missing})
    return out
