"""Stage `pipeline`: run stages in order, each from the previous one's final checkpoint, with gates.

A reward model is not a policy: the stage after `reward_model` starts from the policy before it,
and an `rlvr` stage reaches the reward model by `rl.reward_model = "@reward_model"`.

Each stage runs in `{workdir}/{i}_{stage}` and must pass its gate (`config.<stage>.gate`, e.g.
"eval/loss<1.5, eval/accuracy>=0.5"; see posttrain/eval/gates.py) before the next starts. An `eval`
stage evaluates the previous trained stage's final checkpoint; its `regression_drop` compares with
the previous eval stage. A `rejection_sampling` stage samples with the previous stage's policy and
writes SFT records; every later `sft` stage trains on them (`rejection.output`, or with
`rejection.mix_original` the original data plus them) instead of `sft.train_files`, starting from
that policy (e.g. ["sft", "rejection_sampling", "sft", "rlvr"]). Re-running the same command
resumes where it stopped.
"""

from __future__ import annotations

import logging

import jax

from posttrain import storage
from posttrain.config import RunConfig
from posttrain.config import stages as stage_table
from posttrain.core.plot import plot
from posttrain.errors import UserError
from posttrain.eval.gates import check_gate, gate_record_dir


def run_stage(name: str, cfg: RunConfig, baseline: dict | None = None):
    """Run pipeline stage `name` with its config; an `eval` stage compares with `baseline`."""
    run = stage_table.BY_NAME[name].runner()
    return run(cfg, baseline=baseline) if name == "eval" else run(cfg)


def gate_metrics(result) -> dict:
    """What a stage's gate reads: its last logged row and its final evaluation."""
    return {**(result.rows[-1] if result.rows else {}), **result.eval}


def stage_config(
    cfg: RunConfig, name: str, workdir: str, init_from: str, done: dict[str, str] | None = None, sft_files: str = ""
) -> RunConfig:
    """The config one pipeline stage runs with. `done` maps the stages run before it to their
    workdirs: `rl.reward_model = "@<stage>"` becomes that stage's workdir (RLHF: the reward
    model trained earlier in the same pipeline). `sft_files` (what the last rejection_sampling
    stage wrote) replaces `sft.train_files` of an sft stage."""
    changes = {"stage": name, "workdir": workdir, "init_from": init_from}
    if name == "sft" and sft_files:
        changes["sft.train_files"] = sft_files
    ref = cfg.rl.reward_model
    if name == "rlvr" and ref.startswith("@"):
        if ref[1:] not in (done or {}):
            raise UserError(
                f"rl.reward_model={ref!r}: no stage {ref[1:]!r} runs before rlvr in pipeline.stages="
                f"{tuple(cfg.pipeline.stages)}",
                key="rl.reward_model",
            )
        changes["rl.reward_model"] = done[ref[1:]]
    return cfg.replace(changes)


def check(cfg: RunConfig) -> None:
    """Start-up check of a pipeline: a staged context reaches only stages that change length."""
    stages = [stage_table.BY_NAME[s] for s in cfg.pipeline.stages]
    unstaged = [s.name for s in stages if not s.staged_context and s.trains]
    if "," in cfg.train.seq_len_schedule and unstaged:  # fail before the first stage, not after it
        raise UserError(
            f"train.seq_len_schedule={cfg.train.seq_len_schedule!r} applies to every stage, but "
            f"{unstaged} cannot change sequence length (supported: "
            f"{', '.join(s.name for s in stage_table.STAGES if s.staged_context)})",
            key="train.seq_len_schedule",
        )


def run(cfg: RunConfig) -> dict:
    """Run `cfg.pipeline.stages`; returns {stage: final metrics}. Raises GateFailed on a failed gate."""
    init_from, results, done, last_eval, sft_files = cfg.init_from, {}, {}, None, ""
    for i, name in enumerate(cfg.pipeline.stages):
        workdir = storage.join(cfg.workdir, f"{i}_{name}")
        sub = stage_config(cfg, name, workdir, init_from, done, sft_files)
        result = run_stage(name, sub, baseline=last_eval)
        metrics = gate_metrics(result)
        results[name], done[name] = metrics, workdir
        logging.info(
            check_gate(
                name,
                cfg.section(name).gate,
                metrics,
                baseline=last_eval if name == "eval" else None,
                workdir=gate_record_dir(cfg.workdir),
            )
        )
        if name == "eval":  # an eval stage has no checkpoint: the next stage starts from the last trained one
            last_eval = metrics
        elif name == "rejection_sampling":  # the sft stages after it train on its records
            from posttrain.stages.rejection_sampling import next_sft_files

            sft_files = next_sft_files(sub)
        if stage_table.BY_NAME[name].trains and not stage_table.BY_NAME[name].scores:
            init_from = workdir
    if jax.process_index() == 0:
        logging.info("curves: %s", plot(cfg.workdir, storage.join(cfg.workdir, "metrics.png")))
    return results
