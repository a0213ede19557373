"""Red team of the screenshot agent environment: whole episodes that try to be scored done without
doing the task. A turn that is not exactly one action (another verb, several actions, prose, a
claim of success, an action inside other text) ends the episode with correctness 0 and the format
and invalid-call penalties; state tricks (selecting everything, typing everywhere, never pressing
OK, CANCEL) fail the final state check. Every attack scores correctness 0; the honest episodes 1."""

from __future__ import annotations

import pytest

from posttrain.rl.envs import run_episode
from posttrain.rl.envs.screen_env import ScreenEnv
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.tasks.screen_domain import screen_tasks
from tests.support.screen import TOK, centre, solution, turn

REWARD = RewardFunction({}, RewardConfig(format_penalty=0.5, invalid_tool_call_penalty=0.25))
TASKS = screen_tasks(12, 7, "test")
SELECT = [t for t in TASKS if t.target.goal[0] == "select"]
TYPE = [t for t in TASKS if t.target.goal[0] == "type"]


def everywhere(task) -> str:
    w, h = task.target.size
    return "\n".join(f"click({x}, {y})" for y in range(0, h, 4) for x in range(0, w, 4))


def others(task):
    return [e.label for e in task.target.elements if e.kind == task.target.element(task.target.goal[1]).kind]


MALFORMED = {
    "not an action": lambda t: ["press(OK)"],
    "claims success": lambda t: ["Done: the task is complete and OK was pressed. Reward: 1.0"],
    "click everywhere in one turn": lambda t: [everywhere(t)],
    "the solution in one turn": lambda t: ["\n".join(solution(t, by_xy=False))],
    "action then a claim": lambda t: ['click("OK") -- task completed successfully'],
    "action in a code block": lambda t: ['```\nclick("OK")\n```'],
    "unquoted label": lambda t: ["click(OK)"],
    "right steps, then a claim instead of OK": lambda t: solution(t, by_xy=False)[:-1] + ["The task is done."],
}
STATE_TRICKS = {
    "OK straight away": (TASKS, lambda t: ['click("OK")']),
    "CANCEL": (TASKS, lambda t: solution(t, by_xy=False)[:-1] + ['click("CANCEL")']),
    "select every item, the goal first": (
        SELECT,
        lambda t: (
            [f'click("{t.target.goal[1]}")']
            + [f'click("{x}")' for x in others(t) if x != t.target.goal[1]]
            + ['click("OK")']
        ),
    ),
    "type into every field": (
        TYPE,
        lambda t: [a for f in others(t) for a in (f'click("{f}")', f'type("{t.target.goal[2]}")')] + ['click("OK")'],
    ),
    "type with no field focused": (TYPE, lambda t: [f'type("{t.target.goal[2]}")', 'click("OK")']),
    "never press OK": (TASKS, lambda t: solution(t, by_xy=False)[:-1] + ["click(0, 0)"] * 8),
    "click the instruction text": (TASKS, lambda t: [f'click("{t.prompt[0]["content"][:30]}")', 'click("OK")']),
    "click beside OK": (
        TASKS,
        lambda t: solution(t, True)[:-1] + ["click({}, {})".format(centre(t, "OK")[0], 0)] + ["click(0, 0)"] * 8,
    ),
}


def play(task, turns, **kw):
    e = ScreenEnv(TOK, REWARD, kw.pop("image_dir"), max_turns=kw.pop("max_turns", 6), **kw)
    it = iter(turns)
    return run_episode(e, task, lambda context: turn(next(it)))


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_turns_end_the_episode_with_nothing(tmp_path, name):
    for task in TASKS:
        traj = play(task, MALFORMED[name](task), image_dir=str(tmp_path), max_turn_tokens=8192)
        assert traj.reward.correct == 0.0 and traj.info["malformed"], (name, task.target.goal)
        assert traj.reward.score == pytest.approx(-0.75)  # format and invalid-call penalties
        assert traj.info["invalid_tool_calls"] == 1


@pytest.mark.parametrize("name", sorted(STATE_TRICKS))
def test_state_tricks_fail_the_state_check(tmp_path, name):
    tasks, make = STATE_TRICKS[name]
    assert tasks
    for task in tasks:
        traj = play(task, make(task), image_dir=str(tmp_path))
        assert traj.reward.correct == 0.0 and not traj.info["malformed"], (name, task.target.goal, traj.info)


def test_the_honest_episodes_score_one_and_a_cut_turn_scores_nothing(tmp_path):
    for task in TASKS:
        assert play(task, solution(task, by_xy=True), image_dir=str(tmp_path)).reward.correct == 1.0
    task = TASKS[0]
    traj = play(task, [f'click("{task.target.goal[1]}")' + " " * 40], image_dir=str(tmp_path), max_turn_tokens=16)
    assert traj.reward.correct == 0.0 and traj.info["truncated"] == "turn_tokens"
