"""Math and code verifiers and reward composition, on GSM8K / HumanEval and hostile completions."""

from __future__ import annotations

import concurrent.futures
import gzip
import json
import os
import time
from fractions import Fraction
from pathlib import Path

import pytest

from posttrain.rl.reward import Reward, RewardConfig, RewardFunction, compose, default_reward_function, overlong_penalty
from posttrain.rl.verifiers import (
    CodeTask,
    CodeVerifier,
    MathTask,
    MathVerifier,
    Verdict,
    answers_equal,
    extract_answer,
    extract_code,
)
from posttrain.rl.verifiers.math import parse_number
from posttrain.rl.verifiers.symbolic import SymbolicCheckError
from posttrain.sandbox import Limits, Sandbox, Status
from tests.support.paths import ROOT

DATA = Path(os.environ.get("POSTTRAIN_DATA", ROOT.parent / "shared" / "data"))


def load_jsonl(rel: str) -> list[dict]:
    path = DATA / rel
    if not path.exists():
        pytest.skip(f"data set {path} is absent (set POSTTRAIN_DATA to the shared data folder)")
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def verifier() -> CodeVerifier:
    """Default limits; 4 workers overlap process start-up on 2 cores."""
    with Sandbox(max_workers=4) as sb:
        yield CodeVerifier(sb)


@pytest.fixture(scope="module")
def strict(verifier) -> CodeVerifier:
    """Small limits for hostile completions."""
    return CodeVerifier(verifier.sandbox, Limits(cpu_s=2, wall_s=4.0, memory_bytes=512 << 20, processes=16))


# --- math -----------------------------------------------------------------------------------


def test_gsm8k_reference_solutions_verify_and_altered_answers_fail():
    rows = load_jsonl("gsm8k/test.jsonl")
    assert len(rows) == 1319
    v = MathVerifier()
    tasks = [MathTask.from_gsm8k(r) for r in rows]
    solutions = [r["answer"] for r in rows]
    good = v.verify_many(tasks, solutions)
    assert [t.answer for t, g in zip(tasks, good) if g.correct != 1.0] == []
    assert all(g.format_ok for g in good)
    for alter in (lambda x: x + 1, lambda x: x * 2 + 1, lambda x: -x - 1):
        altered = [MathTask(str(alter(parse_number(t.answer)[0]))) for t in tasks]
        wrong = [t.answer for t, g in zip(altered, v.verify_many(altered, solutions)) if g.correct]
        assert wrong == []


@pytest.mark.parametrize(
    "response,text,source",
    [
        ("so the total is \\boxed{\\frac{3}{4}} apples", "\\frac{3}{4}", "boxed"),
        ("\\boxed{\\{1, 2\\}} and later \\fbox{7}", "7", "boxed"),
        ("work...\n#### 1,234\n", "1,234", "hash"),
        ("The answer is $18. Hope that helps", "$18", "answer_is"),
        ("**Final Answer:** 42 because 6*7", "42", "answer_is"),
        ("we get 3 then 4.5 and finally -12.", "-12", "last_number"),
    ],
)
def test_extract_answer(response, text, source):
    found = extract_answer(response)
    assert (found.text, found.source) == (text, source)


def test_last_number_fallback_is_configurable():
    assert extract_answer("it is 12", last_number_fallback=False) is None
    v = MathVerifier(last_number_fallback=False)
    assert v.verify(MathTask("12"), "it is 12") == Verdict(0.0, False, "no answer found")
    loose = MathVerifier().verify(MathTask("12"), "it is 12")
    assert loose.correct == 1.0 and not loose.format_ok


