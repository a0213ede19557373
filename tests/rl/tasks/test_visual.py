"""Verifiable visual tasks (issue 29 item 4): every answer is read back from the rendered pixels,
the files are deterministic, and held-out problems are disjoint from training ones by meaning (the
same data in another order or place is in one split). Pure Python: Pillow and numpy."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from posttrain.rl.envs.base import Task
from posttrain.rl.envs.draw import _GLYPHS, COLOURS, GLYPH_H, GLYPH_W
from posttrain.rl.tasks import files as task_files
from posttrain.rl.tasks.visual import (
    COLUMNS,
    KINDS,
    SCENE_OF,
    Scene,
    draw_scene,
    scene_key,
    visual_problems,
    visual_split,
)
from posttrain.rl.tasks.visual_render import table_layout
from posttrain.rl.verifiers.label import LabelTask, LabelVerifier
from posttrain.rl.verifiers.math import MathTask
from tests.support.paths import ROOT

sys.path.insert(0, str(ROOT / "tools"))
from visual_tasks import write_visual_tasks  # noqa: E402

FONT = {tuple(rows): ch for ch, rows in _GLYPHS.items() if ch != " "}
assert len(FONT) == len(_GLYPHS) - 1  # every glyph its own pixels: text reads back unambiguously


# ---- reading a scene back from its pixels (independent of the generator's data) ----


def _ink(a: np.ndarray) -> np.ndarray:
    return a.sum(-1) < 150  # black text (not the light grid, not the coloured bars)


def read_text(a: np.ndarray, box: tuple[int, int, int, int]) -> str:
    """The characters drawn in `box` (x0, y0, x1, y1), at the scale their height shows."""
    x0, y0, x1, y1 = box
    ys, xs = np.nonzero(_ink(a[y0:y1, x0:x1]))
    if not len(xs):
        return ""
    top, left, scale = ys.min() + y0, xs.min() + x0, (ys.max() - ys.min() + 1) // GLYPH_H
    out, x = "", left
    while x <= xs.max() + x0:
        rows = tuple(
            "".join(
                "#" if _ink(a[top + r * scale : top + r * scale + 1, x + c * scale : x + c * scale + 1])[0, 0] else "."
                for c in range(GLYPH_W)
            )
            for r in range(GLYPH_H)
        )
        out += FONT[rows]
        x += (GLYPH_W + 1) * scale
    return out


def read_chart(a: np.ndarray) -> dict[str, int]:
    """label -> value: bars are blue runs above the black baseline; units from the grid lines."""
    baseline = next(y for y in range(a.shape[0]) if (a[y, 0] == 0).all())
    grid = [y for y in range(baseline) if (a[y, 0] == 220).all()]
    unit = baseline - grid[-1]
    bar = (a[baseline - 1, :, 2] > 150) & (a[baseline - 1, :, 0] < 100)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], bar.astype(int), [0]])))
    out = {}
    for x0, x1 in zip(edges[::2], edges[1::2]):
        height = int((a[:baseline, (x0 + x1) // 2, 0] < 100).sum())
        assert height % unit == 0
        out[read_text(a, (x0 - 1, baseline + 1, x1 + 1, a.shape[0]))] = height // unit
    return out


def read_table(a: np.ndarray, scene: Scene) -> dict[str, tuple[int, ...]]:
    """row label -> values, reading each cell of the grid (`table_layout` gives only the geometry)."""
    row_h, col_w, _ = table_layout(scene)
    cell = lambda r, c: read_text(a, (c * col_w, r * row_h, (c + 1) * col_w, (r + 1) * row_h))  # noqa: E731
    header = tuple(cell(0, c) for c in range(1, len(COLUMNS) + 1))
    assert header == COLUMNS
    return {
        cell(r, 0): tuple(int(cell(r, c)) for c in range(1, 3)) for r in range(1, a.shape[0] // row_h) if cell(r, 0)
    }


def read_shapes(a: np.ndarray) -> list[tuple[str, str]]:
    """(shape, colour) of each blob: colour by nearest, shape by how much of its box it fills."""
    from scipy import ndimage

    out = []
    for colour, rgb in COLOURS.items():
        mask = np.abs(a.astype(int) - rgb).sum(-1) < 60
        labels, n = ndimage.label(mask)
        for i in range(1, n + 1):
            ys, xs = np.nonzero(labels == i)
            fill = len(xs) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
            out.append(("square" if fill > 0.95 else "circle" if fill > 0.7 else "triangle", colour))
    return out


def answer_from_pixels(image: np.ndarray, question: str, scene: Scene) -> str:
    """The answer to `question`, computed from what the image shows."""
    if m := re.match(r"What is the value of bar (\w)\?", question):
        return str(read_chart(image)[m.group(1)])
    if question.startswith("Which bar is the tallest?"):
        chart = read_chart(image)
        return max(chart, key=chart.get)
    table = read_table(image, scene) if scene.kind == "table" else None
    if m := re.match(r"What is the value in row (\w), column (\w)\?", question):
        return str(table[m.group(1)][COLUMNS.index(m.group(2))])
    if m := re.match(r"Which row has the largest value in column (\w)\?", question):
        return max(table, key=lambda r: table[r][COLUMNS.index(m.group(1))])
    m = re.match(r"How many (?:(red|green|blue) )?(shape|circle|square|triangle)s are there\?", question)
    return str(sum((m.group(1) in (None, c)) and (m.group(2) in ("shape", s)) for s, c in read_shapes(image)))


# ---- the tests ----


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("visual")
    counts = write_visual_tasks(str(out), 60, 40, seed=3)
    return out, counts


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_every_answer_is_read_back_from_the_rendered_image(written):
    """The answer of each record (SFT and RL, train and held out) equals what a reader of the
    pixels computes; the RL records' verifiers score that answer 1 and a wrong one 0."""
    out, _ = written
    checked = 0
    for name in ("rl_train.jsonl", "rl_eval.jsonl"):
        for rec in _records(out / name):
            parts = rec["prompt"][0]["content"]
            image = np.asarray(Image.open(out / parts[0]["image"]).convert("RGB"))
            question = parts[1]["text"].split(" Give the final")[0]
            kind = rec["domain"].removeprefix("visual_")
            scene = _table_scene(image) if kind == "table" else Scene(kind, (), image.shape[0])
            assert answer_from_pixels(image, question, scene) == rec["answer"], (name, rec["id"], question)
            if "choices" in rec:
                task = LabelTask(rec["answer"], tuple(rec["choices"]))
                assert LabelVerifier().verify(task, f"\\boxed{{{rec['answer']}}}").correct == 1.0
                wrong = next(c for c in rec["choices"] if c != rec["answer"])
                assert LabelVerifier().verify(task, f"\\boxed{{{wrong}}}").correct == 0.0
            checked += 1
    assert checked == 100
    for rec in _records(out / "sft_train.jsonl"):
        user, reply = rec["messages"]
        image = np.asarray(Image.open(out / user["content"][0]["image"]).convert("RGB"))
        question = user["content"][1]["text"].split(" Give the final")[0]
        kind = "chart" if "bar" in question else "table" if "row" in question else "shapes"
        scene = _table_scene(image) if kind == "table" else Scene(kind, (), image.shape[0])
        assert reply["content"] == f"\\boxed{{{answer_from_pixels(image, question, scene)}}}"


