"""Images in chat records: `{"type": "image", "image": path}` parts → fixed-size RGB pixels → patches.

Kept deliberately simple: every image is decoded with Pillow, converted to RGB and resized to one
fixed square (`model.vision.image_size`, bicubic, aspect ratio not kept), so an image is always
`(image_size / patch_size)²` patches — one placeholder token each, in raster order. A path is
relative to the folder of the JSONL file that names it, absolute, or any fsspec URL (`gs://`,
`memory://`), read through `sources.read_file`. Pixels stay uint8 in examples (and in a data
iterator's saved state); `patches_of` scales them to [0, 1] and cuts them when a row is built.
"""

from __future__ import annotations

import io
import posixpath
from typing import NamedTuple

import numpy as np

from posttrain.data.sources import read_file


class ImageSpec(NamedTuple):
    """How images become patch tokens: the square size they are resized to, the patch side, and
    the placeholder token id that stands for one patch."""

    image_size: int
    patch_size: int
    token_id: int

    @property
    def num_patches(self) -> int:
        """Patches (placeholder tokens) per image."""
        return (self.image_size // self.patch_size) ** 2

    @property
    def patch_dim(self) -> int:
        """Values per patch: patch_size² RGB pixels."""
        return self.patch_size * self.patch_size * 3

    @classmethod
    def from_config(cls, vision) -> ImageSpec | None:
        """The spec of `model.vision`, or None when its encoder is `none` (text only)."""
        if vision.encoder == "none":
            return None
        return cls(vision.image_size, vision.patch_size, vision.image_token_id)


def resolve_path(image: str, record_path: str | None) -> str:
    """`image` as written in the record at `record_path`: an absolute path or URL as it is, a
    relative one under the folder of the JSONL file."""
    if "://" in image or posixpath.isabs(image) or not record_path:
        return image
    if "://" in record_path:
        protocol, _, rest = record_path.partition("://")
        return f"{protocol}://{posixpath.join(posixpath.dirname(rest), image)}"
    return posixpath.join(posixpath.dirname(record_path), image)


def load_pixels(path: str, size: int) -> np.ndarray:
    """The image at `path` as uint8 RGB [size, size, 3]; a missing or undecodable file is a
    `ValueError` naming it (the caller adds the record's file:line)."""
    from PIL import Image, UnidentifiedImageError

    try:
        blob = read_file(path)
    except Exception as e:  # UserError (missing, unreachable) and OS errors; they name the path
        raise ValueError(f"cannot read the image ({e})") from None
    try:
        with Image.open(io.BytesIO(blob)) as im:
            rgb = im.convert("RGB").resize((size, size), Image.Resampling.BICUBIC)
            return np.asarray(rgb, np.uint8)
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ValueError(f"cannot decode the image {path} ({type(e).__name__}: {e})") from None


def patches_of(pixels: np.ndarray, patch_size: int) -> np.ndarray:
    """uint8 pixels [..., H, W, 3] → float32 patches [..., (H/p)·(W/p), p·p·3] in [0, 1], raster order
    (row by row of patches; inside a patch, row-major pixels, RGB last)."""
    *lead, h, w, c = pixels.shape
    p = patch_size
    x = np.asarray(pixels, np.float32).reshape(*lead, h // p, p, w // p, p, c) / 255.0
    x = np.moveaxis(x, -4, -3)  # [..., H/p, W/p, p, p, c]
    return x.reshape(*lead, (h // p) * (w // p), p * p * c)


NO_VISION = "model.vision.encoder='none' (text only); set it to 'linear'"


def image_parts(
    content, where: str, spec: ImageSpec | None, record_path: str | None, why: str = NO_VISION
) -> tuple[str | list, list]:
    """A message content (a string, or a list of text / image parts) → (content for the tokenizer,
    uint8 pixels of its images in order). Image parts become `{"type": "image", "num_patches"}`;
    a list of text parts only becomes their concatenated string. `where` names the content in
    errors (`field 'messages'[0].content`); `why`: the reason an image is refused without `spec`."""
    if isinstance(content, str):
        return content, []
    if not isinstance(content, list) or not content:
        raise ValueError(f"{where}: expected a string or a non-empty list of parts, got {type(content).__name__}")
    out, pixels = [], []
    for j, part in enumerate(content):
        at = f"{where}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image" and isinstance(part.get("image"), str):
            if spec is None:
                raise ValueError(f"{at}: an image part, but {why}")
            try:
                pixels.append(load_pixels(resolve_path(part["image"], record_path), spec.image_size))
            except ValueError as e:
                raise ValueError(f"{at}: {e}") from None
            out.append({"type": "image", "num_patches": spec.num_patches})
        else:
            raise ValueError(f'{at}: expected {{"type": "text", "text": str}} or {{"type": "image", "image": path}}')
    if not pixels:
        return "".join(p["text"] for p in out), []
    return out, pixels
