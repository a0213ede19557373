"""Images in RL episodes: an environment's image parts as the data layer's patch tokens, and the
patches of an episode's tokens.

`ImageTokens(spec)` is the `image_part` a `ChatEnv` takes when the model sees images
(`model.vision.encoder != none`): each image part becomes `spec.num_patches` placeholder tokens.
`episode_patches(env, tokens)` gives the patches aligned with an episode's tokens (float32
[len(tokens), patch_dim], zeros off the placeholders), decoded exactly as the data layer decodes
an SFT record's images, so the sampler (its prompts) and the learner (its rows) see the same
inputs at the same positions. Decoded images are cached by path: an environment's image files are
named by their content (screens) or are the task files' own, never rewritten under a run.
"""

from __future__ import annotations

import functools

import numpy as np

from posttrain.data.images import ImageSpec, load_pixels
from posttrain.data.packing import place_patches


@functools.lru_cache(maxsize=4096)
def _pixels(path: str, size: int) -> np.ndarray:
    return load_pixels(path, size)


class ImageTokens:
    """`ChatEnv.image_part` for a vision model: an image part → `{"type": "image", "num_patches"}`
    (the tokenizer writes that many placeholders); `patches` loads the images behind them."""

    def __init__(self, spec: ImageSpec) -> None:
        self.spec = spec

    def __call__(self, part: dict) -> dict:
        return {"type": "image", "num_patches": self.spec.num_patches}

    def patches(self, tokens, paths: list[str]) -> np.ndarray:
        """float32 [len(tokens), patch_dim]: the images of `paths` (in order) at the placeholders of
        `tokens`; ValueError when the counts disagree (an image whose tokens were cut)."""
        out = np.zeros((len(tokens), self.spec.patch_dim), np.float32)
        pixels = [_pixels(p, self.spec.image_size) for p in paths]
        place_patches(out, np.asarray(tokens), np.stack(pixels) if pixels else None, self.spec)
        return out


def episode_patches(env, tokens) -> np.ndarray | None:
    """The patches of `tokens` (a prefix-complete context of `env`'s episode, or its whole
    trajectory) from the images the environment has shown; None when the environment takes no
    images (`image_part` is not an `ImageTokens`) or has shown none."""
    part = getattr(env, "image_part", None)
    if not isinstance(part, ImageTokens) or not env.images:
        return None
    return part.patches(tokens, env.images)


# (key, when it is set so that images cannot go with it, why) for `check_rl_images`
UNSUPPORTED = (
    ("sampling.speculative_k", lambda c: c.sampling.speculative_k > 0, "the draft takes no images"),
    ("rl.placement", lambda c: c.rl.placement != "colocated", "only the colocated sampler is given images"),
    ("rl.reward_model", lambda c: bool(c.rl.reward_model), "the learned reward scores tokens without images"),
    ("rl.inflight_update_every", lambda c: c.rl.inflight_update_every > 0, "the chunked decode takes no images"),
)


def check_rl_images(cfg) -> None:
    """RL with images (`model.vision.encoder != none`): refuse, naming the key, what does not carry
    an episode's images to the sampler and the learner (several processes: every process would
    need every episode's images)."""
    if cfg.model.vision.encoder == "none":
        return
    import jax

    why = f"model.vision.encoder={cfg.model.vision.encoder!r}: RL with images runs"
    for key, on, reason in UNSUPPORTED:
        if on(cfg):
            raise ValueError(f"{key}: {why} without it ({reason}); switch it off")
    if jax.process_count() > 1:
        raise ValueError(f"{why} in one process only ({jax.process_count()} processes)")
