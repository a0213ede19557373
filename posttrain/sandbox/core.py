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
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import functools
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from posttrain.sandbox import cgroup
from posttrain.sandbox.isolation import SANDBOX_PATH, Isolation, sandbox_python, visible_paths

INFRA_EXIT = 121  # exit code of launcher/init when setting up the sandbox failed
_READ_CHUNK = 1 << 16

# The launcher runs as `python -I -S -c LAUNCHER_SOURCE <spec json>`: stdlib only, small imports.
LAUNCHER_SOURCE = (Path(__file__).parent / "launcher.py").read_text()


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
    limit: str | None = None  # "cpu", "memory", "file_size", "output" when LIMIT_EXCEEDED
    wall_s: float = 0.0
    cpu_s: float | None = None
    attempts: int = 1
    error: str | None = None  # infrastructure error (status ERROR)

    @property
    def passed(self) -> bool:
        """True when the program ran to completion with exit code 0."""
        return self.status is Status.PASS


class _InfraError(RuntimeError):
    """The sandbox machinery (not the program) failed; the execution may be retried."""


def python_job(source: str, *, args: Sequence[str] = (), files: Mapping[str, str | bytes] | None = None,
               stdin: bytes | None = None, limits: Limits | None = None, python: str | None = None) -> Job:
    """A job that runs `source` as main.py with `python -I` (isolated mode: no user site,
    no PYTHON* variables); python defaults to `sandbox_python()`."""
    all_files = dict(files or {})
    all_files["main.py"] = source
    argv = (python or sandbox_python(), "-I", "main.py", *args)
    return Job(argv=argv, files=all_files, stdin=stdin, limits=limits)


def shell_job(command: str, *, files: Mapping[str, str | bytes] | None = None, stdin: bytes | None = None,
              limits: Limits | None = None) -> Job:
    """A job that runs `command` with /bin/sh -c."""
    return Job(argv=("/bin/sh", "-c", command), files=dict(files or {}), stdin=stdin, limits=limits)


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
            return _execute(job, Limits(cpu_s=5, wall_s=10.0), iso, python, tempfile.gettempdir(), 1,
                            visible_paths()).passed
        except _InfraError:
            return False

    full = Isolation(drop_uid=root, user_ns=not root, net_ns=True, pid_ns=True, mount_ns=True, ipc_ns=True,
                     private_root=True, memory_cgroup=cgroup.memory_cgroup_parent() is not None)
    none = dict(net_ns=False, pid_ns=False, mount_ns=False, ipc_ns=False, private_root=False, memory_cgroup=False)
    if works(full):
        return full
    base = dataclasses.replace(full, **none)
    if not root and not works(base):
        return dataclasses.replace(base, user_ns=False)  # no user namespace: no other either
    usable = {name: getattr(full, name) and works(dataclasses.replace(base, **{name: True}))
              for name in none if name != "private_root"}
    if usable["mount_ns"]:
        usable["private_root"] = works(dataclasses.replace(base, mount_ns=True, private_root=True))
    iso = dataclasses.replace(full, **usable)
    return iso if works(iso) else base


class _UidPool:
    """Hands out host uids unused by any other in-flight execution (random in a high range,
    so separate processes collide with negligible probability)."""

    BASE, SPAN = 1_500_000_000, 500_000_000

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._busy: set[int] = set()

    def acquire(self) -> int:
        with self._lock:
            while (uid := self.BASE + random.randrange(self.SPAN)) in self._busy:
                pass
            self._busy.add(uid)
            return uid

    def release(self, uid: int) -> None:
        with self._lock:
            self._busy.discard(uid)


_UIDS = _UidPool()


class Sandbox:
    """Runs jobs under `detect_isolation()` protections with a bounded worker pool.

    max_workers bounds concurrent executions (default: CPU count); retries is how often an
    infrastructure failure is retried; workdir_root is where staging directories go; visible
    names host paths a program may read besides the system directories (with a private root).
    """

    def __init__(self, limits: Limits = Limits(), *, isolation: Isolation | None = None,
                 max_workers: int | None = None, retries: int = 2, workdir_root: str | None = None,
                 python: str = sys.executable, visible: Sequence[str] = ()) -> None:
        if retries < 0:
            raise ValueError(f"retries must be >= 0, got {retries}")
        self.limits = limits
        self.isolation = isolation or detect_isolation(python)
        self.retries = retries
        self.python = python
        self.workdir_root = os.path.abspath(workdir_root or tempfile.gettempdir())
        self.visible = visible_paths(tuple(visible))
        if any(os.path.commonpath([self.workdir_root, p]) == p for p in self.visible):
            raise ValueError(f"Sandbox workdir_root {self.workdir_root!r} lies inside a visible path; "
                             "the programs would see each other's working directories")
        self.max_workers = max_workers or os.cpu_count() or 1
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    # --- public API -------------------------------------------------------------------------

    def run(self, job: Job) -> ExecResult:
        """Run one job in the calling thread, retrying infrastructure failures."""
        for attempt in range(1, self.retries + 2):
            try:
                return _execute(job, job.limits or self.limits, self.isolation, self.python,
                                self.workdir_root, attempt, self.visible)
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

