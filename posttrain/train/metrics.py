"""Metrics to `{workdir}/metrics.jsonl` (one JSON object per logged step) and TensorBoard events.

Every line is strict JSON (RFC 8259): a non-finite value (NaN, ±inf, e.g. the loss of a diverged
step) is written as `null`; `read_metrics` gives it back as NaN. TensorBoard gets the float itself.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

import numpy as np


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
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._first = True      # the first write also drops rows at or past its step (see write)
        self._tb = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            if os.path.exists(self.path):
                kept = [r for r in read_metrics(workdir) if r["step"] < resume_step]
                with open(self.path, "w") as f:
                    f.writelines(dumps(r) + "\n" for r in kept)
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record `metrics` at `step`; vectors go to JSONL whole and to TensorBoard per element."""
        row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        if self._first and os.path.exists(self.path):
            kept = [r for r in read_metrics(os.path.dirname(self.path)) if r["step"] < row["step"]]
            with open(self.path, "w") as f:
                f.writelines(dumps(r) + "\n" for r in kept)
        self._first = False
        with open(self.path, "a") as f:
            f.write(dumps(row) + "\n")
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
        row = {"step": int(step), "event": kind, **{k: to_python(v) if not isinstance(v, str) else v
                                                     for k, v in fields.items()}}
        if not self.enabled:
            return row
        with open(self.path, "a") as f:
            f.write(dumps(row) + "\n")
        self._tb.add_text(f"events/{kind}", json.dumps(fields, default=str), step)
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def summary(row: dict[str, Any]) -> str:
    """A row's scalars as one console line: `eval/loss=0.8123 eval/accuracy=0.6`."""
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                    if k != "step" and isinstance(v, (int, float)))


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
            logging.info("%s step %d: %d examples so far were longer than train.seq_len and cut to it "
                         "(data.truncate=True)", self.stage, step, self.truncated)
        return counts


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All rows of `{workdir}/metrics.jsonl`; values written as null (non-finite) come back as NaN."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [{k: _from_json(v) for k, v in json.loads(line).items()} for line in f if line.strip()]
