"""The screenshot agent environment (issue 29 item 5): rendered screens, strict actions, the state
machine, the final state check, episodes through the env interface, held-out by meaning.
Pure Python (Pillow): a byte tokenizer that writes image parts as text stands in for the data
layer's image tokens."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest
from PIL import Image

from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs import run_episode
from posttrain.rl.envs.screen import (
    SELECTED,
    Action,
    ActionError,
    Element,
    ScreenState,
    ScreenTask,
    apply,
    check,
    parse_action,
    render,
)
from posttrain.rl.envs.screen_env import NEXT, ScreenEnv, demo_messages
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.tasks.screen_domain import screen_key, screen_split, screen_tasks
from tests.support.paths import ROOT
from tests.support.screen import TOK, centre, solution, turn

REWARD = RewardFunction({}, RewardConfig(format_penalty=0.5, invalid_tool_call_penalty=0.25))


def env(tmp_path, **kw) -> ScreenEnv:
    return ScreenEnv(TOK, REWARD, str(tmp_path / "screens"), **kw)


def play(e: ScreenEnv, task, turns: list[str]):
    it = iter(turns)
    return run_episode(e, task, lambda context: turn(next(it)))


@pytest.mark.parametrize("by_xy", [True, False])
def test_honest_episodes_succeed_by_coordinates_and_by_label(tmp_path, by_xy):
    for task in screen_tasks(6, 0, "train"):
        e = env(tmp_path)
        traj = play(e, task, solution(task, by_xy))
        assert traj.reward.correct == 1.0 and traj.reward.score == 1.0, (task.target.goal, traj.info)
        assert traj.turns == len(solution(task, by_xy)) and len(e.images) == traj.turns


@pytest.mark.parametrize("by_xy", [True, False])
def test_demonstrations_are_the_honest_episodes_conversation(tmp_path, by_xy):
    """SFT demonstrations show exactly what the environment shows in an RL episode."""
    for task in screen_tasks(3, 2, "train"):
        e = env(tmp_path)
        play(e, task, solution(task, by_xy))
        assert demo_messages(task, str(tmp_path / "screens"), by_xy=by_xy) == e.messages


def test_a_demonstration_of_given_actions_is_that_episode_and_must_end_it(tmp_path):
    """`demo_messages(actions=...)` (the sloppy teacher's episodes) is the conversation the
    environment shows for those actions; actions that never press OK or CANCEL are refused."""
    task = screen_tasks(1, 2, "train", kinds=("select",))[0]
    actions = [solution(task, False)[-1]]  # OK at once: well-formed, fails the check
    e = env(tmp_path)
    play(e, task, actions)
    assert demo_messages(task, str(tmp_path / "screens"), actions=actions) == e.messages
    with pytest.raises(ValueError, match="never presses OK or CANCEL"):
        demo_messages(task, str(tmp_path / "screens"), actions=solution(task, False)[:-1])


def test_observations_are_user_messages_with_the_next_screen(tmp_path):
    """Each non-final step adds a user message: the next screen as an image part (an absolute path
    to a PNG showing the new state) and NEXT; the first message holds the screen and instruction."""
    task = next(t for t in screen_tasks(3, 0, "train") if t.target.goal[0] == "select")
    e = env(tmp_path)
    ids = e.reset(task)
    first = e.messages[1]
    assert first["role"] == "user" and first["content"][1]["text"] == task.prompt[0]["content"]
    assert TOK.decode(ids).count("<image ") == 1
    step = e.step(turn(f'click("{task.target.goal[1]}")'))
    assert not step.done and step.reward is None
    message = e.messages[-1]
    assert message["role"] == "user" and message["content"][1] == {"type": "text", "text": NEXT}
    path = message["content"][0]["image"]
    assert path == e.images[-1] and path.startswith(str(tmp_path)) and TOK.decode(step.observation).count(path) == 1
    x0, y0, _, _ = task.target.element(task.target.goal[1]).box
    assert Image.open(path).convert("RGB").getpixel((x0 + 1, y0 + 1)) == SELECTED
    assert Image.open(e.images[0]).convert("RGB").getpixel((x0 + 1, y0 + 1)) != SELECTED
    assert e.trajectory().tokens[-len(step.observation) :] == step.observation


class PatchTokenizer(ByteTokenizer):
    """The data layer's contract: an image part `{"type": "image", "num_patches": n}` is n image
    tokens (here byte 0, id 7), text parts are their text."""

    def encode_chat(self, messages, **kw):
        def text(content):
            if isinstance(content, str):
                return content
            return "".join("\0" * p["num_patches"] if p["type"] == "image" else p["text"] for p in content)

        return super().encode_chat([{**m, "content": text(m["content"])} for m in messages], **kw)


def test_image_part_hook_gives_one_run_of_image_tokens_per_screen(tmp_path):
    """With `image_part`, the trajectory holds each screen's image tokens, screens in `images` order."""
    task = next(t for t in screen_tasks(3, 0, "train") if t.target.goal[0] == "type")
    tok = PatchTokenizer()
    e = ScreenEnv(tok, REWARD, str(tmp_path), image_part=lambda part: {"type": "image", "num_patches": 4})
    it = iter(solution(task, by_xy=True))
    traj = run_episode(e, task, lambda context: tok.encode(next(it)) + [tok.eos_id])
    assert traj.reward.correct == 1.0
    runs = "".join("i" if t == 7 else "." for t in traj.tokens).split(".")
    assert [len(r) for r in runs if r] == [4] * len(e.images) and len(e.images) == 3
    assert all(
        isinstance(p["image"], str)
        for m in e.messages
        if isinstance(m["content"], list)
        for p in m["content"]
        if p["type"] == "image"
    )


def test_screens_are_deterministic_files_named_by_content(tmp_path):
    task = screen_tasks(1, 0, "train")[0]
    a, b = env(tmp_path), env(tmp_path)
    play(a, task, solution(task, True))
    play(b, task, solution(task, True))
    assert a.images == b.images and len(set(a.images)) == len(a.images)
    assert a.trajectory().tokens == b.trajectory().tokens


def test_parse_action_is_strict():
    assert parse_action(" click(12, 30)\n") == Action("click", xy=(12, 30))
    assert parse_action('click("OK")') == Action("click", label="OK")
    assert parse_action('type("42")') == Action("type", text="42")
    for bad in ["click(1,2) click(3,4)", "click(1, 2). Done", "press(OK)", "click(OK)", "type(42)", "", "Clicked OK."]:
        with pytest.raises(ActionError):
            parse_action(bad)


def test_state_machine_and_check():
    items = (Element("item", "CAT", (0, 0, 20, 8)), Element("item", "DOG", (0, 9, 20, 17)))
    buttons = (Element("button", "OK", (0, 40, 10, 48)), Element("button", "CANCEL", (12, 40, 40, 48)))
    task = ScreenTask("Select CAT", items + buttons, ("select", "CAT"), (64, 64))
    state = ScreenState()
    assert apply(task, state, Action("click", xy=(50, 20))) == "clicked nothing"
    assert apply(task, state, Action("type", text="x")).endswith("nothing happened")
    apply(task, state, Action("click", label="cat"))
    apply(task, state, Action("click", xy=(5, 12)))
    assert state.selected == "DOG"
    apply(task, state, Action("click", label="OK"))
    assert check(task, state) == (False, "selected 'DOG', wanted 'CAT'")
    with pytest.raises(RuntimeError):
        apply(task, state, Action("click", label="CAT"))
    with pytest.raises(ValueError, match="OK and CANCEL"):
        ScreenTask("x", items, ("select", "CAT"), (64, 64))
    with pytest.raises(ValueError, match="needs a field"):
        ScreenTask("x", items + buttons, ("type", "CAT", "a"), (64, 64))


def test_render_shows_typed_text_and_focus():
    task = next(t for t in screen_tasks(3, 1, "train") if t.target.goal[0] == "type").target
    state = ScreenState()
    field = task.element(task.goal[1])
    before = np.asarray(render(task, state))
    apply(task, state, Action("click", label=field.label))
    apply(task, state, Action("type", text=task.goal[2]))
    after = np.asarray(render(task, state))
    x0, y0, x1, y1 = field.box
    assert (after[y0, x0 + 1] == SELECTED).all() and not (before[y0, x0 + 1] == SELECTED).all()
    inside = lambda a: (a[y0 + 2 : y1 - 1, x0 + 2 : x1 - 1].sum(-1) == 0).sum()  # noqa: E731
    assert inside(before) == 0 < inside(after)


def test_screen_tasks_are_held_out_by_meaning():
    """The same task laid out otherwise is in one split; held-out meanings never train."""
    train, test = screen_tasks(300, 0, "train"), screen_tasks(45, 0, "test")
    assert not {screen_key(t.target) for t in train} & {screen_key(t.target) for t in test}
    assert len({screen_key(t.target) for t in test}) == 45
    for seed in range(3):  # other layouts of the same meanings
        for t in screen_tasks(100, seed + 5, "train") + screen_tasks(30, seed + 5, "test"):
            moved = ScreenTask(
                t.target.instruction,
                tuple(
                    Element(e.kind, e.label, (e.box[0], e.box[1] + 1, e.box[2], e.box[3] + 1), e.marked)
                    for e in t.target.elements[::-1]
                ),
                t.target.goal,
                t.target.size,
            )
            assert screen_key(moved) == screen_key(t.target) and screen_split(moved) == screen_split(t.target)


def test_demo_files_have_relative_screens_that_exist(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    from screen_demos import write_screen_demos

    out = tmp_path / "demos"
    assert write_screen_demos(str(out), 6, 3, by="xy") == {"screen_sft_train.jsonl": 6, "screen_sft_eval.jsonl": 3}
    for name in ("screen_sft_train.jsonl", "screen_sft_eval.jsonl"):
        for line in (out / name).read_text().splitlines():
            messages = json.loads(line)["messages"]
            images = [
                p["image"]
                for m in messages
                if isinstance(m["content"], list)
                for p in m["content"]
                if p["type"] == "image"
            ]
            assert images and all(not os.path.isabs(p) and (out / p).is_file() for p in images)
            assert [m["role"] for m in messages][-1] == "assistant" and parse_action(messages[-1]["content"])


def _demo_records(out) -> dict[str, list[list[str]]]:
    """The assistant turns of each demonstration file under `out`."""
    return {
        name: [
            [m["content"] for m in json.loads(line)["messages"] if m["role"] == "assistant"]
            for line in (out / name).read_text().splitlines()
        ]
        for name in ("screen_sft_train.jsonl", "screen_sft_eval.jsonl")
    }


@pytest.mark.parametrize("rate", [0.0, 0.5, 1.0])
def test_demo_error_rate_presses_ok_early_in_that_share_of_training_demos(tmp_path, rate):
    """`--error-rate p`: a share p of the training demonstrations press OK one action too early
    (well-formed, failing the environment's own check); the held-out file stays honest."""
    sys.path.insert(0, str(ROOT / "tools"))
    from screen_demos import write_screen_demos

    out, n = tmp_path / "demos", 40
    write_screen_demos(str(out), n, 6, seed=3, by="named", error_rate=rate)
    records = _demo_records(out)
    for name, split, count in (("screen_sft_train.jsonl", "train", n), ("screen_sft_eval.jsonl", "test", 6)):
        rewards = []
        for task, actions in zip(screen_tasks(count, 3, split), records[name], strict=True):
            traj = play(env(tmp_path), task, actions)
            assert not traj.info["malformed"] and parse_action(actions[-1]) == Action("click", label="OK")
            assert len(actions) == len(solution(task, False)) - (traj.reward.correct < 1)  # one short
            rewards.append(traj.reward.correct)
        wrong = rewards.count(0.0)
        if split == "test" or rate == 0.0:
            assert wrong == 0, (name, rewards)
        elif rate == 1.0:
            assert wrong == count
        else:
            assert 0.3 * count <= wrong <= 0.7 * count, wrong
    with pytest.raises(ValueError, match="error_rate"):
        write_screen_demos(str(out), 2, 1, error_rate=1.5)


def test_demo_error_kinds_make_only_those_kinds_sloppy(tmp_path):
    """`--error-kinds select,type`: every training demonstration of those kinds presses OK early at
    rate 1, every `marked` one stays honest (the command line's check of the names, too)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from screen_demos import main, write_screen_demos

    out, n = tmp_path / "demos", 12
    write_screen_demos(str(out), n, 3, seed=3, by="named", error_rate=1.0, error_kinds=("select", "type"))
    tasks = screen_tasks(n, 3, "train")
    solved = {t.difficulty: [] for t in tasks}
    for task, actions in zip(tasks, _demo_records(out)["screen_sft_train.jsonl"], strict=True):
        solved[task.difficulty].append(play(env(tmp_path), task, actions).reward.correct)
    assert solved == {"select": [0.0] * 4, "marked": [1.0] * 4, "type": [0.0] * 4}
    with pytest.raises(SystemExit):
        main(["--out", str(out), "--error-kinds", "select,bogus"])


def test_demos_by_named_click_the_marked_item_at_pixels_and_the_rest_by_label(tmp_path):
    """`--by named`: the instruction's named things (select's item, type's field, OK) by label, the
    marked item (only the screen shows it) at its centre."""
    sys.path.insert(0, str(ROOT / "tools"))
    from screen_demos import write_screen_demos

    out = tmp_path / "demos"
    write_screen_demos(str(out), 9, 3, seed=2, by="named")
    for task, actions in zip(screen_tasks(9, 2, "train"), _demo_records(out)["screen_sft_train.jsonl"], strict=True):
        first = parse_action(actions[0])
        if task.difficulty == "marked":
            assert first.xy == centre(task, task.target.goal[1])
        else:
            assert first.label == task.target.goal[1]
        assert all(parse_action(a).xy is None for a in actions[1:])
        assert play(env(tmp_path), task, actions).reward.correct == 1.0


def test_blank_screen_control_shows_white_screens_and_keeps_the_check(tmp_path, monkeypatch):
    """tools/screen_blank.py: every screen of an episode is white, the reward still the state check."""
    sys.path.insert(0, str(ROOT / "tools"))
    import screen_blank

    from posttrain.rl.envs import screen_env

    monkeypatch.setattr(screen_env, "render", screen_env.render)  # restored after the test
    screen_blank.blank_screens()
    shown = set()
    for task in screen_tasks(3, 0, "train"):
        e = env(tmp_path)
        e.reset(task)
        image = np.asarray(Image.open(e.images[0]))
        assert image.shape == (64, 64, 3) and (image == 255).all()
        shown.add(e.images[0])
        assert play(env(tmp_path), task, solution(task, True)).reward.correct == 1.0
        assert play(env(tmp_path), task, ['click("OK")']).reward.correct == 0.0
    assert len(shown) == 1  # one white file for every screen


def test_the_marked_item_is_filled_red_until_it_is_selected():
    """Which item is marked only the screen shows, as a red fill (a mark of a few pixels was too
    faint for the CPU policy to find: BENCHMARKS.md, "Screenshot agent"); the rest stay white."""
    from posttrain.rl.envs.screen import MARK
    from posttrain.rl.tasks.screen_domain import screen_tasks

    task = next(t.target for t in screen_tasks(6, 0, "train") if t.difficulty == "marked")
    marked = next(e for e in task.elements if e.marked)

    def red_share(state, e):
        x0, y0, x1, y1 = e.box
        px = np.asarray(render(task, state))[y0 + 1 : y1, x0 + 1 : x1]
        return (px == MARK).all(-1).mean()

    assert red_share(ScreenState(), marked) > 0.6  # the label's glyphs cover the rest
    assert all(red_share(ScreenState(), e) == 0 for e in task.elements if e is not marked)
    assert red_share(ScreenState(selected=marked.label), marked) == 0  # selected: filled blue
