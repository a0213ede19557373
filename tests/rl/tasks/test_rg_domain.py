"""reasoning-gym datasets as RL domains (issue 44 item 4): `rl.domains=rg:<dataset>[:weight]`, the
generator's settings (`rl.rg_settings`) checked against its config dataclass, curriculum levels
(`rl.curriculum.rg_levels`), prompts, rewards through the registered verifier, and the refusals."""

from __future__ import annotations

import re
import sys

import pytest

pytest.importorskip("reasoning_gym")

from posttrain.config.rl import domain_weights  # noqa: E402
from posttrain.data.tokenizer import ByteTokenizer  # noqa: E402
from posttrain.errors import UserError  # noqa: E402
from posttrain.rl.tasks.domains import MATH_INSTRUCTION  # noqa: E402
from posttrain.rl.tasks.registry import make_domains, make_reward_fn  # noqa: E402
from posttrain.rl.tasks.rg_domain import SPAN, check_rg, item_seeds, rg_tasks  # noqa: E402
from tests.support.typed_configs import run_cfg  # noqa: E402


def rg_run(domains: str, **changes):
    return run_cfg({"rl.domains": domains, "rl.arithmetic_size": 40, "rl.eval_size": 8, **changes})


def test_rg_domains_train_and_reward_through_the_registered_verifier():
    cfg = rg_run("rg:chain_sum:2, rg:leg_counting")
    assert domain_weights(cfg.rl) == {"rg:chain_sum": 2.0, "rg:leg_counting": 1.0}
    check_rg(cfg)
    reward_fn = make_reward_fn(cfg.rl)
    domains, held_out = make_domains(cfg, ByteTokenizer(), reward_fn)
    assert set(domains) == {"rg:chain_sum", "rg:leg_counting"} and len(held_out) == 16
    task = domains["rg:chain_sum"].tasks[0]
    assert re.fullmatch(r"rg:chain_sum/train/default:\d+", task.id)
    assert task.prompt[0]["content"].endswith(MATH_INSTRUCTION) and "arithmetic problem" in task.prompt[0]["content"]
    right, wrong = task.target.answer, str(int(task.target.answer) + 1)
    rewards = reward_fn.verify_many(
        [task.target] * 3, [f"\\boxed{{{right}}}", f"\\boxed{{{wrong}}}", f"{right} or more"]
    )
    assert [r.correct for r in rewards] == [1.0, 0.0, 0.0] and all(r.error is None for r in rewards)


def test_unknown_refused_and_missing_datasets_are_refused_by_name(monkeypatch):
    with pytest.raises(UserError, match=r"rg:nope is no reasoning-gym dataset; supported: rg:basic_arithmetic, "):
        make_domains(rg_run("rg:nope"), ByteTokenizer(), None)
    with pytest.raises(UserError, match=r"rg:rubiks_cube is a reasoning-gym dataset posttrain does not serve"):
        check_rg(rg_run("rg:rubiks_cube"))
    with pytest.raises(UserError, match=r"rg:decimal_arithmetic is refused: its scorer accepts any value within"):
        check_rg(rg_run("rg:decimal_arithmetic"))
    with pytest.raises(ValueError, match=r"'rg:chain_sum:x' is not name\[:weight\]"):
        rg_run("rg:chain_sum:x")
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # not installed
    with pytest.raises(UserError, match=r"need the reasoning-gym package: pip install 'posttrain\[rg\]'"):
        check_rg(rg_run("rg:chain_sum"))


def test_settings_are_checked_against_the_generator_config_and_change_the_tasks():
    with pytest.raises(UserError, match=r"rg:chain_sum has no setting 'max_term'; valid: min_terms, max_terms, "):
        check_rg(rg_run("rg:chain_sum", **{"rl.rg_settings": "chain_sum.max_term=3"}))
    with pytest.raises(UserError, match=r"chain_sum.seed is posttrain's"):
        check_rg(rg_run("rg:chain_sum", **{"rl.rg_settings": "chain_sum.seed=3"}))
    with pytest.raises(UserError, match=r"max_terms must be >= min_terms"):
        check_rg(rg_run("rg:chain_sum", **{"rl.rg_settings": "chain_sum.min_terms=4; chain_sum.max_terms=3"}))
    with pytest.raises(UserError, match=r"\['leg_counting'\] are not in rl.domains \(rg:chain_sum\)"):
        check_rg(rg_run("rg:chain_sum", **{"rl.rg_settings": "leg_counting.max_animals=3"}))
    with pytest.raises(UserError, match=r"rl.rg_settings=.* cannot take effect: rl.domains names no reasoning-gym"):
        run_cfg({"rl.rg_settings": "chain_sum.max_terms=3"}, stage="rlvr").check_stages()
    cfg = rg_run("rg:chain_sum", **{"rl.rg_settings": "chain_sum.min_terms=5; chain_sum.max_terms=5"})
    domains, _ = make_domains(cfg, ByteTokenizer(), None)
    assert {t.target.metadata["num_terms"] for t in domains["rg:chain_sum"].tasks} == {5}


def test_curriculum_levels_draw_labelled_tasks_at_the_curriculum_settings():
    tasks = rg_tasks("chain_sum", "test", 10, 0, levels=[0, 3])
    by_level: dict[str, set[int]] = {}
    for t in tasks:
        by_level.setdefault(t.difficulty, set()).add(t.target.metadata["num_digits"])
    assert [t.difficulty for t in tasks].count("level0") == 5 and [t.difficulty for t in tasks].count("level3") == 5
    assert by_level["level0"] == {1} and max(by_level["level3"]) > 1
    cfg = rg_run("rg:chain_sum", **{"rl.curriculum.rg_levels": "0,3"})
    domains, held_out = make_domains(cfg, ByteTokenizer(), None)
    assert (
        {t.difficulty for t in domains["rg:chain_sum"].tasks}
        == {t.difficulty for _, t in held_out}
        == {"level0", "level3"}
    )
    with pytest.raises(UserError, match=r"rg:chain_sum has levels 0\.\.10, not 11"):
        check_rg(rg_run("rg:chain_sum", **{"rl.curriculum.rg_levels": "11"}))
    with pytest.raises(UserError, match=r"rg:gsm_symbolic has no curriculum in reasoning-gym"):
        check_rg(rg_run("rg:gsm_symbolic", **{"rl.curriculum.rg_levels": "0"}))
    with pytest.raises(UserError, match=r"chain_sum.max_terms is set by rl.curriculum.rg_levels"):
        check_rg(rg_run("rg:chain_sum", **{"rl.curriculum.rg_levels": "1", "rl.rg_settings": "chain_sum.max_terms=3"}))
    with pytest.raises(UserError, match=r"rl.curriculum.rg_levels='0' cannot take effect"):
        run_cfg({"rl.curriculum.rg_levels": "0"}, stage="rlvr").check_stages()
    with pytest.raises(UserError, match=r"expected distinct levels >= 0"):
        rg_run("rg:chain_sum", **{"rl.curriculum.rg_levels": "1,1"}).replace(stage="rlvr").check_stages()


def test_splits_and_levels_draw_from_disjoint_seed_ranges():
    ranges = sorted(
        (item_seeds(s, split, slot), item_seeds(s, split, slot) + SPAN)
        for s in range(3)
        for split in ("train", "test")
        for slot in range(64)
    )
    assert all(a_end <= b for (_, a_end), (b, _) in zip(ranges, ranges[1:]))
    with pytest.raises(UserError, match=f"at most {SPAN} tasks per split and level"):
        rg_tasks("chain_sum", "train", SPAN + 1, 0)
