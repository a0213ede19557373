"""Verifiable visual tasks: bar charts, tables and shape scenes with exact answers, held out by meaning.

A problem is a scene (the data an image shows) and a question about it:
- `bar_value` "What is the value of bar C?" (an integer) and `bar_max` "Which bar is the tallest?"
  (a label) on a bar chart: labelled bars of integer heights on a unit grid;
- `table_cell` "What is the value in row B, column Y?" (a digit) and `table_max` "Which row has the
  largest value in column X?" (a label) on a table of digits;
- `shape_count` "How many red shapes are there?" / "... circles ..." / "... blue squares ..." (an
  integer) on a scene of coloured circles, squares and triangles;
- `colour_count` "How many green shapes are there?" (0-3, each count equally likely) on a `marks`
  scene: shapes on a 3 x 3 grid whose cells are whole 2 x 2 blocks of 8-pixel patches at 48 pixels,
  0-3 of each colour — the easiest kind for a tiny model (a count of one colour, no glyph to read).
Integer answers are checked by the math verifier, labels by the label verifier (`verifiers/label.py`).
The image alone carries the answer: the question names no value. Images are small (`SIZES`, per
scene kind, configurable) and drawn by `visual_render.render`, deterministic from the seed.

Held out by meaning: a problem's split is a hash of its scene's canonical form (`scene_key`), which
drops what no question depends on (the order of bars or rows, where shapes stand), so the same chart
with its bars in another order, the same table with its rows shuffled, or the same shapes drawn
elsewhere are in one split, and no held-out image's data is ever shown in training, whatever is asked.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np

from posttrain.data.synthetic import SPLITS

KINDS = ("bar_value", "bar_max", "table_cell", "table_max", "shape_count", "colour_count")
SCENE_OF = {"bar_value": "chart", "bar_max": "chart", "table_cell": "table", "table_max": "table"}
SCENE_OF.update(shape_count="shapes", colour_count="marks")
LABEL_KINDS = ("bar_max", "table_max")  # answers that are labels (the rest are integers)
SIZES = {"chart": 48, "table": 48, "shapes": 48, "marks": 48}  # image side in pixels
LABELS = "ABCDEF"
COLUMNS = ("X", "Y")
SHAPES = ("circle", "square", "triangle")
SHAPE_COLOURS = ("red", "green", "blue")
MARKS_GRID, MARKS_MAX = 3, 3  # a marks scene: a 3 x 3 grid, 0-3 shapes of each colour
TEST_PERCENT = 15
INSTRUCTION = " Give the final answer as \\boxed{ANSWER}."


@dataclasses.dataclass(frozen=True)
class Scene:
    """What an image shows. chart: `items` = ((label, value), ...) left to right; table: `items` =
    ((row label, (X, Y)), ...) top to bottom; shapes and marks: `items` = ((shape, colour, cell),
    ...), cell an index into a `grid` x `grid` grid. `size`: the image side in pixels."""

    kind: str
    items: tuple
    size: int
    grid: int = 0
    max_value: int = 0


@dataclasses.dataclass(frozen=True)
class VisualProblem:
    """A question about a scene: `answer` the exact answer; `choices` the labels it is one of
    (label questions) or None (integer answers)."""

    kind: str
    scene: Scene
    question: str
    answer: str
    choices: tuple[str, ...] | None = None


def scene_key(scene: Scene) -> str:
    """The canonical form of a scene: its data without what no question depends on (bar and row
    order, shape positions, image size), the same for every rendering of the same data."""
    if scene.kind == "chart":
        body = ",".join(f"{label}={value}" for label, value in sorted(scene.items))
    elif scene.kind == "table":
        body = ";".join(f"{row}:" + ",".join(map(str, values)) for row, values in sorted(scene.items))
    elif scene.kind in ("shapes", "marks"):
        body = ",".join(sorted(f"{colour} {shape}" for shape, colour, _ in scene.items))
    else:
        raise ValueError(f"scene kind {scene.kind!r}: expected chart, table, shapes or marks")
    return f"{scene.kind}|{body}"


def problem_key(problem: VisualProblem) -> str:
    """The canonical form of a problem: its scene's key and the question (distinct problems)."""
    return f"{scene_key(problem.scene)}|{problem.kind}|{problem.question}"


