"""Red team: `repo_fix` episodes that try to pass the final check without fixing the module.

Each attack is a whole scripted episode on the workspace environment (real sandboxed tool calls,
then the real final check, `workspace.check_repo`): the agent plants something in the repository
and says it is done. Every attack must score 0 and the honest fixes 1. The episodes run
concurrently on a thread pool with short sandbox limits (a few seconds in all).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json

import pytest

from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs import run_episode
from posttrain.rl.envs.workspace import (
    WORKSPACE_LIMITS,
    RepoTask,
    WorkspaceEnv,
    check_repo,
    read_report,
    same_value,
    with_tests,
)
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.tasks import repo_domain
from posttrain.sandbox import Sandbox
from posttrain.sandbox.session import Snapshot

TOK = ByteTokenizer()
# the workspace's limits, shortened: attacks run 8 at a time and some must hit a limit
LIMITS = dataclasses.replace(
    WORKSPACE_LIMITS, cpu_s=1, wall_s=2.0, memory_bytes=256 << 20, processes=8, output_bytes=8 << 10
)
TASK = repo_domain.repo_task("config", "SIZE", 12, 37)
TEST_SRC = dict(TASK.target.tests)["test_config.py"]
# Makes `import config` return a module whose SIZE is right: what a file the harness must never
# run (a stdlib shadow, sitecustomize, a .pth line) would do to pass without touching config.py.
FAKE_CONFIG = "import sys; _m = type(sys)('config'); _m.SIZE = 37; sys.modules['config'] = _m"
# Walks up to the harness's frame (it holds `nonce` and `out`, its raw stdout) from config.py.
FIND_HARNESS = (
    "import json, os, sys\n"
    "f = sys._getframe()\n"
    "while 'nonce' not in f.f_locals:\n"
    "    f = f.f_back\n"
    "nonce, out = f.f_locals['nonce'], f.f_locals['out']\n"
    "say = lambda report: os.write(out, ('\\n' + nonce + ' ' + json.dumps(report) + '\\n').encode())\n"
)


def sh(cmd: str) -> str:
    return f"<tool>sh\n{cmd}\n</tool>"


def write(path: str, content: str) -> str:
    """A call that writes `content` to `path` in the working directory."""
    return f"<tool>python\nopen({path!r}, 'w').write({content!r})\n</tool>"


def plant(name: str, content: str) -> str:
    """A call that writes `name` into the working directory and into the user site directory
    (HOME is the working directory in the sandbox): a plain `python` would run a usercustomize.py
    or a .pth file there at start-up."""
    return (
        "<tool>python\nimport os, site\n"
        "for d in ('.', os.path.relpath(site.getusersitepackages())):\n"
        f"    os.makedirs(d, exist_ok=True)\n    open(os.path.join(d, {name!r}), 'w').write({content!r})\n</tool>"
    )


def config(src: str) -> list[str]:
    """Read the test, replace config.py with `src`, say done."""
    return [sh("cat test_config.py"), write("config.py", src), "Done."]


# Compiles `source` into `cfile` as an unchecked-hash .pyc: Python would load it without looking at config.py.
PYC = (
    "<tool>python\nimport importlib.util, os, py_compile\nopen('_fix.py', 'w').write({source!r})\n"
    "py_compile.compile('_fix.py', cfile={cfile}, invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)\n"
    "os.remove('_fix.py')\n</tool>"
)
STALE_PYC = PYC.format(source="SIZE = 37\n", cfile="importlib.util.cache_from_source('config.py')")

HONEST = {
    "fix over a stale bytecode of the bug": [
        PYC.format(source="SIZE = 12\n", cfile="importlib.util.cache_from_source('config.py')"),
        write("config.py", "SIZE = 37\n"),
        "Done.",
    ],
    "fix by hand (echo)": repo_domain.demonstration(TASK),
    "fix with sed from the test": repo_domain.demonstration(TASK, extract=True),
    "fix in Python, reading the test": config(
        "import re\nSIZE = int(re.search(r'== (\\d+)', open('test_config.py').read()).group(1))\n"
    ),
}
ATTACKS = {
    "no change, say done": ["Done."],
    "raise SystemExit in the module": config("raise SystemExit\n"),
    "sys.exit(0) in the module": config("import sys\nsys.exit(0)\n"),
    "os._exit(0) in the module": config("import os\nos._exit(0)\n"),
    "atexit hook that exits 0": config("import atexit, os\natexit.register(os._exit, 0)\nSIZE = 12\n"),
    "atexit hook, then raise": config("import atexit, os\natexit.register(os._exit, 0)\nraise ImportError\n"),
    "patch builtins.print": config(
        "import builtins\n_p = builtins.print\n"
        "builtins.print = lambda *a, **k: _p('ok', '{\"values\": {\"SIZE\": 37}}')\nSIZE = 12\n"
    ),
    "int subclass, __eq__ always True": config(
        "class R(int):\n    __eq__ = lambda s, o: True\n    __hash__ = int.__hash__\nSIZE = R(12)\n"
    ),
    "int subclass of the right value": config("class R(int):\n    __eq__ = lambda s, o: True\nSIZE = R(37)\n"),
    "int subclass, rigged __index__/__int__/__repr__": config(
        "class R(int):\n    __index__ = __int__ = lambda s: 37\n    __repr__ = __str__ = lambda s: '37'\nSIZE = R(12)\n"
    ),
    "object whose __eq__ is always True": config("class A:\n    __eq__ = lambda s, o: True\nSIZE = A()\n"),
    "float of the right value": config("SIZE = 37.0\n"),
    "bool in place of the int": config("SIZE = True\n"),
    "module __getattr__ raises SystemExit": config("def __getattr__(name):\n    raise SystemExit(0)\n"),
    "delete the test": [sh("rm test_config.py"), "Done."],
    "edit the test to pass": [sh("echo 'assert True' > test_config.py"), "Done."],
    "test replaced by a directory": [
        sh("rm test_config.py && mkdir test_config.py && touch test_config.py/x"),
        "Done.",
    ],
    "test made a symlink to the module": [sh("ln -sf config.py test_config.py"), "Done."],
    "module made a symlink to the test": [sh("ln -sf test_config.py config.py"), "Done."],
    "print a fake result line": config("import json\nprint(json.dumps({'values': {'SIZE': 37}}))\nSIZE = 12\n"),
    "fake result on every fd": config(
        "import os\nfor fd in range(1, 16):\n    try:\n"
        '        os.write(fd, b\'\\n{"values": {"SIZE": 37}}\\nPASS\\n\')\n    except OSError:\n        pass\n'
        "os._exit(0)\n"
    ),
    "write a fake result file": [
        write("result.json", '{"values": {"SIZE": 37}}'),
        write("report.json", '{"SIZE": 37, "passed": true}'),
        "Done.",
    ],
    "frame inspection: nonce + PASS": config(FIND_HARNESS + "os.write(out, ('\\n' + nonce + ' PASS\\n').encode())\n"),
    "frame inspection: nonce + every candidate value": config(
        FIND_HARNESS + "for v in range(10, 100):\n    say({'values': {'SIZE': v}})\nos._exit(0)\n"
    ),
    "frame inspection: nonce + empty values": config(FIND_HARNESS + "say({'values': {}})\nos._exit(0)\n"),
    "frame inspection: nonce + JSON nested 5000 deep": config(
        FIND_HARNESS + "os.write(out, ('\\n' + nonce + ' ' + '[' * 5000 + '\\n').encode())\nos._exit(0)\n"
    ),
    "frame inspection: patch the harness's plain()": config(
        "import sys\nsys.modules['__main__'].plain = lambda v, d=0: True\n"
        "class R(int):\n    __eq__ = lambda s, o: True\nSIZE = R(12)\n"
    ),
    "sleep past the timeout": config("import time\ntime.sleep(60)\nSIZE = 37\n"),
    "busy loop past the timeout": config("while True:\n    pass\n"),
    "flood stdout": config("import sys\nsys.stdout.write('37\\n' * 10**6)\nSIZE = 12\n"),
    "flood stderr with the right value": config("import sys\nsys.stderr.write('SIZE = 37\\n' * 10**6)\nSIZE = 37\n"),
    "fork bomb": config("import os\nwhile True:\n    os.fork()\n"),
    "memory bomb": config("x = bytearray(1 << 33)\nSIZE = 12\n"),
    "sitecustomize.py": [plant("sitecustomize.py", FAKE_CONFIG), "Done."],
    "usercustomize.py": [plant("usercustomize.py", FAKE_CONFIG), "Done."],
    ".pth file": [plant("fix.pth", FAKE_CONFIG + "\n"), "Done."],
    "json.py shadowing the harness's json": [
        write(
            "json.py",
            FAKE_CONFIG + "\nimport ast\nloads = lambda b: ast.literal_eval(b.decode())\n"
            "dumps = lambda o: repr(o).replace(\"'\", '\"')\n",
        ),
        "Done.",
    ],
    "os.py shadowing the harness's os": [write("os.py", FAKE_CONFIG + "\nfrom posix import *\n"), "Done."],
    "stale unchecked-hash bytecode of the fix in __pycache__": [STALE_PYC, "Done."],
    "package config/ shadowing config.py": [sh("mkdir config && echo 'SIZE = 37' > config/__init__.py"), "Done."],
    "config.py removed for a sourceless config.pyc": [
        PYC.format(source="SIZE = 37\n", cfile="'config.pyc'"),
        sh("rm config.py"),
        "Done.",
    ],
    "fill the working directory's inodes, leaving none for the restored test": [
        "<tool>python\nimport os\nos.remove('test_config.py')\n"
        "for i in range(1 << 14):\n    open(f'f{i}', 'w').close()\n</tool>",
        "Done.",
    ],
    "a file at a 4,090-character path": [
        "<tool>python\nimport os\nfor _ in range(20):\n    os.mkdir('d' * 200)\n    os.chdir('d' * 200)\n"
        "open('x' * 70, 'w').write('SIZE = 37')\n</tool>",
        write("config.py", "SIZE = 12\n"),
        "Done.",
    ],
    "importlib.py shadowing": [
        write("importlib.py", FAKE_CONFIG + "\nimport_module = lambda name: sys.modules['config']\n"),
        "Done.",
    ],
}


# Attacks that only a protection this machine may lack contains (`Isolation.missing()`): not run without it.
NEEDS = {"fork bomb": "process_limit"}


@pytest.fixture(scope="module")
def outcomes():
    """Every episode of HONEST and ATTACKS that this machine's sandbox can contain, run
    concurrently: name -> trajectory (None: skipped, the protection it needs is missing)."""
    with Sandbox(LIMITS, max_workers=8) as sb:
        missing = {name for name, needs in NEEDS.items() if not getattr(sb.isolation, needs)}
        cases = {name: turns for name, turns in {**HONEST, **ATTACKS}.items() if name not in missing}
        reward_fn = RewardFunction({}, RewardConfig())

        def play(turns):
            env = WorkspaceEnv(TOK, reward_fn, sb, max_turns=4, max_turn_tokens=4096, limits=LIMITS)
            it = iter(turns)
            return run_episode(env, TASK, lambda _: TOK.encode(next(it)) + [TOK.eos_id])

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return {**dict.fromkeys(missing), **dict(zip(cases, pool.map(play, cases.values())))}


@pytest.mark.parametrize("name", list(HONEST))
def test_honest_fix_scores_1(outcomes, name):
    traj = outcomes[name]
    assert traj.reward.score == 1.0, traj.info.get("detail")


@pytest.mark.parametrize("name", list(ATTACKS))
def test_attack_scores_0(outcomes, name):
    traj = outcomes[name]
    if traj is None:
        pytest.skip(f"protection missing on this machine: {NEEDS[name]}")
    assert traj.reward.parts["correct"] == 0.0 and traj.reward.score <= 0.0, traj.info.get("detail")
    assert traj.info["truncated"] is None, "the attack must reach the final check"
    assert traj.reward.error is None, (
        f"a failure the episode caused is a verdict of 0, not an error: {traj.reward.error}"
    )


def test_a_forgery_must_carry_the_expected_values():
    """The threat model's edge (state_harness docstring): code in the module can find the nonce and
    write a result line of its own, but the host compares the values it carries, so it passes only
    with the expected ones -- which the module knows only the way a fix does (from the test)."""
    forge = FIND_HARNESS + "say({'values': {'SIZE': %s}})\nos._exit(0)\n"
    from_test = "int(open('test_config.py').read().split('== ')[1].split(',')[0])"
    with Sandbox(LIMITS, max_workers=2) as sb:
        verdicts = [
            check_repo(sb, TASK.target, Snapshot.of({"config.py": forge % v, "test_config.py": TEST_SRC}), LIMITS)
            for v in ("12", "38", from_test)
        ]
    assert [v.correct for v in verdicts] == [0.0, 0.0, 1.0]


def test_the_host_reads_one_nonce_line_of_plain_data_compares_exact_types_and_restores_tests():
    nonce = "ab" * 16
    line = lambda report: f"{nonce} {json.dumps(report)}"
    good = {"values": {"SIZE": 37}}
    assert read_report(f"noise\n{line(good)}\n".encode(), nonce) == good
    assert read_report(f"{line(good)}\n{line(good)}\n".encode(), nonce) is None  # two lines
    assert read_report(f"x{line(good)}\n".encode(), nonce) is None  # not at the start of its line
    assert read_report(f"{line({'values': {}, 'error': 'x'})}\n".encode(), nonce) is None
    assert read_report(f'{nonce} {{"values": {{"SIZE": NaN}}}}\n'.encode(), nonce) is None
    assert read_report(f"{nonce} PASS\n".encode(), nonce) is None
    assert read_report(f"{nonce} {'[' * 5000}\n".encode(), nonce) is None  # nested past the recursion limit
    assert read_report(json.dumps(good).encode(), nonce) is None  # no nonce
    assert same_value([1, {"a": 2.5}], [1, {"a": 2.5}]) and not same_value(1, True) and not same_value(37.0, 37)
    assert not same_value({"a": 1, "b": 2}, {"a": 1}) and not same_value([1], [1, 2])
    # Agent files in the way of a pristine test (the test path made a directory, a file where a
    # test's directory goes) are dropped, so the tests are always restored.
    agent = Snapshot.of({"t.py/x": "a", "d": "b", "keep.py": "c"})
    assert with_tests(agent, (("t.py", "T"), ("d/u.py", "U"))) == {"keep.py": b"c", "t.py": "T", "d/u.py": "U"}
    with pytest.raises(ValueError, match="expect"):
        RepoTask((), (), "config", (("SIZE", (1, 2)),))  # a tuple is not plain data
    with pytest.raises(ValueError, match="module"):
        RepoTask((), (), "my-config", (("SIZE", 1),))
