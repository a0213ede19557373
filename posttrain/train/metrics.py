"""Metrics to `{workdir}/metrics.jsonl` (one JSON object per logged step) and TensorBoard events."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def to_python(value: Any) -> Any:
    """Arrays/numpy scalars → JSON-able floats, ints and lists."""
    arr = np.asarray(value)
    if arr.ndim == 0:
        return arr.item()
    return arr.tolist()


class MetricsWriter:
    """Appends metrics to metrics.jsonl and TensorBoard; only process 0 writes."""

    def __init__(self, workdir: str, *, enabled: bool = True, resume_step: int = 0):
        """`resume_step`: rows at or past it (logged after the checkpoint a resumed run starts
        from) are dropped, so the file reads as one uninterrupted run."""
        self.enabled = enabled
        self.path = os.path.join(workdir, "metrics.jsonl")
        self._tb = None
        if enabled:
            os.makedirs(workdir, exist_ok=True)
            if os.path.exists(self.path):
                kept = [r for r in read_metrics(workdir) if r["step"] < resume_step]
                with open(self.path, "w") as f:
                    f.writelines(json.dumps(r) + "\n" for r in kept)
            from tensorboardX import SummaryWriter
            self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))

    def write(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """Record `metrics` at `step`; vectors go to JSONL whole and to TensorBoard per element."""
        row = {"step": int(step), **{k: to_python(v) for k, v in metrics.items()}}
        if not self.enabled:
            return row
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
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
            f.write(json.dumps(row) + "\n")
        self._tb.add_text(f"events/{kind}", json.dumps(fields, default=str), step)
        return row

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()


def read_metrics(workdir: str) -> list[dict[str, Any]]:
    """All rows of `{workdir}/metrics.jsonl`."""
    with open(os.path.join(workdir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]
