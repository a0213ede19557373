"""What the sandbox can protect on this machine, and what a sandboxed program may see.

`Isolation` records which protections are active (probed by `core.detect_isolation`);
`Isolation.missing()` names every gap so that none is silent. `visible_paths()` is the
read-only part of the filesystem a program sees when the sandbox builds it a private root:
the system directories and the Python interpreter, nothing else of the host (no home
directories, no repository, no data sets, no /tmp or /run with their Unix sockets).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import stat
import sys
from collections.abc import Sequence

SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
# Directories a program needs to run (binaries, shared libraries, interpreter, /etc for the
# loader cache, locale, passwd). Symlinks among them (/bin -> usr/bin) are recreated as links.
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc")


@dataclasses.dataclass(frozen=True)
class Isolation:
    """Which protections the sandbox applies on this machine (see `posttrain.sandbox.core`)."""

    drop_uid: bool  # dedicated unprivileged uid per execution (host runs as root)
    user_ns: bool
    net_ns: bool
    pid_ns: bool
    mount_ns: bool
    ipc_ns: bool = False  # private System V IPC and POSIX message queues, gone with the run
    private_root: bool = False  # the program sees only `visible_paths()` and its own files
    memory_cgroup: bool = False  # one memory budget for all the run's processes

    def namespaces(self) -> dict[str, bool]:
        """Namespace switches as the launcher spec expects them."""
        return {
            "user": self.user_ns,
            "net": self.net_ns,
            "pid": self.pid_ns,
            "mount": self.mount_ns,
            "ipc": self.ipc_ns,
        }

    @property
    def process_limit(self) -> bool:
        """RLIMIT_NPROC only bounds a fork bomb when the program's uid is its own (not root's,
        not shared with the host user's other processes)."""
        return self.drop_uid or self.user_ns

    def missing(self) -> list[str]:
        """Human-readable list of the protections that are NOT active here."""
        gaps = []
        if not self.net_ns:
            gaps.append("network: no network namespace, programs can open connections")
        if not self.pid_ns:
            gaps.append("pid: no PID namespace, processes that leave the process group can outlive the run")
        if not self.mount_ns:
            gaps.append("filesystem: no mount namespace, the program can write wherever its uid may")
        if not self.private_root:
            gaps.append(
                "visibility: no private root, the program can read (and connect to Unix sockets in) "
                "whatever its uid may on the host filesystem"
            )
        if not self.ipc_ns:
            gaps.append(
                "ipc: no IPC namespace, System V IPC objects and POSIX message queues outlive the run "
                "and can pass data between runs"
            )
        if not self.memory_cgroup:
            gaps.append(
                "memory: no memory cgroup, memory_bytes bounds each process, so a run may hold up to "
                "processes x memory_bytes"
            )
        if not self.process_limit:
            gaps.append("processes: RLIMIT_NPROC counts the host user's processes, fork bombs are not bounded")
        if not (self.drop_uid or self.user_ns):
            gaps.append("uid: the program runs as the host user and can signal the host's processes")
        return gaps


def _others_can_run(path: str) -> bool:
    """True when a uid with no relation to the file's owner can execute `path` (every
    directory on the way to it and to its symlink target searchable by others)."""
    real = os.path.realpath(path)
    dirs = {os.path.dirname(p) for p in (os.path.abspath(path), real)}
    while dirs:
        d = dirs.pop()
        if not os.stat(d).st_mode & stat.S_IXOTH:
            return False
        if d != os.path.dirname(d):
            dirs.add(os.path.dirname(d))
    return os.stat(real).st_mode & (stat.S_IXOTH | stat.S_IROTH) == stat.S_IXOTH | stat.S_IROTH


@functools.cache
def sandbox_python() -> str:
    """Interpreter for sandboxed Python programs: this one when the sandbox uid can run it,
    else python3 from the sandbox PATH (e.g. when this one lives under a private /root)."""
    if os.geteuid() != 0 or _others_can_run(sys.executable):
        return sys.executable
    found = shutil.which("python3", path=SANDBOX_PATH)
    if found is None or not _others_can_run(found):
        raise RuntimeError(
            f"no Python interpreter an unprivileged uid can run: {sys.executable} is private "
            f"and python3 on {SANDBOX_PATH} is {found!r}"
        )
    return found


@functools.cache
def visible_paths(extra: Sequence[str] = ()) -> tuple[str, ...]:
    """Host paths bound read-only into a private root: SYSTEM_DIRS that exist, the install
    prefixes of `sandbox_python()` when it is this interpreter (e.g. a venv), and `extra`.
    Paths already below another one are dropped."""
    paths = [p for p in SYSTEM_DIRS if os.path.lexists(p)]
    if sandbox_python() == sys.executable:
        exe = os.path.realpath(sys.executable)
        paths += [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix, os.path.dirname(exe)]
    for p in extra:
        if not os.path.isabs(p) or not os.path.exists(p):
            raise ValueError(f"Sandbox visible path {p!r} must be an existing absolute path")
        paths.append(p)
    paths = sorted({os.path.normpath(p) for p in paths})
    return tuple(p for p in paths if not any(p != q and p.startswith(q.rstrip("/") + "/") for q in paths))
