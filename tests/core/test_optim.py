"""`optim.name` / `optim.moment_dtype`: Adafactor and bf16 AdamW moments against plain optax on raw
arrays, sharded (8 devices) == unsharded, factored statistics sharded along their parameter's axes,
a sharded train step that learns and resumes exactly, and the keys' refusals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.config import base_config, run_config
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.harness import starting_state
from posttrain.core.optim import lr_schedule, make_optimizer
from posttrain.core.state import create_train_state, shardings_for
from posttrain.core.step import lm_loss, make_train_step
from posttrain.errors import UserError
from posttrain.models.decoder import Decoder
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from tests.support.sharding import batch, moe_config
from tests.support.typed_configs import typed

MESH = dict(data=1, fsdp=2, expert=2, tensor=2)


def optim_config(**kw):
    # warmup 0: the first step moves, lr(0) = optim.lr
    changes = {"optim.warmup_steps": 0, "optim.weight_decay": 0.1, **{f"optim.{k}": v for k, v in kw.items()}}
    return typed(moe_config()).replace(changes)


def unbox(tree):
    return jax.tree.map(lambda v: v.get_value(), tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


@pytest.fixture(scope="module")
def params_and_grads():
    """Random params shaped and named as the tiny MoE decoder's (nnx Variables) and two random gradients."""
    shapes = jax.eval_shape(lambda: nnx.split(Decoder(moe_config().model, rngs=nnx.Rngs(0)), nnx.Param, ...)[1])
    rng = np.random.default_rng(0)
    normal = lambda scale: jax.tree.map(lambda x: jnp.asarray(rng.normal(0, scale, x.shape), jnp.float32), shapes)
    return normal(0.5), [normal(0.1), normal(0.1)]


def two_steps(tx, params, grads):
    """Params after two updates of `tx` (init included)."""
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def test_adafactor_equals_plain_optax_with_decoupled_decay(params_and_grads):
    """Our Adafactor (global-norm clip, schedule, lr-scaled decay on matrices, nnx Variables) is
    optax.adafactor on raw arrays plus -lr(t) * weight_decay * param on matrices."""
    params, grads = params_and_grads
    cfg = optim_config(name="adafactor", factored_min_dim=8).optim
    schedule = lr_schedule(cfg, 10)
    got, state = jax.jit(functools.partial(two_steps, make_optimizer(cfg, 10)))(params, grads)

    ref_tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adafactor(schedule, min_dim_size_to_factor=8, multiply_by_parameter_scale=False),
    )

    @jax.jit
    def reference(p, grads):
        s = ref_tx.init(p)
        for t, g in enumerate(grads):
            u, s = ref_tx.update(g, s, p)
            p = jax.tree.map(lambda x, d: x + d - (schedule(t) * cfg.weight_decay * x if x.ndim >= 2 else 0), p, u)
        return p

    p = reference(unbox(params), [unbox(g) for g in grads])
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(unbox(got)), jax.tree.leaves(p)):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    factored = state[1][0]
    w = factored.v_row["stacks"][1]["blocks"][0]["mlp"]["w_gate"]  # [layers, experts, embed, expert_mlp]
    assert w.shape == (1, 8, 16) and factored.v["stacks"][1]["blocks"][0]["mlp"]["w_gate"].shape == (1,)
    assert optax.tree.size(factored) < 0.5 * optax.tree.size(params)  # vs AdamW's 2x


def test_adafactor_sharded_equals_unsharded(params_and_grads):
    params, grads = params_and_grads
    tx = make_optimizer(optim_config(name="adafactor", factored_min_dim=8).optim, 10)
    want, _ = jax.jit(functools.partial(two_steps, tx))(params, grads)
    mesh = make_mesh(MESH)
    with use_sharding(mesh, DEFAULT_RULES):
        put = lambda t: jax.device_put(t, shardings_for(t, mesh, DEFAULT_RULES))
        state_sh = shardings_for(jax.eval_shape(tx.init, params), mesh, DEFAULT_RULES)
        got, state = jax.jit(
            functools.partial(two_steps, tx), out_shardings=(shardings_for(params, mesh, DEFAULT_RULES), state_sh)
        )(put(params), [put(g) for g in grads])
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(unbox(got)), jax.tree.leaves(unbox(want))):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-7, err_msg=jax.tree_util.keystr(path))
    f = state[1][0]
    gate = lambda tree: tree["stacks"][1]["blocks"][0]["mlp"]["w_gate"].get_value()
    assert gate(f.v_row).sharding.spec == P(None, "expert", "fsdp")  # expert_mlp reduced
    assert gate(f.v_col).sharding.spec == P(None, "expert", "tensor")  # embed reduced
    assert f.v_row["embed"].get_value().sharding.spec == P("fsdp")  # [vocab, embed]: vocab reduced


