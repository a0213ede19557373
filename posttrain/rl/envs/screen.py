"""Rendered interface screens for a screenshot agent: widgets, a small state machine, the action
grammar and the final state check. Sandbox-free: a screen is pixels drawn from the state
(`render`), nothing runs. `envs/screen_env.py` plays episodes on it; `rl/tasks/screen_domain.py`
makes the tasks.

A screen holds list items, text fields and buttons (`Element`, each a labelled box). The state is
which item is selected, which field has the focus, what each field holds, and whether OK or CANCEL
was pressed. Actions, one per turn, the whole turn being exactly one of (spaces around allowed):

    click(X, Y)        the element whose box holds pixel (X, Y) of the screen (none: nothing happens)
    click("LABEL")     the element with that label (ASCII case ignored; none: nothing happens)
    type("TEXT")       the focused field now holds TEXT (no field focused: nothing happens)

Clicking an item selects it (one at a time), a field focuses it, OK submits, CANCEL gives up. A
turn that is anything else -- prose, two actions, another verb, a claim that the task is done -- is
malformed (`parse_action` raises `ActionError`), and the environment ends the episode on it with
reward 0. The task is done only when OK is pressed and the state then is the goal (`check`):
`select` -- the goal item is selected; `type` -- the goal field holds exactly the goal text and
every other field is empty.
"""

from __future__ import annotations

import dataclasses
import re

from PIL import Image, ImageDraw

from posttrain.rl.envs.draw import BLACK, COLOURS, GLYPH_H, LIGHT, WHITE, draw_text, text_width

KINDS = ("item", "field", "button")
GOALS = ("select", "type")
OK, CANCEL = "OK", "CANCEL"
SELECTED = COLOURS["blue"]
MARK = COLOURS["red"]
BUTTON = (200, 200, 200)
MAX_TEXT = 32
_CLICK_XY = re.compile(r"click\(\s*(\d{1,4})\s*,\s*(\d{1,4})\s*\)")
_CLICK_LABEL = re.compile(r'click\(\s*"([^"\n]{1,32})"\s*\)')
_TYPE = re.compile(r'type\(\s*"([^"\n]{0,32})"\s*\)')


@dataclasses.dataclass(frozen=True)
class Element:
    """A widget: `kind` (item, field or button), its `label` (unique on its screen) and its `box`
    (x0, y0, x1, y1, inclusive) in screen pixels; `marked` fills an item red (until it is selected)."""

    kind: str
    label: str
    box: tuple[int, int, int, int]
    marked: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Element.kind {self.kind!r}: expected one of {KINDS}")
        x0, y0, x1, y1 = self.box
        if not (0 <= x0 <= x1 and 0 <= y0 <= y1):
            raise ValueError(f"Element {self.label!r}: bad box {self.box}")

    def contains(self, x: int, y: int) -> bool:
        """Whether pixel (x, y) is inside the box."""
        x0, y0, x1, y1 = self.box
        return x0 <= x <= x1 and y0 <= y <= y1


@dataclasses.dataclass(frozen=True)
class ScreenTask:
    """One screen and its goal: `elements` (an OK and a CANCEL button among them), `goal`
    (`("select", item)` or `("type", field, text)`), `instruction` (what the user asks, shown with
    the first screen) and the screen `size` (width, height)."""

    instruction: str
    elements: tuple[Element, ...]
    goal: tuple[str, ...]
    size: tuple[int, int]

    def __post_init__(self) -> None:
        labels = [e.label.lower() for e in self.elements]
        if len(set(labels)) != len(labels):
            raise ValueError(f"ScreenTask: labels must be unique on a screen, got {[e.label for e in self.elements]}")
        buttons = {e.label for e in self.elements if e.kind == "button"}
        if not {OK, CANCEL} <= buttons:
            raise ValueError(f"ScreenTask: a screen needs {OK} and {CANCEL} buttons, got {sorted(buttons)}")
        w, h = self.size
        if any(e.box[2] >= w or e.box[3] >= h for e in self.elements):
            raise ValueError(f"ScreenTask: an element lies outside the {w}x{h} screen")
        kinds = {e.label: e.kind for e in self.elements}
        want = {"select": ("item", 2), "type": ("field", 3)}
        if not self.goal or self.goal[0] not in want:
            raise ValueError(f"ScreenTask.goal {self.goal!r}: expected ('select', item) or ('type', field, text)")
        kind, length = want[self.goal[0]]
        if len(self.goal) != length or kinds.get(self.goal[1]) != kind:
            raise ValueError(f"ScreenTask.goal {self.goal!r}: {self.goal[0]} needs a {kind} of the screen")

    def element(self, label: str) -> Element:
        """The element labelled `label` (ASCII case ignored); KeyError if none."""
        for e in self.elements:
            if e.label.lower() == label.lower():
                return e
        raise KeyError(label)


