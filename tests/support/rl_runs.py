"""A tiny `rlvr` run (MoE, 2 × 2 × 2 mesh, 3 steps) and the rows it logs: the loop tests' run,
shared by the files that train through the RL stage."""

import json

from posttrain.config import base_config
from tests.support.typed_configs import TINY_DENSE

TIMING = ("rl/wait_s", "rl/update_s", "rl/gen_s", "rl/verify_s", "rl/device_idle_frac", "tokens_per_s")


def tiny(workdir, **rl):
    """The run's ConfigDict (as a config file gives it, `rl` keys changed), for a test to change
    further: `posttrain.main.run` takes it; a stage's own `run` takes `typed(cfg)`
    (tests/support/typed_configs.py)."""
    cfg = base_config()
    cfg.stage, cfg.workdir = "rlvr", str(workdir)
    m = cfg.model
    m.update(TINY_DENSE)
    m.moe.num_experts, m.moe.expert_mlp_dim = 2, 32
    cfg.mesh.data = 2
    cfg.mesh.expert = 2
    cfg.mesh.tensor = 2
    cfg.train.steps, cfg.train.log_every, cfg.train.progress = 3, 1, False
    cfg.checkpoint.every = 0
    r = cfg.rl
    r.prompts_per_step, r.group_size, r.max_new_tokens, r.eval_every = 2, 4, 12, 0
    r.arithmetic_size, r.verifier_workers = 50, 2
    r.update(rl)
    return cfg


def rows(workdir):
    return [json.loads(l) for l in (workdir / "metrics.jsonl").read_text().splitlines()]
