"""Screen tasks for the screenshot agent (`envs/screen_env.py`): random screens with a goal, held out
by meaning.

Kinds: `select` ("Select the item labelled DOG, then press OK."), `marked` ("Select the marked item,
then press OK.": which one is marked only the screen shows) and `type` ("Type 42 into the field
CODE, then press OK."). Layouts vary: the list's items in random order at a random offset, fields
in random order, OK and CANCEL in either order. A task's split is a hash of its meaning
(`screen_key`: kind, goal and the set of labels on the screen; not where anything stands), so the
same task laid out otherwise is in the same split. The meanings are few (`held_out_counts`: e.g. 18
held-out `type` tasks), so a request for more distinct held-out tasks than exist is refused, never
filled with repeats.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

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


def _meaning(goal: tuple[str, ...], labels) -> str:
    return f"{'|'.join(goal)}|{','.join(sorted(labels))}"


def _split_of(key: str) -> str:
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "little") % 100
    return "test" if bucket < TEST_PERCENT else "train"


def screen_key(task: ScreenTask) -> str:
    """The meaning of a screen task: its goal and the labels on screen (and which item is marked)."""
    return _meaning(task.goal, (f"{e.kind}:{e.label}" + ("*" if e.marked else "") for e in task.elements))


def screen_split(task: ScreenTask) -> str:
    """ "test" for a fixed `TEST_PERCENT` of meanings (a hash of `screen_key`), else "train"."""
    return _split_of(screen_key(task))


def _meanings(kind: str) -> list[str]:
    """Every meaning (`screen_key`) `_screen` can draw for `kind`, enumerated."""
    buttons = [f"button:{OK}", f"button:{CANCEL}"]
    if kind == "type":
        return [
            _meaning(("type", field, text), [f"field:{f}" for f in pair] + buttons)
            for pair in itertools.combinations(FIELDS, 2)
            for field in pair
            for text in TEXTS
        ]
    return [
        _meaning(
            ("select", target),
            [f"item:{x}" + ("*" if kind == "marked" and x == target else "") for x in items] + buttons,
        )
        for n in (3, 4)
        for items in itertools.combinations(ITEMS, n)
        for target in items
    ]


@functools.cache
def held_out_counts() -> dict[str, int]:
    """How many distinct held-out ("test") tasks each kind has: the most a held-out set can hold."""
    return {kind: sum(_split_of(key) == "test" for key in _meanings(kind)) for kind in KINDS}


def max_held_out(kinds: tuple[str, ...] = KINDS) -> int:
    """The most distinct held-out tasks `screen_tasks` can draw with `kinds` in turn."""
    left, n = dict(held_out_counts()), 0
    while left[kind := kinds[n % len(kinds)]] > 0:
        left[kind] -= 1
        n += 1
    return n


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
    if split == "test" and n > (most := max_held_out(kinds)):
        counts = ", ".join(f"{held_out_counts()[k]} {k}" for k in kinds)
        raise ValueError(
            f"{n} distinct held-out screen tasks requested, but the test split has only {counts} "
            f"(kinds {', '.join(kinds)} in turn: at most {most}): ask for at most {most}"
        )
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
