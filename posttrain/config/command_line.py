"""The command line's side of the config: ml-collections ConfigDicts, which config files build and
`--config.a.b=value` overrides change, in and out of `RunConfig`.

This module and `posttrain.main` are the only ones that touch a ConfigDict: a run is one frozen
`RunConfig` from `run_config(config_dict)` on, and every module below receives it (or its sections).
`base_config()` is the ConfigDict of `RunConfig()`'s defaults, locked, so that a misspelt key fails
before anything compiles, naming the valid keys at its level.
"""

from __future__ import annotations

import json
import logging
import types

import ml_collections

from posttrain.config import stages as stage_table
from posttrain.config.fields import Section
from posttrain.config.model import ModelConfig
from posttrain.config.run import RunConfig
from posttrain.config.train import OptimConfig


def to_config_dict(section: Section) -> ml_collections.ConfigDict:
    """A section as a locked ConfigDict, keys in field order (mappings as nested ConfigDicts)."""
    return ml_collections.ConfigDict(_plain(section.to_dict()))


def _plain(values: dict) -> dict:
    return {k: _plain(v) if isinstance(v, dict | types.MappingProxyType) else v for k, v in values.items()}


def base_config() -> ml_collections.ConfigDict:
    """Every key a run may set, with its default: what config files start from."""
    cfg = to_config_dict(RunConfig())
    cfg.lock()
    return cfg


def model_config() -> ml_collections.ConfigDict:
    """The `model` keys with their defaults (a tiny dense decoder)."""
    return to_config_dict(ModelConfig())


def optim_config() -> ml_collections.ConfigDict:
    """The `optim` keys with their defaults."""
    return to_config_dict(OptimConfig())


def run_config(config: ml_collections.ConfigDict | RunConfig) -> RunConfig:
    """The typed run config of a ConfigDict (or a RunConfig), checked for the stages it reaches. The
    first error is the first key of a wrong type, else out of its values, else out of its range,
    else of a wrong syntax, else the first rule broken; each names its key."""
    # (to_json keeps the keys' order, which config.json keeps; to_dict sorts them)
    cfg = config if isinstance(config, RunConfig) else RunConfig.from_dict(json.loads(config.to_json_best_effort()))
    return cfg.check_stages()


def command_line_keys(argv: list[str]) -> set[str]:
    """The keys `--config.a.b=v` / `--config.a.b v` set in `argv`."""
    return {a[len("--config.") :].split("=", 1)[0] for a in argv if a.startswith("--config.")}


def overridden_by_stage() -> dict[str, list[str]]:
    """Generic key → the per-stage keys that replace it when non-zero (`RunConfig.for_stage`)."""
    sections = [s.section for s in stage_table.STAGES if s.own_steps]
    return {"train.steps": [f"{s}.steps" for s in sections], "optim.lr": [f"{s}.lr" for s in sections]}


def _get(cfg, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


def apply_command_line_precedence(cfg: ml_collections.ConfigDict, cli_keys: set[str]) -> list[str]:
    """A generic key given on the command line (`train.steps`, `optim.lr`) beats a stage key set in
    the file (`rl.steps`, ...): that stage key is cleared (0) so the command-line value takes effect.
    A stage key given on the command line too still wins (the more specific one). Returns what changed."""
    notes = []
    for generic, specifics in overridden_by_stage().items():
        if generic not in cli_keys:
            continue
        for key in specifics:
            if _get(cfg, key) and key not in cli_keys:
                section, leaf = key.split(".")
                notes.append(
                    f"{generic}={_get(cfg, generic)!r} from the command line replaces {key}={_get(cfg, key)!r} "
                    "from the config file"
                )
                cfg[section][leaf] = type(_get(cfg, key))(0)
    for note in notes:
        logging.info("config: %s", note)
    return notes
