"""A run's report: one self-contained HTML page to read (and send) after a run.

`write_report(workdir, out)` reads what a run left in its workdir — and, for a pipeline, in each
stage's folder `{workdir}/{i}_{stage}` — and writes one page with no external resources (plots
are inline base64 PNGs, no scripts):
- curves: loss, reward and its parts, KL, entropy, response lengths, throughput per phase and the
  device-idle fraction, held-out evaluations (whichever of them `metrics.jsonl` holds);
- the eval table across checkpoints (`eval/<suite>.jsonl` of eval stages) and the evaluations
  logged during training;
- gate outcomes (`gates.jsonl`, every condition), alerts and other event rows of `metrics.jsonl`;
- a sample of kept rollouts (`rollouts/*.jsonl`, `rl.rollouts_every`) with their rewards and parts;
- long-context accuracy heat maps, length x depth per kind (`long_context.jsonl`, newest step).
"""

from __future__ import annotations

import base64
import dataclasses
import fnmatch
import html
import json
import math
import os
import re
import time

from posttrain import storage
from posttrain.core.plot import load_runs, plt, png_bytes, series

# (title, metric patterns): one panel each, every matching metric of every stage drawn in it.
PANELS = (
    ("loss", ("loss", "ce", "rl/loss", "rl/pg_loss", "rl/value_loss")),
    ("held-out loss", ("eval/loss",)),
    ("reward", ("rl/reward_mean", "rl/reward_std", "rl/verifier_reward_mean", "rl/rm_score_mean", "rl/return_mean")),
    (
        "held-out accuracy",
        (
            "eval/accuracy",
            "eval/mean_accuracy",
            "eval/pass@*",
            "eval/*/accuracy",
            "eval/*/mean_accuracy",
            "eval/*/pass@*",
            "eval/reward_accuracy",
            "eval/policy_accuracy",
            "rm/accuracy",
        ),
    ),
    ("KL to the reference", ("rl/kl", "dpo/kl*")),
    ("entropy (nats/token)", ("rl/entropy",)),
    (
        "response length (tokens)",
        ("rl/response_len_mean", "rl/response_len_max", "eval/response_len", "eval/*/response_len"),
    ),
    ("truncated / clipped fraction", ("rl/truncated_frac", "rl/clip_frac_low", "rl/clip_frac_high")),
    ("seconds per step, by phase", ("rl/gen_s", "rl/verify_s", "rl/update_s", "rl/wait_s", "step_s")),
    ("throughput (tokens/s)", ("tokens_per_s", "rl/tokens_per_s")),
    ("device-idle fraction", ("rl/device_idle_frac",)),
    ("preference margin", ("dpo/margin", "rm/margin")),
    ("gradient norm", ("grad_norm",)),
    ("learning rate", ("lr",)),
)
ROLLOUT_SAMPLE = 12  # rollouts shown, spread over the logged steps
EVAL_COLUMNS = (
    "stage",
    "suite",
    "step",
    "problems",
    "samples",
    "accuracy",
    "mean_accuracy",
    "pass@*",
    "response_len",
    "verifier_errors",
    "seconds",
    "version",
)

RECORD_KEYS = ("checkpoint", "time", "harness")  # an eval record's keys that are not metrics


@dataclasses.dataclass
class Stage:
    """What one (stage) folder of a run holds."""

    name: str  # "." for the run folder itself, else the stage folder's name
    rows: list[dict]  # metrics.jsonl
    evals: list[dict]  # eval/<suite>.jsonl records (an eval stage)
    rollouts: list[dict]  # rollouts/*.jsonl records
    long_context: list[dict]  # long_context.jsonl rows (eval.long_context, tools/long_context_eval.py)


