"""JSONL sources through fsspec (local paths, `gs://` via gcsfs, `memory://`), with line provenance.

A `JsonlSource` reads whole files into memory once and indexes their lines, so grain can shuffle
and address records by index; parsing happens later, per record, inside the pipeline. Every
record keeps its `path:line` so an error can name it, and `SkipLog` is the one place that decides
whether a bad record stops the run or is counted and logged.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import fsspec
import numpy as np

from posttrain.config import ON_ERROR
from posttrain.errors import UserError

log = logging.getLogger(__name__)


def shared_data_dir() -> str:
    """The shared data folder (GSM8K, HumanEval): $POSTTRAIN_DATA, else `shared/data` beside the repo."""
    return os.environ.get("POSTTRAIN_DATA", str(Path(__file__).resolve().parents[2] / ".." / "shared" / "data"))


class DataError(ValueError):
    """A bad input record; the message starts with `path:line:`."""


class RawLine(NamedTuple):
    """One non-empty line of a JSONL file, unparsed."""

    path: str
    line: int  # 1-based line number in the file
    text: bytes

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


class Record(NamedTuple):
    """One parsed JSONL record with its provenance."""

    data: dict
    path: str
    line: int


class SkipLog:
    """The bad-record policy: `raise` a `DataError`, or `skip` — count the record and log why.

    Only the first `max_logged` skips are logged one by one (then a single notice), so a broken
    file does not flood the log; the count keeps going and trainers report it as `data/skipped`.
    """

    def __init__(self, on_error: str = "raise", *, max_logged: int = 20):
        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r}: expected one of {ON_ERROR}")
        self.on_error = on_error
        self.max_logged = max_logged
        self.skipped = 0

    def bad(self, where: str, reason: str) -> None:
        """Handle the bad record at `where` (`path:line`)."""
        if self.on_error == "raise":
            raise DataError(f"{where}: {reason}")
        self.skipped += 1
        if self.skipped <= self.max_logged:
            log.warning("skipping %s: %s", where, reason)
            if self.skipped == self.max_logged:
                log.warning("further bad records are counted (data/skipped) but not logged one by one")


def expand_paths(paths: str | Sequence[str]) -> list[str]:
    """Paths or glob patterns (any fsspec URL) → file URLs; a plain path is kept as written."""
    if isinstance(paths, str):
        paths = [paths]
    if not paths:
        raise ValueError("no data paths given")
    out = []
    for pattern in paths:
        if not any(c in pattern for c in "*?["):
            out.append(pattern)
            continue
        try:
            fs, _, found = fsspec.get_fs_token_paths(pattern)
        except Exception as e:
            raise unreachable(pattern, e, "cannot list") from e
        if not found:
            raise UserError(f"{pattern}: no file matches", path=pattern)
        local = "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,))
        out += sorted(p if local else fs.unstrip_protocol(p) for p in found)
    return out


def _line_spans(blob: bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(starts, ends, line numbers) of the non-empty lines of `blob` (a trailing `\\r` is dropped)."""
    data = np.frombuffer(blob, np.uint8)
    newlines = np.flatnonzero(data == ord("\n"))
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    ends = np.concatenate([newlines, [len(data)]]).astype(np.int64)
    has_cr = np.zeros(len(ends), bool)
    nonempty = ends > starts
    has_cr[nonempty] = data[ends[nonempty] - 1] == ord("\r")
    ends = ends - has_cr
    keep = ends > starts
    return starts[keep], ends[keep], np.flatnonzero(keep) + 1


def read_file(path: str) -> bytes:
    """The bytes of `path` (any fsspec URL, compression from the suffix). A missing file or an
    unreachable remote one (no credentials, no network) is a `UserError` naming the path."""
    try:
        with fsspec.open(path, "rb", compression="infer") as f:
            return f.read()
    except FileNotFoundError:
        raise UserError(f"{path}: no such file", path=path) from None
    except Exception as e:  # gcsfs/aiohttp/auth errors: hundreds of lines that never name the path
        if "://" not in path or path.startswith(("file://", "memory://")):
            raise
        raise unreachable(path, e, "cannot read") from e


def unreachable(path: str, error: Exception, what: str) -> UserError:
    """A one-line UserError for a remote path that failed (credentials, network), naming it."""
    reason = (str(error).strip().splitlines() or [""])[0][:200]
    return UserError(
        f"{path}: {what} ({type(error).__name__}: {reason}); check the path, your credentials "
        "(e.g. gcloud auth application-default login) and the network",
        path=path,
    )


class JsonlSource:
    """Random access to the non-empty lines of JSONL files (grain's `RandomAccessDataSource`).

    Files are read whole (fsspec, compression inferred from the suffix, e.g. `.gz`) and kept as
    bytes plus line offsets: memory is about the files' size. Empty lines are not records and are
    not counted; line numbers are the files' own (1-based).
    """

    def __init__(self, paths: str | Sequence[str]):
        self.paths = expand_paths(paths)
        self._blobs: list[bytes] = []
        self._spans: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for path in self.paths:
            blob = read_file(path)
            self._blobs.append(blob)
            self._spans.append(_line_spans(blob))
        self.file_lengths = [len(s[0]) for s in self._spans]
        self._cum = np.cumsum([0] + self.file_lengths)

    def __len__(self) -> int:
        return int(self._cum[-1])

    def __getitem__(self, index: int) -> RawLine:
        if not 0 <= index < len(self):
            raise IndexError(f"record {index} of {len(self)}")
        f = int(np.searchsorted(self._cum, index, side="right")) - 1
        i = index - int(self._cum[f])
        starts, ends, lines = self._spans[f]
        return RawLine(self.paths[f], int(lines[i]), self._blobs[f][starts[i] : ends[i]])

    def __repr__(self) -> str:
        return f"JsonlSource({len(self.paths)} files, {len(self)} records)"


def parse_line(raw: RawLine) -> dict[str, Any]:
    """A line's JSON object; `ValueError` saying what is wrong (not JSON, not an object)."""
    try:
        data = json.loads(raw.text)
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise ValueError(f"not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise ValueError(f"expected a JSON object, got {type(data).__name__}")
    return data


def read_jsonl(
    paths: str | Sequence[str], *, on_error: str = "raise", skips: SkipLog | None = None
) -> Iterator[Record]:
    """Stream the records of JSONL files in order, each with its `(path, line)`.

    For evaluation sets and tools; training goes through the shuffled pipelines. A line that is
    not a JSON object raises `DataError("path:line: ...")`, or with `on_error="skip"` is counted
    in `skips.skipped` and logged (pass your own `SkipLog` to read the count; it then decides
    instead of `on_error`).
    """
    skips = skips or SkipLog(on_error)
    source = JsonlSource(paths)
    for i in range(len(source)):
        raw = source[i]
        try:
            data = parse_line(raw)
        except ValueError as e:
            skips.bad(raw.where, str(e))
            continue
        yield Record(data, raw.path, raw.line)
