"""The screenshot environment's test tokenizer (image parts as text) and honest episodes' turns."""

from __future__ import annotations

from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs.screen import solution as screen_solution
from posttrain.rl.tasks.files import content_text


class PartsTokenizer(ByteTokenizer):
    """Byte tokens, image parts written as `<image PATH>` text (the data layer's stand-in)."""

    def encode_chat(self, messages, **kw):
        return super().encode_chat([{**m, "content": content_text(m["content"])} for m in messages], **kw)


TOK = PartsTokenizer()


def turn(text: str) -> list[int]:
    return TOK.encode(text) + [TOK.eos_id]


def centre(task, label) -> tuple[int, int]:
    x0, y0, x1, y1 = task.target.element(label).box
    return (x0 + x1) // 2, (y0 + y1) // 2


def solution(task, by_xy: bool) -> list[str]:
    """The honest actions of a Task (`screen.solution` of its target)."""
    return screen_solution(task.target, by_xy)
