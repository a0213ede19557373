"""LoRA on the image weights (issue 29 item 2): vision targets name the patch embedding, the ViT
tower and the projector, never the decoder's (nor the decoder's the tower's); an SFT step with
images trains only the adapters, and the merged weights are W + (alpha/r)·A@B."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state, model_params
from posttrain.core.step import lm_loss, make_train_step
from posttrain.models import lora
from posttrain.models.decoder import Decoder
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from tests.support.vision import abstract_split, image_batch, vision_config

TOWER = dict(vit_layers=1, vit_width=16, vit_heads=2, vit_mlp_dim=32)


def test_vision_targets_name_only_the_image_weights():
    _, vit, _ = abstract_split("vit")
    _, linear, _ = abstract_split("linear")
    _, text, _ = abstract_split("none")
    paths = lambda params, targets: set(lora.target_paths(params, targets))  # noqa: E731
    assert paths(vit, ("wq", "fc2", "patch", "proj1", "proj2")) == {
        "vision/layers/0/wq",
        "vision/layers/1/wq",
        "vision/layers/0/fc2",
        "vision/layers/1/fc2",
        "vision/patch",
        "vision/proj1",
        "vision/proj2",
    }
    assert paths(linear, ("proj",)) == {"vision/proj"}
    # the decoder's targets never reach the tower: the default adapts the language model only
    assert paths(vit, ("q", "k", "v", "o")) == paths(text, ("q", "k", "v", "o"))
    assert not any(p.startswith("vision/") for p in paths(vit, lora.TEXT_TARGETS))
    for params, targets in ((text, ("q", "proj")), (linear, ("q", "wq")), (vit, ("proj",))):
        with pytest.raises(ValueError, match=r"lora.targets: vision targets \['(proj|wq)'\] match no weight"):
            lora.target_paths(params, targets)
    with pytest.raises(ValueError, match=r"lora.targets: unknown \['vit_q'\]"):
        lora.target_paths(vit, ("q", "vit_q"))


def test_linear_patch_embedding_merge_is_w_plus_scaled_low_rank():
    _, params, _ = abstract_split("linear")  # shapes only: merge leaves untargeted weights as they are
    rng = np.random.default_rng(0)
    params["vision"]["proj"] = nnx.Param(jnp.asarray(rng.normal(size=(48, 16)), jnp.float32))
    adapters = lora.init_adapters(params, ("proj",), 2, jax.random.key(1))
    assert set(adapters) == {"vision/proj"}
    ad = adapters["vision/proj"]
    assert ad["a"].shape == (48, 2) and ad["b"].shape == (2, 16)
    ad["b"] = nnx.LoRAParam(jnp.asarray(rng.normal(size=(2, 16)), jnp.float32))
    merged = lora.merge(params, adapters, 0.5)
    w, a, b = (np.asarray(x) for x in (params["vision"]["proj"][...], ad["a"][...], ad["b"][...]))
    np.testing.assert_allclose(merged["vision"]["proj"][...], w + 0.5 * a @ b, rtol=1e-5, atol=1e-6)
    assert merged["vision"]["bias"] is params["vision"]["bias"]


def test_lora_sft_step_with_images_moves_only_the_adapters():
    targets = ("q", "wq", "wv", "fc1", "patch", "proj1", "proj2")
    cfg = vision_config({"lora.rank": 2, "lora.alpha": 4.0, "lora.targets": targets}, encoder="vit", **TOWER)
    mesh = make_mesh(dict(data=2, fsdp=2, tensor=2))
    tx = make_optimizer(cfg.optim, 10)
    batch = image_batch()
    with use_sharding(mesh, DEFAULT_RULES):
        graphdef, state, shardings = create_train_state(
            lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, DEFAULT_RULES, cfg.lora
        )
        assert {k for k in state.params if k.startswith("vision/")} == {
            "vision/layers/0/wq",
            "vision/layers/0/wv",
            "vision/layers/0/fc1",
            "vision/patch",
            "vision/proj1",
            "vision/proj2",
        }
        base = jax.device_get(state.frozen)
        step = jax.jit(
            make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe), lora_cfg=cfg.lora),
            out_shardings=(shardings, None),
        )
        for _ in range(2):  # the first step's learning rate is 0 (warmup)
            state, _ = step(state, batch)
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(jax.device_get(state.frozen))):
            np.testing.assert_array_equal(a, b)  # the base (tower included) never moves
        adapters = jax.device_get(state.params)
        for k, ad in adapters.items():  # the image gradient reaches every adapter, the tower's too
            assert np.abs(np.asarray(ad["b"][...])).max() > 0, k
        merged = jax.device_get(model_params(state, cfg.lora))  # the weights the step's model uses
    scale = cfg.lora.alpha / cfg.lora.rank
    at = lambda tree, path: functools.reduce(lambda t, k: t[int(k) if k.isdigit() else k], path.split("/"), tree)  # noqa: E731
    for path in ("vision/layers/0/wq", "vision/proj1", "vision/patch", "stacks/0/blocks/0/attn/q"):
        a, b = (np.asarray(adapters[path][x][...]) for x in "ab")
        w = np.asarray(at(base, path)[...])
        want = w + scale * (a.reshape(-1, *a.shape[-2:]) @ b.reshape(-1, *b.shape[-2:])).reshape(w.shape)
        np.testing.assert_allclose(at(merged, path)[...], want, rtol=1e-5, atol=1e-6, err_msg=path)
    np.testing.assert_array_equal(at(merged, "vision/layers/0/wk")[...], at(base, "vision/layers/0/wk")[...])