def _execute(job: Job, limits: Limits, iso: Isolation, python: str, workdir_root: str, attempt: int,
             visible: Sequence[str]) -> ExecResult:
    """One execution of `job`; raises _InfraError when the sandbox machinery fails."""
    argv = list(job.argv)
    if not argv:
        raise ValueError("Job.argv is empty")
    exe = argv[0] if os.sep in argv[0] else shutil.which(argv[0], path=SANDBOX_PATH)
    if exe is None:
        raise ValueError(f"Job.argv[0] {argv[0]!r} not found on {SANDBOX_PATH}")
    argv[0] = exe
    uid = _UIDS.acquire() if iso.drop_uid else os.getuid()
    workdir = tempfile.mkdtemp(prefix="posttrain-sbx-", dir=workdir_root)
    status_r, status_w = os.pipe()
    proc = memory = None
    try:
        _write_files(workdir, job.files, uid if iso.drop_uid else None)
        try:
            memory = cgroup.create(limits.memory_bytes) if iso.memory_cgroup else None
        except OSError as e:
            raise _InfraError(f"cannot create the run's memory cgroup: {e}") from e
        spec = {
            "argv": argv, "workdir": workdir, "status_fd": status_w, "ns": iso.namespaces(),
            "drop_uid": iso.drop_uid, "uid": uid, "gid": uid, "infra_exit": INFRA_EXIT,
            "limits": dataclasses.asdict(limits),
            "root": list(visible) if iso.private_root else None,
            "env": {"PATH": SANDBOX_PATH, "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8"},
        }
        start = time.monotonic()
        proc = _start_launcher(python, spec, job.stdin is not None, memory)
        os.close(status_w)
        status_w = -1
        out = _collect(proc, status_r, job.stdin, start + limits.wall_s, limits.output_bytes)
        wall = time.monotonic() - start
        if not proc.stdout.closed:  # the PID namespace dies with init; its processes leave the cgroup
            _kill_group(proc)
        oom = cgroup.oom_kills(memory) if memory else 0
        return _classify(out, proc.returncode, limits, wall, attempt, oom)
    finally:
        if proc is not None and not proc.stdout.closed:  # not yet killed and reaped above
            _kill_group(proc)
        if memory is not None:
            cgroup.remove(memory)
        for fd in (status_r, status_w):
            if fd >= 0:
                os.close(fd)
        shutil.rmtree(workdir, ignore_errors=True)
        if iso.drop_uid:
            _UIDS.release(uid)


def _start_launcher(python: str, spec: dict, has_stdin: bool, memory: str | None) -> subprocess.Popen:
    """Start the launcher. With a memory cgroup, move it there while its interpreter starts
    (a move costs milliseconds), then let it fork the program ("go" pipe): every process of
    the run is charged to the run's budget."""
    go_r, go_w = os.pipe() if memory else (-1, -1)
    try:
        try:
            proc = subprocess.Popen(
                [python, "-I", "-S", "-c", LAUNCHER_SOURCE, json.dumps({**spec, "go_fd": go_r if memory else None})],
                stdin=subprocess.PIPE if has_stdin else subprocess.DEVNULL, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(spec["status_fd"], *((go_r,) if memory else ())),
                start_new_session=True, env={}, cwd="/")
        except OSError as e:
            raise _InfraError(f"cannot start launcher: {e}") from e
        if memory:
            try:
                cgroup.attach(memory, proc.pid)
                os.write(go_w, b"1")
            except OSError as e:
                _kill_group(proc)
                raise _InfraError(f"cannot move the launcher into its memory cgroup: {e}") from e
        return proc
    finally:
        for fd in (go_r, go_w):
            if fd >= 0:
                os.close(fd)


def _write_files(workdir: str, files: Mapping[str, str | bytes], owner: int | None) -> None:
    """Write the job's files below workdir (refusing paths that escape it), owned by `owner`."""
    base = os.path.realpath(workdir)
    for rel, content in files.items():
        path = os.path.realpath(os.path.join(base, rel))
        if os.path.isabs(rel) or not path.startswith(base + os.sep):
            raise ValueError(f"Job.files path {rel!r} escapes the working directory")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(content.encode() if isinstance(content, str) else content)
    if owner is not None:
        for root, dirs, names in os.walk(base):
            for name in [*dirs, *names]:
                os.chown(os.path.join(root, name), owner, owner)
        os.chown(base, owner, owner)


