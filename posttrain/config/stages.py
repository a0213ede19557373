"""The one list of stages: what `config.stage` and `pipeline.stages` may name, and what each stage is.

The CLI, the run config's rules, the pipeline and the gates all read this table. It is plain data:
each stage's `run` and `check` are `"module:function"` paths imported only when the stage runs or
is checked (jax starts only when needed). Adding a stage means its module in `posttrain/stages/`,
its config section (if it has one of its own), and one line here.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Stage:
    """One stage. `section`: its config section (its `steps`, `lr`, `gate`); `gated`: a run of it
    must pass `config.<section>.gate`; `trains`: it writes the checkpoint the next pipeline stage
    starts from; `scores`: its result scores a policy rather than being one (the stage after it
    starts from the policy before it); `staged_context`: it follows `train.seq_len_schedule`;
    `own_steps`: `<section>.steps` / `<section>.lr` replace train.steps / optim.lr when non-zero;
    `samples`: it calls the sampler (evals, samples, rollouts: `sampling.max_context` bounds it);
    `records`: the kind of records its `train_files` / `eval_files` hold ("" for none);
    `check`: its start-up checks of the config, run before any stage of the run trains."""

    name: str
    section: str
    run: str
    gated: bool = True
    trains: bool = True
    scores: bool = False
    staged_context: bool = False
    in_pipeline: bool = True
    own_steps: bool = False
    samples: bool = False
    records: str = ""
    check: str = ""

    def runner(self) -> Callable:
        """The stage's run(cfg) function, imported now."""
        return _resolve(self.run)

    def checker(self) -> Callable | None:
        """The stage's check(cfg) function (raises a UserError naming the key), or None."""
        return _resolve(self.check) if self.check else None


def _resolve(path: str) -> Callable:
    module, _, fn = path.partition(":")
    return getattr(importlib.import_module(module), fn)


STAGES = (
    Stage("lm", "train", "posttrain.stages.lm:run", gated=False, in_pipeline=False),
    Stage("sft", "sft", "posttrain.stages.sft:run", staged_context=True, own_steps=True, samples=True, records="sft"),
    Stage(
        "reward_model",
        "reward_model",
        "posttrain.stages.reward_model:run",
        scores=True,
        own_steps=True,
        records="preference",
    ),
    Stage("dpo", "dpo", "posttrain.stages.dpo:run", own_steps=True, samples=True, records="preference"),
    Stage(
        "eval",
        "eval",
        "posttrain.stages.eval:run",
        trains=False,
        samples=True,
        check="posttrain.stages.eval:check_eval_config",
    ),
    Stage(
        "rlvr",
        "rl",
        "posttrain.stages.rlvr:run",
        own_steps=True,
        samples=True,
        check="posttrain.rl.checks:check_rlvr_stage",
    ),
    Stage("rejection_sampling", "rejection", "posttrain.stages.rejection_sampling:run", trains=False, samples=True),
    Stage(
        "pipeline",
        "pipeline",
        "posttrain.stages.pipeline:run",
        gated=False,
        in_pipeline=False,
        check="posttrain.stages.pipeline:check",
    ),
)
BY_NAME = {s.name: s for s in STAGES}
PIPELINE_STAGES = tuple(s.name for s in STAGES if s.in_pipeline)


def section(stage: str) -> str:
    """The config section of `stage` (its own name for an unknown one)."""
    return BY_NAME[stage].section if stage in BY_NAME else stage