@pytest.mark.parametrize(
    "pred,ref,equal",
    [
        ("1,000", "1000", True),
        ("$18.00", "18", True),
        ("\\$5", "5", True),
        ("50%", "50", True),
        ("50\\%", "0.5", False),  # issue 42: percent is a unit, read one way (50% is 50, never 0.5)
        ("3/4", "0.75", True),
        ("\\frac{3}{4}", "0.75", True),
        ("-\\frac{1}{2}", "-0.5", True),
        ("12 apples", "12", True),
        ("x = 7", "7", True),
        ("0.1 + 0.2", "0.3", False),  # issue 25: a sum left to add is not the value
        ("1450000", "1450001", False),
        ("2.5", "2.6", False),
        ("3/4", "4/3", False),
        ("1e3", "1000", True),
        ("7", "-7", False),
        ("(x+1)^2", "x^2+2x+1", True),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
        ("\\{1,2\\}", "\\{2,1\\}", True),
        ("[0,1)", "[0,1]", False),
        ("x^2", "x^3", False),
        # tolerance from the reference's own precision (issue 16)
        ("1234566.0", "1234567", False),
        ("1234567.0", "1234567", True),
        ("1e-9", "0", False),
        ("0.0", "0", True),
        ("3.14159", "3.14", True),
        ("3.146", "3.14", False),
        ("3.1", "3.14", False),
        ("1540", "1.5e3", True),
        ("1560", "1.5e3", False),
        ("0.333", "1/3", False),
        ("12.54%", "12.5%", True),
        ("0.1254", "12.5%", False),  # issue 42: percent read one way
        ("0.126", "12.5%", False),
        ("3", "3.0", True),
        ("1,234,567.0", "1234567", True),
    ],
)
def test_answers_equal(pred, ref, equal):
    assert answers_equal(pred, ref) is equal


def test_symbolic_guard_refuses_towers_quickly_off_the_main_thread():
    towers = ["2^{10^{10}}", "(10^{100})!", "2**2**2**2**2**2", "9^{9^{9}}"]
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(2) as pool:  # no SIGALRM timeouts in threads
        assert not any(pool.map(lambda s: answers_equal(s, "5"), towers))
    assert time.monotonic() - t < 5


@pytest.fixture(scope="module")
def math_verifier() -> MathVerifier:
    """One verifier (one symbolic worker process) for the timeout and error tests."""
    v = MathVerifier(symbolic_timeout=3.0)
    assert v.verify(MathTask("x^2+2x+1"), "\\boxed{(x+1)^2}").correct == 1.0  # starts the worker
    yield v
    v._checker.close()


def test_symbolic_timeout_holds_off_the_main_thread_and_is_an_error(math_verifier):
    # sympy expands both degree-2000 polynomials for minutes; the guard lets it through. (The
    # reference is an expression: against a number such as "0" the answer is refused at once as not
    # being a number, issue 25.)
    rf = RewardFunction({MathTask: math_verifier})
    before = math_verifier.errors
    t = time.monotonic()
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        reward = pool.submit(rf.verify, MathTask("2x+1"), "\\boxed{(x+1)^{2000}-(x+2)^{2000}}").result()
    assert time.monotonic() - t < 3.0 + 3.0
    assert reward.score == 0.0 and "timed out after 3 s" in reward.error
    assert math_verifier.errors == before + 1
    with concurrent.futures.ThreadPoolExecutor(1) as pool:  # a fresh worker serves the next check
        assert pool.submit(rf.verify, MathTask("\\{1,2\\}"), "\\boxed{\\{2,1\\}}").result() == Reward(
            1.0, {"correct": 1.0, "format": 0.0, "length": 0.0, "tool_calls": 0.0}
        )


def test_symbolic_worker_ignores_ctrl_c(math_verifier):
    """Ctrl-C goes to the terminal's whole process group; the run finishes its step (with this
    worker's checks) before stopping, so the worker must not die of it."""
    import signal

    checker = math_verifier._checker
    assert checker.equal("1", "1")
    pid = checker._proc.pid
    os.kill(pid, signal.SIGINT)
    time.sleep(0.5)
    assert checker.equal("2", "1+1") and checker._proc.pid == pid


def test_verifier_exceptions_set_error_not_a_silent_zero(math_verifier, monkeypatch):
    with pytest.raises(SymbolicCheckError, match="math-verify failed .*AttributeError"):
        math_verifier._checker.equal(None, "1")  # an exception inside math-verify

    def broken(text):
        raise ZeroDivisionError("injected")

    monkeypatch.setattr("posttrain.rl.verifiers.math.parse_number", broken)
    before = math_verifier.errors
    verdict = math_verifier.verify(MathTask("18"), "The answer is 17.")
    assert verdict == Verdict(0.0, True, "answer_is: '17' not checked", error="ZeroDivisionError: injected")
    assert math_verifier.errors == before + 1
    reward = compose(verdict, RewardConfig())
    assert reward.error == "ZeroDivisionError: injected" and reward.score == 0.0


def test_gsm8k_record_without_answer_is_named():
    with pytest.raises(ValueError, match="####"):
        MathTask.from_gsm8k({"question": "q", "answer": "no marker"})


