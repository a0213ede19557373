"""The ViT tower (`model.vision.encoder = vit`) and the LLaVA family against transformers: a tiny
random LlavaForConditionalGeneration (SigLIP tower, Llama text model) loaded into posttrain with
logits equal to transformers' on images (1 device and an 8-device mesh), and exported back."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.data.images import patches_of
from posttrain.errors import UserError
from posttrain.models.decoder import Decoder
from tests.support.typed_configs import model, run_cfg

torch = pytest.importorskip("torch", reason="HF interop tests need the hf extra: pip install torch==2.13.0 -e '.[hf]'")
transformers = pytest.importorskip("transformers", reason="HF interop tests need the hf extra: pip install -e '.[hf]'")

from posttrain.core.init import load_model_state  # noqa: E402
from posttrain.core.state import abstract_model  # noqa: E402
from posttrain.models.hf import model_config_from_hf, save_hf  # noqa: E402
from posttrain.models.hf.llava import model_config_from_llava  # noqa: E402
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding  # noqa: E402

IMAGE_ID, SIZE, PATCH = 63, 8, 4  # 4 patches per image
MEAN, STD = [0.4, 0.5, 0.6], [0.2, 0.3, 0.25]  # not SigLIP's 0.5s: the mapping is tested


def llava_config(**overrides):
    tower = transformers.SiglipVisionConfig(
        hidden_size=16,
        intermediate_size=24,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=SIZE,
        patch_size=PATCH,
    )
    text = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        initializer_range=0.2,
    )
    kw = dict(
        image_token_id=IMAGE_ID, vision_feature_layer=-1, vision_feature_select_strategy="full", image_seq_length=4
    )
    return transformers.LlavaConfig(vision_config=tower, text_config=text, **{**kw, **overrides})


def hf_llava(tmp_path):
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(llava_config()).float().eval()
    with torch.no_grad():  # norms and biases random too, so their mapping is tested
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
            elif "vision" in name or "projector" in name:
                p.mul_(3.0)
    src = str(tmp_path / "src")
    model.save_pretrained(src)
    transformers.SiglipImageProcessor(
        image_mean=MEAN, image_std=STD, size=dict(height=SIZE, width=SIZE)
    ).save_pretrained(src)
    return model, src


def inputs(rows=4, length=24, seed=0):
    """tokens [rows, length] with 1 or 2 images each (4 placeholders apiece), the uint8 pixels
    of the images in order, and posttrain's patches aligned with the tokens."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, IMAGE_ID, (rows, length))
    starts = [(2,), (5, 14), (0, 20), (9,)][:rows]
    for r, row in enumerate(starts):
        for s in row:
            tokens[r, s : s + 4] = IMAGE_ID
    pixels = rng.integers(0, 256, (sum(map(len, starts)), SIZE, SIZE, 3), dtype=np.uint8)
    patches = np.zeros((rows, length, PATCH * PATCH * 3), np.float32)
    patches[tokens == IMAGE_ID] = patches_of(pixels, PATCH).reshape(-1, PATCH * PATCH * 3)
    return tokens, pixels, patches


def hf_logits(model, tokens, pixels):
    """transformers' logits; pixel values as the SigLIP processor makes them (rescale, normalise)."""
    px = (pixels.astype(np.float32) / 255 - np.float32(MEAN)) / np.float32(STD)
    px = torch.as_tensor(px.transpose(0, 3, 1, 2)) if len(px) else None
    with torch.no_grad():
        out = model(input_ids=torch.as_tensor(tokens), pixel_values=px)
    return out.logits.numpy()