def test_bfloat16_first_moment_is_stored_and_matches_optax(params_and_grads):
    params, grads = params_and_grads
    cfg = optim_config(moment_dtype="bfloat16").optim
    got, state = jax.jit(functools.partial(two_steps, make_optimizer(cfg, 10)))(params, grads)
    adam = state[1][0]
    assert {x.dtype for x in jax.tree.leaves(adam.mu)} == {jnp.dtype(jnp.bfloat16)}
    assert {x.dtype for x in jax.tree.leaves(adam.nu)} == {jnp.dtype(jnp.float32)}
    default = make_optimizer(optim_config().optim, 10).init(params)[1][0]
    assert {x.dtype for x in jax.tree.leaves(default.mu)} == {jnp.dtype(jnp.float32)}
    ref_tx = optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip),
        optax.adamw(
            lr_schedule(cfg, 10),
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=lambda t: jax.tree.map(lambda x: x.ndim >= 2, t),
            mu_dtype=jnp.bfloat16,
        ),
    )
    want, _ = jax.jit(functools.partial(two_steps, ref_tx))(unbox(params), [unbox(g) for g in grads])
    for a, r in zip(jax.tree.leaves(unbox(got)), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, r, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "changes, key",
    [
        (dict(name="sgd"), "optim.name"),
        (dict(moment_dtype="float8"), "optim.moment_dtype"),
        (dict(name="adafactor", moment_dtype="bfloat16"), "optim.moment_dtype"),
        (dict(name="adafactor", b1=0.8), "optim.b1"),
        (dict(name="adafactor", eps=1e-6), "optim.eps"),
        (dict(factored_min_dim=32), "optim.factored_min_dim"),
        (dict(name="adafactor", factored_min_dim=0), "optim.factored_min_dim"),
    ],
)
def test_bad_optimizer_keys_are_refused_by_name(changes, key):
    cfg = base_config()
    cfg.optim.update(changes)
    with pytest.raises(UserError, match=key.replace(".", r"\.")) as e:
        run_config(cfg)
    assert e.value.key == key


def test_what_no_optimizer_can_build_is_refused_before_one_is_made():
    with pytest.raises(ValueError, match=r"optim\.name='sgd'"):
        optim_config(name="sgd")
    with pytest.raises(ValueError, match=r"optim\.moment_dtype='bfloat16' applies to optim\.name='adamw' only"):
        optim_config(name="adafactor", moment_dtype="bfloat16")


@pytest.fixture(scope="module")
def adafactor_run():
    """A sharded Adafactor train step on the 8-device mesh, compiled once."""
    cfg = optim_config(name="adafactor", factored_min_dim=8, lr=1e-2)
    mesh = make_mesh(MESH)
    tx = make_optimizer(cfg.optim, 10)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))
    with use_sharding(mesh, DEFAULT_RULES):
        graphdef, state, shardings = create_train_state(make, tx, mesh, DEFAULT_RULES)
        step = jax.jit(
            make_train_step(graphdef, tx, functools.partial(lm_loss, moe_cfg=cfg.model.moe)),
            out_shardings=(shardings, None),
        )
    return mesh, state, shardings, step, batch(cfg)


def test_adafactor_train_step_learns_and_resumes_exactly(adafactor_run, tmp_path):
    mesh, fresh, shardings, step, b = adafactor_run
    states, losses = [fresh], []
    with use_sharding(mesh, DEFAULT_RULES):
        for _ in range(4):
            state, metrics = step(states[-1], b)
            states.append(state)
            losses.append(float(metrics["loss"]))
        assert losses[-1] < losses[0] - 0.05, losses
        ckpt = Checkpointer(str(tmp_path), every=1, keep=2, async_save=False)
        ckpt.save(2, {k: getattr(states[2], k) for k in ("params", "rest", "opt_state")}, meta={"optim": "adafactor"})
        with pytest.raises(UserError, match=r"optim\.name='adamw'.*holds the state of optim\.name='adafactor'") as e:
            starting_state(fresh, shardings, ckpt, start=2, optim_name="adamw")
        assert e.value.key == "optim.name"
        resumed, _, _ = starting_state(fresh, shardings, ckpt, start=2, optim_name="adafactor")
        ckpt.close()
        assert int(resumed.step) == 2
        for _ in range(2):
            resumed, _ = step(resumed, b)
    for (path, a), r in zip(
        jax.tree_util.tree_leaves_with_path(resumed.opt_state), jax.tree.leaves(states[-1].opt_state)
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r), err_msg=jax.tree_util.keystr(path))
    for a, r in zip(jax.tree.leaves(resumed.params), jax.tree.leaves(states[-1].params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
