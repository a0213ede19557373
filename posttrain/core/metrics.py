"""Metrics to `{workdir}/metrics.jsonl` (one JSON object per logged step) and TensorBoard events.

Every line is strict JSON (RFC 8259): a non-finite value (NaN, ±inf, e.g. the loss of a diverged
step) is written as `null`; `read_metrics` gives it back as NaN. TensorBoard gets the float itself.

A `gs://` (any URL) workdir: metrics.jsonl is an `AppendLog` (uploaded whole by the first write
10 s or more after the previous upload and on close, see `posttrain.storage`) and the TensorBoard
event file is buffered and uploaded whole on each TensorBoard flush, through fsspec.
"""

from __future__ import annotations

import io
import json
import logging
from typing import Any

import numpy as np

from posttrain import storage


def to_python(value: Any) -> Any:
    """Arrays/numpy scalars → JSON-able floats, ints and lists."""
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item()
    return arr.tolist()


def strict_json(value: Any) -> Any:
    """`value` with non-finite floats (also inside lists) replaced by None: JSON without NaN."""
    if isinstance(value, float):
        return value if np.isfinite(value) else None
    if isinstance(value, list):
        return [strict_json(v) for v in value]
    return value


def _from_json(value: Any) -> Any:
    if value is None:
        return float("nan")
    if isinstance(value, list):
        return [_from_json(v) for v in value]
    return value


def dumps(row: dict[str, Any]) -> str:
    """One metrics row as a strict JSON line (no NaN/Infinity tokens)."""
    return json.dumps({k: strict_json(v) for k, v in row.items()}, allow_nan=False)


class MetricsWriter:
    """Appends metrics to metrics.jsonl and TensorBoard; only process 0 writes."""

    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int = 0):
        """`resume_step`: rows at or past it (logged after the checkpoint a resumed run starts
        from) are dropped, so the file reads as one uninterrupted run. The first `write` drops
        rows at or past its own step too (a resume that fell back to an older checkpoint)."""
        self.enabled = enabled
        self.path = storage.join(workdir, "metrics.jsonl")
        self._first = True  # the first write also drops rows at or past its step (see write)
        self._tb = None
        if enabled:
            storage.makedirs(workdir)
            self._log = storage.AppendLog(self.path)
            self._keep_before(resume_step)
            from tensorboardX import SummaryWriter

            tb = storage.join(workdir, "tensorboard")
            if storage.is_url(tb):
                _register_tensorboard_store(tb)
            self._tb = SummaryWriter(tb)

    def _keep_before(self, step: int) -> None:
        """Drop the rows at or past `step` from metrics.jsonl (if it has any)."""
        text = self._log.text()
        if text:
            self._log.rewrite(lines_before(text, step))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record `metrics` at `step`; vectors go to JSONL whole and to TensorBoard per element."""
        row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        if self._first:
            self._keep_before(row["step"])
        self._first = False
        self._log.append(dumps(row) + "\n")
        for k, v in row.items():
            if k == "step":
                continue
            if isinstance(v, list):
                for i, x in enumerate(np.ravel(v)):
                    self._tb.add_scalar(f"{k}/{i}", float(x), step)
            else:
                self._tb.add_scalar(k, float(v), step)
        return row

    def event(self, step: int, kind: str, **fields: Any) -> dict[str, Any]:
        """Record a non-scalar event (e.g. a health alert) as a row `{"step", "event": kind, ...}`
        in metrics.jsonl and as TensorBoard text under `events/{kind}`."""
        row = {
            "step": int(step),
            "event": kind,
            **{k: to_python(v) if not isinstance(v, str) else v for k, v in fields.items()},
        }
        if not self.enabled:
            return row
        self._log.append(dumps(row) + "\n")
        self._tb.add_text(f"events/{kind}", json.dumps(fields, default=str), step)
        return row

    def flush(self) -> None:
        """Make every row written so far durable (uploads a gs:// metrics.jsonl; local files are
        appended as they come). Loops call it before a checkpoint, so a run killed after that
        checkpoint and resumed from it has every earlier row."""
        if self._tb is not None:
            self._log.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._log.close()
            self._tb = None


def summary(row: dict[str, Any]) -> str:
    """A row's scalars as one console line: `eval/loss=0.8123 eval/accuracy=0.6`."""
    return " ".join(
        f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
        for k, v in row.items()
        if k != "step" and isinstance(v, (int, float))
    )


def compiling(bar, name: str) -> None:
    """Say that the first step compiles (tens of seconds of an otherwise silent 0% bar)."""
    bar.set_description(f"{name} (compiling…)")
    logging.info("%s: compiling the first step (the bar moves once it ran)", name)


def compiled(bar, name: str) -> None:
    """The first step ran: the bar's description back to the stage's name."""
    bar.set_description(name)


class DataCounts:
    """The data iterator's counts for the metrics (`data/skipped`, `data/truncated`), and a console
    line whenever more examples were truncated (`data.truncate=True` cuts them silently otherwise)."""

    def __init__(self, stage: str):
        self.stage, self.truncated = stage, 0

    def read(self, step: int, batches) -> dict[str, int]:
        counts = {f"data/{k}": int(getattr(batches, k)) for k in ("skipped", "truncated") if hasattr(batches, k)}
        if counts.get("data/truncated", 0) > self.truncated:
            self.truncated = counts["data/truncated"]
            logging.info(
                "%s step %d: %d examples so far were longer than train.seq_len and cut to it (data.truncate=True)",
                self.stage,
                step,
                self.truncated,
            )
        return counts


def lines_before(text: str, step: int) -> str:
    """The JSON lines of `text` whose "step" is below `step`: what a run resumed at `step` keeps of a
    file it writes by step (metrics.jsonl, samples.jsonl)."""
    return "".join(line + "\n" for line in text.splitlines() if line.strip() and json.loads(line)["step"] < step)


def parse_metrics(text: str) -> list[dict[str, Any]]:
    """The rows of metrics.jsonl text; values written as null (non-finite) come back as NaN."""
    return [{k: _from_json(v) for k, v in json.loads(line).items()} for line in text.splitlines() if line.strip()]


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All rows of `{workdir}/metrics.jsonl` (local or URL); non-finite values come back as NaN."""
    return parse_metrics(storage.read_text(storage.join(workdir, "metrics.jsonl")))


class _StoreRecordWriter:
    """A TensorBoard event file on an object store: bytes kept in memory, uploaded whole per flush."""

    def __init__(self, path: str):
        self.path, self.buffer = path, io.BytesIO()

    def write(self, data: bytes) -> None:
        self.buffer.write(data)

    def flush(self) -> None:
        storage.write_bytes(self.path, self.buffer.getvalue())

    def close(self) -> None:
        self.flush()


class _StoreWriterFactory:
    def open(self, path: str) -> _StoreRecordWriter:
        return _StoreRecordWriter(path)

    def directory_check(self, path: str) -> None:
        pass  # object stores have no folders


def _register_tensorboard_store(url: str) -> None:
    """Make tensorboardX write event files under `url`'s protocol through fsspec (gcsfs for gs://,
    replacing tensorboardX's own google-cloud-storage writer: one set of credentials for all)."""
    from tensorboardX.record_writer import register_writer_factory

    register_writer_factory(url.split("://", 1)[0], _StoreWriterFactory())
