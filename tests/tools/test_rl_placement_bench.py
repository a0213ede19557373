"""tools/rl_placement_bench.py's arithmetic (pure Python; the runs themselves are minutes): steps/s
from the learner loop's logged times, steps before --skip (compiles) left out."""

import importlib.util
import json

from tests.support.paths import ROOT


def bench():
    spec = importlib.util.spec_from_file_location("rl_placement_bench", ROOT / "tools" / "rl_placement_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_steps_per_s_leaves_out_the_compiling_steps_and_rows_without_times(tmp_path):
    rows = [{"step": 0, "rl/wait_s": 30.0, "rl/update_s": 20.0}]  # compiles: left out
    rows += [{"step": s, "rl/wait_s": 0.25, "rl/update_s": 0.75} for s in (1, 2, 3)]
    rows += [{"step": 4, "eval/accuracy": 0.5}]  # an evaluation row has no loop times
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rate, wait = bench().steps_per_s(tmp_path, skip=1)
    assert rate == 1.0 and wait == 0.25


def test_spread_is_the_median_and_range_or_says_one_round():
    b = bench()
    assert b.spread([1.0, 3.0, 2.0]) == "2.00 (1.00-3.00)" and b.spread([0.7]) == "0.70 (1 round)"
