"""Run health alerts: named rules over the metrics rows that the SFT and RL loops already log.

`AlertMonitor.update(step, metrics) -> list[Alert]` is pure host code (no model): each rule reads
the row, compares it with a threshold from `config.alerts` (and, for the drift rules, with the
metric's own exponential running mean / std over earlier rows) and says whether it fires. The loops
call `AlertMonitor.check`, which also writes each alert as an event row to metrics.jsonl (and
TensorBoard text), shows it on the progress bar, and with `alerts.on = "stop"` raises `AlertStop`.

Rules (a threshold of 0 turns one off):
- reward_drift: |rl/reward_mean − running mean| / max(running std, MIN_STD) > threshold (a z-score).
- entropy_collapse: rl/entropy < threshold (nats per token).
- kl_blowup: rl/kl > threshold.
- response_len_explosion: rl/response_len_mean > threshold × its running mean.
- clip_saturation: rl/clip_frac_low + rl/clip_frac_high > threshold.
- nonfinite: any metric is NaN or ±inf (on/off).
- verifier_error_rate: rl/verifier_errors / rl/responses > threshold.
- throughput_stall: tokens/s < threshold × its running mean on STALL_ROWS consecutive rows
  (tokens_per_s, or for RL rl/new_tokens over rl/wait_s + rl/update_s).
The drift rules (reward_drift, response_len_explosion, throughput_stall) fire only after WARMUP
earlier rows; throughput skips the first row (it includes compilation).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable
from typing import Any

from posttrain.config import ALERT_MODES as MODES

WARMUP = 5  # earlier rows a running statistic needs before its rule may fire
DECAY = 0.9  # exponential running mean / variance: weight of the past
MIN_STD = 0.05  # floor on the reward's running std (a constant reward would make every change infinite)
STALL_ROWS = 2  # consecutive slow rows before throughput_stall fires


class AlertStop(RuntimeError):
    """A health rule fired with `alerts.on = "stop"`."""


@dataclasses.dataclass(frozen=True)
class Alert:
    """One firing of rule `rule` at `step`: the observed `value` against `threshold`."""

    rule: str
    step: int
    value: float
    threshold: float
    message: str


class Running:
    """Exponential running mean and variance of one metric (what "its own statistics" means)."""

    def __init__(self):
        self.count, self.mean, self.var = 0, 0.0, 0.0

    def add(self, x: float) -> None:
        if self.count == 0:
            self.mean = x
        else:
            delta = x - self.mean
            self.mean += (1 - DECAY) * delta
            self.var = DECAY * (self.var + (1 - DECAY) * delta * delta)
        self.count += 1

    @property
    def std(self) -> float:
        return math.sqrt(self.var)


def _get(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _throughput(metrics: dict) -> float | None:
    if (tps := _get(metrics, "tokens_per_s")) is not None:
        return tps
    tokens, wait, update = (_get(metrics, k) for k in ("rl/new_tokens", "rl/wait_s", "rl/update_s"))
    if None in (tokens, wait, update) or wait + update <= 0:
        return None
    return tokens / (wait + update)


def _verifier_error_rate(metrics: dict) -> float | None:
    errors, responses = _get(metrics, "rl/verifier_errors"), _get(metrics, "rl/responses")
    return None if errors is None or not responses else errors / responses


def _clip_frac(metrics: dict) -> float | None:
    low, high = _get(metrics, "rl/clip_frac_low"), _get(metrics, "rl/clip_frac_high")
    return None if low is None and high is None else (low or 0.0) + (high or 0.0)


# rule -> (value of the row, kind): "above"/"below" compare with the threshold; "drift" is a
# z-score against the running stats; "growth"/"stall" a ratio to the running mean.
RULES: dict[str, tuple[Callable[[dict], float | None], str]] = {
    "reward_drift": (lambda m: _get(m, "rl/reward_mean"), "drift"),
    "entropy_collapse": (lambda m: _get(m, "rl/entropy"), "below"),
    "kl_blowup": (lambda m: _get(m, "rl/kl"), "above"),
    "response_len_explosion": (lambda m: _get(m, "rl/response_len_mean"), "growth"),
    "clip_saturation": (_clip_frac, "above"),
    "verifier_error_rate": (_verifier_error_rate, "above"),
    "throughput_stall": (_throughput, "stall"),
}


class AlertMonitor:
    """Evaluates the rules on each logged metrics row; `thresholds[rule]` (0 = off)."""

    def __init__(self, thresholds: dict[str, float], *, nonfinite: bool = True, mode: str = "warn"):
        unknown = set(thresholds) - set(RULES)
        if unknown:
            raise ValueError(f"alerts: unknown rules {sorted(unknown)}; valid: {sorted(RULES)}")
        negative = {k: v for k, v in thresholds.items() if v < 0}
        if negative:
            raise ValueError(
                "alerts: thresholds must be >= 0 (0 turns a rule off), got "
                + ", ".join(f"alerts.{k}={v}" for k, v in negative.items())
            )
        if mode not in MODES:
            raise ValueError(f"alerts.on={mode!r}: expected one of {', '.join(MODES)}")
        self.thresholds, self.nonfinite, self.mode = dict(thresholds), nonfinite, mode
        self.running = {rule: Running() for rule in RULES}
        self.seen = {rule: 0 for rule in RULES}
        self.slow_rows = 0

    @classmethod
    def from_config(cls, a) -> AlertMonitor:
        """The monitor configured by the `alerts` section."""
        return cls({rule: float(getattr(a, rule)) for rule in RULES}, nonfinite=bool(a.nonfinite), mode=a.on)

    def update(self, step: int, metrics: dict[str, Any]) -> list[Alert]:
        """The alerts the row `metrics` at `step` raises; the running statistics then take it in."""
        if self.mode == "off":
            return []
        out = []
        if self.nonfinite:
            bad = sorted(k for k, v in metrics.items() if isinstance(v, float) and not math.isfinite(v))
            if bad:
                out.append(Alert("nonfinite", step, float("nan"), 0.0, f"non-finite metrics: {', '.join(bad)}"))
        for rule, (read, kind) in RULES.items():
            x = read(metrics)
            if x is None or not math.isfinite(x):
                continue
            self.seen[rule] += 1
            threshold, run = self.thresholds.get(rule, 0.0), self.running[rule]
            if kind == "stall" and self.seen[rule] == 1:
                continue  # the first interval includes compilation
            fired = self._fires(kind, x, threshold, run)
            if kind == "stall":
                # One slow interval is usually an evaluation or a checkpoint inside it: a stall must
                # last STALL_ROWS rows, and slow rows do not drag the running mean down.
                self.slow_rows = self.slow_rows + 1 if fired is not None else 0
                if fired is not None:
                    if self.slow_rows >= STALL_ROWS:
                        out.append(Alert(rule, step, fired, threshold, _message(rule, kind, x, fired, threshold, run)))
                    continue
            elif fired is not None:
                out.append(Alert(rule, step, fired, threshold, _message(rule, kind, x, fired, threshold, run)))
            run.add(x)
        return out

    @staticmethod
    def _fires(kind: str, x: float, threshold: float, run: Running) -> float | None:
        """The rule's value if it fires (the compared quantity), else None."""
        if not threshold:
            return None
        if kind == "above":
            return x if x > threshold else None
        if kind == "below":
            return x if x < threshold else None
        if run.count < WARMUP:
            return None
        if kind == "drift":
            z = abs(x - run.mean) / max(run.std, MIN_STD)
            return z if z > threshold else None
        ratio = x / run.mean if run.mean > 0 else math.inf
        if kind == "growth":
            return ratio if ratio > threshold else None
        return ratio if ratio < threshold else None  # stall

    def check(self, step: int, metrics: dict[str, Any], writer=None, bar=None) -> list[Alert]:
        """`update`, then report: a warning log line, an event row per alert in `writer`, the rule
        names on the progress bar `bar`; raise AlertStop (naming the rules) when mode is "stop"."""
        alerts = self.update(step, metrics)
        for a in alerts:
            logging.warning("alert %s at step %d: %s", a.rule, a.step, a.message)
            if writer is not None:
                writer.event(step, "alert", rule=a.rule, value=a.value, threshold=a.threshold, message=a.message)
        if alerts and bar is not None:
            shown = getattr(bar, "postfix", None)  # a bar without a postfix yet has no such attribute
            bar.set_postfix_str(f"{shown + ', ' if shown else ''}alert={'+'.join(a.rule for a in alerts)}")
        if alerts and self.mode == "stop":
            raise AlertStop(
                f"run stopped at step {step} by alerts.on='stop': "
                + "; ".join(f"{a.rule}: {a.message}" for a in alerts)
            )
        return alerts


def _message(rule: str, kind: str, x: float, value: float, threshold: float, run: Running) -> str:
    if kind == "drift":
        return (
            f"{x:.4g} is {value:.2f} std from its running mean {run.mean:.4g} (std {run.std:.3g}) "
            f"> alerts.{rule}={threshold:g}"
        )
    if kind in ("growth", "stall"):
        sign = ">" if kind == "growth" else "<"
        return f"{x:.4g} is {value:.3g}× its running mean {run.mean:.4g} ({sign} alerts.{rule}={threshold:g})"
    return f"{x:.4g} {'>' if kind == 'above' else '<'} alerts.{rule}={threshold:g}"
