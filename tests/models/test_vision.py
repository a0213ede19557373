"""Images in the token stream (issue 29, items 1–2): records with image parts, patches in the batch,
the linear patch embedding in the decoder, sharded == one device, and SFT on tiny rendered images."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from PIL import Image

from posttrain.core.step import lm_loss
from posttrain.data.images import ImageSpec, patches_of, resolve_path
from posttrain.data.packing import Packer, build_row, fit_length
from posttrain.data.pipeline import sft_batches
from posttrain.data.sources import DataError
from posttrain.data.tokenizer import load_tokenizer
from posttrain.errors import UserError
from posttrain.models.decoder import Decoder
from tests.support.vision import BYTE, SPEC, abstract_split, image_batch, split_model, vision_config

COLOURS = {"red": (255, 0, 0), "green": (0, 255, 0), "blue": (0, 0, 255), "white": (255, 255, 255)}


def png(path, rgb, size=12):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (size, size), rgb).save(path)
    return path


def record(image: str, answer: str) -> dict:
    question = [{"type": "image", "image": image}, {"type": "text", "text": "Colour?"}]
    return {"messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]}


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


BATCH_KW = {"batch_size": 2, "seq_len": 32, "seed": 0, "process_index": 0, "process_count": 1, "images": SPEC}


def batches(path, **kw):
    return sft_batches(path, BYTE, **{**BATCH_KW, **kw})


def test_image_paths_resolve_under_the_jsonl_folder():
    assert resolve_path("img/a.png", "/data/x/train.jsonl") == "/data/x/img/a.png"
    assert resolve_path("/abs/a.png", "/data/x/train.jsonl") == "/abs/a.png"
    assert resolve_path("img/a.png", "gs://b/x/train.jsonl") == "gs://b/x/img/a.png"
    assert resolve_path("memory://m/a.png", "gs://b/x/train.jsonl") == "memory://m/a.png"


def test_patches_are_raster_order_in_0_1():
    pixels = np.arange(8 * 8 * 3, dtype=np.uint8).reshape(8, 8, 3)
    p = patches_of(pixels, 4)
    assert p.shape == (4, 48) and p.dtype == np.float32
    np.testing.assert_array_equal(p[1].reshape(4, 4, 3), np.float32(pixels[0:4, 4:8]) / 255)  # top-right patch
    np.testing.assert_array_equal(p[2].reshape(4, 4, 3), np.float32(pixels[4:8, 0:4]) / 255)  # bottom-left


def test_sft_batches_carry_patches_at_their_placeholders(tmp_path):
    png(tmp_path / "img" / "red.png", COLOURS["red"])
    png(tmp_path / "blue.png", COLOURS["blue"])
    path = write_jsonl(tmp_path / "train.jsonl", [record("img/red.png", "red"), record("blue.png", "blue")])
    batch = next(batches(path, shuffle=False, packing=False))
    inputs, patches = batch["inputs"], batch["patches"]
    assert patches.shape == (2, 32, SPEC.patch_dim) and patches.dtype == np.float32
    slots = inputs == BYTE.image_id
    assert (slots.sum(1) == SPEC.num_patches).all()  # each row's image whole
    assert not patches[~slots].any()  # zeros away from placeholders
    colours = {tuple(np.round(p.reshape(-1, 3).mean(0) * 255).astype(int)) for p in patches[slots]}
    assert colours == {(255, 0, 0), (0, 0, 255)}
    assert not (batch["loss_mask"] * ((batch["targets"] == BYTE.image_id) | slots)).any()  # no loss on images
    assert BYTE.decode(inputs[0]).startswith("Colour?")  # the placeholder decodes to nothing


def test_a_missing_image_names_file_and_line_or_is_skipped(tmp_path):
    png(tmp_path / "red.png", COLOURS["red"])
    (tmp_path / "broken.png").write_bytes(b"not a png")
    recs = [record("red.png", "red"), record("nowhere.png", "x"), record("broken.png", "y"), record("red.png", "red")]
    path = write_jsonl(tmp_path / "train.jsonl", recs)
    with pytest.raises(DataError, match=r"train\.jsonl:2: field 'messages'\[0\]\.content\[0\]: .*nowhere\.png"):
        next(batches(path, shuffle=False, batch_size=4, packing=False))
    it = batches(path, shuffle=False, on_error="skip", batch_size=2, packing=False)
    batch = next(it)
    assert it.skipped == 2 and (batch["inputs"] == BYTE.image_id).sum() == 2 * SPEC.num_patches


def test_an_image_needs_a_vision_model(tmp_path):
    png(tmp_path / "red.png", COLOURS["red"])
    path = write_jsonl(tmp_path / "train.jsonl", [record("red.png", "red")])
    with pytest.raises(DataError, match=r"train\.jsonl:1: .*image part, but model\.vision\.encoder='none'"):
        next(batches(path, images=None))


def example(n_text: int, images: int, rgb=(10, 20, 30)) -> dict:
    tokens = [1] + [BYTE.image_id] * (images * SPEC.num_patches) + [50] * n_text
    return {
        "tokens": np.asarray(tokens, np.int32),
        "loss_mask": np.asarray([False] * (1 + images * SPEC.num_patches) + [True] * n_text),
        "pixels": np.full((images, 8, 8, 3), rgb, np.uint8),
    }


def test_truncation_and_packing_never_cut_an_image():
    two = example(3, 2)  # 1 + 8 placeholders + 3 text
    with pytest.raises(ValueError, match="cut an image"):
        fit_length(two, 7, truncate=True, images=SPEC)  # inside the second image
    cut = fit_length(two, 5, truncate=True, images=SPEC)  # right after the first
    assert len(cut["pixels"]) == 1 and len(cut["tokens"]) == 5
    packer, rows = Packer(16, open_rows=2), []
    for ex in [example(2, 1, (255, 0, 0)), example(5, 1, (0, 255, 0)), example(1, 2, (0, 0, 255))]:
        rows += packer.add(ex)
    rows += packer.flush()
    for row in rows:
        built = build_row(row, 16, images=SPEC)
        slots = built["inputs"] == BYTE.image_id
        assert slots.sum() == sum(len(e["pixels"]) for e in row) * SPEC.num_patches
        for segment, ex in enumerate(row, start=1):  # each example's patches in its own segment
            mine = slots & (built["segment_ids"] == segment)
            got = built["patches"][mine].reshape(-1, 3)
            np.testing.assert_allclose(got, np.broadcast_to(ex["pixels"][0, 0, 0] / 255.0, got.shape))


def test_sft_batches_drop_an_example_whose_truncation_would_cut_its_image(tmp_path):
    png(tmp_path / "red.png", COLOURS["red"])
    long_question = record("red.png", "red")
    long_question["messages"][0]["content"].insert(0, {"type": "text", "text": "x" * 7})
    path = write_jsonl(tmp_path / "train.jsonl", [long_question, record("red.png", "red")])
    # the first: <bos> <user> 7 bytes, then its image at 9..12: a cut at 11 falls inside it (dropped);
    # the second's image is at 2..5: cut at 11 after it (kept, truncated)
    with pytest.raises(DataError, match=r"train\.jsonl:1: too long.*truncating would cut an image"):
        next(batches(path, seq_len=11, truncate=True, shuffle=False, packing=False, batch_size=1))
    it = batches(path, seq_len=11, truncate=True, on_error="skip", shuffle=False, packing=False, batch_size=1)
    batch = next(it)
    assert (it.skipped, it.truncated) == (1, 1) and (batch["inputs"] == BYTE.image_id).sum() == SPEC.num_patches


def test_text_only_model_has_no_vision_parameters():
    """encoder = none adds nothing (tests/test_golden.py pins that text-only runs are unchanged)."""
    _, params, _ = abstract_split("none")
    _, with_vision, _ = abstract_split()
    assert "vision" not in params
    assert {k: v.shape for k, v in with_vision["vision"].items()} == {"proj": (48, 16), "bias": (16,)}
    shapes = lambda state: jax.tree.map(lambda x: x.shape, nnx.to_pure_dict(state))
    assert shapes(params) == {k: v for k, v in shapes(with_vision).items() if k != "vision"}


def test_decoder_replaces_placeholder_embeddings_with_projected_patches():
    """Reference by hand: a text-only decoder whose vocabulary has one extra token per placeholder,
    its embedding row set to that placeholder's `patch @ proj + bias`, gives the same logits; the
    gradient of the patch projection is the chain rule through those rows."""
    batch = image_batch()
    graphdef, params, rest = split_model()
    cot = jnp.asarray(np.random.default_rng(1).normal(size=(*batch["inputs"].shape, 264)), jnp.float32)

    def f(params):
        logits, _ = nnx.merge(graphdef, params, rest)(batch["inputs"], patches=batch["patches"])
        return (logits * cot).sum(), logits

    (_, logits), grads = jax.value_and_grad(f, has_aux=True)(params)

    slots = np.argwhere(np.asarray(batch["inputs"]) == BYTE.image_id)
    n = len(slots)
    ref_graphdef, ref_params, ref_rest = abstract_split("none", 264 + n)
    assert not jax.tree.leaves(ref_rest)  # a dense model: parameters only
    for key in ("stacks", "final_norm"):
        ref_params[key] = params[key]
    ref_params["head"] = nnx.Param(jnp.pad(params["head"][...], ((0, 0), (0, n))))
    tokens = np.asarray(batch["inputs"]).copy()
    tokens[slots[:, 0], slots[:, 1]] = 264 + np.arange(n)
    picked = np.asarray(batch["patches"])[slots[:, 0], slots[:, 1]]  # [n, 48]
    proj, bias = params["vision"]["proj"][...], params["vision"]["bias"][...]

    def ref(embed_rows, proj, bias):
        p = jax.tree.map(lambda x: x, ref_params)
        p["embed"] = nnx.Param(jnp.concatenate([embed_rows, picked @ proj + bias]))
        logits, _ = nnx.merge(ref_graphdef, p, ref_rest)(jnp.asarray(tokens))
        logits = logits[..., :264].at[..., BYTE.image_id].set(-1e9)  # the placeholder is never predicted
        return (logits * cot).sum(), logits

    (_, ref_logits), ref_grads = jax.value_and_grad(ref, argnums=(0, 1, 2), has_aux=True)(
        params["embed"][...], proj, bias
    )
    np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grads["vision"]["proj"][...], ref_grads[1], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["vision"]["bias"][...], ref_grads[2], rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(grads["embed"][...], ref_grads[0], rtol=1e-4, atol=1e-5)
    assert np.abs(ref_grads[1]).max() > 0


@pytest.mark.parametrize("vision", [{}, {"patch_positions": True}], ids=["linear", "patch_positions"])
def test_sharded_with_images_equals_one_device(vision):
    from posttrain.core.state import shardings_for
    from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding

    cfg = vision_config(**vision)
    batch = image_batch(b=8)
    graphdef, params, rest = split_model(**vision)

    def loss_and_grads(params, rest, batch):
        return jax.value_and_grad(lambda p: lm_loss(nnx.merge(graphdef, p, rest), batch, cfg.model.moe)[0])(params)

    loss, grads = jax.jit(loss_and_grads)(params, rest, batch)
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    with use_sharding(mesh, DEFAULT_RULES):
        from posttrain.core.batch import put_batch

        sh = functools.partial(jax.device_put)
        sh_params = sh(params, shardings_for(params, mesh, DEFAULT_RULES))
        sh_rest = sh(rest, shardings_for(rest, mesh, DEFAULT_RULES))
        placed = put_batch({k: np.asarray(v) for k, v in batch.items()})
        assert placed["patches"].sharding.spec[0] == ("data", "fsdp")  # rows over the batch axes
        assert sh_params["vision"]["proj"][...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
        if vision:
            assert sh_params["vision"]["pos"][...].sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
        s_loss, s_grads = jax.jit(loss_and_grads)(sh_params, sh_rest, placed)
    np.testing.assert_allclose(s_loss, loss, rtol=1e-5)
    for (path, a), (_, r) in zip(
        jax.tree_util.tree_leaves_with_path(s_grads), jax.tree_util.tree_leaves_with_path(grads)
    ):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_vision_config_is_checked():
    from posttrain.config import run_config

    run_config(vision_config(encoder="vit"))  # built: models.vit (its own rules: tests/models/hf/test_llava.py)
    with pytest.raises(UserError, match=r"model\.vision\.patch_size=3 must divide"):
        vision_config(patch_size=3)
    with pytest.raises(UserError, match=r"model\.vision\.image_token_id=263: expected < model\.vocab_size=263"):
        vision_config({"model.vocab_size": 263})


def test_tokenizer_must_have_the_models_placeholder():
    from posttrain.stages.common import stage_tokenizer

    cfg = vision_config(image_token_id=5)
    with pytest.raises(UserError, match=r"model\.vision\.image_token_id=5.*image token's id is 263"):
        stage_tokenizer(cfg)
    assert stage_tokenizer(vision_config()).image_id == 263


@pytest.mark.parametrize("vision", [{}, {"patch_positions": True}], ids=["linear", "patch_positions"])
def test_sampling_with_images_prefills_patches_and_logprobs_equal_the_learners(vision):
    """The static KV-cached sampler with image prompts (rows of one and two images): its
    log-probs are the learner's forward pass over prompt + completion with the same patches, and
    the patches matter."""
    from posttrain.sampling.generate import generate
    from posttrain.sampling.rules import SamplingParams

    graphdef, params, rest = split_model(**vision)
    rng = np.random.default_rng(2)
    prompts = [[1, 4, *[BYTE.image_id] * 4, 60, 61, 2, 5], [1, 4, 70, *[BYTE.image_id] * 8, 2, 5]]
    patches = [np.where((np.asarray(p) == BYTE.image_id)[:, None], rng.random((len(p), 48)), 0) for p in prompts]
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    samples = generate(graphdef, params, rest, prompts, sampling, jax.random.key(0), patches=patches)
    blind = generate(graphdef, params, rest, prompts, sampling, jax.random.key(0), patches=[p * 0 for p in patches])
    assert not np.allclose(samples.logprobs, blind.logprobs)  # the images reach the prompt's cache
    assert BYTE.image_id not in samples.tokens  # the placeholder is never sampled (its logit is masked)
    model = nnx.merge(graphdef, params, rest)
    for i, (prompt, p) in enumerate(zip(prompts, patches)):
        n = int(samples.lengths[i])
        seq = np.asarray([*prompt, *samples.completion(i)])[None]
        full = np.concatenate([p, np.zeros((n, 48))])[None]
        logits, _ = model(jnp.asarray(seq), patches=jnp.asarray(full, jnp.float32))
        logp = jax.nn.log_softmax(logits[0, len(prompt) - 1 : -1])
        learner = np.take_along_axis(np.asarray(logp), seq[0, len(prompt) :, None], axis=1)[:, 0]
        np.testing.assert_allclose(samples.logprobs[i, :n], learner, rtol=1e-5, atol=1e-5)


def test_sft_on_tiny_rendered_images_learns_the_colour(tmp_path):
    """`posttrain.main.run` on solid-colour PNGs whose answer is the colour's name (the question is
    the same for all, so only the image tells them apart): the loss falls, the eval loss is
    computed with images, and the sample log's greedy answers to image prompts name the colours."""
    from posttrain import main

    records = []
    for name, rgb in COLOURS.items():
        png(tmp_path / "images" / f"{name}.png", rgb, size=10)
        records.append(record(f"images/{name}.png", name))
    train = write_jsonl(tmp_path / "train.jsonl", records * 4)
    cfg = vision_config(
        {
            "stage": "sft",
            "workdir": str(tmp_path / "run"),
            "sft.train_files": train,
            "sft.eval_files": train,
            "sft.sample_tokens": 8,
            **{"train.steps": 50, "train.batch_size": 8, "train.seq_len": 32},
            **{"train.log_every": 10, "train.eval_every": 50, "train.progress": False},
            **{"optim.lr": 1e-2, "optim.warmup_steps": 5, "checkpoint.every": 1000},
        }
    )
    result = main.run(cfg)
    losses = [r["ce"] for r in result.rows if "ce" in r]
    assert losses[-1] < 0.5 * losses[0], losses
    assert result.eval["eval/loss"] < 0.5 * losses[0], result.eval
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert {s["prompt"] for s in samples} == {"<image>Colour?"}
    # the same question, told apart by the image alone (the first three records: red, green, blue)
    assert [s["completion"] for s in samples] == ["red", "green", "blue"]


