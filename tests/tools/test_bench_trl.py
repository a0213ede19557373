"""tools/bench_trl.py: TRL's reward function is posttrain's (the verdict, 0 for a cut-off response),
the posttrain side's command names only real config keys, and the summary's ratio of per-update times
leaves out each run's first (compiling) update."""

import importlib.util
import sys

import pytest

from posttrain.config import base_config
from posttrain.main import check_overrides
from tests.support.paths import ROOT


def tool():
    spec = importlib.util.spec_from_file_location("bench_trl_tool", ROOT / "tools" / "bench_trl.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_trl_reward_is_the_verdict_and_zero_when_cut_off():
    eos, limit = 2, 4
    reward = tool().trl_reward(limit, eos)
    said = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    completions = [said("It is \\boxed{12}."), said("It is \\boxed{13}."), said("It is \\boxed{12}"), said("12")]
    ids = [[5, 6, eos], [5, 6, eos], [5, 6, 7, 8], [5, 6, 7, eos]]  # the third is cut off at the limit
    assert reward(completions, ["12"] * 4, ids) == [1.0, 0.0, 0.0, 1.0]


def test_the_posttrain_command_sets_real_config_keys():
    module = tool()
    args = module.argparse.Namespace(
        model="models/smollm2", seed=3, updates=3, prompts=4, group=8, max_new_tokens=32, temperature=1.0,
        lr=2e-6, remat="full",
    )  # fmt: skip
    argv = module.posttrain_command(args, "/tmp/w")
    assert argv[:4] == [sys.executable, "-m", "posttrain.main", "--config=configs/smollm2_grpo.py:models/smollm2"]
    check_overrides(argv[4:], base_config())  # exits naming the key if one is not a config key
    assert "--config.rl.group_size=8" in argv and "--config.seed=3" in argv


def test_summary_ratio_leaves_out_the_first_update_and_spans_the_rounds():
    rounds = [
        {"posttrain": dict(update_s=[100, 10, 10], peak_gib=5), "trl": dict(update_s=[50, 30, 30], peak_gib=6),
         "accuracy": {"posttrain": 0.3, "trl": 0.25}},
        {"posttrain": dict(update_s=[90, 20, 20], peak_gib=4), "trl": dict(update_s=[10, 20, 20], peak_gib=7),
         "accuracy": {"posttrain": 0.2, "trl": 0.2}},
    ]  # fmt: skip
    summary = tool().summarise(rounds)
    assert summary["trl_over_posttrain_update_s"] == dict(median=2.0, low=1.0, high=3.0)
    assert summary["posttrain"]["peak_gib_max"] == 5 and summary["trl"]["held_out_accuracy"] == [0.25, 0.2]


def test_one_update_is_refused():
    with pytest.raises(SystemExit):
        tool().main(["models/smollm2", "--updates", "1"])
