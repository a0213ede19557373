"""Files under a local path or a URL (`gs://bucket/...` through gcsfs, `memory://`, any fsspec
protocol), one set of functions for every file a run reads or writes outside orbax.

Local paths go through the plain OS calls (atomic renames, real appends); URLs through fsspec.
Object stores have no append and no rename: `append_text` rewrites the object with the new text
added (fine for small, rarely written files: eval records, samples, error logs), `AppendLog`
keeps a growing file (metrics.jsonl) in memory and uploads it whole at most every `flush_secs`
and on `flush`/`close` (and at interpreter exit), and `replace` is a copy then delete.
Checkpoints are orbax's (tensorstore for arrays, etils.epath for folders): they take URLs as they
are. Credentials are Google's application-default ones (`gcloud auth application-default login`,
or the VM's service account); `STORAGE_EMULATOR_HOST` points gcsfs at an emulator.
"""

from __future__ import annotations

import builtins
import glob as _glob
import os
import shutil
import threading
import time
import weakref
from typing import IO

import fsspec


def is_url(path: str) -> bool:
    """True for `proto://...` paths other than `file://` (those are local)."""
    return "://" in path and not path.startswith("file://")


def local(path: str) -> str:
    """`file://x` → `x`; other paths unchanged."""
    return path.removeprefix("file://")


def join(base: str, *parts: str) -> str:
    """`base/part/...` for paths and URLs alike."""
    if is_url(base):
        return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])
    return os.path.join(local(base), *parts)


def open_file(path: str, mode: str = "r", **kw) -> IO:
    """`open(path, mode)` for a local path, `fsspec.open(path, mode).open()` for a URL (as a
    context manager either way). Mode "a" on a URL is refused: use `append_text` or `AppendLog`."""
    if not is_url(path):
        return builtins.open(local(path), mode, **kw)
    if "a" in mode:
        raise ValueError(f"{path}: object stores cannot append (mode {mode!r}); use storage.append_text")
    return fsspec.open(path, mode, **kw).open()


def _fs(path: str) -> tuple[fsspec.AbstractFileSystem, str]:
    return fsspec.core.url_to_fs(path)


def _path_test(path: str, name: str) -> bool:
    """`os.path.<name>(path)` for a local path, the fsspec filesystem's `<name>` for a URL
    (`exists`, `isdir`, `isfile`: the same question on either side)."""
    if not is_url(path):
        return getattr(os.path, name)(local(path))
    fs, p = _fs(path)
    return getattr(fs, name)(p)


def exists(path: str) -> bool:
    """Whether a file or folder `path` exists (a URL folder: any object under it)."""
    return _path_test(path, "exists")


def isdir(path: str) -> bool:
    """Whether `path` is a folder (for a URL: a prefix with objects under it)."""
    return _path_test(path, "isdir")


def isfile(path: str) -> bool:
    """Whether `path` is a file (object)."""
    return _path_test(path, "isfile")


def makedirs(path: str) -> None:
    """Create folder `path` and its parents; nothing to do on object stores (no folders)."""
    if not is_url(path):
        os.makedirs(local(path), exist_ok=True)


def glob(pattern: str) -> list[str]:
    """Sorted paths matching `pattern`; URLs come back with their protocol."""
    if not is_url(pattern):
        return sorted(_glob.glob(local(pattern)))
    fs, p = _fs(pattern)
    return sorted(fs.unstrip_protocol(x) for x in fs.glob(p))


def write_bytes(path: str, data: bytes) -> None:
    """Write `data` to `path` whole."""
    with open_file(path, "wb") as f:
        f.write(data)


def read_text(path: str) -> str:
    """The text of file `path`."""
    with open_file(path, "r") as f:
        return f.read()


def write_text(path: str, text: str) -> None:
    """Write `text` to `path` whole (replacing it)."""
    with open_file(path, "w") as f:
        f.write(text)


def append_text(path: str, text: str) -> None:
    """Append `text` to `path` (created if missing). On an object store the object is read and
    written again whole: for small files written now and then, not per step (see AppendLog)."""
    if not is_url(path):
        with builtins.open(local(path), "a") as f:
            f.write(text)
        return
    old = read_text(path) if exists(path) else ""
    write_text(path, old + text)


def replace(src: str, dst: str) -> None:
    """Move file `src` to `dst`, replacing it (atomic on a local disk; copy + delete on a store)."""
    if not is_url(src):
        os.replace(local(src), local(dst))
        return
    fs, p = _fs(src)
    fs.cp_file(p, _fs(dst)[1])  # not fs.mv: gcsfs tries a move API first that not every store has
    fs.rm_file(p)


def copy_file(src: str, dst: str) -> None:
    """Copy file `src` to `dst` (either may be a URL)."""
    if not is_url(src) and not is_url(dst):
        shutil.copyfile(local(src), local(dst))
        return
    with open_file(src, "rb") as fi, open_file(dst, "wb") as fo:
        shutil.copyfileobj(fi, fo)


class _Pending:
    """The in-memory text of a remote AppendLog and whether it differs from the object."""

    def __init__(self, path: str, text: str):
        self.path, self.parts, self.dirty, self.lock = path, [text], False, threading.Lock()

    def upload(self, force: bool = False) -> None:
        with self.lock:
            if not (self.dirty or force):
                return
            text = "".join(self.parts)
            self.parts[:] = [text]
            self.dirty = False
        write_text(self.path, text)


class AppendLog:
    """A text file that grows line by line (metrics.jsonl).

    Local: appended in place. URL: the text is kept in memory (read once from the object if it
    exists) and uploaded whole when a write comes `flush_secs` after the last upload, on `flush`
    and `close`, and at interpreter exit (or when the log is garbage collected); a process killed
    outright loses the rows written since the last upload: at most `flush_secs` worth of them.
    """

    def __init__(self, path: str, *, flush_secs: float = 10.0):
        self.path, self.flush_secs = path, flush_secs
        self.remote = is_url(path)
        self._last = time.monotonic()
        if self.remote:
            self._pending = _Pending(path, read_text(path) if exists(path) else "")
            weakref.finalize(self, self._pending.upload)

    def rewrite(self, text: str) -> None:
        """Replace the whole file with `text` (uploaded at once)."""
        if not self.remote:
            write_text(self.path, text)
            return
        with self._pending.lock:
            self._pending.parts[:] = [text]
        self.flush(force=True)

    def append(self, text: str) -> None:
        """Add `text` at the end."""
        if not self.remote:
            append_text(self.path, text)
            return
        with self._pending.lock:
            self._pending.parts.append(text)
            self._pending.dirty = True
        if time.monotonic() - self._last >= self.flush_secs:
            self.flush()

    @property
    def pending(self) -> bool:
        """Whether text was appended since the last upload (always False locally)."""
        return self.remote and self._pending.dirty

    def text(self) -> str:
        """The whole file as it is (or will be, once uploaded)."""
        if not self.remote:
            return read_text(self.path) if exists(self.path) else ""
        with self._pending.lock:
            return "".join(self._pending.parts)

    def flush(self, force: bool = False) -> None:
        """Upload pending text now (URL; nothing to do locally)."""
        if self.remote:
            self._pending.upload(force)
            self._last = time.monotonic()

    def close(self) -> None:
        """Upload what is pending; the log stays usable."""
        self.flush()