def test_a_vision_model_is_not_exported_as_a_text_family():
    from posttrain.models.hf.config import hf_config_from_model

    with pytest.raises(ValueError, match=r"cannot represent model\.vision\.encoder='linear'"):
        hf_config_from_model(vision_config().model)
    assert hf_config_from_model(vision_config(encoder="none").model, context=32)["architectures"] == [
        "LlamaForCausalLM"
    ]


def test_iterator_state_with_images_resumes_the_same_batches(tmp_path):
    """Open packed rows hold uint8 pixels; the JSON state brings them back (and their patches)."""
    for name, rgb in COLOURS.items():
        png(tmp_path / f"{name}.png", rgb)
    path = write_jsonl(tmp_path / "train.jsonl", [record(f"{n}.png", n) for n in COLOURS] * 3)
    first = batches(path, batch_size=2, seq_len=48)
    next(first)
    state = json.loads(json.dumps(first.get_state()))
    assert any(row for row in state["batcher"]["packer"]["rows"])  # something carried over
    expected = [next(first) for _ in range(3)]
    resumed = batches(path, batch_size=2, seq_len=48)
    resumed.set_state(state)
    for want in expected:
        got = next(resumed)
        for k in want:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


def test_zig_zag_layout_moves_patches_with_their_tokens():
    """Context parallelism lays rows out in zig-zag order before placing them; patches are aligned
    with the tokens, so each placeholder keeps its own patch."""
    from posttrain.parallel.zigzag import unzigzag, zigzag_batch

    batch = {k: np.asarray(v) for k, v in image_batch(b=2, s=16).items()}
    zz = zigzag_batch(batch, 2)
    assert not np.array_equal(zz["inputs"], batch["inputs"])
    slots = zz["inputs"] == BYTE.image_id
    assert (np.abs(zz["patches"]).sum(-1) > 0)[slots].all() and not zz["patches"][~slots].any()
    np.testing.assert_array_equal(unzigzag(zz["patches"], 2), batch["patches"])


