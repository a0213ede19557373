"""Stage `pipeline`: run stages in order, each from the previous one's final checkpoint, with gates.

A reward model is not a policy: the stage after `reward_model` starts from the policy before it,
and an `rlvr` stage reaches the reward model by `rl.reward_model = "@reward_model"`.

Each stage runs in `{workdir}/{i}_{stage}` and must pass its gate (`config.<stage>.gate`, e.g.
"eval/loss<1.5") before the next starts. Re-running the same command resumes where it stopped.
"""

from __future__ import annotations

import logging
import operator
import os
import re

import jax

from posttrain.train import stages as stage_lib
from posttrain.train.plot import plot

def _rlvr(cfg):
    from posttrain.rl import loop
    return loop.run(cfg)


RUNNERS = {"sft": stage_lib.sft, "reward_model": stage_lib.reward_model, "dpo": stage_lib.dpo, "rlvr": _rlvr}
STAGED_CONTEXT = ("sft",)         # stages that follow train.seq_len_schedule
SECTION = {"rlvr": "rl"}          # the config section of a stage, where it differs from its name
# Stages whose result scores a policy rather than being one: later stages start from the policy
# before them (RLHF: [sft, reward_model, rlvr]).
SCORERS = ("reward_model",)
_OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_GATE = re.compile(r"^\s*([\w/.\-]+)\s*(<=|>=|<|>)\s*([-+0-9.eE]+)\s*$")


class GateFailed(RuntimeError):
    """A stage finished but its evaluation gate did not hold."""


def check_gate(stage: str, gate: str, metrics: dict) -> str:
    """Raise GateFailed unless `gate` ("metric op value") holds on `metrics`; returns a summary."""
    if not gate:
        return f"{stage}: no gate"
    m = _GATE.match(gate)
    if not m:
        raise ValueError(f"config.{stage}.gate={gate!r}: expected 'metric op number', e.g. 'eval/loss<1.5'")
    name, op, value = m.group(1), m.group(2), float(m.group(3))
    if name not in metrics:
        raise GateFailed(f"{stage}: gate {gate!r} needs metric {name!r}, which the stage did not report "
                         f"(has: {', '.join(sorted(metrics))}); set config.{stage}.eval_files?")
    if not _OPS[op](metrics[name], value):
        raise GateFailed(f"{stage}: gate {gate!r} failed: {name} = {metrics[name]:.4g}")
    return f"{stage}: gate {gate!r} passed ({name} = {metrics[name]:.4g})"


def stage_config(cfg, name: str, workdir: str, init_from: str, done: dict[str, str] | None = None):
    """The config one pipeline stage runs with. `done` maps the stages run before it to their
    workdirs: `rl.reward_model = "@<stage>"` becomes that stage's workdir (RLHF: the reward
    model trained earlier in the same pipeline)."""
    sub = cfg.copy_and_resolve_references()
    sub.stage, sub.workdir, sub.init_from = name, workdir, init_from
    ref = sub.rl.reward_model
    if name == "rlvr" and ref.startswith("@"):
        if ref[1:] not in (done or {}):
            raise ValueError(f"rl.reward_model={ref!r}: no stage {ref[1:]!r} runs before rlvr in pipeline.stages="
                             f"{tuple(cfg.pipeline.stages)}")
        sub.rl.reward_model = done[ref[1:]]
    return sub


def run(cfg) -> dict:
    """Run `cfg.pipeline.stages`; returns {stage: final metrics}. Raises GateFailed on a failed gate."""
    unknown = [s for s in cfg.pipeline.stages if s not in RUNNERS]
    if unknown:
        raise ValueError(f"pipeline.stages: unknown {unknown}; valid: {sorted(RUNNERS)}")
    unstaged = [s for s in cfg.pipeline.stages if s not in STAGED_CONTEXT]
    if "," in cfg.train.seq_len_schedule and unstaged:     # fail before the first stage, not after it
        raise ValueError(f"train.seq_len_schedule={cfg.train.seq_len_schedule!r} applies to every stage, but "
                         f"{unstaged} cannot change sequence length (supported: {', '.join(STAGED_CONTEXT)})")
    init_from, results, done = cfg.init_from, {}, {}
    for i, name in enumerate(cfg.pipeline.stages):
        workdir = os.path.join(cfg.workdir, f"{i}_{name}")
        result = RUNNERS[name](stage_config(cfg, name, workdir, init_from, done))
        metrics = {**(result.rows[-1] if result.rows else {}), **result.eval}
        results[name], done[name] = metrics, workdir
        logging.info(check_gate(name, cfg[SECTION.get(name, name)].gate, metrics))
        if name not in SCORERS:
            init_from = workdir
    if jax.process_index() == 0:
        logging.info("curves: %s", plot(cfg.workdir, os.path.join(cfg.workdir, "metrics.png")))
    return results
