"""Sandbox jobs and their outcomes: what to run (`Job`, built by `python_job` / `shell_job`),
under which `Limits`, and what happened (`ExecResult`, its `Status`).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence

from posttrain.sandbox.isolation import sandbox_python


class Status(enum.StrEnum):
    """Outcome of one execution. ERROR means the sandbox itself failed after all retries."""

    PASS = "pass"
    FAIL = "fail"
    TIMEOUT = "timeout"
    CRASH = "crash"
    LIMIT_EXCEEDED = "limit_exceeded"
    ERROR = "error"


@dataclasses.dataclass(frozen=True)
class Limits:
    """Resource limits for one execution. memory_bytes is the address-space limit of each
    process and, where a memory cgroup is available, the budget of all of them together."""

    cpu_s: int = 10
    wall_s: float = 20.0
    memory_bytes: int = 1 << 30  # RLIMIT_AS per process; the run's cgroup budget
    processes: int = 32  # RLIMIT_NPROC: processes/threads of the sandbox uid
    file_bytes: int = 16 << 20  # RLIMIT_FSIZE: largest file the program may write
    open_files: int = 64
    output_bytes: int = 64 << 10  # per stream; past it the program is killed, output truncated
    disk_bytes: int = 64 << 20  # size of the private working-directory tmpfs

    @property
    def inodes(self) -> int:
        """Files and directories the working-directory tmpfs can hold (its `nr_inodes`)."""
        return max(1024, self.disk_bytes // 4096)

    def __post_init__(self) -> None:
        if not isinstance(self.cpu_s, int):
            raise ValueError(f"Limits.cpu_s must be whole seconds (RLIMIT_CPU), got {self.cpu_s!r}")
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"Limits.{f.name} must be positive, got {getattr(self, f.name)!r}")


@dataclasses.dataclass(frozen=True)
class Job:
    """One program to run: argv (argv[0] resolved on the sandbox PATH), files for its
    working directory (relative path -> content), optional stdin bytes, optional limits."""

    argv: tuple[str, ...]
    files: Mapping[str, str | bytes] = dataclasses.field(default_factory=dict)
    stdin: bytes | None = None
    limits: Limits | None = None


@dataclasses.dataclass(frozen=True)
class ExecResult:
    """What happened: status, exit code (negative = killed by that signal), captured output
    (truncated to the limit), which limit was exceeded, and timings."""

    status: Status
    exit_code: int | None
    stdout: bytes
    stderr: bytes
    # when LIMIT_EXCEEDED: "cpu", "memory", "file_size", "output"; "disk" when the job's files do not
    # fit in the working directory (bytes or inodes), "files" when one has a name no file can have
    limit: str | None = None
    wall_s: float = 0.0
    cpu_s: float | None = None
    attempts: int = 1
    error: str | None = None  # infrastructure error (status ERROR)

    @property
    def passed(self) -> bool:
        """True when the program ran to completion with exit code 0."""
        return self.status is Status.PASS


def python_job(
    source: str,
    *,
    args: Sequence[str] = (),
    files: Mapping[str, str | bytes] | None = None,
    stdin: bytes | None = None,
    limits: Limits | None = None,
    python: str | None = None,
) -> Job:
    """A job that runs `source` as main.py with `python -I` (isolated mode: no user site,
    no PYTHON* variables); python defaults to `sandbox_python()`."""
    all_files = dict(files or {})
    all_files["main.py"] = source
    argv = (python or sandbox_python(), "-I", "main.py", *args)
    return Job(argv=argv, files=all_files, stdin=stdin, limits=limits)


def shell_job(
    command: str,
    *,
    files: Mapping[str, str | bytes] | None = None,
    stdin: bytes | None = None,
    limits: Limits | None = None,
) -> Job:
    """A job that runs `command` with /bin/sh -c."""
    return Job(argv=("/bin/sh", "-c", command), files=dict(files or {}), stdin=stdin, limits=limits)