# --- code -----------------------------------------------------------------------------------

# Wraps the entry point so that its return value is altered (bool flipped, number + 1, ...).
ALTER = """

def _posttrain_alter(value):
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    if isinstance(value, str):
        return value + "?"
    if isinstance(value, (list, tuple)):
        return type(value)([*value, None])
    return [value]

_posttrain_original = {entry}

def {entry}(*args, **kwargs):
    return _posttrain_alter(_posttrain_original(*args, **kwargs))
"""


def test_humaneval_canonical_solutions_pass_and_altered_ones_fail(verifier):
    rows = load_jsonl("humaneval/HumanEval.jsonl.gz")
    assert len(rows) == 164
    tasks = [CodeTask.from_humaneval(r) for r in rows]
    good = [r["canonical_solution"] for r in rows]
    bad = [r["canonical_solution"] + ALTER.format(entry=r["entry_point"]) for r in rows]
    results = verifier.check_many(tasks + tasks, good + bad)
    failed = [(r["task_id"], res.detail) for r, res in zip(rows, results[:164]) if not res.passed]
    assert failed == []
    passed = [r["task_id"] for r, res in zip(rows, results[164:]) if res.passed]
    assert passed == []
    assert all(res.detail.startswith("FAIL AssertionError") for res in results[164:])


ADD = CodeTask(
    prompt='def add(a, b):\n    """Return a + b."""\n',
    test="def check(candidate):\n    assert candidate(2, 3) == 5\n    assert candidate(-1, 1) == 0\n",
    entry_point="add",
)

STEAL_TOKEN = r"""    return 0
import os, re
ppid = os.getppid()
try:
    maps = open(f"/proc/{ppid}/maps").read().splitlines()
    mem = open(f"/proc/{ppid}/mem", "rb")
    for line in maps:
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        try:
            mem.seek(lo)
            found = re.search(rb'"token": "([0-9a-f]{32})"', mem.read(hi - lo))
        except OSError:
            continue
        if found:
            print("STOLEN", found.group(1).decode(), flush=True)
            open(f"/proc/{ppid}/fd/1", "w").write(found.group(1).decode() + " PASS\n")
except OSError as e:
    print("denied", e)
"""

HOSTILE = {
    "sys.exit before checks": "    return 0\nimport sys\nsys.exit(0)\n",
    "os._exit before checks": "    return 0\nimport os\nos._exit(0)\n",
    "prints fake success": "    return 0\nimport sys\nprint('PASS')\nsys.stdout.write('0' * 32 + ' PASS\\n')\n",
    "atexit fake success": "    return 0\nimport atexit\natexit.register(lambda: print('PASS'))\n",
    "redefines AssertionError and print": (
        "    return 0\nimport builtins\nclass Never(BaseException): pass\n"
        "builtins.AssertionError = Never\nbuiltins.print = lambda *a, **k: None\n"
    ),
    "always-equal object": (
        "    class Anything:\n        def __eq__(self, other): return True\n"
        "        def __ne__(self, other): return False\n    return Anything()\n"
    ),
    "always-equal int subclass": "    class I(int):\n        def __eq__(self, other): return True\n    return I(0)\n",
    "returns unittest.mock.ANY (equal to everything)": "    from unittest import mock\n    return mock.ANY\n",
    "monkeypatches the harness": (
        "    return 0\nimport sys\nm = sys.modules['__main__']\nfor name in dir(m):\n"
        "    if callable(getattr(m, name)):\n        setattr(m, name, lambda *a, **k: None)\n"
    ),
    "overwrites files in its directory": (
        "    return 0\nimport glob\nfor f in glob.glob('*') + glob.glob('.*'):\n"
        "    try:\n        open(f, 'w').write('def check(candidate): pass')\n    except OSError:\n        pass\n"
    ),
    "kills the harness": "    return 0\nimport os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
    "steals the token from harness memory": STEAL_TOKEN,
    "ptrace attach": (
        "    return 0\nimport ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\n"
        "print('ptrace', libc.ptrace(16, os.getppid(), 0, 0), ctypes.get_errno())\n"
    ),
    "infinite loop": "    return a + b\nwhile True:\n    pass\n",
    "sleeps forever": "    return a + b\nimport time\ntime.sleep(60)\n",
    "fork bomb": "    return a + b\nimport os\nwhile True:\n    try: os.fork()\n    except OSError: pass\n",
    "memory bomb": "    return a + b\nx = bytearray(10**10)\n",
    "returns a generator": "    yield a + b\n",
    "returns a pickle that runs code": (
        "    class Evil:\n        def __reduce__(self):\n            import os\n"
        "            return (os.system, ('echo PWNED >&2',))\n    return Evil()\n"
    ),
}