def visual_split(scene: Scene) -> str:
    """ "test" for a fixed `TEST_PERCENT` of scenes (a hash of `scene_key`), else "train"."""
    bucket = int.from_bytes(hashlib.sha256(scene_key(scene).encode()).digest()[:8], "little") % 100
    return "test" if bucket < TEST_PERCENT else "train"


def _chart(rng: np.random.Generator, size: int, max_value: int) -> Scene:
    n = int(rng.integers(3, 6))
    labels = sorted(rng.choice(list(LABELS), n, replace=False).tolist())
    rng.shuffle(labels)
    while True:  # one tallest bar, so "which is the tallest" has one answer
        values = rng.integers(1, max_value + 1, n).tolist()
        if values.count(max(values)) == 1:
            return Scene("chart", tuple(zip(labels, values)), size, max_value=max_value)


def _table(rng: np.random.Generator, size: int) -> Scene:
    n = int(rng.integers(3, 5))
    rows = list(LABELS[:n])
    rng.shuffle(rows)
    while True:  # one largest value per column
        values = rng.integers(0, 10, (n, len(COLUMNS)))
        if all((values[:, j] == values[:, j].max()).sum() == 1 for j in range(len(COLUMNS))):
            items = tuple((r, tuple(int(v) for v in vs)) for r, vs in zip(rows, values))
            return Scene("table", items, size, max_value=9)


def _shapes(rng: np.random.Generator, size: int, grid: int) -> Scene:
    n = int(rng.integers(1, min(7, grid * grid) + 1))
    cells = rng.choice(grid * grid, n, replace=False).tolist()
    items = tuple(
        (SHAPES[int(rng.integers(len(SHAPES)))], SHAPE_COLOURS[int(rng.integers(len(SHAPE_COLOURS)))], int(c))
        for c in cells
    )
    return Scene("shapes", items, size, grid=grid)


def _marks(rng: np.random.Generator, size: int) -> Scene:
    """0-`MARKS_MAX` shapes of each colour (independent, uniform), in random cells of the grid."""
    colours = [c for c in SHAPE_COLOURS for _ in range(int(rng.integers(MARKS_MAX + 1)))]
    cells = rng.choice(MARKS_GRID * MARKS_GRID, len(colours), replace=False).tolist()
    items = tuple((SHAPES[int(rng.integers(len(SHAPES)))], c, int(cell)) for c, cell in zip(colours, cells))
    return Scene("marks", items, size, grid=MARKS_GRID)


