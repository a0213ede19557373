"""configs/screen_tiny.py from an initialisation the benchmark did not use (seed 3; BENCHMARKS ran
0, 1, 2 with tools/seeds.py), at reduced size (400 of the 800 mixed SFT steps, 10 of the 30 GRPO
updates), run as a user runs it: the demonstrations by tools/screen_demos.py, the `:marked` stage,
the recipe from it, then the blank-screen control. Slow: `python -m pytest --runslow -m slow
tests/e2e/test_screen_tiny.py` (~15 min on a free core)."""

import json
import runpy

import pytest

from tests.support.cli_runs import run_as_user
from tests.support.paths import ROOT


def test_the_marked_mode_is_the_first_stage_of_the_recipe(monkeypatch):
    """`:marked` trains from scratch on its own demonstrations (SFT only) into the folder the
    recipe starts from; the model is the recipe's; an unknown mode is refused by name."""
    monkeypatch.syspath_prepend(str(ROOT))  # configs import configs.vision_tiny
    get_config = runpy.run_path(str(ROOT / "configs/screen_tiny.py"))["get_config"]
    recipe, marked = get_config(), get_config("marked")
    assert marked.stage == "sft" and marked.init_from == "" and marked.workdir == recipe.init_from
    assert recipe.stage == "pipeline" and recipe.pipeline.stages == ("sft", "rlvr")
    assert "marked_demos" in marked.sft.train_files and "marked" not in recipe.sft.train_files
    assert marked.model.to_dict() == recipe.model.to_dict()
    with pytest.raises(ValueError, match="screen_tiny.py:more: expected one of"):
        get_config("more")


def _evaluations(workdir) -> dict[int, dict]:
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r for r in rows if "eval/accuracy" in r}


@pytest.mark.slow
def test_screen_agent_reads_the_marked_item_from_another_initialisation(tmp_path):
    """After the `:marked` stage and the mixed SFT, the policy clicks the marked item on at least 80% of
    the 19 held-out `marked` screens after 10 GRPO updates, and at most 50% when the screens are blank
    (a fixed guess scores 26-42%: BENCHMARKS, "Screenshot agent"); RL raises the overall held-out
    success. The benchmark's seeds 0 / 1 / 2 read 19 / 19 / 19 of 19 after SFT and 5-8 / 19 blank
    (BENCHMARKS, "The screenshot agent over initialisations"); this test's run: 18 / 19, 8 / 19 blank."""
    demos = [str(ROOT / "tools/screen_demos.py"), "--by", "named"]
    run_as_user([*demos, "--out", "runs/screen_tiny_demos", "--n", "4000", "--eval", "56", "--error-rate", "0.5"]
        + ["--error-kinds", "select,type", "--kinds", "marked,select,marked,type"], tmp_path)  # fmt: skip
    run_as_user([*demos, "--out", "runs/screen_tiny_marked_demos", "--n", "3000", "--eval", "72", "--kinds", "marked"],
        tmp_path)  # fmt: skip
    config, seed = str(ROOT / "configs/screen_tiny.py"), ["--config.seed=3", "--config.train.progress=false"]
    run_as_user(["-m", "posttrain.main", "--config", f"{config}:marked", *seed], tmp_path)
    reduced = ["--config.workdir=run", "--config.sft.steps=400", "--config.rl.steps=10"]
    run_as_user(["-m", "posttrain.main", "--config", config, *seed, *reduced], tmp_path)
    trained = _evaluations(tmp_path / "run" / "1_rlvr")
    assert sorted(trained) == [0, 10], trained
    assert trained[10]["eval/accuracy/marked"] >= 0.8, trained
    assert trained[10]["eval/accuracy"] > trained[0]["eval/accuracy"], trained
    blank = ["--config.stage=rlvr", "--config.workdir=blank", "--config.init_from=run/1_rlvr", "--config.rl.steps=1"]
    run_as_user([str(ROOT / "tools/screen_blank.py"), "--config", config, *seed, *blank], tmp_path)
    assert _evaluations(tmp_path / "blank")[0]["eval/accuracy/marked"] <= 0.5
