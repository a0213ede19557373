"""Code-verifier throughput: executions/s of the sandbox pool vs one at a time on the HumanEval
canonical solutions, and the fixed cost of one execution (called from tools/bench.py)."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

from posttrain.rl.verifiers.code import CodeTask, CodeVerifier
from posttrain.sandbox import Sandbox
from posttrain.sandbox.bench import overhead_rows

DEFAULT_DATA = Path(__file__).resolve().parents[4] / "shared" / "data"


def sandbox_bench(
    data_dir: str | os.PathLike | None = None,
    *,
    workers: int | None = None,
    limit: int | None = None,
    repeats: int = 20,
) -> list[dict]:
    """Rows for tools/bench.py: per-execution overhead of an empty program, of `python -I`
    and of the code harness on a trivial task; then HumanEval canonical solutions (the first
    `limit`, all 164 by default) one at a time and on a pool of `workers` (default: CPUs).

    data_dir holds humaneval/HumanEval.jsonl.gz (default: shared/data beside the repo, or
    $POSTTRAIN_DATA).
    """
    data = Path(data_dir or os.environ.get("POSTTRAIN_DATA", DEFAULT_DATA))
    path = data / "humaneval" / "HumanEval.jsonl.gz"
    if not path.exists():
        raise FileNotFoundError(f"sandbox_bench needs {path} (pass data_dir or set POSTTRAIN_DATA)")
    with gzip.open(path, "rt") as f:
        rows = [json.loads(line) for line in f][:limit]
    tasks = [CodeTask.from_humaneval(r) for r in rows]
    solutions = [r["canonical_solution"] for r in rows]
    workers = workers or os.cpu_count() or 1
    out = []
    with Sandbox(max_workers=1) as serial, Sandbox(max_workers=workers) as pool:
        trivial = CodeTask(test="assert f() == 1", functions=("f",))
        harness = {"code harness, trivial task": CodeVerifier(serial).job(trivial, "def f():\n    return 1\n")[0]}
        out += overhead_rows(serial, harness, repeats)
        for name, sandbox in (("one at a time", serial), (f"pool of {workers}", pool)):
            verifier = CodeVerifier(sandbox)
            t = time.perf_counter()
            results = verifier.check_many(tasks, solutions)
            sec = time.perf_counter() - t
            out.append(
                {
                    "what": f"humaneval canonical, {name}",
                    "execs": len(tasks),
                    "passed": sum(r.passed for r in results),
                    "s": sec,
                    "execs_per_s": len(tasks) / sec,
                }
            )
    return out
