"""The one list of stages: what `config.stage` and `pipeline.stages` may name.

The CLI (`main.py`), the pipeline, the config checks and the gates all read this table. It is plain
data and imports nothing of posttrain, so layers below the stages (the gates in `eval/`) may read
it; each stage's `run` is a `"module:function"` path imported only when the stage runs (jax starts
only when needed). Adding a stage means its module and one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage. `section` is its config section (its `steps`, `lr`, `gate`); `gated`: a run of it
    must pass `config.<section>.gate`; `trains`: it writes the checkpoint the next pipeline stage
    starts from; `scores`: its result scores a policy rather than being one (the stage after it
    starts from the policy before it); `staged_context`: it follows `train.seq_len_schedule`."""

    name: str
    section: str
    run: str
    gated: bool = True
    trains: bool = True
    scores: bool = False
    staged_context: bool = False
    in_pipeline: bool = True
    own_steps: bool = False  # `<section>.steps` / `<section>.lr` replace train.steps / optim.lr when non-zero
    check: str = ""  # "module:function": its start-up checks of the config, run before any stage trains

    def runner(self) -> Callable:
        """The stage's run(cfg[, ...]) function, imported now."""
        return _resolve(self.run)

    def checker(self) -> Callable | None:
        """The stage's check(cfg) function (raises ValueError / UserError naming the key), or None."""
        return _resolve(self.check) if self.check else None


def _resolve(path: str) -> Callable:
    module, _, fn = path.partition(":")
    return getattr(importlib.import_module(module), fn)


STAGES = (
    Stage("lm", "train", "posttrain.stages.lm:run", gated=False, in_pipeline=False),
    Stage("sft", "sft", "posttrain.stages.sft:run", staged_context=True, own_steps=True),
    Stage("reward_model", "reward_model", "posttrain.stages.reward_model:run", scores=True, own_steps=True),
    Stage("dpo", "dpo", "posttrain.stages.dpo:run", own_steps=True),
    Stage("eval", "eval", "posttrain.stages.eval:run", trains=False, check="posttrain.stages.eval:check_eval_config"),
    Stage("rlvr", "rl", "posttrain.stages.rlvr:run", own_steps=True, check="posttrain.rl.checks:check_rlvr_stage"),
    Stage(
        "rejection_sampling",
        "rejection",
        "posttrain.stages.rejection_sampling:run",
        trains=False,
        check="posttrain.stages.rejection_sampling:check_config",
    ),
    Stage("pipeline", "pipeline", "posttrain.stages.pipeline:run", gated=False, in_pipeline=False),
)
BY_NAME = {s.name: s for s in STAGES}
GATED = tuple(s.name for s in STAGES if s.gated)
PIPELINE_STAGES = tuple(s.name for s in STAGES if s.in_pipeline)


def section(stage: str) -> str:
    """The config section of `stage` (its own name for an unknown one)."""
    return BY_NAME[stage].section if stage in BY_NAME else stage