def _table_scene(image: np.ndarray) -> Scene:
    """A table's geometry from its pixels: the light rule lines give the row count."""
    rules = [y for y in range(image.shape[0]) if (image[y, 0] == 220).all()]
    return Scene("table", ((None, None),) * len(rules), image.shape[0])


def test_the_same_arguments_write_the_same_bytes(written, tmp_path):
    out, counts = written
    again = tmp_path / "again"
    assert write_visual_tasks(str(again), 60, 40, seed=3) == counts
    files = lambda d: {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}  # noqa: E731
    assert files(again) == files(out)
    other = tmp_path / "other"
    write_visual_tasks(str(other), 60, 40, seed=4)
    assert (other / "rl_train.jsonl").read_bytes() != (out / "rl_train.jsonl").read_bytes()


def _equivalent_forms(scene: Scene, rng: np.random.Generator) -> list[Scene]:
    """The same data shown otherwise: bars or rows in other orders, shapes in other cells, other sizes."""
    forms = [Scene(scene.kind, scene.items, scene.size + 16, scene.grid, scene.max_value)]
    for _ in range(3):
        if scene.kind in ("shapes", "marks"):
            cells = rng.choice(scene.grid * scene.grid, len(scene.items), replace=False)
            items = tuple((s, c, int(cell)) for (s, c, _), cell in zip(scene.items, cells))
        else:
            items = tuple(scene.items[i] for i in rng.permutation(len(scene.items)))
        forms.append(Scene(scene.kind, items, scene.size, scene.grid, scene.max_value))
    return forms


def test_every_form_of_a_scene_is_in_one_split():
    """Reordered bars and rows, moved shapes and resized images keep their scene's split. With a
    key that kept the order (or the positions), about half of these scenes would straddle."""
    rng = np.random.default_rng(0)
    test = 0
    for i in range(1500):
        kind = ("chart", "table", "shapes", "marks")[i % 4]
        scene = draw_scene(rng, kind, {"chart": 48, "table": 48, "shapes": 48, "marks": 48})
        forms = _equivalent_forms(scene, rng)
        assert {scene_key(f) for f in forms} == {scene_key(scene)}
        assert {visual_split(f) for f in forms} == {visual_split(scene)}
        test += visual_split(scene) == "test"
    assert 150 < test < 310  # about 15% held out


