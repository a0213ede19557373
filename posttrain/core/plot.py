"""Draw a run's main curves to PNG (`python tools/plot_metrics.py WORKDIR [--out FILE]`).

Reads `{WORKDIR}/metrics.jsonl` (and those of pipeline stages below it) and plots every scalar
metric that has more than one point — loss, eval metrics, rewards, accuracy — one panel each.
"""

from __future__ import annotations

import io
import json
import math
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from posttrain import storage  # noqa: E402

PREFERRED = (
    "eval/accuracy",
    "rl/reward_mean",
    "loss",
    "ce",
    "eval/loss",
    "eval/mean_accuracy",
    "eval/pass@4",
    "eval/reward_accuracy",
    "eval/policy_accuracy",
    "dpo/margin",
    "rm/accuracy",
    "rl/entropy",
    "rl/kl",
    "grad_norm",
    "lr",
    "tokens_per_s",
)


def load_runs(workdir: str) -> dict[str, list[dict]]:
    """{run name: rows} for WORKDIR (local or URL) and any pipeline stage folders inside it."""
    top = storage.join(workdir, "metrics.jsonl")
    paths = ([top] if storage.isfile(top) else []) + storage.glob(storage.join(workdir, "*", "metrics.jsonl"))
    if not paths:
        raise SystemExit(f"error: no metrics.jsonl in {workdir} or its stage folders")
    runs, root = {}, storage.join(workdir, "")
    for p in paths:
        name = p[len(root) :].rsplit("metrics.jsonl", 1)[0].strip("/") if p.startswith(root) else p
        runs[name or "."] = [json.loads(l) for l in storage.read_text(p).splitlines() if l.strip()]
    return runs


def series(rows: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Scalar metric name → (steps, values)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for r in rows:
        if "event" in r:  # alerts and other events are not curves
            continue
        for k, v in r.items():
            if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                xs, ys = out.setdefault(k, ([], []))
                xs.append(r["step"])
                ys.append(v)
    return {k: v for k, v in out.items() if len(v[0]) > 1}


def png_bytes(fig, dpi: int = 100) -> bytes:
    """A finished matplotlib figure as PNG bytes (laid out tight); the figure is closed."""
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    return buf.getvalue()


def plot(workdir: str, out: str, max_panels: int = 12) -> str:
    """Write the PNG and return its path."""
    runs = {name: series(rows) for name, rows in load_runs(workdir).items()}
    names = sorted(
        {k for s in runs.values() for k in s},
        key=lambda k: (PREFERRED.index(k) if k in PREFERRED else len(PREFERRED), k),
    )[:max_panels]
    cols = min(3, len(names)) or 1
    rows = math.ceil(len(names) / cols) or 1
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.2 * rows), squeeze=False)
    for ax, name in zip(axes.flat, names):
        for run, s in runs.items():
            if name in s:
                ax.plot(*s[name], label=run, marker="." if len(s[name][0]) < 30 else None)
        ax.set_title(name)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(runs) > 1:
            ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    fig.suptitle(workdir if storage.is_url(workdir) else os.path.abspath(workdir), fontsize=9)
    storage.write_bytes(out, png_bytes(fig))
    return out