def test_a_hugging_face_tokenizer_without_an_image_token_is_refused(tmp_path):
    from posttrain.stages.common import stage_tokenizer
    from tests.support.hf import make_hf_folder

    tokenizer = make_hf_folder(str(tmp_path / "tok"), {"eos_token": "<|im_end|>"})
    cfg = vision_config({"model.vocab_size": 320, "data.tokenizer": tokenizer})
    with pytest.raises(UserError, match=r"data\.tokenizer.*no image token"):
        stage_tokenizer(cfg)
    with pytest.raises(ValueError, match="no image token"):
        load_tokenizer(cfg.data.tokenizer).encode_chat(record("x.png", "red")["messages"])


def test_a_hugging_face_tokenizer_expands_its_image_token_to_the_patches(tmp_path):
    """As a LLaVA processor does: an image part is the tokenizer's `<image>` token in the rendered
    chat, expanded to the image's patches (never trainable), and SFT batches carry the patches there."""
    from posttrain.stages.common import stage_tokenizer
    from tests.support.hf import CHATML, make_hf_folder

    root = make_hf_folder(str(tmp_path / "tok"), {"eos_token": "<|im_end|>", "chat_template": CHATML}, ("<image>",))
    tok = load_tokenizer(root)
    image_id = tok.encode("<image>")[0]
    assert tok.image_id == image_id and tok.encode("<image>") == [image_id]
    parts = [{"type": "image", "num_patches": 4}, {"type": "text", "text": "Colour?"}]
    ids, mask = tok.encode_chat([{"role": "user", "content": parts}, {"role": "assistant", "content": "red"}])
    flat_ids, flat_mask = tok.encode_chat(
        [{"role": "user", "content": "<image>Colour?"}, {"role": "assistant", "content": "red"}]
    )
    at = flat_ids.index(image_id)
    assert ids == flat_ids[:at] + [image_id] * 4 + flat_ids[at + 1 :]
    assert mask == flat_mask[:at] + [False] * 4 + flat_mask[at + 1 :] and any(mask)
    with pytest.raises(ValueError, match="1 image parts but 2 '<image>' tokens"):
        tok.encode_chat([{"role": "user", "content": [parts[0], {"type": "text", "text": "<image>?"}]}])

    png(tmp_path / "red.png", COLOURS["red"])
    png(tmp_path / "blue.png", COLOURS["blue"])
    path = write_jsonl(tmp_path / "train.jsonl", [record("red.png", "red"), record("blue.png", "blue")])
    spec = ImageSpec(image_size=8, patch_size=4, token_id=image_id)
    batch = next(
        sft_batches(path, tok, **{**BATCH_KW, "images": spec, "seq_len": 64, "shuffle": False, "packing": False})
    )
    slots = batch["inputs"] == image_id
    assert (slots.sum(1) == 4).all()
    colours = {tuple(np.round(p.reshape(-1, 3).mean(0) * 255).astype(int)) for p in batch["patches"][slots]}
    assert colours == {(255, 0, 0), (0, 0, 255)}
    assert not (batch["loss_mask"] * slots).any() and batch["loss_mask"].any()

    cfg = vision_config({"model.vocab_size": 320, "data.tokenizer": root}, image_token_id=image_id)
    assert stage_tokenizer(cfg).image_id == image_id


