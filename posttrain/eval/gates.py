"""Evaluation gates: a stage's gate is a list of conditions over its metrics, all of which must hold.

Syntax (`config.<stage>.gate`): conditions separated by commas, each `metric op number` with op
one of `< <= > >=`, e.g. "unit_test_pass>=0.6, tool_success_rate>=0.5, long_ctx_multihop>=0.3,
regression_drop<=0.02" (`config.syntax.parse_gate`). The config checks a gate's syntax when it is
built, so a typo fails before anything trains, naming the key.

`regression_drop` is computed, not logged: over the suites that both the current evaluation and the
baseline (the previous evaluation of the same run: the previous eval stage of a pipeline, or the
previous checkpoint of a multi-checkpoint eval stage) report with the same suite version,
    regression_drop = max over those suites of (baseline greedy accuracy − current greedy accuracy),
from the `<suite>/accuracy` and `<suite>/version` entries. Negative means every shared suite
improved. With no baseline at all the condition is reported "n/a" and holds (there is nothing to
regress from); with a baseline but no shared suite of the same version it fails.

Every gate checked (pass or fail, each condition with its value) is appended to
`{workdir}/gates.jsonl` of the run (a pipeline's top workdir), which tools/report.py shows.
"""

from __future__ import annotations

import dataclasses
import json
import time

from posttrain.config import stages as stage_table
from posttrain.config.syntax import OPS, Condition, parse_gate

REGRESSION_DROP = "regression_drop"
GATES_FILE = "gates.jsonl"  # every gate checked, appended under the run's workdir (for tools/report.py)


class GateFailed(RuntimeError):
    """A stage finished but its evaluation gate did not hold; the message reports every condition."""


@dataclasses.dataclass(frozen=True)
class Outcome:
    """One condition checked: the metric's value (None when missing), whether it held, a note."""

    condition: Condition
    value: float | None
    passed: bool
    note: str = ""


def gate_key(stage: str) -> str:
    """The config key holding `stage`'s gate."""
    return f"config.{stage_table.section(stage)}.gate"


def regression_drop(current: dict, baseline: dict) -> float | None:
    """max over suites in both with the same version of (baseline − current) greedy accuracy; None
    when no suite is shared."""
    drops = [
        baseline[k] - current[k]
        for k in current
        if k.endswith("/accuracy")
        and k in baseline
        and current.get(k.removesuffix("accuracy") + "version") is not None
        and current.get(k.removesuffix("accuracy") + "version") == baseline.get(k.removesuffix("accuracy") + "version")
    ]
    return max(drops) if drops else None


def evaluate_gate(conditions: list[Condition], metrics: dict, baseline: dict | None = None) -> list[Outcome]:
    """Every condition checked against `metrics` (and `baseline` for regression_drop)."""
    out = []
    for c in conditions:
        if c.metric == REGRESSION_DROP and c.metric not in metrics:
            if baseline is None:
                out.append(Outcome(c, None, True, "n/a: no earlier evaluation to compare with"))
                continue
            value = regression_drop(metrics, baseline)
            if value is None:
                out.append(Outcome(c, None, False, "no suite evaluated in both with the same version"))
                continue
        else:
            value = metrics.get(c.metric)
        if not isinstance(value, (int, float)):
            has = ", ".join(sorted(k for k, v in metrics.items() if isinstance(v, (int, float))))
            out.append(Outcome(c, None, False, f"not reported (has: {has})"))
            continue
        out.append(Outcome(c, float(value), bool(OPS[c.op](value, c.threshold))))
    return out


def gate_report(stage: str, outcomes: list[Outcome]) -> str:
    """One line per condition: value, threshold, PASS/FAIL (and why, when the value is missing)."""
    lines = [f"{stage} gate: {'passed' if all(o.passed for o in outcomes) else 'FAILED'}"]
    for o in outcomes:
        value = "—" if o.value is None else f"{o.value:.4g}"
        lines.append(
            f"  {'PASS' if o.passed else 'FAIL'}  {o.condition.metric} = {value} "
            f"(needs {o.condition.op} {o.condition.threshold:g}){'  ' + o.note if o.note else ''}"
        )
    return "\n".join(lines)


def gate_record(stage: str, outcomes: list[Outcome]) -> dict:
    """One checked gate as a JSON object: the stage, whether it passed, and every condition."""
    return {
        "stage": stage,
        "passed": all(o.passed for o in outcomes),
        "time": time.time(),
        "conditions": [
            {
                "metric": o.condition.metric,
                "op": o.condition.op,
                "threshold": o.condition.threshold,
                "value": o.value,
                "passed": o.passed,
                "note": o.note,
            }
            for o in outcomes
        ],
    }


def gate_record_dir(workdir: str) -> str | None:
    """Where a run records its gate outcomes: its workdir (local or URL), on process 0 only."""
    import jax

    return workdir if jax.process_index() == 0 else None


def write_gate_record(workdir: str, record: dict) -> None:
    """Append `record` to `{workdir}/gates.jsonl` (what a report shows as gate outcomes)."""
    from posttrain import storage

    storage.makedirs(workdir)
    storage.append_text(storage.join(workdir, GATES_FILE), json.dumps(record) + "\n")


def check_gate(stage: str, spec: str, metrics: dict, baseline: dict | None = None, workdir: str | None = None) -> str:
    """The report of `stage`'s gate `spec` on `metrics`; raises GateFailed (with the full report)
    unless every condition holds. With `workdir`, the outcome is also appended to its gates.jsonl."""
    conditions = parse_gate(spec, gate_key(stage))
    if not conditions:
        return f"{stage}: no gate"
    outcomes = evaluate_gate(conditions, metrics, baseline)
    if workdir is not None:
        write_gate_record(workdir, gate_record(stage, outcomes))
    report = gate_report(stage, outcomes)
    if not all(o.passed for o in outcomes):
        raise GateFailed(report)
    return report
