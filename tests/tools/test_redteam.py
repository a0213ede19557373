"""tools/redteam.py --rg: the raw-vs-guarded table of reasoning-gym's scorers (BENCHMARKS.md's), and
its exit status (1 only when the guard lets an attack pay, or refuses an honest form, on a served dataset)."""

import importlib.util

import pytest

from tests.support.paths import ROOT


def tool():
    spec = importlib.util.spec_from_file_location("redteam_tool", ROOT / "tools" / "redteam.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rg_table_shows_raw_and_guarded_scores(capsys, monkeypatch):
    pytest.importorskip("reasoning_gym")
    from posttrain.rl.verifiers import rg

    module = tool()
    assert module.reasoning_gym(["gsm_symbolic", "decimal_arithmetic"]) == 0
    out = capsys.readouterr().out
    assert (
        "| rg:gsm_symbolic | 47 | 0 | 0 | 0 | yes |" in out
        and "| rg:decimal_arithmetic | 15 | 0 | 1 | 11 | refused |" in out
    )
    assert "| words after: or more | 1 / 0 | 0 / 0 |" in out  # gsm_symbolic's scorer reads the first number
    monkeypatch.setattr(
        rg, "guarded_answer", lambda response: rg.Guarded("1", "boxed")
    )  # a guard that lets all through
    assert module.reasoning_gym(["gcd"]) == 1
    assert "== rg:gcd: the guard lets through [" in capsys.readouterr().out
