"""Pixel drawing shared by the rendered environments (`envs/screen.py`) and the visual task
generator (`rl/tasks/visual.py`): a 3x5 bitmap font drawn at an integer scale (crisp at 32-64 px,
the same pixels on every machine and Pillow version: no font files, no anti-aliasing), colours,
and PNG bytes written deterministically."""

from __future__ import annotations

import io

from PIL import Image

# Each glyph is 5 rows of 3 columns ("#" = ink). Lower case is drawn as upper case.
_GLYPHS = {
    "0": ("###", "#.#", "#.#", "#.#", "###"),
    "1": (".#.", "##.", ".#.", ".#.", "###"),
    "2": ("###", "..#", "###", "#..", "###"),
    "3": ("###", "..#", ".##", "..#", "###"),
    "4": ("#.#", "#.#", "###", "..#", "..#"),
    "5": ("###", "#..", "###", "..#", "###"),
    "6": ("###", "#..", "###", "#.#", "###"),
    "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"),
    "9": ("###", "#.#", "###", "..#", "###"),
    "A": (".#.", "#.#", "###", "#.#", "#.#"),
    "B": ("##.", "#.#", "##.", "#.#", "##."),
    "C": (".##", "#..", "#..", "#..", ".##"),
    "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "E": ("###", "#..", "##.", "#..", "###"),
    "F": ("###", "#..", "##.", "#..", "#.."),
    "G": (".##", "#..", "#.#", "#.#", ".##"),
    "H": ("#.#", "#.#", "###", "#.#", "#.#"),
    "I": ("###", ".#.", ".#.", ".#.", "###"),
    "J": ("..#", "..#", "..#", "#.#", ".#."),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"),
    "L": ("#..", "#..", "#..", "#..", "###"),
    "M": ("#.#", "###", "###", "#.#", "#.#"),
    "N": ("##.", "#.#", "#.#", "#.#", "#.#"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."),
    "P": ("##.", "#.#", "##.", "#..", "#.."),
    "Q": (".#.", "#.#", "#.#", "##.", ".##"),
    "R": ("##.", "#.#", "##.", "#.#", "#.#"),
    "S": (".##", "#..", ".#.", "..#", "##."),
    "T": ("###", ".#.", ".#.", ".#.", ".#."),
    "U": ("#.#", "#.#", "#.#", "#.#", "###"),
    "V": ("#.#", "#.#", "#.#", "#.#", ".#."),
    "W": ("#.#", "#.#", "###", "###", "#.#"),
    "X": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "Y": ("#.#", "#.#", ".#.", ".#.", ".#."),
    "Z": ("###", "..#", ".#.", "#..", "###"),
    " ": ("...", "...", "...", "...", "..."),
    "-": ("...", "...", "###", "...", "..."),
    ".": ("...", "...", "...", "...", ".#."),
    ":": ("...", ".#.", "...", ".#.", "..."),
    "?": ("###", "..#", ".##", "...", ".#."),
}
GLYPH_W, GLYPH_H = 3, 5
WHITE, BLACK, GREY, LIGHT = (255, 255, 255), (0, 0, 0), (128, 128, 128), (220, 220, 220)
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 30), "blue": (30, 60, 220)}


def glyph(ch: str) -> tuple[str, ...]:
    """The 5 rows of a character's glyph (lower case as upper; unknown characters as '?')."""
    return _GLYPHS.get(ch.upper(), _GLYPHS["?"])


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of `text` drawn by `draw_text` (one blank column between characters)."""
    return max(0, (len(text) * (GLYPH_W + 1) - 1) * scale)


def draw_text(img: Image.Image, x: int, y: int, text: str, colour=BLACK, scale: int = 1) -> None:
    """Draw `text` with its top-left corner at (x, y), each font pixel a `scale` x `scale` block
    (pixels falling outside the image are dropped)."""
    px, (w, h) = img.load(), img.size
    for i, ch in enumerate(text):
        left = x + i * (GLYPH_W + 1) * scale
        for r, row in enumerate(glyph(ch)):
            for c, bit in enumerate(row):
                if bit != "#":
                    continue
                for dy in range(scale):
                    for dx in range(scale):
                        u, v = left + c * scale + dx, y + r * scale + dy
                        if 0 <= u < w and 0 <= v < h:
                            px[u, v] = colour


def png_bytes(img: Image.Image) -> bytes:
    """The image as PNG bytes, written the same way every time (no metadata, fixed compression)."""
    buf = io.BytesIO()
    img.save(buf, format="PNG", optimize=False, compress_level=6)
    return buf.getvalue()
