"""Start-up validation of a run's config: every enum, range and cross-field rule, checked before
anything compiles, each error a `UserError` naming the key (`posttrain.config` has the keys, their
defaults and, in its typed sections, what values they may take).

The checks that live with the code they guard (gate syntax: `eval.gates.validate_gates`, the `rl.*`
rules: `rl.checks.check_rl_config`, alert rules, eval suites) are called from here, once, for the
stages the run will reach, so a pipeline's last stage is checked before its first one trains.

Precedence where two keys set one thing (`<stage>.steps` / `train.steps`, `<stage>.lr` /
`optim.lr`): the stage's key wins when it is non-zero, unless the generic key was given on the
command line and the stage's key was not: a command-line value is never silently replaced by a
value from the config file (`apply_command_line_precedence`).
"""

from __future__ import annotations

import logging
import re

from posttrain.config import RunConfig
from posttrain.errors import UserError
from posttrain.stages import registry

STAGE_SECTIONS = {s.name: s.section for s in registry.STAGES if s.own_steps}
# generic key → the per-stage keys that replace it when non-zero (posttrain.config.with_stage_overrides)
OVERRIDDEN_BY_STAGE = {
    "train.steps": [f"{s}.steps" for s in STAGE_SECTIONS.values()],
    "optim.lr": [f"{s}.lr" for s in STAGE_SECTIONS.values()],
}


def get(cfg, key: str):
    """The value at a dotted key."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def stages_of(cfg) -> tuple[str, ...]:
    """The stages a run reaches: `pipeline.stages` for a pipeline, else the stage itself."""
    return tuple(cfg.pipeline.stages) if cfg.stage == "pipeline" else (cfg.stage,)


def _as_user_error(e: ValueError) -> UserError:
    """A module check's ValueError ("rl.advantage='foo': ...") as a UserError with its key."""
    m = re.match(r"(?:config\.)?([a-z_]+(?:\.[a-z_0-9]+)+)[=: ]", str(e))
    return UserError(str(e), key=m.group(1) if m else None)


def check_values(cfg) -> RunConfig:
    """The typed run config of `cfg` (`RunConfig.from_config`): a UserError naming the first key whose
    value is out of its enum or range or breaks a cross-field rule. Imports nothing heavy: `main.run`
    calls it first."""
    return RunConfig.from_config(cfg)


def check_config(cfg) -> None:
    """`check_values`, then each stage's own start-up checks (data files, gates, rl.*, alerts, eval
    suites) for the stages the run reaches; a UserError naming the key."""
    from posttrain.core.alerts import AlertMonitor
    from posttrain.eval.gates import validate_gates
    from posttrain.stages.data_files import check_stage_files

    check_values(cfg)
    stages = stages_of(cfg)
    check_stage_files(cfg, stages)  # named files exist, "synthetic:" can be generated: every stage, up front
    try:
        validate_gates(cfg, stages)
        from posttrain.rl.checks import check_episode_cohorts, check_sampling_config

        check_sampling_config(cfg, stages)
        check_episode_cohorts(cfg, stages)
        AlertMonitor.from_config(cfg.alerts)
        for stage in registry.STAGES:  # each stage's own checks: a pipeline's last stage before its first trains
            if stage.name in stages and stage.check:
                stage.checker()(cfg)
    except ValueError as e:
        raise _as_user_error(e) from None


def command_line_keys(argv: list[str]) -> set[str]:
    """The keys `--config.a.b=v` / `--config.a.b v` set in `argv`."""
    return {a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.")}


def apply_command_line_precedence(cfg, cli_keys: set[str]) -> list[str]:
    """A generic key given on the command line (`train.steps`, `optim.lr`) beats a stage key set in
    the file (`rl.steps`, ...): that stage key is cleared (0) so the command-line value takes effect.
    A stage key given on the command line too still wins (the more specific one). Returns what changed."""
    notes = []
    for generic, specifics in OVERRIDDEN_BY_STAGE.items():
        if generic not in cli_keys:
            continue
        for key in specifics:
            if get(cfg, key) and key not in cli_keys:
                section, leaf = key.split(".")
                notes.append(
                    f"{generic}={get(cfg, generic)!r} from the command line replaces {key}={get(cfg, key)!r} "
                    "from the config file"
                )
                cfg[section][leaf] = type(get(cfg, key))(0)
    for note in notes:
        logging.info("config: %s", note)
    return notes
