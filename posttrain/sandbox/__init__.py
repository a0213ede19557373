"""Sandbox: run untrusted programs (model completions, tool calls) in contained processes.

Used by the verifiers and environments in `posttrain.rl`; it imports nothing from them.
`job` holds what to run and what happened (Job, Limits, ExecResult, Status), `execute` runs one
job (limits, namespaces), `core` the `Sandbox` (worker pool, retries) and `detect_isolation`,
`launcher` is the first process inside each sandbox, `bench` measures the per-execution cost.
"""

from posttrain.sandbox.core import Sandbox, detect_isolation
from posttrain.sandbox.isolation import SANDBOX_PATH, Isolation, sandbox_python
from posttrain.sandbox.job import ExecResult, Job, Limits, Status, python_job, shell_job

__all__ = [
    "SANDBOX_PATH",
    "ExecResult",
    "Isolation",
    "Job",
    "Limits",
    "Sandbox",
    "Status",
    "detect_isolation",
    "python_job",
    "sandbox_python",
    "shell_job",
]