def _jsonl(path: str) -> list[dict]:
    """The objects of a JSONL file; a malformed line is an error naming the file and line."""
    out = []
    for i, line in enumerate(storage.read_text(path).splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
    return out


def load_stages(workdir: str) -> list[Stage]:
    """The run folder and its stage folders (those with a metrics.jsonl), in pipeline order."""
    stages = []
    for name, rows in load_runs(workdir).items():
        folder = workdir if name == "." else storage.join(workdir, name)
        evals = [r for p in storage.glob(storage.join(folder, "eval", "*.jsonl")) for r in _jsonl(p)]
        rollouts = [r for p in storage.glob(storage.join(folder, "rollouts", "*.jsonl")) for r in _jsonl(p)]
        lc = storage.join(folder, "long_context.jsonl")
        stages.append(Stage(name, rows, evals, rollouts, _jsonl(lc) if storage.isfile(lc) else []))
    order = lambda s: (s.name != ".", int(m.group(1)) if (m := re.match(r"(\d+)_", s.name)) else 1 << 30, s.name)
    return sorted(stages, key=order)


def rl_tokens_per_s(rows: list[dict]) -> None:
    """Add `rl/tokens_per_s` (new tokens over the step's wait + update time) to the RL rows."""
    for r in rows:
        seconds = (r.get("rl/wait_s") or 0) + (r.get("rl/update_s") or 0)
        if "rl/new_tokens" in r and seconds > 0:
            r["rl/tokens_per_s"] = r["rl/new_tokens"] / seconds


def reward_parts(rollouts: list[dict]) -> dict[str, tuple[list[int], list[float]]]:
    """Mean of each reward part over the kept rollouts of each step: `reward part/<name>` → (steps, means)."""
    by_step: dict[int, dict[str, list[float]]] = {}
    for r in rollouts:
        for k, v in {
            **r.get("parts", {}),
            **{f"verifier/{k}": v for k, v in r.get("verifier_parts", {}).items()},
        }.items():
            if isinstance(v, (int, float)):
                by_step.setdefault(r["step"], {}).setdefault(k, []).append(v)
    out: dict[str, tuple[list[int], list[float]]] = {}
    for step in sorted(by_step):
        for k, vs in by_step[step].items():
            xs, ys = out.setdefault(f"reward part/{k}", ([], []))
            xs.append(step)
            ys.append(sum(vs) / len(vs))
    return out


def figure_png(curves: list[tuple[str, list, list]], title: str) -> str:
    """One panel (label, steps, values per curve) as a base64 PNG."""
    fig, ax = plt.subplots(figsize=(5.0, 2.9))
    for label, xs, ys in curves:
        ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None, linewidth=1.2)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=6, loc="best")
    return base64.b64encode(png_bytes(fig, dpi=80)).decode()


def panels(stage: Stage) -> list[tuple[str, str]]:
    """(title, base64 PNG) for each panel of PANELS with data in `stage`, then the reward parts of
    its kept rollouts. Stages get their own panels: their steps and scales differ."""
    rl_tokens_per_s(stage.rows)
    curves = series(stage.rows)
    curves.update({k: v for k, v in reward_parts(stage.rollouts).items() if len(v[0]) > 1})
    out = []
    for title, patterns in (*PANELS, ("reward parts (kept rollouts, mean)", ("reward part/*",))):
        lines = [(k, *curves[k]) for k in sorted(curves) if any(fnmatch.fnmatchcase(k, p) for p in patterns)]
        if lines:
            out.append((title, figure_png(lines, title)))
    return out


def long_context_section(stages: list[Stage]) -> str:
    """Each stage's newest length x depth accuracy grid per kind, as heat maps."""
    from posttrain.eval.long_context_eval import heatmap_figure

    parts = [
        f'<img alt="long context {_text(s.name)}" src="data:image/png;base64,'
        f'{base64.b64encode(png_bytes(heatmap_figure(s.long_context, s.name), dpi=80)).decode()}">'
        for s in stages
        if s.long_context
    ]
    return "".join(parts) or "<p class=none>No long-context evaluation (eval.long_context).</p>"


def curves_section(stages: list[Stage]) -> str:
    """The panels of every stage, a heading per stage when there are several."""
    parts = []
    for s in stages:
        imgs = "".join(
            f'<img alt="{_text(t)}" title="{_text(t)}" width=400 height=232 src="data:image/png;base64,{png}">'
            for t, png in panels(s)
        )
        if imgs:
            parts.append((f"<h3>{_text(s.name)}</h3>" if len(stages) > 1 else "") + f"<div class=grid>{imgs}</div>")
    return "".join(parts) or "<p class=none>No curves (no metric has two points).</p>"


