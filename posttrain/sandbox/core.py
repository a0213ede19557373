"""Sandbox: run untrusted programs in a contained child process.

Each execution gets resource limits (CPU time, address space, processes, file size, open
files), a wall-clock timeout that kills the whole process group, a fresh working directory
that is deleted afterwards, a scrubbed environment, a closed stdin (unless input is given)
and stdout/stderr capped at a byte limit. On Linux it also uses, where the OS allows:

* a network namespace (no interfaces but a downed loopback: no network at all),
* a PID namespace (the program sees only its own processes; when it ends, all die),
* a mount namespace (every mount read-only, a fresh size-limited tmpfs as working
  directory and /dev/shm, a private /proc),
* a private root: the program sees only the system directories and the interpreter
  (`isolation.visible_paths()`, read-only) and its own files -- no home directories, no
  repository, no reference data, no host /tmp or /run and so no host Unix sockets,
* an IPC namespace (System V IPC and POSIX message queues die with the run),
* a memory cgroup per execution (`cgroup.py`): `Limits.memory_bytes` is one budget for all
  the run's processes together, not only a per-process address-space limit,
* a dedicated unprivileged uid per execution when the host runs as root (so RLIMIT_NPROC
  bounds fork bombs, and the program can signal or write nothing of anyone else's), or a
  user namespace when it does not.

`detect_isolation()` probes which of these work here; `Isolation.missing()` names the ones
that do not. A `Sandbox` runs many executions concurrently on a bounded thread pool and
retries infrastructure failures (never the program's own).

Process tree of one execution: host -> launcher (`launcher.py`: enters namespaces,
mounts) -> init (pid 1 of the new PID namespace, reaps, reports exit status on a private pipe)
-> program.

Modules: `job` (Job, Limits, ExecResult, Status, the job builders), `execute` (one execution:
the launcher, its streams, the outcome), this one (`detect_isolation`, `Sandbox`).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence

from posttrain.sandbox import cgroup
from posttrain.sandbox.execute import _execute, _InfraError
from posttrain.sandbox.isolation import Isolation, visible_paths
from posttrain.sandbox.job import ExecResult, Job, Limits, Status


@functools.cache
def detect_isolation(python: str = sys.executable) -> Isolation:
    """Probe which protections work on this machine by running /bin/true under each candidate.

    Root gets a dedicated uid plus whichever of net/pid/mount/ipc namespaces can be created
    (a private root needs the mount namespace); other users need a user namespace for any
    namespace at all. The memory cgroup is probed separately. Cached per interpreter.
    """
    root = os.geteuid() == 0

    def works(iso: Isolation) -> bool:
        try:
            job = Job(argv=("/bin/true",))
            return _execute(
                job, Limits(cpu_s=5, wall_s=10.0), iso, python, tempfile.gettempdir(), 1, visible_paths()
            ).passed
        except _InfraError:
            return False

    full = Isolation(
        drop_uid=root,
        user_ns=not root,
        net_ns=True,
        pid_ns=True,
        mount_ns=True,
        ipc_ns=True,
        private_root=True,
        memory_cgroup=cgroup.memory_cgroup_parent() is not None,
    )
    none = dict(net_ns=False, pid_ns=False, mount_ns=False, ipc_ns=False, private_root=False, memory_cgroup=False)
    if works(full):
        return full
    base = dataclasses.replace(full, **none)
    if not root and not works(base):
        return dataclasses.replace(base, user_ns=False)  # no user namespace: no other either
    usable = {
        name: getattr(full, name) and works(dataclasses.replace(base, **{name: True}))
        for name in none
        if name != "private_root"
    }
    if usable["mount_ns"]:
        usable["private_root"] = works(dataclasses.replace(base, mount_ns=True, private_root=True))
    iso = dataclasses.replace(full, **usable)
    return iso if works(iso) else base


class Sandbox:
    """Runs jobs under `detect_isolation()` protections with a bounded worker pool.

    max_workers bounds concurrent executions (default: CPU count); retries is how often an
    infrastructure failure is retried; workdir_root is where staging directories go; visible
    names host paths a program may read besides the system directories (with a private root).
    """

    def __init__(
        self,
        limits: Limits = Limits(),
        *,
        isolation: Isolation | None = None,
        max_workers: int | None = None,
        retries: int = 2,
        workdir_root: str | None = None,
        python: str = sys.executable,
        visible: Sequence[str] = (),
    ) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.limits = limits
        self.isolation = isolation or detect_isolation(python)
        self.retries = retries
        self.python = python
        self.workdir_root = os.path.abspath(workdir_root or tempfile.gettempdir())
        self.visible = visible_paths(tuple(visible))
        if any(os.path.commonpath([self.workdir_root, p]) == p for p in self.visible):
            raise ValueError(
                f"Sandbox workdir_root {self.workdir_root!r} lies inside a visible path; "
                "the programs would see each other's working directories"
            )
        self.max_workers = max_workers or os.cpu_count() or 1
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # --- public API -------------------------------------------------------------------------

    def run(self, job: Job) -> ExecResult:
        """Run one job in the calling thread, retrying infrastructure failures."""
        for attempt in range(1, self.retries + 2):
            try:
                return _execute(
                    job,
                    job.limits or self.limits,
                    self.isolation,
                    self.python,
                    self.workdir_root,
                    attempt,
                    self.visible,
                )
            except _InfraError as e:
                last = str(e)
                time.sleep(0.05 * attempt)
        return ExecResult(Status.ERROR, None, b"", b"", attempts=self.retries + 1, error=last)

    def submit(self, job: Job) -> concurrent.futures.Future[ExecResult]:
        """Queue a job on the worker pool; at most max_workers run at once."""
        with self._pool_lock:
            if self._pool is None:
                self._pool = concurrent.futures.ThreadPoolExecutor(self.max_workers, thread_name_prefix="sandbox")
            return self._pool.submit(self.run, job)

    def map(self, jobs: Iterable[Job]) -> list[ExecResult]:
        """Run jobs concurrently on the pool; results in input order."""
        return [f.result() for f in [self.submit(j) for j in jobs]]

    def close(self) -> None:
        """Wait for queued jobs and stop the worker threads."""
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
