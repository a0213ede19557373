"""Stage `pipeline`: run stages in order, each from the previous one's final checkpoint, with gates.

Each stage runs in `{workdir}/{i}_{stage}` and must pass its gate (`config.<stage>.gate`, e.g.
"eval/loss<1.5, eval/accuracy>=0.5"; see posttrain/eval/gates.py) before the next starts. An `eval`
stage evaluates the previous trained stage's final checkpoint; its `regression_drop` compares with
the previous eval stage. Re-running the same command resumes where it stopped.
"""

from __future__ import annotations

import logging
import os

import jax

from posttrain.eval.gates import SECTION, GateFailed, check_gate, validate_gates  # noqa: F401 (re-exported)
from posttrain.train import stages as stage_lib
from posttrain.train.plot import plot

def _rlvr(cfg):
    from posttrain.rl import loop
    return loop.run(cfg)


def _eval(cfg, baseline=None):
    from posttrain.rl import evaluation
    return evaluation.run(cfg, baseline=baseline)


RUNNERS = {"sft": stage_lib.sft, "reward_model": stage_lib.reward_model, "dpo": stage_lib.dpo, "rlvr": _rlvr,
           "eval": _eval}


def gate_metrics(result) -> dict:
    """What a stage's gate reads: its last logged row and its final evaluation."""
    return {**(result.rows[-1] if result.rows else {}), **result.eval}


def stage_config(cfg, name: str, workdir: str, init_from: str):
    """The config one pipeline stage runs with."""
    sub = cfg.copy_and_resolve_references()
    sub.stage, sub.workdir, sub.init_from = name, workdir, init_from
    return sub


def run(cfg) -> dict:
    """Run `cfg.pipeline.stages`; returns {stage: final metrics}. Raises GateFailed on a failed gate."""
    unknown = [s for s in cfg.pipeline.stages if s not in RUNNERS]
    if unknown:
        raise ValueError(f"pipeline.stages: unknown {unknown}; valid: {sorted(RUNNERS)}")
    validate_gates(cfg, cfg.pipeline.stages)
    init_from, results, last_eval = cfg.init_from, {}, None
    for i, name in enumerate(cfg.pipeline.stages):
        workdir = os.path.join(cfg.workdir, f"{i}_{name}")
        sub = stage_config(cfg, name, workdir, init_from)
        result = RUNNERS[name](sub, baseline=last_eval) if name == "eval" else RUNNERS[name](sub)
        metrics = results[name] = gate_metrics(result)
        logging.info(check_gate(name, cfg[SECTION.get(name, name)].gate, metrics,
                                baseline=last_eval if name == "eval" else None))
        if name == "eval":          # an eval stage has no checkpoint: the next stage starts from the last trained one
            last_eval = metrics
        else:
            init_from = workdir
    if jax.process_index() == 0:
        logging.info("curves: %s", plot(cfg.workdir, os.path.join(cfg.workdir, "metrics.png")))
    return results