def forward(cfg, params, rest, tokens, patches, mesh, positions=None):
    graphdef = nnx.graphdef(abstract_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    fn = jax.jit(lambda p, r, t, x, pos: nnx.merge(graphdef, p, r)(t, pos, patches=x)[0])
    with use_sharding(mesh, DEFAULT_RULES):
        return np.asarray(fn(params, rest, tokens, patches, positions))


def test_llava_logits_match_transformers_on_images_and_round_trip(tmp_path):
    model, src = hf_llava(tmp_path)
    tokens, pixels, patches = inputs()
    ref = hf_logits(model, tokens, pixels)
    text_only = hf_logits(model, np.where(tokens == IMAGE_ID, 0, tokens), pixels[:0])
    assert np.abs(ref - text_only).max() > 0.3  # the images change the logits: the comparison means something
    cfg = model_config_from_hf(src)
    assert (cfg.vision.encoder, cfg.vision.image_mean, cfg.vision.image_std) == ("vit", tuple(MEAN), tuple(STD))
    keep = np.arange(64) != IMAGE_ID  # posttrain never predicts the placeholder (its logit is -1e9)
    meshes = {
        "1 device": make_mesh(dict(data=1), jax.devices()[:1]),
        "8 devices": make_mesh(dict(data=2, fsdp=2, tensor=2)),
    }
    for name, mesh in meshes.items():
        with use_sharding(mesh, DEFAULT_RULES):
            params, rest, _ = load_model_state(f"hf:{src}", lambda: Decoder(cfg, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
        got = forward(cfg, params, rest, tokens, patches, mesh)
        np.testing.assert_allclose(got[..., keep], ref[..., keep], atol=1e-4, rtol=0, err_msg=name)
    wrong = model_config_from_hf(src).replace({"vision.image_std": (0.5,) * 3, "vision.vit_heads": 1})
    with pytest.raises(ValueError, match=r"model\.vision\.image_std: model has \(0\.5(.|\n)*model\.vision\.vit_heads"):
        load_model_state(f"hf:{src}", lambda: Decoder(wrong, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
    # tokens in any order (zig-zag): the tower regroups each image by position
    perm = np.random.default_rng(1).permutation(tokens.shape[1])
    positions = np.broadcast_to(np.arange(tokens.shape[1]), tokens.shape)[:, perm]
    got = forward(cfg, params, rest, tokens[:, perm], patches[:, perm], mesh, positions)
    np.testing.assert_allclose(got[..., keep], ref[:, perm][..., keep], atol=1e-4, rtol=0)
    # export: transformers reads the same model back, and so does posttrain
    out = str(tmp_path / "out")
    with open(os.path.join(src, "config.json")) as f:
        save_hf(out, params, cfg, base_config=json.load(f), progress=False)
    again = transformers.LlavaForConditionalGeneration.from_pretrained(out).eval()
    np.testing.assert_allclose(hf_logits(again, tokens, pixels), ref, atol=1e-5, rtol=0)
    assert model_config_from_hf(out).to_dict() == cfg.to_dict()


@pytest.mark.parametrize(
    "change, key",
    [
        (dict(vision_feature_layer=-2), "vision_feature_layer"),
        (dict(vision_feature_select_strategy="default"), "vision_feature_select_strategy"),
        (dict(projector_hidden_act="relu"), "projector_hidden_act"),
        (dict(image_seq_length=5), "image_seq_length"),
    ],
)
def test_unsupported_llava_config_is_an_error_naming_the_key(change, key):
    hf = llava_config(**change).to_dict()
    with pytest.raises(ValueError, match=key):
        model_config_from_llava(hf, {"image_mean": MEAN, "image_std": STD}, "m/config.json")


def test_llava_needs_a_siglip_tower_and_the_processor_normalisation():
    clip = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(image_size=SIZE, patch_size=PATCH),
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
    ).to_dict()
    with pytest.raises(ValueError, match="vision_config.model_type='clip_vision_model'"):
        model_config_from_llava(clip, {}, "m/config.json")
    with pytest.raises(ValueError, match=r"m/preprocessor_config.json: missing"):
        model_config_from_llava(llava_config().to_dict(), None, "m/config.json")
    cfg = model_config_from_llava(llava_config().to_dict(), {"do_normalize": False}, "m/config.json")
    assert (cfg.vision.image_mean, cfg.vision.image_std) == ((0.0,) * 3, (1.0,) * 3)


def tower(**vision):
    """A ViT tower (`model.vision.encoder = vit`) of a tiny model, its vision keys changed."""
    from posttrain.models.vision import make_vision

    vision = {
        **dict(encoder="vit", image_size=SIZE, patch_size=PATCH, image_token_id=IMAGE_ID),
        **dict(vit_width=16, vit_heads=2, vit_mlp_dim=24, vit_layers=1),
        **vision,
    }
    cfg = model({f"vision.{k}": v for k, v in vision.items()}, embed_dim=32)
    return make_vision(cfg, nnx.Rngs(0))


def same_weights(dst, src):
    """dst with src's values for every parameter both have."""
    theirs = dict(nnx.to_flat_state(nnx.state(src, nnx.Param)))
    mine = nnx.to_flat_state(nnx.state(dst, nnx.Param))
    nnx.update(dst, nnx.from_flat_state([(p, theirs[p]) for p, _ in mine]))
    return dst


def test_vit_keys_change_the_tower():
    tokens, _, patches = inputs(rows=2)
    base = tower()
    embed = lambda m: embed_with(m, tokens, patches)
    ref = embed(base)
    assert base.layers[0].fc1.shape == (16, 24) and base.proj2.shape == (32, 32) and len(base.layers) == 1
    assert len(tower(vit_layers=2).layers) == 2 and tower(vit_width=8).patch.shape == (48, 8)
    # (image_mean / image_std: the LLaVA parity test, whose processor constants are not 0 / 1)
    for change in (dict(vit_final_norm=False), dict(vit_heads=4)):
        assert not np.allclose(embed(same_weights(tower(**change), base)), ref), change
    assert not ref[tokens != IMAGE_ID].any() and ref[tokens == IMAGE_ID].std() > 0.1  # only placeholders change
    # each image is encoded on its own: changing one image leaves the others' embeddings alone
    other = patches.copy()
    other[0, 2:6] = 0.5
    changed = np.abs(embed_with(base, tokens, other) - ref).max(-1) > 1e-6
    assert changed[0, 2:6].all() and not changed[0, 6:].any() and not changed[1].any()


@nnx.jit
def _embed(model, tokens, patches):
    return model(tokens, patches, jnp.zeros((*tokens.shape, 32)))


def embed_with(model, tokens, patches):
    """The tower's output at each token (zeros where the token embedding is kept)."""
    return np.asarray(_embed(model, jnp.asarray(tokens), jnp.asarray(patches)))


def test_vit_config_rules():
    for change, message in [
        (dict(encoder="vit", vit_width=10, vit_heads=4), r"model\.vision\.vit_heads=4 must divide"),
        (dict(encoder="linear", image_mean=(0.5, 0.5, 0.5)), r"model\.vision\.image_mean.*only encoder='vit'"),
        (dict(encoder="vit", image_std=(1.0, 0.0, 1.0)), r"model\.vision\.image_std.*none zero"),
    ]:
        with pytest.raises(UserError, match=message):
            run_cfg({f"model.vision.{k}": v for k, v in change.items()})


def test_sampler_with_the_vit_tower_matches_the_learner():
    """Image prompts of different lengths (padded in the batch) through the KV-cached sampler: the
    tower encodes them in prefill and the log-probs are the learner's."""
    from posttrain.sampling.generate import generate
    from posttrain.sampling.rules import SamplingParams

    vision = dict(encoder="vit", image_size=SIZE, patch_size=PATCH, image_token_id=IMAGE_ID)
    vision.update(vit_width=8, vit_heads=2, vit_mlp_dim=16, vit_layers=1)
    cfg = model(
        {f"vision.{k}": v for k, v in vision.items()},
        **dict(vocab_size=64, embed_dim=16, num_layers=1, num_heads=2, num_kv_heads=1, head_dim=8, mlp_dim=32),
    )
    graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)
    prompts = [[1, 4, *[IMAGE_ID] * 4, 6, 2, 5], [1, *[IMAGE_ID] * 8, 7, 2, 5]]
    rng = np.random.default_rng(3)
    patches = [np.where((np.asarray(p) == IMAGE_ID)[:, None], rng.random((len(p), 48)), 0) for p in prompts]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=4)
    samples = generate(graphdef, params, rest, prompts, sampling, jax.random.key(0), patches=patches)
    seqs = [np.asarray([*prompt, *samples.completion(i)]) for i, prompt in enumerate(prompts)]
    length = max(map(len, seqs))  # one batched learner pass: rows padded at the end (causal: no effect)
    tokens = np.stack([np.pad(q, (0, length - len(q))) for q in seqs])
    full = np.stack([np.pad(p, ((0, length - len(p)), (0, 0))) for p in patches]).astype(np.float32)
    logits = jax.jit(lambda p, r, t, x: nnx.merge(graphdef, p, r)(t, patches=x)[0])(params, rest, tokens, full)
    logp = np.asarray(jax.nn.log_softmax(logits))
    for i, prompt in enumerate(prompts):
        n = int(samples.lengths[i])
        got = np.take_along_axis(logp[i, len(prompt) - 1 : len(prompt) - 1 + n], seqs[i][len(prompt) :, None], axis=1)
        np.testing.assert_allclose(samples.logprobs[i, :n], got[:, 0], rtol=1e-5, atol=1e-5)
