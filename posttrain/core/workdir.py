"""A lock on a run's workdir, held for the whole run: two runs writing one workdir corrupt it
(interleaved metrics.jsonl, orbax temporary folders left behind), so the second one fails fast.

The lock is `fcntl.flock` on `{workdir}/.posttrain.lock`, which the kernel releases when the holder dies
(also on SIGKILL), plus the holder's pid, host, start time and command written into that file to
name it in the error. A lock file that still names a holder but is not locked was left by a run
that died: it is reported and taken over. A run also conflicts with runs holding the lock of an
ancestor folder or of a direct subfolder (a pipeline's stage workdirs are `{workdir}/{i}_{stage}`);
within one process the lock is re-entrant, so a pipeline's stages never wait on their parent.

`gs://` and other remote workdirs: object stores have no flock. The lock is then a local file
keyed by the URL under the user's cache dir, which catches two runs on the same machine; runs on
different machines in one remote workdir are not detected (a warning says so).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Iterator

from posttrain.errors import UserError

LOCK_NAME = ".posttrain.lock"
_HELD: dict[str, tuple[int, int]] = {}  # lock file → (fd, depth) held by this process


class WorkdirBusy(UserError):
    """Another live process holds the workdir's lock."""


def user_cache_dir() -> str:
    """`$XDG_CACHE_HOME/posttrain` (default `~/.cache/posttrain`): the project's own files
    (compilation cache, locks of remote workdirs); never a path the user named for data."""
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "posttrain")


def lock_file(workdir: str) -> str:
    """Where the lock of `workdir` lives: `{workdir}/.posttrain.lock`, or for a URL a local file keyed by it."""
    if "://" in workdir and not workdir.startswith("file://"):
        key = hashlib.sha1(workdir.rstrip("/").encode()).hexdigest()[:16]
        return os.path.join(user_cache_dir(), "locks", f"{key}.lock")
    return os.path.join(os.path.realpath(workdir.removeprefix("file://")), LOCK_NAME)


def _holder() -> dict:
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join(sys.argv)[:300],
    }


def _read_holder(fd: int) -> dict:
    os.lseek(fd, 0, os.SEEK_SET)
    text = os.read(fd, 65536).decode(errors="replace").strip()
    try:
        return json.loads(text) if text else {}
    except ValueError:
        return {"raw": text[:200]}


def _describe(holder: dict) -> str:
    if not holder:
        return "another process (no holder recorded)"
    return (
        f"pid {holder.get('pid')} on host {holder.get('host')} (started {holder.get('started')}, "
        f"command: {holder.get('command', '?')})"
    )


def _busy(workdir: str, path: str, fd: int) -> WorkdirBusy:
    holder = _read_holder(fd)
    return WorkdirBusy(
        f"workdir {workdir} is in use by {_describe(holder)} [lock {path}]; wait for that "
        "run to finish or stop it, or pass another --config.workdir",
        key="workdir",
        path=workdir,
    )


def _check_free(workdir: str, path: str) -> None:
    """Raise WorkdirBusy if another process holds the lock file `path` (without taking it)."""
    if path in _HELD or not os.path.exists(path):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # not ours to read (another user's folder): nothing we can check
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
    except OSError as e:
        if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise
        raise _busy(workdir, path, fd) from None
    finally:
        os.close(fd)


def _related_locks(path: str) -> list[str]:
    """Lock files of the ancestors and the direct subfolders of the workdir whose lock is `path`."""
    folder = os.path.dirname(path)
    out, parent = [], os.path.dirname(folder)
    while parent and parent != folder:
        out.append(os.path.join(parent, LOCK_NAME))
        folder, parent = parent, os.path.dirname(parent)
    return out + sorted(glob.glob(os.path.join(os.path.dirname(path), "*", LOCK_NAME)))


def _acquire(workdir: str, path: str) -> int:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        error = _busy(workdir, path, fd) if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else e
        os.close(fd)
        raise error from None
    previous = _read_holder(fd)
    if previous:
        logging.warning(
            "workdir %s: taking over a stale lock left by %s, which is no longer running", workdir, _describe(previous)
        )
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(_holder()).encode(), 0)
    os.fsync(fd)
    return fd


@contextlib.contextmanager
def workdir_lock(workdir: str) -> Iterator[str]:
    """Hold the lock of `workdir` for the `with` block; yields the lock file's path.

    Raises `WorkdirBusy` at once (no waiting) naming the holder if another live process holds
    it, or the lock of an ancestor or direct subfolder. Re-entrant within this process, also for
    subfolders of a workdir this process holds.
    """
    path = lock_file(workdir)
    remote = "://" in workdir and not workdir.startswith("file://")
    if remote and path not in _HELD:
        logging.warning(
            "workdir %s is remote: it is locked on this machine only (%s); make sure no run on another machine uses it",
            workdir,
            path,
        )
    for other in [] if remote else _related_locks(path):
        _check_free(workdir, other)
    if path in _HELD:
        fd, depth = _HELD[path]
        _HELD[path] = (fd, depth + 1)
    else:
        _HELD[path] = (_acquire(workdir, path), 1)
    try:
        yield path
    finally:
        fd, depth = _HELD.pop(path)
        if depth > 1:
            _HELD[path] = (fd, depth - 1)
        else:
            os.ftruncate(fd, 0)  # released cleanly: nothing stale to report next time
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
