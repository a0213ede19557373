"""Drawing the scenes of the visual tasks (`rl/tasks/visual.py`) with Pillow: bar charts on a unit
grid, tables of digits, shape scenes. Pixels are exact (no anti-aliasing, the 3x5 font of
`envs/draw.py`), so a test can read every answer back from the image, and the same scene draws the
same bytes every time. `layout_*` give where things are, for the renderer and for those tests."""

from __future__ import annotations

from PIL import Image, ImageDraw

from posttrain.rl.envs.draw import BLACK, COLOURS, GLYPH_H, LIGHT, WHITE, draw_text, text_width
from posttrain.rl.tasks.visual import COLUMNS, Scene

BAR = (40, 90, 200)
LABEL_BAND = GLYPH_H + 3  # pixels under the plot for the bar labels


def chart_layout(scene: Scene) -> tuple[int, int, list[tuple[int, int]]]:
    """(baseline y, pixels per unit, [(left x, width)] of each bar) of a chart."""
    size, n = scene.size, len(scene.items)
    baseline = size - LABEL_BAND
    unit = max(1, (baseline - 2) // scene.max_value)
    slot = (size - 2) // n
    width = max(3, slot - 3)
    return baseline, unit, [(1 + i * slot + (slot - width) // 2, width) for i in range(n)]


def table_layout(scene: Scene) -> tuple[int, int, int]:
    """(row height, column width, font scale) of a table: a header row, then one row per item;
    a label column, then one column per value."""
    rows, cols = len(scene.items) + 1, len(COLUMNS) + 1
    row_h, col_w = scene.size // rows, scene.size // cols
    return row_h, col_w, max(1, min((row_h - 2) // GLYPH_H, (col_w - 2) // 4))


def shape_cell(scene: Scene, cell: int) -> tuple[int, int, int, int]:
    """The box (x0, y0, x1, y1) a shape in `cell` is drawn in (inclusive, 2 px inside its cell)."""
    side = scene.size // scene.grid
    x, y = (cell % scene.grid) * side, (cell // scene.grid) * side
    return x + 2, y + 2, x + side - 3, y + side - 3


def _chart(scene: Scene, img: Image.Image) -> None:
    draw = ImageDraw.Draw(img)
    baseline, unit, bars = chart_layout(scene)
    for v in range(1, scene.max_value + 1):
        draw.line([(0, baseline - v * unit), (scene.size - 1, baseline - v * unit)], fill=LIGHT)
    draw.line([(0, baseline), (scene.size - 1, baseline)], fill=BLACK)
    for (label, value), (x, w) in zip(scene.items, bars):
        draw.rectangle([x, baseline - value * unit, x + w - 1, baseline - 1], fill=BAR)
        draw_text(img, x + (w - text_width(label)) // 2, baseline + 2, label)


def _table(scene: Scene, img: Image.Image) -> None:
    draw = ImageDraw.Draw(img)
    row_h, col_w, scale = table_layout(scene)
    rows = [("", COLUMNS)] + [(label, tuple(str(v) for v in values)) for label, values in scene.items]
    for r in range(1, len(rows)):
        draw.line([(0, r * row_h - 1), (col_w * (len(COLUMNS) + 1) - 1, r * row_h - 1)], fill=LIGHT)
    for r, (label, cells) in enumerate(rows):
        for c, text in enumerate((label, *cells)):
            x = c * col_w + (col_w - text_width(text, scale)) // 2
            draw_text(img, x, r * row_h + (row_h - GLYPH_H * scale) // 2, text, scale=scale)


def _shapes(scene: Scene, img: Image.Image) -> None:
    draw = ImageDraw.Draw(img)
    for shape, colour, cell in scene.items:
        x0, y0, x1, y1 = shape_cell(scene, cell)
        fill = COLOURS[colour]
        if shape == "square":
            draw.rectangle([x0, y0, x1, y1], fill=fill)
        elif shape == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=fill)
        else:
            draw.polygon([((x0 + x1) // 2, y0), (x1, y1), (x0, y1)], fill=fill)


def render(scene: Scene) -> Image.Image:
    """The scene as an RGB image of `scene.size` x `scene.size` pixels on white."""
    img = Image.new("RGB", (scene.size, scene.size), WHITE)
    {"chart": _chart, "table": _table, "shapes": _shapes, "marks": _shapes}[scene.kind](scene, img)
    return img


def blank(size: int) -> Image.Image:
    """A white image: the control that shows whether the image, not the text, carries the answer."""
    return Image.new("RGB", (size, size), WHITE)
