"""Sharded == unsharded: logits, loss and gradients on several 8-device meshes; params placed as the rules say."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state, shardings_for
from posttrain.core.step import lm_loss, make_train_step
from posttrain.models.decoder import Decoder
from posttrain.parallel import DEFAULT_RULES, logical_spec, make_mesh, resolve_mesh_shape, use_sharding
from tests.support.sharding import batch, moe_config

MESHES = [dict(data=8), dict(data=2, expert=2, tensor=2), dict(fsdp=2, expert=4), dict(tensor=2, expert=2, data=2)]


def loss_and_grads(graphdef, params, rest, batch, *, moe_cfg):
    def f(params):
        model = nnx.merge(graphdef, params, rest)
        logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
        loss, metrics = lm_loss(model, batch, moe_cfg)
        return loss, (logits, metrics)

    (loss, (logits, metrics)), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, logits, metrics, grads


@pytest.fixture(scope="module")
def reference():
    cfg = moe_config()
    model = Decoder(cfg.model, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    b = batch(cfg)
    fn = jax.jit(functools.partial(loss_and_grads, graphdef, moe_cfg=cfg.model.moe))
    out = fn(params, rest, b)
    return cfg, graphdef, params, rest, b, out


# ZeRO-3 weights over fsdp with the residual stream's embed dim over tensor (activation names)
ACTIVATIONS_ON_TENSOR = {**DEFAULT_RULES, "activation_embed": ("tensor",)}
LAYOUTS = [(sizes, DEFAULT_RULES) for sizes in MESHES] + [(dict(fsdp=4, tensor=2), ACTIVATIONS_ON_TENSOR)]


@pytest.mark.parametrize(
    "sizes, rules",
    LAYOUTS,
    ids=[
        ",".join(f"{k}={v}" for k, v in s.items()) + ("" if r is DEFAULT_RULES else ",activations-on-tensor")
        for s, r in LAYOUTS
    ],
)
def test_sharded_matches_single_device(reference, sizes, rules):
    cfg, graphdef, params, rest, b, (loss, logits, metrics, grads) = reference
    mesh = make_mesh({**dict(data=1), **sizes})
    with use_sharding(mesh, rules):
        sh_params = jax.device_put(params, shardings_for(params, mesh, rules))
        sh_rest = jax.device_put(rest, shardings_for(rest, mesh, rules))
        fn = jax.jit(functools.partial(loss_and_grads, graphdef, moe_cfg=cfg.model.moe))
        s_loss, s_logits, s_metrics, s_grads = fn(sh_params, sh_rest, b)
    np.testing.assert_allclose(s_loss, loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(s_logits, logits, rtol=1e-5, atol=1e-5)
    for k in ("moe/aux_loss", "moe/z_loss", "moe/load"):
        np.testing.assert_allclose(s_metrics[k], metrics[k], rtol=1e-5, atol=1e-6, err_msg=k)
    for (path, a), (_, r) in zip(
        jax.tree_util.tree_leaves_with_path(s_grads), jax.tree_util.tree_leaves_with_path(grads)
    ):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_params_and_optimizer_state_sharded_by_rules():
    cfg = moe_config()
    mesh = make_mesh(dict(data=1, fsdp=2, expert=2, tensor=2))
    tx = make_optimizer(cfg.optim, 10)
    with use_sharding(mesh, DEFAULT_RULES):
        graphdef, state, _ = create_train_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, DEFAULT_RULES)
    dense, moe = state.params["stacks"][0]["blocks"][0], state.params["stacks"][1]["blocks"][0]
    assert dense["attn"]["q"].sharding.spec == P(None, "fsdp", "tensor")  # layers, embed, heads, head_dim
    assert dense["attn"]["k"].sharding.spec == P(None, "fsdp", "tensor")
    assert dense["mlp"]["down"].sharding.spec == P(None, "tensor", "fsdp")  # layers, mlp, embed
    assert moe["mlp"]["w_gate"].sharding.spec == P(
        None, "expert", "fsdp", "tensor"
    )  # layers, experts, embed, expert_mlp
    assert moe["mlp"]["w_down"].sharding.spec == P(None, "expert", "tensor", "fsdp")
    assert state.params["embed"].sharding.spec == P("tensor", "fsdp")
    # Adam moments live where their parameters live.
    mu = state.opt_state[1][0].mu
    assert mu["stacks"][1]["blocks"][0]["mlp"]["w_gate"].sharding.spec == P(None, "expert", "fsdp", "tensor")
    # Each device holds 1/8 of an expert weight.
    w = moe["mlp"]["w_gate"]
    assert w.addressable_shards[0].data.size * 8 == w.size


def test_train_step_sharded_matches_single_device():
    cfg = moe_config()
    b = batch(cfg)
    results = []
    for sizes in (dict(data=1), dict(data=2, expert=2, tensor=2)):
        devices = jax.devices()[:1] if sizes == dict(data=1) else None
        mesh = make_mesh(sizes, devices=devices)
        tx = make_optimizer(cfg.optim, 10)
        with use_sharding(mesh, DEFAULT_RULES):
            graphdef, state, shardings = create_train_state(
                lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), tx, mesh, DEFAULT_RULES
            )
            step = jax.jit(
                make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe)),
                out_shardings=(shardings, None),
                donate_argnums=0,
            )
            for _ in range(2):
                state, metrics = step(state, b)
        results.append((jax.device_get(metrics["loss"]), jax.device_get(state.params)))
    np.testing.assert_allclose(results[0][0], results[1][0], rtol=1e-5)
    for a, r in zip(jax.tree.leaves(results[0][1]), jax.tree.leaves(results[1][1])):
        np.testing.assert_allclose(
            a, r, rtol=1e-3, atol=2e-4
        )  # Adam normalises near-zero gradients, amplifying float noise


def test_logical_spec_rules():
    mesh = make_mesh(dict(data=2, fsdp=1, expert=2, tensor=2))
    assert logical_spec(("batch", "length", "embed"), mesh, DEFAULT_RULES) == P(("data", "expert"))
    # 2 KV heads cannot split 4 ways: stays replicated rather than failing.
    mesh4 = make_mesh(dict(data=2, tensor=4))
    assert logical_spec(("embed", "kv_heads", "head_dim"), mesh4, DEFAULT_RULES, (16, 2, 8)) == P()
    assert logical_spec(("embed", "heads", "head_dim"), mesh4, DEFAULT_RULES, (16, 8, 8)) == P(None, "tensor")


def test_mesh_shape_errors_name_the_problem():
    assert resolve_mesh_shape(dict(data=-1, tensor=2), 8) == (4, 1, 1, 2, 1)
    with pytest.raises(ValueError, match="needs 6 devices but 8"):
        resolve_mesh_shape(dict(data=3, tensor=2), 8)
    with pytest.raises(ValueError, match="at most one axis"):
        resolve_mesh_shape(dict(data=-1, tensor=-1), 8)
    with pytest.raises(ValueError, match="unknown axes"):
        resolve_mesh_shape(dict(dta=8), 8)


def test_platform_comes_from_the_mesh_and_cpu_meshes_keep_the_cpu_paths(monkeypatch):
    """`mesh_platform` reads the devices of the mesh a program is built for; on a CPU mesh the MoE
    dispatch stays padded and the sampler slices layers before its loop (the TPU side is checked
    by tests/plan/test_compile_plan.py, which builds a mesh over abstract TPU devices; the switch that
    takes the accelerator paths on the CPU by tests/parallel/test_mesh_platform_paths.py)."""
    from posttrain.models.moe.dispatch import expert_layout
    from posttrain.parallel import mesh_platform
    from posttrain.parallel.mesh import ACCELERATOR_PATHS_ENV
    from posttrain.sampling import engine

    monkeypatch.delenv(ACCELERATOR_PATHS_ENV, raising=False)
    assert mesh_platform() == "cpu"
    mesh = make_mesh(dict(data=2, expert=4))
    assert mesh_platform(mesh) == "cpu"
    cfg = moe_config()
    model = Decoder(cfg.model, rngs=nnx.Rngs(0))
    with use_sharding(mesh, DEFAULT_RULES):
        assert mesh_platform() == "cpu"
        layout = expert_layout(mesh, P(("data", "expert")), P(), P("expert"), P("expert"), "auto")
        assert layout.dispatch == "padded"
        assert engine.decode_layers(model) is not None


def test_activation_and_weight_layouts_change_independently():
    """`activation_embed` moves the residual stream, not the weights; `embed` moves the weights,
    not the residual stream."""
    cfg = moe_config()
    mesh = make_mesh(dict(fsdp=4, tensor=2))
    tokens = jnp.zeros((8, 8), jnp.int32)

    def layouts(rules):
        with use_sharding(mesh, rules):
            model = nnx.merge(*nnx.split(Decoder(cfg.model, rngs=nnx.Rngs(0))))
            _, params, _ = nnx.split(model, nnx.Param, ...)
            weight = shardings_for(params, mesh, rules)["embed"].get_value().spec
            hidden = jax.jit(lambda t: model._embed(t))(tokens).sharding.spec
        return weight, hidden

    assert layouts(DEFAULT_RULES) == (P("tensor", "fsdp"), P("fsdp"))
    assert layouts(ACTIVATIONS_ON_TENSOR) == (P("tensor", "fsdp"), P("fsdp", None, "tensor"))
    assert layouts({**DEFAULT_RULES, "embed": ()}) == (P("tensor"), P("fsdp"))
