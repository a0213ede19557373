"""Sandbox: run untrusted programs (model completions, tool calls) in contained processes.

Used by the verifiers and environments in `posttrain.rl`; it imports nothing from them.
`core` runs jobs (limits, namespaces, worker pool), `launcher` is the first process inside
each sandbox, `bench` measures the per-execution cost.
"""

from posttrain.sandbox.core import (
    SANDBOX_PATH, ExecResult, Isolation, Job, Limits, Sandbox, Status, detect_isolation, python_job,
    sandbox_python, shell_job,
)

__all__ = ["SANDBOX_PATH", "ExecResult", "Isolation", "Job", "Limits", "Sandbox", "Status", "detect_isolation",
           "python_job", "sandbox_python", "shell_job"]
