"""A run's start-up checks beyond its config's own (`RunConfig`): what needs the filesystem, the
registries or the stages' modules — data files exist or can be generated, gates name metrics their
stage reports, each stage's own checks — for every stage the run reaches, so that a pipeline's last
stage is checked before its first one trains. Each error is a UserError naming the key."""

from __future__ import annotations

import re

from posttrain.config import RunConfig
from posttrain.config import stages as stage_table
from posttrain.config.registry import check_registered
from posttrain.errors import UserError
from posttrain.stages.data_files import check_stage_files


def check_run(cfg: RunConfig) -> None:
    """Every start-up check of the stages `cfg` reaches (`main.run` calls it before any stage runs):
    first the names its keys give (losses, estimators, environments: `registered` fields), whatever
    the stages, as a key's choices are."""
    from posttrain.rl.checks import check_episode_cohorts, register_builtins

    register_builtins()
    check_registered(cfg)
    check_stage_files(cfg, cfg.stages)
    try:
        check_episode_cohorts(cfg)
        for stage in stage_table.STAGES:  # a pipeline's stages in table order, then the pipeline itself
            if (stage.name in cfg.stages or stage.name == cfg.stage) and stage.check:
                stage.checker()(cfg)
    except UserError:
        raise
    except ValueError as e:  # a module's check ("rl.advantage='foo': ...") as a UserError with its key
        m = re.match(r"(?:config\.)?([a-z_]+(?:\.[a-z_0-9]+)+)[=: ]", str(e))
        raise UserError(str(e), key=m.group(1) if m else None) from None
