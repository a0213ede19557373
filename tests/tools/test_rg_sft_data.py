"""tools/rg_sft_data.py: SFT records of reasoning-gym's training split, never a held-out task of the
RL run they prepare, each response scoring 1 through the guarded verifier."""

import importlib.util

import pytest

from tests.support.paths import ROOT


def tool():
    spec = importlib.util.spec_from_file_location("rg_sft_data", ROOT / "tools" / "rg_sft_data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_records_are_training_tasks_answered_in_the_paid_format():
    pytest.importorskip("reasoning_gym")
    from posttrain.config import RunConfig
    from posttrain.rl.tasks.registry import DOMAINS
    from posttrain.rl.verifiers.rg import RGVerifier

    changes = {"rl.domains": "rg:chain_sum,rg:gcd", "rl.arithmetic_size": 60, "rl.eval_size": 20}
    cfg = RunConfig(seed=3).replace({**changes, "rl.curriculum.rg_levels": "0"})
    rows = tool().records(cfg)
    assert len(rows) > 60 and rows[0]["response"].endswith("}.")
    held_out = {t.prompt[0]["content"] for name in ("rg:chain_sum", "rg:gcd") for t in DOMAINS[name](cfg, None)[1]}
    assert not {r["prompt"] for r in rows} & held_out
    tasks = [t for name in ("rg:chain_sum", "rg:gcd") for t in DOMAINS[name](cfg, None)[0].tasks]
    verdicts = RGVerifier().verify_many([t.target for t in tasks], [r["response"] for r in rows])
    assert all(v.correct == 1.0 for v in verdicts)
    with pytest.raises(SystemExit, match="'arithmetic' is not a reasoning-gym domain"):
        tool().records(RunConfig().replace({"rl.domains": "arithmetic"}))