@dataclasses.dataclass
class _Collected:
    stdout: bytearray
    stderr: bytearray
    status: list[dict]
    killed: str | None  # "timeout" or "output" when the host killed the process group


def _collect(proc: subprocess.Popen, status_r: int, stdin: bytes | None, deadline: float,
             max_output: int) -> _Collected:
    """Pump stdin/stdout/stderr/status until all close or a deadline/output limit is hit."""
    out = _Collected(bytearray(), bytearray(), [], None)
    status_buf = bytearray()
    sinks = {proc.stdout.fileno(): out.stdout, proc.stderr.fileno(): out.stderr, status_r: status_buf}
    sel = selectors.DefaultSelector()
    for fd in sinks:
        sel.register(fd, selectors.EVENT_READ)
    pending = memoryview(stdin or b"")
    if proc.stdin is not None:
        os.set_blocking(proc.stdin.fileno(), False)
        sel.register(proc.stdin.fileno(), selectors.EVENT_WRITE)
    try:
        while sel.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                out.killed = "timeout"
                break
            events = sel.select(min(remaining, 0.5))
            if not events and proc.poll() is not None:
                break  # launcher gone; only escaped descendants hold the pipes (no PID namespace)
            for key, _ in events:
                fd = key.fd
                if fd not in sinks:
                    try:
                        pending = pending[os.write(fd, pending[:_READ_CHUNK]):]
                    except BlockingIOError:
                        continue
                    except BrokenPipeError:
                        pending = pending[:0]  # the program closed its stdin
                    if not pending:
                        sel.unregister(fd)
                        proc.stdin.close()
                    continue
                data = os.read(fd, _READ_CHUNK)
                if not data:
                    sel.unregister(fd)
                    continue
                sink = sinks[fd]
                sink += data
                if fd != status_r and len(sink) > max_output:
                    del sink[max_output:]
                    out.killed = "output"
            if out.killed:
                break
    finally:
        sel.close()
    if out.killed:
        _kill_group(proc)
    else:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            out.killed = "timeout"
            _kill_group(proc)
    _drain(status_r, status_buf)
    # Whole lines only: a line is one atomic pipe write, a kill can only cut off the last one.
    out.status = [json.loads(line) for line in status_buf.split(b"\n")[:-1]]
    return out


def _drain(fd: int, buf: bytearray) -> None:
    """Read what is left in a pipe without blocking (its writers are dead by now)."""
    os.set_blocking(fd, False)
    try:
        while data := os.read(fd, _READ_CHUNK):
            buf += data
    except BlockingIOError:
        pass


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher's process group (init dies with it, and with init the PID namespace)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


_SIGNAL_LIMITS = {signal.SIGXCPU: "cpu", signal.SIGXFSZ: "file_size"}
_STDERR_LIMITS = {b"MemoryError": "memory", b"File too large": "file_size",
                  b"Resource temporarily unavailable": "processes"}


def _classify(out: _Collected, launcher_rc: int, limits: Limits, wall: float, attempt: int,
              oom_kills: int = 0) -> ExecResult:
    """Turn the collected streams and status lines into an ExecResult (or an _InfraError).
    A run in which the kernel killed a process for the run's memory budget exceeded it."""
    errors = [s["error"] for s in out.status if "error" in s]
    exits = [s for s in out.status if "exit" in s]
    common = dict(stdout=bytes(out.stdout), stderr=bytes(out.stderr), wall_s=wall, attempts=attempt)
    if out.killed == "timeout":
        return ExecResult(Status.TIMEOUT, None, limit="wall", **common)
    if out.killed == "output":
        return ExecResult(Status.LIMIT_EXCEEDED, None, limit="output", **common)
    if errors or not exits:
        raise _InfraError(f"sandbox setup failed (launcher rc={launcher_rc}): {'; '.join(errors) or 'no status'}"
                          f"; stderr: {bytes(out.stderr[-500:])!r}")
    code, cpu = exits[-1]["exit"], exits[-1]["cpu_s"]
    common["cpu_s"] = cpu
    if oom_kills:
        return ExecResult(Status.LIMIT_EXCEEDED, code, limit="memory", **common)
    if code == 0:
        return ExecResult(Status.PASS, 0, **common)
    if code < 0:
        sig = -code
        limit = _SIGNAL_LIMITS.get(sig)
        if sig == signal.SIGKILL and cpu >= limits.cpu_s:
            limit = "cpu"
        return ExecResult(Status.LIMIT_EXCEEDED if limit else Status.CRASH, code, limit=limit, **common)
    tail = bytes(out.stderr[-300:])
    limit = next((name for marker, name in _STDERR_LIMITS.items() if marker in tail), None)
    return ExecResult(Status.LIMIT_EXCEEDED if limit else Status.FAIL, code, limit=limit, **common)