def test_code_verifier_passes_correct_and_contains_hostile_completions(strict):
    names = ["correct", *HOSTILE]
    completions = ["    return a + b\n", *HOSTILE.values()]
    t = time.monotonic()
    results = dict(zip(names, strict.check_many([ADD] * len(names), completions)))
    assert time.monotonic() - t < 3 * strict.limits.wall_s
    assert results.pop("correct").passed
    cheated = {name: r.detail for name, r in results.items() if r.passed}
    assert cheated == {}
    assert results["sleeps forever"].status is Status.TIMEOUT
    assert "not plain data" in results["always-equal int subclass"].detail
    assert "solution returned a posix.system" in results["returns a pickle that runs code"].detail


def test_solution_cannot_read_the_token_from_harness_memory(strict):
    job, token = strict.job(ADD, STEAL_TOKEN)
    res = strict.sandbox.run(job)
    assert b"STOLEN" not in res.stderr and token.encode() not in res.stderr, res.stderr
    assert b"denied" in res.stderr and res.stdout.decode().startswith(f"{token} FAIL")


def test_unit_test_style_tasks_and_expected_exceptions(verifier):
    task = CodeTask(
        test=(
            "assert square(3) == 9\nassert halve(3) == 1.5\ntry:\n    square(-1)\n"
            "    raise AssertionError('no error')\nexcept ValueError:\n    pass\n"
        ),
        functions=("square", "halve"),
    )
    good = (
        "def square(x):\n    if x < 0:\n        raise ValueError('negative')\n    return x * x\n"
        "def halve(x):\n    return x / 2\n"
    )
    no_raise = "def square(x):\n    return x * x\ndef halve(x):\n    return x / 2\n"
    missing = "def square(x):\n    return x * x\n"
    results = verifier.check_many([task] * 3, [good, no_raise, missing])
    assert [r.passed for r in results] == [True, False, False]
    assert "no error" in results[1].detail and "KeyError" in results[2].detail


def test_extract_code_and_verify_from_response(verifier):
    response = "Here:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."
    assert extract_code(response) == ("def add(a, b):\n    return a + b\n", True)
    assert extract_code("    return a + b\n") == ("    return a + b\n", False)
    assert verifier.verify(ADD, response) == Verdict(1.0, True, "passed")
    assert verifier.verify(ADD, "```python\ndef add(a, b):\n    return a - b\n```").correct == 0.0


def test_code_task_bad_input_is_named():
    with pytest.raises(ValueError, match="not a Python identifier"):
        CodeTask(test="", entry_point="bad name")
    with pytest.raises(ValueError, match="entry_point or functions"):
        CodeTask(test="assert True")
    with pytest.raises(KeyError, match="HumanEval/7 lacks field 'test'"):
        CodeTask.from_humaneval({"task_id": "HumanEval/7", "prompt": "", "entry_point": "f"})


# --- reward composition ---------------------------------------------------------------------


def test_overlong_penalty_matches_dapo():
    # L_max = 100, L_cache = 20: 0 up to 80, linear to -1 at 100, -1 beyond.
    expected = {0: 0.0, 80: 0.0, 85: -0.25, 90: -0.5, 100: -1.0, 101: -1.0, 10_000: -1.0}
    for length, value in expected.items():
        assert overlong_penalty(length, 100, 20) == pytest.approx(value), length


def test_compose_reports_every_part_and_sums_them():
    config = RewardConfig(
        correct_weight=2.0,
        format_penalty=0.25,
        max_tokens=100,
        overlong_buffer=20,
        overlong_penalty=0.5,
        invalid_tool_call_penalty=0.1,
        max_tool_calls=3,
        excess_tool_call_penalty=0.2,
    )
    reward = compose(Verdict(1.0, False), config, num_tokens=90, tool_calls=5, invalid_tool_calls=2)
    assert reward.parts == pytest.approx({"correct": 2.0, "format": -0.25, "length": -0.25, "tool_calls": -0.6})
    assert reward.score == pytest.approx(sum(reward.parts.values()))
    plain = compose(Verdict(0.0, False), RewardConfig())
    assert plain == Reward(0.0, {"correct": 0.0, "format": 0.0, "length": 0.0, "tool_calls": 0.0})


