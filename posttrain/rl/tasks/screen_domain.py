"""Screen tasks for the screenshot agent (`envs/screen_env.py`): random screens with a goal, held out
by meaning.

Kinds: `select` ("Select the item labelled DOG, then press OK."), `marked` ("Select the marked item,
then press OK.": which one is marked only the screen shows) and `type` ("Type 42 into the field
CODE, then press OK."). Layouts vary: the list's items in random order at a random offset, fields
in random order, OK and CANCEL in either order. A task's split is a hash of its meaning
(`screen_key`: kind, goal and the set of labels on the screen; not where anything stands), so the
same task laid out otherwise is in the same split.
"""

from __future__ import annotations

import hashlib

import numpy as np

from posttrain.data.synthetic import SPLITS
from posttrain.rl.envs.base import Task
from posttrain.rl.envs.draw import GLYPH_H, text_width
from posttrain.rl.envs.screen import CANCEL, OK, Element, ScreenTask
from posttrain.rl.tasks.domains import Domain

KINDS = ("select", "marked", "type")
ITEMS = ("CAT", "DOG", "SUN", "CAR", "BOX", "HAT", "CUP", "PEN")
FIELDS = ("NAME", "CITY", "CODE", "MAIL")
TEXTS = ("42", "7", "ABC", "RED", "ZOO", "19", "BOB", "5", "GO", "XY", "100", "JO")
TEST_PERCENT = 15
ROW = GLYPH_H + 5  # an item's or a field's height


def screen_key(task: ScreenTask) -> str:
    """The meaning of a screen task: its goal and the labels on screen (and which item is marked)."""
    labels = sorted(f"{e.kind}:{e.label}" + ("*" if e.marked else "") for e in task.elements)
    return f"{'|'.join(task.goal)}|{','.join(labels)}"


def screen_split(task: ScreenTask) -> str:
    """ "test" for a fixed `TEST_PERCENT` of meanings (a hash of `screen_key`), else "train"."""
    bucket = int.from_bytes(hashlib.sha256(screen_key(task).encode()).digest()[:8], "little") % 100
    return "test" if bucket < TEST_PERCENT else "train"


def _buttons(rng: np.random.Generator, w: int, h: int) -> list[Element]:
    y0 = h - ROW - 1
    labels = [OK, CANCEL] if rng.random() < 0.5 else [CANCEL, OK]
    out, x = [], 1 + int(rng.integers(0, 3))
    for label in labels:
        width = text_width(label) + 6
        out.append(Element("button", label, (x, y0, x + width - 1, y0 + ROW - 1)))
        x += width + 4
    return out


def _screen(rng: np.random.Generator, kind: str, size: tuple[int, int]) -> ScreenTask:
    w, h = size
    if kind == "type":
        labels = [str(x) for x in rng.choice(FIELDS, 2, replace=False)]
        left = max(text_width(f) for f in FIELDS) + 3
        top = 1 + int(rng.integers(0, 4))
        fields = [
            Element("field", f, (left, top + i * (ROW + 3), w - 2, top + i * (ROW + 3) + ROW - 1))
            for i, f in enumerate(labels)
        ]
        field, text = labels[int(rng.integers(2))], str(TEXTS[int(rng.integers(len(TEXTS)))])
        instruction = f"Type {text} into the field {field}, then press OK."
        return ScreenTask(instruction, (*fields, *_buttons(rng, w, h)), ("type", field, text), size)
    n = int(rng.integers(3, 5))
    labels = [str(x) for x in rng.choice(ITEMS, n, replace=False)]
    left, top = 1 + int(rng.integers(0, 6)), 1 + int(rng.integers(0, max(1, h - 2 * ROW - n * ROW - 3)))
    target = int(rng.integers(n))
    items = [
        Element(
            "item", label, (left, top + i * ROW, left + 25, top + i * ROW + ROW - 1), kind == "marked" and i == target
        )
        for i, label in enumerate(labels)
    ]
    instruction = (
        f"Select the item labelled {labels[target]}, then press OK."
        if kind == "select"
        else "Select the marked item, then press OK."
    )
    return ScreenTask(instruction, (*items, *_buttons(rng, w, h)), ("select", labels[target]), size)


def screen_tasks(
    n: int, seed: int, split: str, *, kinds: tuple[str, ...] = KINDS, size: tuple[int, int] = (64, 64)
) -> list[Task]:
    """`n` screen tasks of `split`, kinds in turn, ids `screen/{split}/{seed}:{i}`; the prompt is the
    instruction (the env shows the screen with it). Held-out tasks are distinct by meaning."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r}: expected one of {SPLITS}")
    if bad := [k for k in kinds if k not in KINDS]:
        raise ValueError(f"screen task kinds {bad}: expected some of {KINDS}")
    if size[0] < 48 or size[1] < 48:
        raise ValueError(f"screen size {size}: expected at least 48x48 pixels (the widgets must fit)")
    rng = np.random.default_rng([seed, SPLITS.index(split), 29])
    tasks: list[Task] = []
    seen: set[str] = set()
    for i in range(n):
        kind = kinds[i % len(kinds)]
        for _ in range(10_000):
            screen = _screen(rng, kind, size)
            if screen_split(screen) != split or (split == "test" and screen_key(screen) in seen):
                continue
            seen.add(screen_key(screen))
            tasks.append(
                Task(f"screen/{split}/{seed}:{i}", ({"role": "user", "content": screen.instruction},), screen, kind)
            )
            break
        else:
            raise ValueError(f"could not draw {n} distinct {split} screen tasks of kind {kind!r}: ask for fewer")
    return tasks


def screen_domain(make_env, n: int = 1000, seed: int = 0, split: str = "train", **kw) -> Domain:
    """Domain "screen": `screen_tasks(n, seed, split, **kw)` run on `make_env()` (a ScreenEnv)."""
    return Domain("screen", screen_tasks(n, seed, split, **kw), make_env)
