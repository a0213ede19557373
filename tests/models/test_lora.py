"""LoRA: only adapters train; merged weights are W + (alpha/r)·A@B per layer and per expert."""

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
from tests.support.typed_configs import run_cfg


def config(changes=None):
    shape = dict(vocab_size=32, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    return run_cfg(
        {
            **{f"model.{k}": v for k, v in shape.items()},
            **{"model.moe.num_experts": 4, "model.moe.expert_mlp_dim": 16, "model.moe.first_dense": 1},
            **{"lora.rank": 2, "lora.alpha": 4.0, "lora.targets": ("q", "o", "down", "w_up")},
            **(changes or {}),
        }
    )


def test_merge_is_w_plus_scaled_low_rank_per_layer_and_expert():
    cfg = config()
    _, params, _ = nnx.split(Decoder(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    adapters = lora.init_adapters(params, cfg.lora.targets, 2, jax.random.key(1))
    assert set(adapters) == {
        "stacks/0/blocks/0/attn/q",
        "stacks/0/blocks/0/attn/o",
        "stacks/0/blocks/0/mlp/down",
        "stacks/1/blocks/0/attn/q",
        "stacks/1/blocks/0/attn/o",
        "stacks/1/blocks/0/mlp/w_up",
    }
    rng = np.random.default_rng(0)
    adapters = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), adapters)
    merged = lora.merge(params, adapters, 0.5)
    # o: [layers, heads, head_dim, embed], fan-in = heads*head_dim
    w, a, b = (
        np.asarray(x)
        for x in (
            params["stacks"][0]["blocks"][0]["attn"]["o"][...],
            adapters["stacks/0/blocks/0/attn/o"]["a"][...],
            adapters["stacks/0/blocks/0/attn/o"]["b"][...],
        )
    )
    l, h, d, e = w.shape
    expected = w + 0.5 * np.einsum("lir,lro->lio", a, b).reshape(l, h, d, e)
    np.testing.assert_allclose(merged["stacks"][0]["blocks"][0]["attn"]["o"][...], expected, rtol=1e-5, atol=1e-6)
    # expert w_up: [layers, experts, embed, expert_mlp]: one adapter per layer and expert
    w = np.asarray(params["stacks"][1]["blocks"][0]["mlp"]["w_up"][...])
    ad = adapters["stacks/1/blocks/0/mlp/w_up"]
    assert ad["a"].shape == (1, 4, 16, 2) and ad["b"].shape == (1, 4, 2, 16)
    expected = w + 0.5 * np.einsum("leir,lero->leio", np.asarray(ad["a"][...]), np.asarray(ad["b"][...]))
    np.testing.assert_allclose(merged["stacks"][1]["blocks"][0]["mlp"]["w_up"][...], expected, rtol=1e-5, atol=1e-6)
    # untouched weights are the same arrays
    assert merged["stacks"][0]["blocks"][0]["attn"]["k"][...] is params["stacks"][0]["blocks"][0]["attn"]["k"][...]


def test_only_adapters_train_and_logits_follow_the_merge():
    cfg = config()
    mesh = make_mesh(dict(data=2, expert=2, tensor=2))
    tx = make_optimizer(cfg.optim, 10)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 32, (4, 9))
    batch = {
        "inputs": jnp.asarray(tokens[:, :-1]),
        "targets": jnp.asarray(tokens[:, 1:]),
        "loss_mask": jnp.ones((4, 8), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(8), (4, 8)),
        "segment_ids": jnp.ones((4, 8), jnp.int32),
    }
    with use_sharding(mesh, DEFAULT_RULES):
        graphdef, state, shardings = create_train_state(
            lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, DEFAULT_RULES, cfg.lora
        )
        assert all(
            isinstance(v, nnx.LoRAParam)
            for v in jax.tree.leaves(state.params, is_leaf=lambda x: isinstance(x, nnx.Variable))
        )
        n_adapter = sum(x.size for x in jax.tree.leaves(state.params))
        assert (
            sum(x.size for x in jax.tree.leaves(state.opt_state)) == 2 * n_adapter + 2
        )  # Adam mu, nu; Adam and schedule step counts
        base = jax.device_get(state.frozen)
        logits0 = nnx.merge(graphdef, model_params(state, cfg.lora), state.rest)(batch["inputs"])[0]
        step = jax.jit(
            make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe), lora_cfg=cfg.lora),
            out_shardings=(shardings, None),
        )
        for _ in range(3):
            state, metrics = step(state, batch)
        for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(jax.device_get(state.frozen))):
            np.testing.assert_array_equal(a, b)  # the base never moves
        assert any(np.abs(np.asarray(x)).max() > 0 for k, ad in state.params.items() for x in [ad["b"][...]])
        merged = model_params(state, cfg.lora)
        logits = nnx.merge(graphdef, merged, state.rest)(batch["inputs"])[0]
    assert not np.allclose(logits, logits0, atol=1e-4)  # adapters changed the model
    # The adapted model evaluated on explicitly merged host weights gives the same logits.
    host = lora.merge(jax.device_get(state.frozen), jax.device_get(state.params), cfg.lora.alpha / cfg.lora.rank)
    ref = nnx.merge(graphdef, host, jax.device_get(state.rest))(batch["inputs"])[0]
    np.testing.assert_allclose(logits, ref, rtol=1e-5, atol=1e-5)


def test_bad_lora_config_is_named():
    cfg = config()
    _, params, _ = nnx.split(Decoder(cfg.model, rngs=nnx.Rngs(0)), nnx.Param, ...)
    with pytest.raises(ValueError, match="lora.targets"):
        lora.init_adapters(params, ("qq",), 2, jax.random.key(0))
    with pytest.raises(ValueError, match="lora.dropout"):  # refused by the typed config, before any state
        config({"lora.dropout": 0.1})
