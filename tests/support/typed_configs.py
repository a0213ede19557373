"""Typed configs for tests: what a test changes, as the command line would, in a RunConfig.

Tests write `run(cfg)` with the ConfigDict a config file gives (main's edge converts it); a test
that hands a config to a component below `main` gives it the typed one: `typed(cfg)` of a
ConfigDict, or `model(num_layers=1)`, `rl(clip_low=0.1)`, `run_cfg({"rl.steps": 2})` built directly.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from posttrain.config import ModelConfig, RLConfig, RunConfig, SamplingConfig

# the one-layer dense model the small stage runs share (`cfg.model.update(TINY_DENSE)`)
TINY_DENSE = dict(vocab_size=264, embed_dim=32, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=16, mlp_dim=64)


def typed(config) -> RunConfig:
    """The RunConfig of ConfigDict `config` (a config file's, changed by a test), checked as a
    section (not for its stages: `posttrain.config.run_config` adds those)."""
    if isinstance(config, RunConfig):
        return config
    return RunConfig.from_dict(json.loads(config.to_json_best_effort()))


def run_cfg(changes: dict[str, Any] | None = None, **top) -> RunConfig:
    """RunConfig() with dotted `changes` ({"rl.steps": 2}) and top-level keys."""
    return RunConfig().replace(changes or {}, **top)


def model(changes: dict[str, Any] | None = None, **fields) -> ModelConfig:
    """ModelConfig() with `fields` and dotted `changes` ({"moe.num_experts": 4})."""
    return ModelConfig().replace(changes or {}, **fields)


def rl(**fields) -> RLConfig:
    """RLConfig() with `fields` (its own rules, checked when an rlvr run starts, are not checked)."""
    return dataclasses.replace(RLConfig(), **fields)


def sampling(**fields) -> SamplingConfig:
    """SamplingConfig() with `fields`."""
    return dataclasses.replace(SamplingConfig(), **fields)


def checked(config, stage: str | None = None) -> RunConfig:
    """The RunConfig of `config` (a ConfigDict or a RunConfig) for a run of `stage` (default: its
    own), checked as a run's start checks it: its sections, then the rules of the stages it reaches."""
    cfg = typed(config)
    return (cfg.replace(stage=stage) if stage else cfg).check_stages()
