"""One sandboxed execution (`_execute`): stage the job's files in a fresh working directory,
start the launcher (`launcher.py`, run from its source as `python -I -S -c`) in the run's memory
cgroup, pump its streams under the wall-clock and output limits, kill its process group, and
classify the outcome as an `ExecResult`. A failure of the machinery itself raises `_InfraError`,
which `Sandbox` retries. Also owns the pool of dedicated uids of in-flight executions.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import random
import selectors
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from posttrain.sandbox import cgroup
from posttrain.sandbox.isolation import SANDBOX_PATH, Isolation
from posttrain.sandbox.job import ExecResult, Job, Limits, Status

INFRA_EXIT = 121  # exit code of launcher/init when setting up the sandbox failed
_READ_CHUNK = 1 << 16

# The launcher runs as `python -I -S -c LAUNCHER_SOURCE <spec json>`: stdlib only, small imports.
LAUNCHER_SOURCE = (Path(__file__).parent / "launcher.py").read_text()


class _InfraError(RuntimeError):
    """The sandbox machinery (not the program) failed; the execution may be retried."""


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


def _execute(
    job: Job, limits: Limits, iso: Isolation, python: str, workdir_root: str, attempt: int, visible: Sequence[str]
) -> ExecResult:
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
        try:
            _write_files(workdir, job.files, uid if iso.drop_uid else None)
        except _FilesRefused as e:
            return ExecResult(Status.LIMIT_EXCEEDED, None, b"", str(e).encode(), limit="files", attempts=attempt)
        try:
            memory = cgroup.create(limits.memory_bytes) if iso.memory_cgroup else None
        except OSError as e:
            raise _InfraError(f"cannot create the run's memory cgroup: {e}") from e
        spec = {
            "argv": argv,
            "workdir": workdir,
            "status_fd": status_w,
            "ns": iso.namespaces(),
            "drop_uid": iso.drop_uid,
            "uid": uid,
            "gid": uid,
            "infra_exit": INFRA_EXIT,
            "limits": dataclasses.asdict(limits),
            "inodes": limits.inodes,
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
                stdin=subprocess.PIPE if has_stdin else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(spec["status_fd"], *((go_r,) if memory else ())),
                start_new_session=True,
                env={},
                cwd="/",
            )
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


class _FilesRefused(Exception):
    """A job's file that no file system can hold by that name (too long, a NUL, a file where a
    directory goes): the job's fault, a limit it hit, never the host's."""


# Errors a file's name or place causes; any other (a full or failing host disk) is the host's.
_NAME_ERRORS = (errno.ENAMETOOLONG, errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.EILSEQ, errno.EINVAL, errno.ELOOP)


def _write_files(workdir: str, files: Mapping[str, str | bytes], owner: int | None) -> None:
    """Write the job's files below workdir (refusing paths that escape it), owned by `owner`."""
    base = os.path.realpath(workdir)
    for rel, content in files.items():
        if "\0" in rel:
            raise _FilesRefused(f"Job.files path {rel[:100]!r}: a NUL byte is in no file name")
        try:
            path = os.path.realpath(os.path.join(base, rel))
            if os.path.isabs(rel) or not path.startswith(base + os.sep):
                raise ValueError(f"Job.files path {rel!r} escapes the working directory")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "wb") as f:
                f.write(content.encode() if isinstance(content, str) else content)
        except UnicodeEncodeError as e:
            raise _FilesRefused(f"Job.files path {rel[:100]!r}...: not a file name ({e.reason})") from e
        except OSError as e:
            if e.errno not in _NAME_ERRORS:
                raise _InfraError(f"cannot stage the job's files: {e}") from e
            raise _FilesRefused(f"Job.files path {rel[:100]!r} ({len(rel)} characters): {e.strerror}") from e
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


def _collect(
    proc: subprocess.Popen, status_r: int, stdin: bytes | None, deadline: float, max_output: int
) -> _Collected:
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
                        pending = pending[os.write(fd, pending[:_READ_CHUNK]) :]
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
_STDERR_LIMITS = {
    b"MemoryError": "memory",
    b"File too large": "file_size",
    b"Resource temporarily unavailable": "processes",
}


def _classify(
    out: _Collected, launcher_rc: int, limits: Limits, wall: float, attempt: int, oom_kills: int = 0
) -> ExecResult:
    """Turn the collected streams and status lines into an ExecResult (or an _InfraError).
    A run in which the kernel killed a process for the run's memory budget exceeded it."""
    errors = [s["error"] for s in out.status if "error" in s]
    exits = [s for s in out.status if "exit" in s]
    common = dict(stdout=bytes(out.stdout), stderr=bytes(out.stderr), wall_s=wall, attempts=attempt)
    if out.killed == "timeout":
        return ExecResult(Status.TIMEOUT, None, limit="wall", **common)
    if out.killed == "output":
        return ExecResult(Status.LIMIT_EXCEEDED, None, limit="output", **common)
    if room := next((s for s in out.status if "limit" in s), None):  # the job's files did not fit
        common["stderr"] += str(room.get("detail", "")).encode()
        return ExecResult(Status.LIMIT_EXCEEDED, None, limit=str(room["limit"]), **common)
    if errors or not exits:
        raise _InfraError(
            f"sandbox setup failed (launcher rc={launcher_rc}): {'; '.join(errors) or 'no status'}"
            f"; stderr: {bytes(out.stderr[-500:])!r}"
        )
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
