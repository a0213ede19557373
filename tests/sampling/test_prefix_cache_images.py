"""Sampling with images (issue 29, item 3): continuous batching and the prefix cache take prompts
with images and give the static sampler's samples; their behaviour log-probs are the learner's
over prompt + completion with the same patches; cached prefixes are keyed by image content too.

The tiny vision decoder is tests/models/test_vision.py's (`split_model`, made once per process).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.sampling import ContinuousBatcher, SamplingParams, generate
from posttrain.sampling.generate import SlotConfig
from posttrain.sampling.prefix_cache import Images, PrefixCache, block_keys, whole_images
from tests.support.vision import BYTE, SPEC, split_model

IMG = BYTE.image_id
# stop tokens 10..59 of 264 end some samples early and leave others at the limit
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=6, stop_ids=tuple(range(10, 60)), num_samples=2)
RNG = np.random.default_rng(4)


def image_patches(tokens, seed: int) -> np.ndarray:
    """Random patches at the placeholders of `tokens`, zeros elsewhere (`data.packing.place_patches`)."""
    tokens = np.asarray(tokens)
    rng = np.random.default_rng(seed)
    return np.where((tokens == IMG)[:, None], rng.random((len(tokens), SPEC.patch_dim)), 0).astype(np.float32)


# two prompts with images (one with two) and a text-only prompt among them
PROMPTS = [[1, 4, *[IMG] * 4, 60, 61, 2, 5], [7, 8, 9], [1, 4, 70, *[IMG] * 8, 2, 5]]
PATCHES = [image_patches(PROMPTS[0], 1), None, image_patches(PROMPTS[2], 2)]


def same(a, b):
    np.testing.assert_array_equal(a.tokens, b.tokens)
    np.testing.assert_array_equal(a.lengths, b.lengths)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    np.testing.assert_allclose(a.sampling_logprobs, b.sampling_logprobs, atol=1e-5)


@functools.cache
def learner_forward():
    graphdef, _, _ = split_model()
    return jax.jit(lambda params, rest, tokens, patches: nnx.merge(graphdef, params, rest)(tokens, patches=patches)[0])


def learner_logprobs(prompts, patches, samples, shape=(8, 32)) -> list[np.ndarray]:
    """The learner's log-probs of each sample's tokens: one forward over prompt + completion with
    the prompt's patches (zeros along the completion), as `rl_batch` lays a trajectory out."""
    _, params, rest = split_model()
    g = len(samples.tokens) // len(prompts)
    tokens = np.zeros(shape, np.int32)
    rows = np.zeros((*shape, SPEC.patch_dim), np.float32)
    for i in range(len(samples.tokens)):
        prompt, p = prompts[i // g], patches[i // g]
        seq = [*prompt, *samples.completion(i)]
        tokens[i, : len(seq)] = seq
        if p is not None:
            rows[i, : len(prompt)] = p
    logp = np.asarray(jax.nn.log_softmax(learner_forward()(params, rest, tokens, rows)))
    out = []
    for i in range(len(samples.tokens)):
        start, n = len(prompts[i // g]), int(samples.lengths[i])
        out.append(logp[i, np.arange(start - 1, start + n - 1), tokens[i, start : start + n]])
    return out


def assert_learner_equals_behaviour(prompts, patches, samples):
    for i, learner in enumerate(learner_logprobs(prompts, patches, samples)):
        n = int(samples.lengths[i])
        np.testing.assert_allclose(samples.sampling_logprobs[i, :n], learner, rtol=1e-5, atol=1e-5, err_msg=str(i))


def test_continuous_batching_with_images_equals_static_and_the_learner():
    """Grouped continuous batching (prompts prefilled once) and the request queue (each request
    prefilled when a slot frees up) give the static sampler's tokens and log-probs for the same
    key, text-only prompts mixed in; the behaviour log-probs are the learner's with the patches."""
    graphdef, params, rest = split_model()
    key = jax.random.key(5)
    static = generate(graphdef, params, rest, PROMPTS, SAMPLING, key, patches=PATCHES)
    blind = [None if p is None else p * 0 for p in PATCHES]
    blind = generate(graphdef, params, rest, PROMPTS, SAMPLING, key, patches=blind)
    assert not np.allclose(static.logprobs[:2], blind.logprobs[:2])  # the images matter
    assert len(set(static.lengths.tolist())) > 1
    grouped = generate(graphdef, params, rest, PROMPTS, SAMPLING, key, slots=SlotConfig(2, 1), patches=PATCHES)
    same(grouped, static)
    batcher = ContinuousBatcher(graphdef, SAMPLING, num_slots=2, prefill_batch=1)
    ids = [batcher.submit(p, patches=x) for p, x in zip(PROMPTS, PATCHES)]
    queued = batcher.run(params, rest, key)
    assert queued.prompt_index.tolist() == np.repeat(ids, 2).tolist()
    same(queued, static)
    assert_learner_equals_behaviour(PROMPTS, PATCHES, grouped)
    with pytest.raises(ValueError, match="patches: 3 rows for a prompt of 4 tokens"):
        batcher.submit([1, IMG, IMG, IMG], patches=np.zeros((3, SPEC.patch_dim)))


def test_prefix_cache_is_keyed_by_image_content():
    """Turn two of image prompts (blocks of 8): with the same image a context is served from turn
    one's KV; the same tokens with another image find no cached prefix (sharing it would serve the
    first image's KV); a hit that would cut an image backs off. Outputs equal plain sampling, and
    the behaviour log-probs are the learner's with the patches."""
    graphdef, params, rest = split_model()
    cache = PrefixCache(4096, block=8)
    key = jax.random.key(5)  # turn one is the static call of the test above (its compiled program)
    first = generate(graphdef, params, rest, PROMPTS, SAMPLING, key, patches=PATCHES, prefix_cache=cache)
    same(first, generate(graphdef, params, rest, PROMPTS, SAMPLING, key, patches=PATCHES))
    assert cache.stats.hits == 0 and cache.stats.inserted >= 2
    # turn two: prompt 0 + a tool message with its image and with another one; prompt 2 + a token
    # (block 0 is held, but ends inside its image at 3..10: no hit)
    second = [PROMPTS[0] + [3, 4, 5], PROMPTS[0] + [3, 4, 5], PROMPTS[2] + [6]]
    pad = lambda p, n: np.pad(p, ((0, n), (0, 0)))  # noqa: E731
    blue = image_patches(PROMPTS[0], 12)
    images = [pad(PATCHES[0], 3), pad(blue, 3), pad(PATCHES[2], 1)]
    cached = generate(graphdef, params, rest, second, SAMPLING, jax.random.key(2), patches=images, prefix_cache=cache)
    assert (cache.stats.hits, cache.stats.hit_tokens) == (1, 8)  # only row 0's: same ids, same image
    plain = generate(graphdef, params, rest, second, SAMPLING, jax.random.key(2), patches=images)
    same(cached, plain)
    assert not np.allclose(cached.logprobs[:2], cached.logprobs[2:4])  # rows 0 and 1: another image, other samples
    assert_learner_equals_behaviour(second, images, cached)


def test_image_block_keys_and_hits_never_cut_an_image():
    """Pure host logic: a block's key covers the patches at its placeholders (other patch values
    are ignored, a block without placeholders keeps its text key, so a text prompt shares it); a
    hit backs off to a block before an image it would cut."""
    tokens = np.array([5] * 16 + [6, 7, *[IMG] * 8] + [8] * 6)  # 32 tokens, an image at 18..25
    red, blue = Images(image_patches(tokens, 1), IMG), Images(image_patches(tokens, 2), IMG)
    text, keys_red, keys_blue = block_keys(tokens, 16), block_keys(tokens, 16, red), block_keys(tokens, 16, blue)
    assert keys_red[0] == keys_blue[0] == text[0]  # no placeholder in block 0
    assert len({keys_red[1], keys_blue[1], text[1]}) == 3
    noise = Images(red.patches + (tokens != IMG)[:, None], IMG)  # values off the placeholders: ignored
    assert block_keys(tokens, 16, noise) == keys_red
    assert whole_images(tokens, 16, 8, IMG) == 16 and whole_images(tokens, 32, 8, IMG) == 32
    assert whole_images(tokens, 24, 8, IMG) == 16  # 24 is inside the image (18..25): back to 16

    cache = PrefixCache(4096, block=8)
    kv = ((np.zeros((2, 1, 40), np.float32), np.zeros((2, 40, 1), np.float32)),)
    longer = np.concatenate([tokens, [9] * 9])
    pad = lambda im: Images(np.pad(im.patches, ((0, 9), (0, 0))), IMG)  # noqa: E731
    cache.insert(longer, kv, pad(red))
    assert cache.lookup(longer, pad(red))[1] == 40  # the whole image and what follows it
    assert cache.lookup(tokens, red)[1] == 16  # blocks 0..23 are held, but 24 would cut the image
    assert cache.lookup(longer, pad(blue))[1] == 16  # another image: only the text before it
    assert cache.lookup(longer)[1] == 16  # no images given: text keys, the same text blocks


@pytest.mark.parametrize(
    "vision",
    [
        # ~1 CPU-minute (a second model and its programs); the linear encoder's tests cover the rest
        pytest.param({"encoder": "vit"}, marks=pytest.mark.slow, id="vit"),
        pytest.param({"patch_positions": True}, id="patch_positions"),
    ],
)
def test_placeholder_ranks_through_continuous_batching_and_the_prefix_cache(vision):
    """A vit tower (each image encoded from all its patches) and linear patch positions (each patch's
    place) both rank an image's placeholders (`vit.placeholder_ranks`): continuous batching equals
    static sampling, and the prefix cache, whose suffix here holds a whole new screen (row 0) or
    would cut an image without the back-off (row 1), equals plain sampling."""
    from posttrain.models.decoder import Decoder
    from tests.support.vision import vision_config

    graphdef, params, rest = nnx.split(Decoder(vision_config(**vision).model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    if "pos" in params["vision"]:  # zero at the start: draw it, so that the place matters
        params["vision"]["pos"][...] = jax.random.normal(jax.random.key(5), params["vision"]["pos"].shape)
    key = jax.random.key(5)
    static = generate(graphdef, params, rest, PROMPTS, SAMPLING, key, patches=PATCHES)
    grouped = generate(graphdef, params, rest, PROMPTS, SAMPLING, key, slots=SlotConfig(2, 1), patches=PATCHES)
    same(grouped, static)
    cache = PrefixCache(4096, block=8)
    same(generate(graphdef, params, rest, PROMPTS, SAMPLING, key, patches=PATCHES, prefix_cache=cache), static)
    second = [PROMPTS[0] + [3, 4, 5, *[IMG] * 4, 7], PROMPTS[2] + [6], PROMPTS[0] + [3, 4]]
    images = [
        np.concatenate([np.pad(PATCHES[0], ((0, 3), (0, 0))), image_patches([IMG] * 4 + [7], 9)]),
        np.pad(PATCHES[2], ((0, 1), (0, 0))),
        np.pad(PATCHES[0], ((0, 2), (0, 0))),
    ]
    cached = generate(graphdef, params, rest, second, SAMPLING, jax.random.key(2), patches=images, prefix_cache=cache)
    assert (cache.stats.hits, cache.stats.hit_tokens) == (2, 16)  # rows 0 and 2; row 1 backs off to 0
    same(cached, generate(graphdef, params, rest, second, SAMPLING, jax.random.key(2), patches=images))