def test_patch_positions_add_a_learned_embedding_of_each_patchs_place():
    """model.vision.patch_positions: a placeholder's input is `patch @ proj + bias + pos[k mod N]`
    for the k-th placeholder of its row (N patches an image), also when the row is laid out in
    zig-zag order; the gradient of `pos` is the sum of the cotangents at each place (numpy
    reference); the embedding starts at zero, so an untrained model equals the plain linear one."""
    from posttrain.parallel.zigzag import zigzag_batch

    cfg = vision_config(patch_positions=True)
    model = Decoder(cfg.model, rngs=nnx.Rngs(0))
    assert not np.asarray(model.vision.pos[...]).any()  # zero-initialised: the linear embedding
    pos = np.random.default_rng(3).normal(size=model.vision.pos.shape).astype(np.float32)
    model.vision.pos[...] = jnp.asarray(pos)
    batch = {k: np.asarray(v) for k, v in image_batch(b=2, s=16).items()}
    tokens, patches = batch["inputs"], batch["patches"]
    x = np.zeros((*tokens.shape, 16), np.float32)
    proj, bias = np.asarray(model.vision.proj[...]), np.asarray(model.vision.bias[...])
    want = x.copy()
    for row in range(2):
        slots = np.flatnonzero(tokens[row] == BYTE.image_id)
        want[row, slots] = patches[row, slots] @ proj + bias + pos[np.arange(len(slots)) % SPEC.num_patches]
    got = model.vision(jnp.asarray(tokens), jnp.asarray(patches), jnp.asarray(x))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    zz = zigzag_batch(batch, 2)
    got_zz = model.vision(*map(jnp.asarray, (zz["inputs"], zz["patches"], x)), zz["positions"], zz["segment_ids"])
    np.testing.assert_allclose(got_zz, zigzag_batch({"inputs": want}, 2)["inputs"], rtol=1e-5, atol=1e-5)

    cot = np.random.default_rng(4).normal(size=want.shape).astype(np.float32)
    graphdef, state = nnx.split(model.vision)
    grads = jax.grad(
        lambda s: (nnx.merge(graphdef, s)(jnp.asarray(tokens), jnp.asarray(patches), jnp.asarray(x)) * cot).sum()
    )(state)
    ref = np.zeros_like(pos)
    for row in range(2):
        slots = np.flatnonzero(tokens[row] == BYTE.image_id)
        np.add.at(ref, np.arange(len(slots)) % SPEC.num_patches, cot[row, slots])
    np.testing.assert_allclose(grads["pos"][...], ref, rtol=1e-5, atol=1e-5)
    assert np.abs(ref).max() > 0


def test_patch_positions_are_read_only_by_the_linear_encoder():
    from posttrain.config import run_config

    run_config(vision_config(patch_positions=True))
    with pytest.raises(UserError, match=r"model\.vision\.patch_positions=True: read only with encoder='linear'"):
        vision_config(encoder="vit", patch_positions=True)
    _, params, _ = abstract_split()
    assert "pos" not in params["vision"]  # off by default: the plain linear embedding
