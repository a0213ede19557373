"""An rlvr run on reasoning-gym domains (issue 44 item 6): `rl.domains=rg:...` with generator
settings and curriculum levels trains through the stage: tasks of both domains drawn, scored by
the guarded reasoning-gym verifier without errors, per-level metrics."""

from __future__ import annotations

import pytest

pytest.importorskip("reasoning_gym")

from posttrain.stages import rlvr as loop  # noqa: E402
from tests.support.rl_runs import rows, tiny  # noqa: E402
from tests.support.typed_configs import typed  # noqa: E402


def test_an_rlvr_step_on_two_reasoning_gym_domains(tmp_path):
    cfg = tiny(
        tmp_path / "run",
        domains="rg:chain_sum:2,rg:leg_counting",
        rg_settings="chain_sum.allow_negation=True",
        arithmetic_size=20,
    )
    cfg.train.steps = 1
    cfg.rl.curriculum.rg_levels = "0,1"
    cfg.model.moe.num_experts, cfg.mesh.data, cfg.mesh.expert, cfg.mesh.tensor = 0, -1, 1, 1  # dense: compiles faster
    loop.run(typed(cfg))
    rs = [r for r in rows(tmp_path / "run") if "event" not in r]
    train = [r for r in rs if "tasks/batches" in r]
    assert [r["step"] for r in train] == [0] and all(r["rl/verifier_errors"] == 0 for r in train)
    last = train[-1]
    assert last["tasks/rg:chain_sum/samples"] + last["tasks/rg:leg_counting/samples"] == 2 * 4  # prompts x group size
    levels = [k for k in last if k.startswith("tasks/rg:") and "/difficulty/level" in k and k.endswith("/samples")]
    assert levels and {k.split("/difficulty/")[1].split("/")[0] for k in levels} <= {"level0", "level1"}