def test_colour_counts_are_balanced_and_each_shape_fills_whole_patches():
    """colour_count (the kind a tiny model learns): answers 0-3 about equally often, so the
    commonest answer, what an image-blind policy can do best, scores about a quarter; each shape
    is drawn inside its own 16-pixel cell, a 2 x 2 block of 8-pixel patches, never straddling two
    cells' patches."""
    from collections import Counter

    from posttrain.rl.tasks.visual_render import render

    problems = visual_problems(800, 0, "train", kinds=("colour_count",))
    counts = Counter(p.answer for p in problems)
    assert set(counts) == {"0", "1", "2", "3"} and max(counts.values()) < 0.3 * len(problems)
    for p in problems[:50]:
        a = np.asarray(render(p.scene)).astype(int)
        ink = (a != 255).any(-1)
        for _, colour, cell in p.scene.items:
            r, c = divmod(cell, 3)
            box = ink[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16]
            assert box[2:14, 2:14].any() and not box[:2].any() and not box[14:].any()
            assert (np.abs(a[r * 16 : (r + 1) * 16, c * 16 : (c + 1) * 16] - COLOURS[colour]).sum(-1) < 60).any()
        assert ink.sum() == sum(
            ink[(cell // 3) * 16 : (cell // 3 + 1) * 16, (cell % 3) * 16 : (cell % 3 + 1) * 16].sum()
            for _, _, cell in p.scene.items
        )


def test_held_out_scenes_are_never_shown_in_training():
    """By meaning: no held-out scene's canonical form (read back from its data) is a training
    scene's, for the SFT and the RL draws alike; held-out problems are distinct."""
    train = visual_problems(600, 0, "train") + visual_problems(600, 1, "train")
    held_out = visual_problems(200, 0, "test")
    assert {visual_split(p.scene) for p in train} == {"train"}
    assert {visual_split(p.scene) for p in held_out} == {"test"}
    assert not {scene_key(p.scene) for p in train} & {scene_key(p.scene) for p in held_out}
    keys = [(scene_key(p.scene), p.question) for p in held_out]
    assert len(keys) == len(set(keys))
    assert [p.kind for p in held_out[: len(KINDS)]] == list(KINDS)


def test_records_have_relative_image_paths_that_exist(written):
    """Every record parses as JSON, in the chat-message convention, its images relative to the
    file's folder and there; label answers carry their choices and name the label verifier."""
    out, counts = written
    assert counts == {
        "sft_train.jsonl": 60,
        "sft_eval.jsonl": 40,
        "rl_train.jsonl": 60,
        "rl_eval.jsonl": 40,
        "rl_eval_blank.jsonl": 40,
    }
    for name in counts:
        for rec in _records(out / name):
            messages = rec["messages"] if name.startswith("sft") else rec["prompt"]
            image, text = messages[0]["content"]
            assert messages[0]["role"] == "user" and image["type"] == "image" and text["type"] == "text"
            path = image["image"]
            assert not os.path.isabs(path) and ".." not in path and (out / path).is_file(), path
            if name.startswith("rl"):
                assert rec["domain"] in {f"visual_{s}" for s in SCENE_OF.values()}
                assert ("verifier" in rec) == (rec["difficulty"] in ("bar_max", "table_max")) == ("choices" in rec)
    blank = {r["prompt"][0]["content"][0]["image"] for r in _records(out / "rl_eval_blank.jsonl")}
    assert len(blank) == 1 and not np.asarray(Image.open(out / blank.pop())).min() < 255


def test_task_files_resolve_images_and_key_them_by_content(tmp_path):
    """rl.train_files readers: relative image paths are joined to the file's folder, a missing one
    is a record error, and the overlap key tells images apart by their bytes, not their names."""
    (tmp_path / "a.png").write_bytes(b"one")
    (tmp_path / "b.png").write_bytes(b"two")
    (tmp_path / "c.png").write_bytes(b"one")

    def prompt(name):
        return [{"role": "user", "content": [{"type": "image", "image": name}, {"type": "text", "text": "Which?"}]}]

    resolved = task_files.resolve_images(prompt("a.png"), str(tmp_path))
    assert resolved[0]["content"][0]["image"] == str(tmp_path / "a.png")
    with pytest.raises(task_files.RecordError, match="missing.png"):
        task_files.resolve_images(prompt("missing.png"), str(tmp_path))
    key = lambda n: task_files.normalise_prompt(
        Task("t", tuple(task_files.resolve_images(prompt(n), str(tmp_path))), None)
    )  # noqa: E731
    assert key("a.png") == key("c.png") != key("b.png")


def test_label_records_name_the_label_verifier():
    record = {"prompt": "Which bar is the tallest?", "answer": "B", "choices": ["A", "B"], "verifier": "label"}
    _, task = task_files.record_task(record, "f.jsonl:1", ())
    assert task.target == LabelTask("B", ("A", "B"))
    _, numeric = task_files.record_task({"prompt": "Value of bar A?", "answer": "7"}, "f.jsonl:2", ())
    assert numeric.target == MathTask("7")
    with pytest.raises(task_files.RecordError, match="choices"):
        task_files.record_task({**record, "choices": "AB"}, "f.jsonl:3", ())


def test_a_visual_task_scores_in_a_single_turn_env(written):
    """An rl_eval record as a task (images resolved) in a SingleTurnEnv with image tokens: the
    right label scores 1, a choice echo 0; the env lists the image its tokens stand for."""
    from posttrain.data.tokenizer import ByteTokenizer
    from posttrain.rl.envs import SingleTurnEnv, run_episode
    from posttrain.rl.reward import RewardFunction

    class PatchTokenizer(ByteTokenizer):
        def encode_chat(self, messages, **kw):
            text = lambda c: (
                c if isinstance(c, str) else "".join("\0" * p.get("num_patches", 0) or p.get("text", "") for p in c)
            )  # noqa: E731
            return super().encode_chat([{**m, "content": text(m["content"])} for m in messages], **kw)

    out, _ = written
    rec = next(r for r in _records(out / "rl_eval.jsonl") if "choices" in r)
    prompt = tuple(task_files.resolve_images(rec["prompt"], str(out)))
    task = Task(rec["id"], prompt, LabelTask(rec["answer"], tuple(rec["choices"])))
    tok = PatchTokenizer()
    reward_fn = RewardFunction({LabelTask: LabelVerifier()})
    for reply, want in ((f"\\boxed{{{rec['answer']}}}", 1.0), (f"\\boxed{{{', '.join(rec['choices'])}}}", 0.0)):
        env = SingleTurnEnv(
            tok, reward_fn, max_turn_tokens=64, image_part=lambda p: {"type": "image", "num_patches": 9}
        )
        traj = run_episode(env, task, lambda context: tok.encode(reply) + [tok.eos_id])
        assert traj.reward.correct == want
        assert env.images == [str(out / rec["prompt"][0]["content"][0]["image"])] and traj.tokens.count(7) == 9


def test_written_task_files_read_as_tasks_with_their_images(written):
    """rl.train_files / eval_files with image prompts read as tasks (the data layer's messages
    accept part lists here), each image part resolved to a file that exists, nothing skipped."""
    from posttrain.data.sources import SkipLog

    out, _ = written
    for name in ("rl_train.jsonl", "rl_eval.jsonl", "rl_eval_blank.jsonl"):
        by_domain = task_files.read_task_files(str(out / name), (), SkipLog("raise"))
        tasks = [t for items in by_domain.values() for _, t in items]
        assert len(tasks) == len(_records(out / name)) > 0
        for task in tasks:
            parts = task.prompt[0]["content"]
            assert os.path.isfile(next(p["image"] for p in parts if p["type"] == "image"))


def test_a_sloppy_sft_teacher_counts_one_too_many_and_only_in_sft_training(tmp_path):
    """`sft_error_rate`: that fraction of the SFT training answers that are integers is one more
    than the exact answer (the images and questions stay), labels are never changed, and every
    other file (held-out, RL) is byte for byte the exact one."""
    exact, sloppy = tmp_path / "exact", tmp_path / "sloppy"
    kinds = ("colour_count", "bar_max")
    write_visual_tasks(str(exact), 200, 20, seed=5, kinds=kinds)
    write_visual_tasks(str(sloppy), 200, 20, seed=5, kinds=kinds, sft_error_rate=0.5)
    wrong = 0
    for a, b in zip(_records(exact / "sft_train.jsonl"), _records(sloppy / "sft_train.jsonl")):
        assert a["messages"][0] == b["messages"][0]
        want, got = (m["messages"][1]["content"][len("\\boxed{") : -1] for m in (a, b))
        if not want.isdigit():
            assert got == want
        elif got != want:
            assert int(got) == int(want) + 1
            wrong += 1
    assert 30 < wrong < 70  # about half of the 100 integer answers
    for name in ("sft_eval.jsonl", "rl_train.jsonl", "rl_eval.jsonl", "rl_eval_blank.jsonl"):
        assert (exact / name).read_bytes() == (sloppy / name).read_bytes()
    with pytest.raises(ValueError, match="sft_error_rate"):
        write_visual_tasks(str(tmp_path / "bad"), 2, 2, sft_error_rate=1.5)
