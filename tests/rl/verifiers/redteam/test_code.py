"""Red team of the program-checking verifier (HumanEval `CodeVerifier`): every attack scores 0 and
the honest solution 1, with short sandbox limits and the attacks run concurrently; the helper finds
the holes of a naive user verifier that trusts the exit status."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from posttrain.rl.verifiers.code import CodeVerifier
from posttrain.rl.verifiers.program_attacks import PROGRAM_ATTACKS
from posttrain.rl.verifiers.redteam import builtin_cases, redteam
from posttrain.sandbox import Limits, Sandbox

LIMITS = Limits(cpu_s=2, wall_s=3.0, memory_bytes=512 << 20, processes=16)


@pytest.fixture(scope="module")
def code_verifier():
    with Sandbox(max_workers=8) as sandbox:
        yield CodeVerifier(sandbox, LIMITS)


def test_every_program_attack_scores_zero(code_verifier):
    kind, _, cases = builtin_cases("humaneval")
    t = time.monotonic()
    report = redteam(code_verifier, cases, kind=kind)
    elapsed = time.monotonic() - t
    assert {name: [o.detail for o in outs] for name, outs in report.won().items()} == {}
    assert report.honest_failed() == []
    assert len(report.attacks()) == len(PROGRAM_ATTACKS) >= 30
    assert elapsed < 60, f"red team took {elapsed:.0f} s"
    by_name = {o.attack: o for o in report.outcomes if o.case == 0}
    # rigged equality never reaches HumanEval's ==: results cross as plain data only
    assert "not plain data" in by_name["always-equal int subclass"].detail
    assert "not plain data" in by_name["returns unittest.mock.ANY"].detail
    # exiting 0 early is a failed load or call, never a pass
    assert "SystemExit" in by_name["sys.exit(0) at import"].detail
    assert "exited before answering" in by_name["os._exit(0) at import"].detail


def naive_score(prompt: str, response: str, record: dict) -> float:
    """A user verifier that runs prompt + code + tests and trusts exit status 0: the hole."""
    code = response.split("```python\n")[-1].split("```")[0]
    program = record["prompt"] + code + "\n" + record["test"] + f"\ncheck({record['entry_point']})\n"
    try:
        done = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=3)
    except subprocess.TimeoutExpired:
        return 0.0
    return float(done.returncode == 0)


def test_helper_reports_exit_zero_holes_of_a_user_verifier():
    kind, _, cases = builtin_cases("humaneval")
    import dataclasses

    records = [
        dataclasses.replace(c, task={"prompt": c.task.prompt, "test": c.task.test, "entry_point": c.entry_point})
        for c in cases[:1]
    ]
    chosen = [a for a in PROGRAM_ATTACKS if "exit" in a.name or "equal" in a.name or a.name == "prints success lines"]
    report = redteam(naive_score, records, kind=kind, attacks=chosen)
    assert report.honest_failed() == []
    won = set(report.won())
    assert {"sys.exit(0) at import", "os._exit(0) at import", "always-equal object"} <= won
    assert "prints success lines" not in won