@dataclasses.dataclass
class ScreenState:
    """What the user has done so far."""

    selected: str | None = None
    focused: str | None = None
    values: dict[str, str] = dataclasses.field(default_factory=dict)
    submitted: bool = False
    cancelled: bool = False

    @property
    def over(self) -> bool:
        """OK or CANCEL was pressed."""
        return self.submitted or self.cancelled


@dataclasses.dataclass(frozen=True)
class Action:
    """A parsed action: `verb` "click" (at `xy`, or on `label`) or "type" (`text`)."""

    verb: str
    xy: tuple[int, int] | None = None
    label: str | None = None
    text: str | None = None

    def __str__(self) -> str:
        if self.verb == "type":
            return f'type("{self.text}")'
        return f"click({self.xy[0]}, {self.xy[1]})" if self.xy else f'click("{self.label}")'


class ActionError(ValueError):
    """A turn that is not exactly one action; the message says what was expected."""


def parse_action(text: str) -> Action:
    """The one action a turn is (module docstring); ActionError for anything else."""
    turn = text.strip()
    if m := _CLICK_XY.fullmatch(turn):
        return Action("click", xy=(int(m.group(1)), int(m.group(2))))
    if m := _CLICK_LABEL.fullmatch(turn):
        return Action("click", label=m.group(1))
    if m := _TYPE.fullmatch(turn):
        return Action("type", text=m.group(1))
    raise ActionError(
        f'not one action: {turn[:60]!r} (expected exactly one of click(X, Y), click("LABEL"), type("TEXT"))'
    )


def apply(task: ScreenTask, state: ScreenState, action: Action) -> str:
    """Apply one action to `state` (in place); returns what happened, for logs."""
    if state.over:
        raise RuntimeError("the screen is closed (OK or CANCEL was pressed)")
    if action.verb == "type":
        if state.focused is None:
            return "typed with no field focused: nothing happened"
        state.values[state.focused] = action.text
        return f"field {state.focused} holds {action.text!r}"
    if action.xy is not None:
        hit = next((e for e in task.elements if e.contains(*action.xy)), None)
    else:
        hit = next((e for e in task.elements if e.label.lower() == action.label.lower()), None)
    if hit is None:
        return "clicked nothing"
    if hit.kind == "item":
        state.selected = hit.label
    elif hit.kind == "field":
        state.focused = hit.label
    elif hit.label == OK:
        state.submitted = True
    elif hit.label == CANCEL:
        state.cancelled = True
    return f"clicked {hit.kind} {hit.label}"


def check(task: ScreenTask, state: ScreenState) -> tuple[bool, str]:
    """Whether the episode reached its goal: OK pressed with the goal state (module docstring)."""
    if not state.submitted:
        return False, "cancelled" if state.cancelled else "OK was never pressed"
    if task.goal[0] == "select":
        return state.selected == task.goal[1], f"selected {state.selected!r}, wanted {task.goal[1]!r}"
    _, field, text = task.goal
    others = {k: v for k, v in state.values.items() if k != field and v}
    done = state.values.get(field) == text and not others
    return done, f"fields {state.values}, wanted {field}={text!r} and the others empty"


def solution(task: ScreenTask, by_xy: bool = True) -> list[str]:
    """The honest actions for the goal: click its item or field (at its box's centre, or by label),
    type the text, press OK (the scripted demonstrations, the tests' reference episodes)."""

    def click(label: str) -> str:
        if not by_xy:
            return f'click("{label}")'
        x0, y0, x1, y1 = task.element(label).box
        return f"click({(x0 + x1) // 2}, {(y0 + y1) // 2})"

    typed = [f'type("{task.goal[2]}")'] if task.goal[0] == "type" else []
    return [click(task.goal[1]), *typed, click(OK)]


def render(task: ScreenTask, state: ScreenState) -> Image.Image:
    """The screen in `state`: items (the selected one filled blue), fields (the focused one outlined
    blue, the text it holds inside, its label to its left), buttons (grey)."""
    img = Image.new("RGB", task.size, WHITE)
    draw = ImageDraw.Draw(img)
    for e in task.elements:
        x0, y0, x1, y1 = e.box
        ty = y0 + (y1 - y0 + 1 - GLYPH_H) // 2
        if e.kind == "item":
            selected = state.selected == e.label
            draw.rectangle(e.box, fill=SELECTED if selected else MARK if e.marked else WHITE, outline=LIGHT)
            draw_text(img, x0 + 2, ty, e.label, WHITE if selected else BLACK)
        elif e.kind == "field":
            focused = state.focused == e.label
            draw.rectangle(e.box, outline=SELECTED if focused else BLACK, width=2 if focused else 1)
            draw_text(img, x0 - 1 - text_width(e.label) - 1, ty, e.label)
            draw_text(img, x0 + 3, ty, state.values.get(e.label, "")[: max(0, (x1 - x0 - 4) // 4)])
        else:
            draw.rectangle(e.box, fill=BUTTON, outline=BLACK)
            draw_text(img, x0 + (x1 - x0 + 1 - text_width(e.label)) // 2, ty, e.label)
    return img