def test_reward_config_and_inputs_are_validated():
    with pytest.raises(ValueError, match="overlong_buffer"):
        RewardConfig(max_tokens=10, overlong_buffer=10)
    with pytest.raises(ValueError, match="format_penalty"):
        RewardConfig(format_penalty=-1)
    with pytest.raises(ValueError, match="num_tokens"):
        compose(Verdict(1.0, True), RewardConfig(max_tokens=10))
    with pytest.raises(TypeError, match="no verifier for task type str"):
        RewardFunction({MathTask: MathVerifier()}).verify("task", "response")


def test_reward_function_mixes_domains_in_order(verifier):
    config = RewardConfig(format_penalty=0.5, max_tokens=50, overlong_buffer=10)
    rf = RewardFunction({MathTask: MathVerifier(), CodeTask: verifier}, config)
    tasks = [MathTask("18"), ADD, MathTask("3"), ADD]
    responses = ["\\boxed{18}", "```python\ndef add(a, b):\n    return a + b\n```", "maybe 4", "    return a * b\n"]
    rewards = rf.verify_many(tasks, responses, num_tokens=[10, 45, 10, 10])
    assert [r.parts["correct"] for r in rewards] == [1.0, 1.0, 0.0, 0.0]
    assert [r.parts["format"] for r in rewards] == [0.0, 0.0, -0.5, -0.5]
    assert rewards[1].parts["length"] == pytest.approx(-0.5) and rewards[1].score == pytest.approx(0.5)
    assert rf.verify(MathTask("18"), "#### 18", num_tokens=5) == rewards[0]


def test_default_reward_function_knows_both_domains():
    rf = default_reward_function(sandbox=Sandbox(max_workers=1))
    assert set(rf.verifiers) == {MathTask, CodeTask}
    assert rf.verify(MathTask("0.5"), "\\boxed{\\frac{1}{2}}").score == 1.0
    assert parse_number("\\frac{1}{2}") == [Fraction(1, 2)]


def test_symbolic_worker_exits_quietly_when_its_parent_goes():
    """The worker answers until its parent's end of stdin closes, then exits cleanly (no traceback
    printed at the end of every run that used it); its protocol is line JSON."""
    import subprocess
    import sys

    worker = subprocess.Popen(
        [sys.executable, "-m", "posttrain.rl.verifiers.symbolic_worker"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert json.loads(worker.stdout.readline()) == {"ready": True}
    worker.stdin.write(json.dumps({"pred": "(x+1)^2", "ref": "x^2+2x+1"}) + "\n")
    worker.stdin.flush()
    assert json.loads(worker.stdout.readline()) == {"ok": True}
    worker.stdin.close()
    assert worker.wait(timeout=60) == 0
    assert worker.stderr.read() == ""


def test_math_answer_forms_table():
    """The accept/refuse table of the math verifier's rules (module docstring of verifiers/math.py)."""
    rows = json.loads((ROOT / "tests" / "data" / "math_answer_forms.json").read_text())
    assert len(rows) >= 60
    wrong = [(pred, ref, why) for pred, ref, accept, why in rows if answers_equal(pred, ref) is not accept]
    assert wrong == []


def test_verifier_works_from_a_plain_script(tmp_path):
    """Issue 25: the symbolic worker used multiprocessing "spawn", which re-ran the caller's
    `__main__`: a script scoring answers at its top level printed twice and its worker never
    started (120 s, then a reject). Now the script runs once and gets the right verdict."""
    import subprocess
    import sys

    script = tmp_path / "score.py"
    script.write_text(
        "from posttrain.rl.verifiers import MathTask, MathVerifier\n"
        "print('side effect', flush=True)\n"
        "v = MathVerifier()\n"
        "print(v.verify(MathTask('x^2+2x+1'), '\\\\boxed{(x+1)^2}').correct)\n"
    )
    root = str(ROOT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=90
    )
    assert (out.returncode, out.stdout) == (0, "side effect\n1.0\n"), out.stderr
    assert time.monotonic() - t < 60