def draw_scene(rng: np.random.Generator, kind: str, sizes: dict[str, int], max_value: int = 8) -> Scene:
    """A random scene of `kind` ("chart", "table", "shapes" or "marks") at its size in `sizes`."""
    size = sizes[kind]
    if kind == "chart":
        return _chart(rng, size, max_value)
    if kind == "table":
        return _table(rng, size)
    if kind == "marks":
        return _marks(rng, size)
    return _shapes(rng, size, grid=max(2, size // 12))


def ask(rng: np.random.Generator, kind: str, scene: Scene) -> VisualProblem:
    """A question of `kind` about `scene`, with its exact answer computed from the scene's data."""
    if kind == "bar_value":
        label, value = scene.items[int(rng.integers(len(scene.items)))]
        return VisualProblem(kind, scene, f"What is the value of bar {label}?", str(value))
    if kind == "bar_max":
        labels = tuple(sorted(label for label, _ in scene.items))
        best = max(scene.items, key=lambda it: it[1])[0]
        return VisualProblem(kind, scene, "Which bar is the tallest?", best, labels)
    if kind == "table_cell":
        row, values = scene.items[int(rng.integers(len(scene.items)))]
        j = int(rng.integers(len(COLUMNS)))
        return VisualProblem(kind, scene, f"What is the value in row {row}, column {COLUMNS[j]}?", str(values[j]))
    if kind == "table_max":
        j = int(rng.integers(len(COLUMNS)))
        labels = tuple(sorted(row for row, _ in scene.items))
        best = max(scene.items, key=lambda it: it[1][j])[0]
        question = f"Which row has the largest value in column {COLUMNS[j]}?"
        return VisualProblem(kind, scene, question, best, labels)
    if kind == "shape_count":
        shape, colour = SHAPES[int(rng.integers(len(SHAPES)))], SHAPE_COLOURS[int(rng.integers(len(SHAPE_COLOURS)))]
        by = int(rng.integers(3))  # by colour, by shape, by both
        match = [(by == 1 or c == colour) and (by == 0 or s == shape) for s, c, _ in scene.items]
        what = (f"{colour} shapes", f"{shape}s", f"{colour} {shape}s")[by]
        return VisualProblem(kind, scene, f"How many {what} are there?", str(sum(match)))
    if kind == "colour_count":
        colour = SHAPE_COLOURS[int(rng.integers(len(SHAPE_COLOURS)))]
        count = sum(c == colour for _, c, _ in scene.items)
        return VisualProblem(kind, scene, f"How many {colour} shapes are there?", str(count))
    raise ValueError(f"visual task kind {kind!r}: expected one of {KINDS}")


def visual_problems(
    n: int,
    seed: int,
    split: str,
    *,
    kinds: tuple[str, ...] = KINDS,
    sizes: dict[str, int] | None = None,
    max_value: int = 8,
) -> list[VisualProblem]:
    """`n` problems of `split` ("train" or "test"), kinds in turn, deterministic from `seed` and the
    split. A scene of the other split is drawn again (rejection), so every scene is in its own split
    (`visual_split`); held-out problems are distinct by meaning (`problem_key`)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    if bad := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"visual task kinds {bad}: expected some of {KINDS}")
    sizes = {**SIZES, **(sizes or {})}
    rng = np.random.default_rng([seed, SPLITS.index(split)])
    out: list[VisualProblem] = []
    seen: set[str] = set()
    for i in range(n):
        kind = kinds[i % len(kinds)]
        for _ in range(10_000):
            scene = draw_scene(rng, SCENE_OF[kind], sizes, max_value)
            if visual_split(scene) != split:
                continue
            problem = ask(rng, kind, scene)
            if split == "test" and problem_key(problem) in seen:
                continue
            seen.add(problem_key(problem))
            out.append(problem)
            break
        else:
            raise ValueError(f"could not draw {n} distinct {split} problems of kind {kind!r}: ask for fewer")
    return out


def user_message(image: str, question: str, instruction: str = INSTRUCTION) -> dict:
    """The user turn of a visual problem in the chat-message convention: the image, then the question."""
    return {
        "role": "user",
        "content": [{"type": "image", "image": image}, {"type": "text", "text": question + instruction}],
    }


def sft_record(problem: VisualProblem, image: str, instruction: str = INSTRUCTION) -> dict:
    """An SFT record: the user turn (`image` is the path written into the record) and the answer."""
    return {
        "messages": [
            user_message(image, problem.question, instruction),
            {"role": "assistant", "content": f"\\boxed{{{problem.answer}}}"},
        ]
    }


def task_record(problem: VisualProblem, image: str, task_id: str, instruction: str = INSTRUCTION) -> dict:
    """An `rl.train_files` / `rl.eval_files` record: integers for the math verifier, labels for the
    label verifier (with their choices); domain `visual_<scene>`, difficulty the question kind."""
    record = {
        "prompt": [user_message(image, problem.question, instruction)],
        "answer": problem.answer,
        "domain": f"visual_{problem.scene.kind}",
        "id": task_id,
        "difficulty": problem.kind,
    }
    if problem.choices is not None:
        record.update(verifier="label", choices=list(problem.choices))
    return record
