"""`repo_fix`: a built-in agent domain that takes several tool calls to solve.

Each task is a tiny repository with a failing test: `{module}.py` sets a constant to the wrong
value and `test_{module}.py` asserts the right one. The prompt names the failing test but not
the constant or its value, so the agent has to look (`cat test_config.py`), then fix the module
(`echo 'SIZE = 37' > config.py`, copying the value by hand; or let the shell take it from the test,
`sed ... test_config.py > config.py`; or Python), then say it is done. The final check
(`workspace.check_repo`) does not run the test: a trusted harness imports the module in the
sandbox (the pristine test written over the agent's files) and passes `SIZE` out as plain data,
and the host compares it with the task's `expect`, so exiting 0, rigging `__eq__` or editing the
test passes nothing.

Held-out tasks are disjoint from training tasks by construction: a task's split is a hash of the
fix it needs (module, constant, right value), 10% "test", so no held-out fix line appears in any
training task (nor in the scripted demonstrations, which are drawn from "train").
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import random

from posttrain.rl.envs.base import Task
from posttrain.rl.envs.workspace import RepoTask
from posttrain.rl.tasks.domains import Domain

MODULES = ("config", "limits", "params", "settings", "consts", "defaults", "values", "options")
CONSTANTS = ("SIZE", "LIMIT", "COUNT", "RATE", "DEPTH", "WIDTH", "SCALE", "OFFSET")
VALUES = range(10, 100)
TEST_PERCENT = 10
TRAIN_SIZE = 2000


def repo_split(module: str, constant: str, right: int) -> str:
    """ "train" or "test" (TEST_PERCENT %): a hash of the fix the task needs."""
    h = int(hashlib.sha256(f"{module}:{constant}={right}".encode()).hexdigest(), 16)
    return "test" if h % 100 < TEST_PERCENT else "train"


def repo_task(module: str, constant: str, wrong: int, right: int) -> Task:
    """The task whose `{module}.py` sets `constant = wrong` and whose test wants `right`."""
    if module not in MODULES or constant not in CONSTANTS or wrong == right:
        raise ValueError(
            f"repo_task: expected a module of {MODULES}, a constant of {CONSTANTS} and "
            f"wrong != right, got {module!r}, {constant!r}, {wrong}, {right}"
        )
    test = f"test_{module}.py"
    test_src = f"from {module} import {constant}\nassert {constant} == {right}, {constant}\n"
    target = RepoTask(
        files=((f"{module}.py", f"{constant} = {wrong}\n"), (test, test_src)),
        tests=((test, test_src),),
        module=module,
        expect=((constant, right),),
    )
    prompt = ({"role": "user", "content": f"{test} fails. Fix {module}.py."},)
    return Task(f"repo_fix/{module}/{constant}/{wrong}/{right}", prompt, target)


def repo_tasks(split: str, n: int, seed: int) -> list[Task]:
    """`n` distinct tasks of `split`, drawn with `seed`."""
    if split not in ("train", "test"):
        raise ValueError(f"repo_tasks: split must be 'train' or 'test', got {split!r}")
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < n:
        m, c, w, r = rng.choice(MODULES), rng.choice(CONSTANTS), rng.choice(VALUES), rng.choice(VALUES)
        if w == r or (m, c, w, r) in seen or repo_split(m, c, r) != split:
            continue
        seen.add((m, c, w, r))
        out.append(repo_task(m, c, w, r))
    return out


def task_fields(task: Task) -> tuple[str, str, int, int]:
    """(module, constant, wrong, right) of a repo_fix task."""
    _, m, c, w, r = task.id.split("/")
    return m, c, int(w), int(r)


def demonstration(task: Task, *, extract: bool = False) -> list[str]:
    """A scripted solution, turn by turn: read the test, write the fix, finish. The fix copies the
    value by hand (`echo 'SIZE = 37' > config.py`) or, with `extract`, has `sed` cut it out of the
    test (`sed '1d;s/assert //;s/=//;s/,.*//' test_config.py > config.py`: the same line for every
    task of a module, so it carries no task's answer)."""
    m, c, _, r = task_fields(task)
    fix = f"sed '1d;s/assert //;s/=//;s/,.*//' test_{m}.py > {m}.py" if extract else f"echo '{c} = {r}' > {m}.py"
    return [f"<tool>sh\ncat test_{m}.py\n</tool>", f"<tool>sh\n{fix}\n</tool>", "Done."]


def demonstration_records(
    tasks: list[Task], make_env, *, workers: int = 2, extract_frac: float = 0.0, seed: int = 0
) -> list[dict]:
    """SFT records `{"messages": [...]}` of scripted episodes (`demonstration`) run for real in
    `make_env()`'s sandboxed workspace, so their tool outputs are what the policy will see;
    a fraction `extract_frac` (drawn with `seed`) fix with `sed` instead of by hand (the record's
    `fix` says which); only episodes whose final check passed are kept (all, unless the sandbox failed)."""
    from posttrain.rl.envs.runner import run_episode

    if not 0.0 <= extract_frac <= 1.0:
        raise ValueError(f"demonstration_records: extract_frac must be in [0, 1], got {extract_frac}")
    rng = random.Random(seed)
    extract = [rng.random() < extract_frac for _ in tasks]

    def one(task, ext):
        env, turns = make_env(), iter(demonstration(task, extract=ext))
        traj = run_episode(env, task, lambda _: env.tok.encode(next(turns)) + [env.tok.stop_ids[0]])
        return (
            {"messages": env.messages, "task_id": task.id, "fix": "extract" if ext else "copy"}
            if traj.reward.correct >= 1.0
            else None
        )

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        return [r for r in pool.map(one, tasks, extract) if r is not None]


def copy_drills(n: int, seed: int) -> list[dict]:
    """SFT records `{"messages": [...]}` that drill the copy a fix needs (read a module, a name and
    a value from a tool's output, write them into a command) in the episode's message format, on
    names no task uses: lowercase modules and names (tasks' constants are upper case, their
    modules from MODULES) with 1-4 digit values, so no task's fix line, held-out or not, appears."""
    rng, letters, out = random.Random(seed), "abcdefghijklmnopqrstuvwxyz", []
    word = lambda: "".join(rng.choice(letters) for _ in range(rng.randint(2, 8)))
    for _ in range(n):
        mod, name = word(), word()
        while mod in MODULES:
            mod = word()
        value = rng.randint(0, 10 ** rng.randint(1, 4) - 1)
        out.append(
            {
                "messages": [
                    {"role": "user", "content": f"test_{mod}.py fails. Fix {mod}.py."},
                    {"role": "assistant", "content": f"<tool>sh\ncat test_{mod}.py\n</tool>"},
                    {
                        "role": "tool",
                        "content": f"<output>\nfrom {mod} import {name}\nassert {name} == {value}, {name}\n</output>",
                    },
                    {"role": "assistant", "content": f"<tool>sh\necho '{name} = {value}' > {mod}.py\n</tool>"},
                ]
            }
        )
    return out


def repo_fix_domain(make_env, *, n: int = TRAIN_SIZE, seed: int = 0) -> Domain:
    """The training domain: `n` tasks of the "train" split."""
    return Domain("repo_fix", repo_tasks("train", n, seed), make_env)