def _text(x) -> str:
    """HTML-escaped text with control characters shown as escapes (sampled text can hold any byte)."""
    s = x if isinstance(x, str) else json.dumps(x) if isinstance(x, (dict, list)) else _num(x)
    s = "".join(
        c if c in "\n\t" or c.isprintable() else f"\\x{ord(c):02x}" if ord(c) < 256 else f"\\u{ord(c):04x}" for c in s
    )
    return html.escape(s)


def _num(x) -> str:
    if isinstance(x, bool) or x is None:
        return "—" if x is None else str(x)
    if isinstance(x, float):
        return "nan" if math.isnan(x) else f"{x:.4g}"
    return str(x)


def table(header: list[str], rows: list[list], classes: list[str] | None = None) -> str:
    """An HTML table of already-chosen cells (escaped here)."""
    head = "".join(f"<th>{_text(h)}</th>" for h in header)
    body = "".join(
        f"<tr{f' class={c}' if c else ''}>" + "".join(f"<td>{_text(v)}</td>" for v in r) + "</tr>"
        for r, c in zip(rows, classes or [""] * len(rows))
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def eval_section(stages: list[Stage]) -> str:
    """The eval-stage records across checkpoints, then the evaluations logged during training."""
    recs = [{"stage": s.name, **r} for s in stages for r in s.evals]
    parts = []
    if recs:
        cols = [
            c
            for pat in EVAL_COLUMNS
            for c in sorted({k for r in recs for k in r}, key=_pass_k_order)
            if fnmatch.fnmatchcase(c, pat)
        ]
        cols = list(dict.fromkeys(cols))
        # an lm-eval suite's record holds that task's own metrics (`eval.lm_harness.suite_metrics`)
        lm = {k for r in recs if r.get("harness") == "lm-eval" for k in r if k not in (*cols, *RECORD_KEYS)}
        cols += sorted(lm)
        parts.append(table(cols, [[r.get(c) for c in cols] for r in recs]))
    for s in (s for s in stages if not s.evals):  # an eval stage's rows repeat its records
        rows = [r for r in s.rows if "event" not in r and any(k.startswith("eval/") for k in r)]
        if rows:
            cols = sorted({k for r in rows for k in r if k.startswith("eval/") and not isinstance(r[k], (list, dict))})
            parts.append(
                f"<h3>during training: {_text(s.name)}</h3>"
                + table(["step", *cols], [[r["step"], *(r.get(c) for c in cols)] for r in rows])
            )
    return "".join(parts) or "<p class=none>No evaluations in this run.</p>"


def _pass_k_order(name: str):
    m = re.fullmatch(r"pass@(\d+)", name)
    return (0, int(m.group(1))) if m else (1, name)


def gates_section(workdir: str) -> str:
    """Every gate checked (`gates.jsonl` of the run and its stages), each condition with its value."""
    paths = storage.glob(storage.join(workdir, "gates.jsonl")) + storage.glob(storage.join(workdir, "*", "gates.jsonl"))
    records = [r for p in paths for r in _jsonl(p)]
    if not records:
        return "<p class=none>No gate was checked in this run (none configured, or the run stopped before one).</p>"
    rows, classes = [], []
    for g in records:
        for c in g["conditions"]:
            rows.append(
                [
                    g["stage"],
                    "passed" if g["passed"] else "FAILED",
                    c["metric"],
                    f"{c['op']} {c['threshold']:g}",
                    c["value"],
                    "PASS" if c["passed"] else "FAIL",
                    c.get("note", ""),
                ]
            )
            classes.append("pass" if c["passed"] else "fail")
    return table(["stage", "gate", "metric", "needs", "value", "condition", "note"], rows, classes)


def events_section(stages: list[Stage]) -> str:
    """Alerts and other event rows of metrics.jsonl, in order."""
    rows = [
        [s.name, r["step"], r["event"], r.get("rule", ""), r.get("value"), r.get("threshold"), r.get("message", "")]
        for s in stages
        for r in s.rows
        if "event" in r
    ]
    if not rows:
        return "<p class=none>No alerts or other events in metrics.jsonl.</p>"
    return table(
        ["stage", "step", "event", "rule", "value", "threshold", "message"],
        rows,
        ["fail" if r[2] == "alert" else "" for r in rows],
    )


def sample_rollouts(rollouts: list[dict], n: int = ROLLOUT_SAMPLE) -> list[dict]:
    """Up to `n` rollouts spread over the logged steps (first and last step included), in step order."""
    steps = sorted({r["step"] for r in rollouts})
    per_step = {s: [r for r in rollouts if r["step"] == s] for s in steps}
    picked, i = [], 0
    while len(picked) < min(n, len(rollouts)):
        for s in steps:
            if i < len(per_step[s]) and len(picked) < n:
                picked.append(per_step[s][i])
        i += 1
    return sorted(picked, key=lambda r: (r["step"], r.get("sample", 0)))


def rollouts_section(stages: list[Stage]) -> str:
    """A sample of kept rollouts with prompt, response, reward and its parts."""
    parts = []
    for s in stages:
        if not s.rollouts:
            continue
        for r in sample_rollouts(s.rollouts):
            meta = (
                f"{_text(s.name)} · step {r['step']} · {_text(r.get('domain', ''))} · {_text(r.get('task_id', ''))}"
                f" · reward <b>{_text(r.get('reward'))}</b>"
            )
            details = {k: r.get(k) for k in ("parts", "verifier_parts", "error", "truncated", "num_tokens") if r.get(k)}
            parts.append(
                f"<div class=rollout><div class=meta>{meta}</div><pre class=prompt>{_text(r.get('prompt', ''))}"
                f"</pre><pre class=response>{_text(r.get('response', ''))}</pre>"
                f"<div class=meta>{_text(details)}</div></div>"
            )
    if not parts:
        return "<p class=none>No rollouts kept (set rl.rollouts_every to keep some).</p>"
    return "".join(parts)


CSS = """body{font-family:system-ui,sans-serif;margin:24px;color:#222;max-width:1400px}
h1{font-size:20px}h2{font-size:16px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}h3{font-size:13px}
.grid{display:flex;flex-wrap:wrap;gap:8px}.grid img{border:1px solid #eee}
table{border-collapse:collapse;font-size:12px;margin:6px 0}td,th{border:1px solid #ddd;padding:3px 6px;text-align:right}
th{background:#f4f4f4}tr.fail td{background:#fde2e2}tr.pass td{background:#e6f4e6}.none{color:#777}
.rollout{border:1px solid #ddd;margin:6px 0;padding:4px 8px;font-size:12px}
pre{white-space:pre-wrap;word-break:break-all;margin:2px 0}.prompt{color:#555}.response{background:#f7f7f7}
.meta{color:#444}"""


def render(workdir: str) -> str:
    """The report page of the run in `workdir`, as HTML text."""
    stages = load_stages(workdir)
    config = storage.join(workdir, "config.json")
    stage_names = ", ".join(s.name for s in stages if s.name != ".") or "one stage"
    if storage.isfile(config):
        c = json.loads(storage.read_text(config))
        stage_names = (
            f"{c.get('stage')}: {', '.join(c.get('pipeline', {}).get('stages', []))}"
            if c.get("stage") == "pipeline"
            else str(c.get("stage"))
        )
    where = workdir if storage.is_url(workdir) else os.path.abspath(storage.local(workdir))
    return (
        f"<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>posttrain report: {_text(workdir)}</title>"
        f"<style>{CSS}</style></head><body><h1>posttrain run report</h1>"
        f'<p title="{_text(where)}">{_text(workdir)} · {_text(stage_names)} · '
        f"written {time.strftime('%Y-%m-%d %H:%M %Z')}</p>"
        f"<h2>Curves</h2>{curves_section(stages)}"
        f"<h2>Evaluations</h2>{eval_section(stages)}<h2>Long context</h2>{long_context_section(stages)}"
        f"<h2>Gates</h2>{gates_section(workdir)}"
        f"<h2>Alerts and events</h2>{events_section(stages)}<h2>Sample rollouts</h2>{rollouts_section(stages)}"
        "</body></html>"
    )


def write_report(workdir: str, out: str | None = None) -> str:
    """Write the report of the run in `workdir` to `out` (default `{workdir}/report.html`); its path."""
    out = out or storage.join(workdir, "report.html")
    storage.write_bytes(out, render(workdir).encode("utf-8"))
    return out
