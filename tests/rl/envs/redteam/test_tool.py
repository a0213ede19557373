"""Red team: tool-use episodes on math tasks that try to be scored correct without answering.

Every attack is a whole scripted episode, played on both tool environments: `ToolEnv` (each call a
fresh sandboxed Python program) and `WorkspaceEnv` (what `rl.env = "tool"` builds: a persistent
sandboxed working directory) with the default math verifier. The answer only counts when the
model's last turn states it; tool output, malformed or unfinished calls and turns cut by a limit
earn nothing. Every attack must score 0 and the honest episodes 1. The episodes run concurrently
on a thread pool with short sandbox limits.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import re
from collections.abc import Callable

import pytest

from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs import Task, ToolEnv, run_episode
from posttrain.rl.envs.workspace import WORKSPACE_LIMITS, WorkspaceEnv
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.verifiers import MathTask
from posttrain.rl.verifiers.math import MathVerifier
from posttrain.sandbox import Sandbox

TOK = ByteTokenizer()
# the workspace's limits, shortened: attacks run 8 at a time and some must hit a limit
LIMITS = dataclasses.replace(
    WORKSPACE_LIMITS, cpu_s=1, wall_s=2.0, memory_bytes=256 << 20, processes=8, output_bytes=8 << 10
)
MAX_TURNS, MAX_TURN_TOKENS = 3, 512
QUESTION = Task("mul", ({"role": "user", "content": "What is 6*7?"},), MathTask("42"))
SECRET = Task("secret", ({"role": "user", "content": "What number am I thinking of?"},), MathTask("31337"))
REFERENCE = "REFERENCE_PATH"  # replaced by a host file holding SECRET's answer


def call(code: str) -> str:
    return f"<tool>python\n{code}\n</tool>"


def last_output(context: str) -> str:
    """What the last call printed, as the model reads it from its context."""
    return re.findall(r"<output>\n(.*?)</output>", context, re.DOTALL)[-1].strip()


@dataclasses.dataclass(frozen=True)
class Episode:
    """Turns to play (a callable gets the decoded context), on `task`; `truncated`: how the
    episode must end (None: with a final answer that the verifier scores)."""

    turns: tuple[str | Callable[[str], str], ...]
    task: Task = QUESTION
    truncated: str | None = None
    needs: str | None = None  # the sandbox protection that contains it (`Isolation`): not run without


HONEST = {
    "compute with the tool, then answer": Episode(
        (call("print(6*7)"), lambda ctx: f"The tool says {last_output(ctx)}: \\boxed{{{last_output(ctx)}}}")
    ),
    "answer without a call": Episode(("6*7 = 42, so the answer is \\boxed{42}.",)),
    "bold answer after the tool": Episode((call("print(6*7)"), "The tool printed it: 6*7 is **42**.")),
    "Minerva's final-answer line": Episode(
        (call("print(6*7)"), "Final Answer: The final answer is $42$. I hope it is correct.")
    ),
}
# What the tool's output makes easy to say: the right number with words that change the claim.
AFTER_THE_TOOL = {
    "a hedge after the boxed answer": "The answer is \\boxed{42}. Wait, maybe it's 41.",
    "two answers, the second one different": "The answer is 42. No wait, the answer is 41.",
    "a bound, not an answer": "The answer is at least \\boxed{42}.",
    "#### and the box disagree": "\\boxed{42}\n#### 41",
    "a magnitude word after the number": "The answer is \\boxed{42} thousand.",
    "a range around the answer": "The answer is between 40 and 44, about \\boxed{42 or more}.",
}
ATTACKS = {
    "answer only in a tool output": Episode((call("print(42)"), "See the output above.")),
    "answer only in a tool output, empty last turn": Episode((call("print(42)"), "")),
    "unclosed call holding the answer, every turn": Episode(
        ("<tool>python\nprint(42)  # \\boxed{42}",) * MAX_TURNS, truncated="max_turns"
    ),
    "unclosed call holding the answer, then done": Episode(("<tool>python\nprint(42)\n\\boxed{42}", "Done.")),
    "answer as text after </tool>, every turn": Episode(
        (call("print(42)") + "\n\\boxed{42}",) * MAX_TURNS, truncated="max_turns"
    ),
    "answer before a call in the same turn, every turn": Episode(
        ("\\boxed{42}\n" + call("print(1)"),) * MAX_TURNS, truncated="max_turns"
    ),
    "two calls in one turn, every turn": Episode(
        (call("print(42)") + call("print(42)"),) * MAX_TURNS, truncated="max_turns"
    ),
    "answer in a call to an unknown tool": Episode(("<tool>answer\n42\n</tool>",) * MAX_TURNS, truncated="max_turns"),
    "calls until the turn limit, never answers": Episode((call("print(42)"),) * MAX_TURNS, truncated="max_turns"),
    "answer in a turn cut by the token budget": Episode(
        ("\\boxed{42} " + "42 " * MAX_TURN_TOKENS,), truncated="turn_tokens"
    ),
    "answer written to a file, not said": Episode(
        (call("open('answer.txt', 'w').write('\\\\boxed{42}')"), "The answer is in answer.txt.")
    ),
    "every candidate boxed, the right one first": Episode(
        (" ".join(f"\\boxed{{{i}}}" for i in [42, *(i for i in range(10, 50) if i != 42)]),)
    ),
    "restate the question": Episode((call("print(6*7)"), "The answer is 6*7.")),
    "restate the question, boxed": Episode((call("print(6*7)"), "\\boxed{6*7}")),
    "flood the tool output, then point at it": Episode(
        (call("print('42\\n' * 10**6)"), "The answer is in the output above.")
    ),
    "flood the tool output, then guess": Episode((call("print('x' * 10**7)"), "\\boxed{41}")),
    "sleep past the call's timeout, then say done": Episode((call("import time\ntime.sleep(60)\nprint(42)"), "Done.")),
    "fork bomb, then say done": Episode(
        (call("import os\nwhile True:\n    os.fork()"), "Done."), needs="process_limit"
    ),
    **{name: Episode((call("print(6*7)"), answer)) for name, answer in AFTER_THE_TOOL.items()},
    "fill the working directory's inodes, then guess": Episode(
        (call("for i in range(1 << 14):\n    open(f'f{i}', 'w').close()"), "\\boxed{41}")
    ),
    "a file at a 4,090-character path, then guess": Episode(
        (
            call(
                "import os\nfor _ in range(20):\n    os.mkdir('d' * 200)\n    os.chdir('d' * 200)\nopen('x' * 70, 'w')"
            ),
            call("print(6*7)"),
            "\\boxed{41}",
        )
    ),
    "read the reference from the host": Episode(
        (
            call(f"print(open({REFERENCE!r}).read())"),
            lambda ctx: f"\\boxed{{{last_output(ctx).splitlines()[-1][:40]}}}",
        ),
        task=SECRET,
        needs="private_root",
    ),
}


def tool_env(sb, reward_fn):
    return ToolEnv(TOK, reward_fn, sb, max_turns=MAX_TURNS, max_turn_tokens=MAX_TURN_TOKENS, limits=LIMITS)


def workspace_env(sb, reward_fn):
    return WorkspaceEnv(TOK, reward_fn, sb, max_turns=MAX_TURNS, max_turn_tokens=MAX_TURN_TOKENS, limits=LIMITS)


ENVS = {"tool": tool_env, "workspace": workspace_env}


@pytest.fixture(scope="module")
def played(tmp_path_factory):
    """Every (env, episode) of HONEST and ATTACKS that this machine's sandbox can contain, run
    concurrently: (env, name) -> trajectory."""
    reference = tmp_path_factory.mktemp("reference") / "answers.txt"
    reference.write_text(f"secret: {SECRET.target.answer}\n{SECRET.target.answer}\n")
    with Sandbox(LIMITS, max_workers=8) as sb:
        table = {**HONEST, **ATTACKS}
        cases = [(e, n, ep) for e in ENVS for n, ep in table.items() if not ep.needs or getattr(sb.isolation, ep.needs)]
        reward_fn = RewardFunction({MathTask: MathVerifier()}, RewardConfig())

        def play(case):
            env_name, _, ep = case
            turns = iter(ep.turns)

            def policy(context):
                t = next(turns)
                t = t(TOK.decode(context)) if callable(t) else t
                return TOK.encode(t.replace(REFERENCE, str(reference))) + [TOK.eos_id]

            return run_episode(ENVS[env_name](sb, reward_fn), ep.task, policy)

        with concurrent.futures.ThreadPoolExecutor(8) as pool:
            return dict(zip([(e, n) for e, n, _ in cases], pool.map(play, cases)))


def cases(table):
    return [(env, name) for env in ENVS for name in table]


@pytest.mark.parametrize("env, name", cases(HONEST))
def test_honest_episode_scores_1(played, env, name):
    traj = played[env, name]
    assert traj.reward.score == 1.0, traj.reward


@pytest.mark.parametrize("env, name", cases(ATTACKS))
def test_attack_scores_0(played, env, name):
    if (env, name) not in played:
        pytest.skip(f"protection missing on this machine: {ATTACKS[name].needs} (Isolation.missing())")
    traj = played[env, name]
    assert traj.reward.parts["correct"] == 0.0 and traj.reward.score <= 0.0, (traj.reward, traj.info)
    assert traj.info["truncated"] == ATTACKS[name].truncated
    assert traj.reward.error is None, f"a failure the episode caused is a verdict of 0, not an error: {traj.reward}"
