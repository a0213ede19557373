"""One memory budget per sandboxed run: a memory cgroup (v2 `memory.max` or v1
`memory.limit_in_bytes`) created per execution below this process's own memory cgroup (v2:
beside it, where the memory controller is enabled for children).

RLIMIT_AS bounds each process; a cgroup bounds the run's processes together (resident memory,
including the pages of files it writes to its tmpfs). The host moves the launcher into the
cgroup before the launcher forks, so every descendant is charged to it; when the total passes
the budget the kernel's OOM killer kills inside the cgroup only. Where no writable memory
controller exists (no root, no delegation), `memory_cgroup_parent()` is None and the run's
memory is bounded only by processes x memory_bytes (reported by `Isolation.missing()`).
"""

from __future__ import annotations

import errno
import functools
import itertools
import os
import time

_COUNTER = itertools.count()


@functools.cache
def memory_cgroup_parent() -> tuple[str, int] | None:
    """(directory, cgroup version) under which this process may create memory cgroups with a
    limit, or None. Probed once by creating and removing a child cgroup."""
    for parent, version in _candidates():
        probe = os.path.join(parent, f"posttrain-sbx-probe-{os.getpid()}")
        try:
            os.mkdir(probe)
        except OSError:
            continue
        try:
            if os.path.exists(os.path.join(probe, _LIMIT_FILE[version])):
                return parent, version
        finally:
            _rmdir(probe)
    return None


_LIMIT_FILE = {1: "memory.limit_in_bytes", 2: "memory.max"}


def _candidates() -> list[tuple[str, int]]:
    """Memory-controller directories of this process's own cgroup (v2 first, then v1)."""
    with open("/proc/self/cgroup") as f:
        rows = [line.rstrip("\n").split(":", 2) for line in f]
    with open("/proc/self/mountinfo") as f:
        mounts = [line.split() for line in f]
    out = []
    for fstype, version in (("cgroup2", 2), ("cgroup", 1)):
        for row in mounts:
            sep = row.index("-")
            if row[sep + 1] != fstype or (version == 1 and "memory" not in row[sep + 3].split(",")):
                continue
            for hier, controllers, path in rows:
                if (version == 2 and hier == "0") or (version == 1 and "memory" in controllers.split(",")):
                    rel = os.path.relpath(path, row[3])  # our cgroup relative to the mount's root
                    if rel.startswith(".."):
                        continue
                    own = os.path.normpath(os.path.join(row[4], rel))
                    out.append((own, version))
                    if version == 2 and own != row[4]:
                        # v2 enables controllers for children only in cgroups without processes
                        # (ours has them), so siblings of our cgroup are the usual place.
                        out.append((os.path.dirname(own), version))
    if os.geteuid() != 0:
        out = [c for c in out if os.access(c[0], os.W_OK)]
    return out


def create(limit_bytes: int) -> str | None:
    """A fresh memory cgroup limited to `limit_bytes` (no swap), or None when unavailable."""
    found = memory_cgroup_parent()
    if found is None:
        return None
    parent, version = found
    path = os.path.join(parent, f"posttrain-sbx-{os.getpid()}-{next(_COUNTER)}")
    os.mkdir(path)
    try:
        if version == 2:
            _write(path, "memory.max", limit_bytes)
            _write(path, "memory.swap.max", 0, optional=True)
            _write(path, "memory.oom.group", 1, optional=True)  # an OOM kills the whole run
        else:
            _write(path, "memory.limit_in_bytes", limit_bytes)
            _write(path, "memory.memsw.limit_in_bytes", limit_bytes, optional=True)  # swap counts too
    except BaseException:
        _rmdir(path)
        raise
    return path


def attach(path: str, pid: int) -> None:
    """Move process `pid` into the cgroup (its later children are born there)."""
    with open(os.path.join(path, "cgroup.procs"), "w") as f:
        f.write(str(pid))


def oom_kills(path: str) -> int:
    """How many processes the kernel killed in this cgroup for exceeding its limit."""
    name = "memory.events" if os.path.exists(os.path.join(path, "memory.events")) else "memory.oom_control"
    try:
        with open(os.path.join(path, name)) as f:
            fields = dict(line.split() for line in f if line.strip())
    except OSError:
        return 0
    return int(fields.get("oom_kill", 0))


def remove(path: str, timeout_s: float = 2.0) -> None:
    """Remove the cgroup once its last process has exited (they die with the PID namespace,
    which can take a moment after the launcher is reaped)."""
    deadline = time.monotonic() + timeout_s
    while not _rmdir(path) and time.monotonic() < deadline:
        time.sleep(0.002)


def _rmdir(path: str) -> bool:
    """rmdir, True when gone; False while processes remain (EBUSY)."""
    try:
        os.rmdir(path)
    except FileNotFoundError:
        return True
    except OSError as e:
        if e.errno != errno.EBUSY:
            raise
        return False
    return True


def _write(path: str, name: str, value: int, *, optional: bool = False) -> None:
    """Write one control file; `optional` ones may be absent (e.g. no swap accounting)."""
    try:
        with open(os.path.join(path, name), "w") as f:
            f.write(str(value))
    except FileNotFoundError:
        if not optional:
            raise
