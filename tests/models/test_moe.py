"""MoE layer: routing and losses against hand-written references, capacity drops, expert-parallel
layouts on 8 simulated devices against the single-device layer, router-bias balancing."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding

from posttrain.models.moe import MoE, RouterBias
from posttrain.parallel import DEFAULT_RULES, logical_spec, make_mesh, shardings_for, use_sharding
from tests.support.typed_configs import model

D, F, E, K, B, S = 16, 32, 8, 2, 8, 8

CASES = {
    "softmax_norm_shared": dict(router="softmax", norm_topk_prob=True, num_shared_experts=1),
    "softmax_raw": dict(router="softmax", norm_topk_prob=False),
    "sigmoid_norm_scaled": dict(router="sigmoid", norm_topk_prob=True, routed_scaling=2.5),
    "sigmoid_raw_shared": dict(router="sigmoid", norm_topk_prob=False, num_shared_experts=2),
}


def make_cfg(**moe):
    """A tiny float32 model config with an 8-expert top-2 MoE."""
    moe = dict(num_experts=E, top_k=K, expert_mlp_dim=F, shared_mlp_dim=F, **moe)
    return model({f"moe.{k}": v for k, v in moe.items()}, embed_dim=D)


@functools.cache
def build(case: str, **extra):
    """(graphdef, params, rest) of an MoE layer; sigmoid routers get a random non-zero bias."""
    cfg = make_cfg(**CASES[case], **extra)
    model = MoE(cfg, rngs=nnx.Rngs(0))
    if model.router_bias is not None:
        model.router_bias[...] = 0.3 * jax.random.normal(jax.random.key(7), (E,))
    return nnx.split(model, nnx.Param, ...)


X = jax.random.normal(jax.random.key(1), (B, S, D))
CT = jax.random.normal(jax.random.key(2), (B, S, D))
# Real tokens (1) and padding (0), uneven over rows (so over devices), one row all padding: an RL
# batch. The layer tests run on this padded batch; their reference sees only the real tokens.
ROW_LENGTHS = np.array([8, 5, 0, 8, 3, 8, 1, 6])
MASK = jnp.asarray(np.arange(S)[None, :] < ROW_LENGTHS[:, None])
REAL = np.asarray(MASK).reshape(-1)


def layer_loss(graphdef, params, rest, x, ct, mask=MASK):
    """A scalar touching the real tokens' outputs and both router losses, for gradient checks."""
    y, aux = nnx.merge(graphdef, params, rest)(x, mask)
    return jnp.sum(y * ct * mask[..., None]) + aux["aux_loss"] + aux["z_loss"], (y, aux)


def layer_grad_fn():
    """A fresh jitted (loss, (y, aux)), (d params, d x) — fresh so each sharding context traces."""
    return jax.jit(jax.value_and_grad(layer_loss, argnums=(1, 3), has_aux=True), static_argnums=0)


LAYER_GRAD = layer_grad_fn()


def swiglu(x, gate, up, down):
    return (jax.nn.silu(x @ gate) * (x @ up)) @ down


def reference_loss(p, x, ct, routing, bias):
    """Naive MoE: every expert on every token with dense matmuls, HF routing, HF aux loss.

    routing: (router, norm_topk_prob, routed_scaling)."""
    router, norm_topk_prob, routed_scaling = routing
    t = x.reshape(-1, D)
    logits = t @ p["router"]
    if router == "softmax":
        probs = jax.nn.softmax(logits, axis=-1)
        w, idx = jax.lax.top_k(probs, K)
        if norm_topk_prob:
            w = w / w.sum(-1, keepdims=True)
    else:
        scores = jax.nn.sigmoid(logits)
        _, idx = jax.lax.top_k(scores + bias, K)
        w = jnp.take_along_axis(scores, idx, axis=-1)
        if norm_topk_prob:
            w = w / (w.sum(-1, keepdims=True) + 1e-20)
        probs = scores / scores.sum(-1, keepdims=True)
    w = w * routed_scaling
    combine = jnp.zeros((t.shape[0], E)).at[jnp.arange(t.shape[0])[:, None], idx].set(w)
    y = sum(combine[:, e : e + 1] * swiglu(t, p["w_gate"][e], p["w_up"][e], p["w_down"][e]) for e in range(E))
    if "shared" in p:
        y = y + swiglu(t, p["shared"]["gate"], p["shared"]["up"], p["shared"]["down"])
    mask = jax.nn.one_hot(idx, E)  # [T, k, E]
    aux_loss = E * jnp.sum(mask.mean(0) * probs.mean(0)[None])
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    aux = {
        "aux_loss": aux_loss,
        "z_loss": z_loss,
        "load": mask.sum((0, 1)) / mask[..., 0].size,
        "dropped": jnp.float32(0),
        "experts": idx.reshape(*x.shape[:2], K),
    }
    y = y.reshape(x.shape)
    return jnp.sum(y * ct) + aux_loss + z_loss, (y, aux)


def routing_of(cfg):
    """The static routing switches of a config, for `reference_loss`."""
    return cfg.moe.router, cfg.moe.norm_topk_prob, cfg.moe.routed_scaling


REFERENCE_GRAD = jax.jit(jax.value_and_grad(reference_loss, argnums=(0, 1), has_aux=True), static_argnums=3)


@functools.cache
def unsharded(case: str):
    """Single-device loss, outputs, aux and gradients of a case on the padded batch (computed once)."""
    return LAYER_GRAD(*build(case), X, CT)


def real_tokens(a):
    """[B, S, ...] → [1, real tokens, ...]: the batch with its padding removed."""
    return jnp.asarray(np.asarray(a).reshape(B * S, *a.shape[2:])[REAL][None])


def assert_tree_close(a, b, rtol=1e-5, atol=1e-5):
    jax.tree.map(lambda u, v: np.testing.assert_allclose(np.asarray(u), np.asarray(v), rtol=rtol, atol=atol), a, b)


@pytest.mark.parametrize("case", list(CASES))
def test_dropless_matches_dense_reference(case):
    # On the padded batch, outputs, statistics and gradients equal the plain reference's on the
    # same batch with the padding removed; padding gets no gradient.
    graphdef, params, rest = build(case)
    (loss, (y, aux)), (g_params, g_x) = unsharded(case)
    bias = rest["router_bias"][...] if "router_bias" in rest else None
    pure = nnx.to_pure_dict(params)
    (ref_loss, (ref_y, ref_aux)), (ref_g_params, ref_g_x) = REFERENCE_GRAD(
        pure, real_tokens(X), real_tokens(CT), routing_of(make_cfg(**CASES[case])), bias
    )
    assert_tree_close(real_tokens(y), ref_y)
    np.testing.assert_array_equal(real_tokens(aux["experts"]), ref_aux["experts"])  # the experts it reports
    assert_tree_close(aux, {**ref_aux, "experts": aux["experts"]})
    assert_tree_close(loss, ref_loss)
    assert_tree_close(real_tokens(g_x), ref_g_x)
    np.testing.assert_array_equal(np.asarray(g_x).reshape(B * S, D)[~REAL], 0.0)
    assert_tree_close(nnx.to_pure_dict(g_params), ref_g_params)


FORWARD = jax.jit(lambda graphdef, x, *states, mask=None: nnx.merge(graphdef, *states)(x, mask), static_argnums=0)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_aux_losses_match_numpy_formulas(router):
    graphdef, state = nnx.split(MoE(make_cfg(router=router, norm_topk_prob=False), rngs=nnx.Rngs(3)))
    _, aux = FORWARD(graphdef, X, state)
    t = np.asarray(X, np.float64).reshape(-1, D)
    logits = t @ np.asarray(state["router"][...], np.float64)
    if router == "softmax":
        probs = np.exp(logits - logits.max(-1, keepdims=True))
    else:
        probs = 1 / (1 + np.exp(-logits))  # zero bias: choice = scores
    probs = probs / probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :K]  # [T, k]
    mask = (top[..., None] == np.arange(E)).astype(np.float64)  # [T, k, E]
    # HF: mean over tokens per slot, summed over slots (not divided by k), times E.
    aux_loss = E * np.sum(mask.mean(0) * probs.mean(0)[None])
    z_loss = np.mean((logits.max(-1) + np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1))) ** 2)
    np.testing.assert_allclose(aux["aux_loss"], aux_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["z_loss"], z_loss, rtol=1e-5)
    np.testing.assert_allclose(aux["load"], mask.sum((0, 1)) / (t.shape[0] * K), rtol=1e-6)


def test_capacity_drops_overflow_in_token_order():
    # Tokens of group A (t % 4 != 0: 48 tokens) pick experts 0 and 1, group B (16 tokens) experts
    # 2 and 3. Capacity ceil(1.0 * 64 * 2 / 8) = 16: experts 0 and 1 keep the first 16 A tokens.
    cfg = make_cfg(router="softmax", norm_topk_prob=True, capacity_factor=1.0)
    model = MoE(cfg, rngs=nnx.Rngs(0))
    kernel = np.zeros((D, E), np.float32)
    kernel[0, :2] = [10.0, 9.0]
    kernel[1, 2:4] = [10.0, 9.0]
    model.router[...] = jnp.asarray(kernel)
    group_a = np.arange(B * S) % 4 != 0
    x = np.array(X).reshape(-1, D)
    x[:, 0], x[:, 1] = group_a, ~group_a
    x = jnp.asarray(x.reshape(B, S, D))
    graphdef, state = nnx.split(model)
    y, aux = FORWARD(graphdef, x, state)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    (_, (dense_y, _)), _ = REFERENCE_GRAD(params, x, CT, routing_of(cfg), None)
    kept = ~group_a | (np.cumsum(group_a) <= 16)
    y, dense_y = np.asarray(y).reshape(-1, D), np.asarray(dense_y).reshape(-1, D)
    np.testing.assert_allclose(y[kept], dense_y[kept], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[~kept], 0.0)
    np.testing.assert_allclose(aux["dropped"], (32 + 32) / 128)
    np.testing.assert_allclose(aux["load"], np.array([48, 48, 16, 16, 0, 0, 0, 0]) / 128)


def test_padding_takes_no_capacity():
    # The capacity case above with the first 16 tokens padding (12 of group A, 4 of B): experts 0
    # and 1 keep the first 16 *real* A tokens; padding is routed nowhere and not counted.
    cfg = make_cfg(router="softmax", norm_topk_prob=True, capacity_factor=1.0)
    model = MoE(cfg, rngs=nnx.Rngs(0))
    kernel = np.zeros((D, E), np.float32)
    kernel[0, :2] = [10.0, 9.0]
    kernel[1, 2:4] = [10.0, 9.0]
    model.router[...] = jnp.asarray(kernel)
    group_a = np.arange(B * S) % 4 != 0
    real = np.arange(B * S) >= 16
    x = np.array(X).reshape(-1, D)
    x[:, 0], x[:, 1] = group_a, ~group_a
    x = jnp.asarray(x.reshape(B, S, D))
    graphdef, state = nnx.split(model)
    y, aux = FORWARD(graphdef, x, state, mask=jnp.asarray(real.reshape(B, S)))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    (_, (dense_y, _)), _ = REFERENCE_GRAD(params, x, CT, routing_of(cfg), None)
    kept = real & (~group_a | (np.cumsum(group_a & real) <= 16))
    y, dense_y = np.asarray(y).reshape(-1, D), np.asarray(dense_y).reshape(-1, D)
    np.testing.assert_allclose(y[kept], dense_y[kept], rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(y[~kept], 0.0)
    np.testing.assert_allclose(aux["dropped"], (20 + 20) / 96, rtol=1e-6)  # 36 real A tokens each
    np.testing.assert_allclose(aux["load"], np.array([36, 36, 12, 12, 0, 0, 0, 0]) / 96, rtol=1e-6)


def test_router_bias_update_counts_real_tokens_only():
    model = MoE(make_cfg(router="sigmoid", bias_update_rate=0.01), rngs=nnx.Rngs(0))
    nnx.jit(lambda m, x, mask: m(x, mask, update_bias=True))(model, X, MASK)
    logits = real_tokens(X)[0] @ np.asarray(model.router[...])
    top = np.argsort(-logits, axis=-1)[:, :K]  # zero bias: the top sigmoid scores
    load = np.bincount(top.reshape(-1), minlength=E) / top.size
    padded_load = np.bincount(
        np.argsort(-(np.asarray(X).reshape(-1, D) @ np.asarray(model.router[...])), axis=-1)[:, :K].reshape(-1),
        minlength=E,
    ) / (B * S * K)
    assert (np.sign(1 / E - load) != np.sign(1 / E - padded_load)).any()  # padding would mislead
    np.testing.assert_allclose(model.router_bias[...], 0.01 * np.sign(1 / E - load), atol=1e-7)


def test_router_bias_moves_towards_balance():
    model = MoE(make_cfg(router="sigmoid", bias_update_rate=0.01), rngs=nnx.Rngs(0))

    @functools.partial(nnx.jit, static_argnames="update")
    def step(m, x, update):
        return m(x, update_bias=update)[1]

    aux = step(model, X, False)
    np.testing.assert_array_equal(model.router_bias[...], 0.0)
    aux = step(model, X, True)
    load = np.asarray(aux["load"])
    bias = np.asarray(nnx.state(model, RouterBias)["router_bias"][...])
    assert (load > 1 / E).any() and (load < 1 / E).any()
    np.testing.assert_allclose(bias, 0.01 * np.sign(1 / E - load), atol=1e-7)


def shard(tree, mesh, rules):
    """Place an nnx.State as its variables' logical names and the rules say."""
    return jax.device_put(tree, shardings_for(tree, mesh, rules))


def run_sharded(case, sizes, rules=DEFAULT_RULES, **extra):
    """Loss, outputs, aux and gradients of a case on a mesh, plus the sharded weights."""
    mesh = make_mesh(sizes)
    graphdef, params, rest = build(case, **extra)
    params, rest = shard(params, mesh, rules), shard(rest, mesh, rules)
    x = jax.device_put(X, NamedSharding(mesh, logical_spec(("batch", "length", None), mesh, rules, X.shape)))
    mask = jax.device_put(MASK, NamedSharding(mesh, logical_spec(("batch", "length"), mesh, rules, MASK.shape)))
    fn = layer_grad_fn()
    with use_sharding(mesh, rules):
        out = fn(graphdef, params, rest, x, CT, mask)
        jaxpr = str(jax.make_jaxpr(fn, static_argnums=0)(graphdef, params, rest, x, CT, mask))
    return mesh, out, params, jaxpr


LAYOUTS = [  # (mesh, rules, case, expected expert-parallel all-to-all)
    (dict(data=8), DEFAULT_RULES, "softmax_norm_shared", False),
    (dict(data=2, expert=2, tensor=2), DEFAULT_RULES, "softmax_raw", True),
    (dict(fsdp=2, expert=4), DEFAULT_RULES, "sigmoid_raw_shared", True),
    # the same device grid as data2-expert2-tensor2 (make_mesh fixes the axis order): another router
    (dict(tensor=2, expert=2, data=2), DEFAULT_RULES, "sigmoid_norm_scaled", True),
    # tokens replicated over fsdp and expert: embed gathered invariant, experts summed, no a2a
    (
        dict(data=2, fsdp=2, expert=2),
        {**DEFAULT_RULES, "batch": ("data",), "activation_batch": ("data",)},
        "softmax_norm_shared",
        False,
    ),
]


@pytest.mark.parametrize(
    "sizes,rules,case,a2a",
    LAYOUTS,
    ids=["data8", "data2-expert2-tensor2", "fsdp2-expert4", "tensor2-expert2-data2", "batch-on-data-only"],
)
def test_sharded_matches_unsharded(sizes, rules, case, a2a):
    mesh, out, params, jaxpr = run_sharded(case, sizes, rules)
    assert_tree_close(out, unsharded(case))
    assert ("all_to_all" in jaxpr) == a2a
    ep = mesh.shape["expert"]
    for name in ("w_gate", "w_up", "w_down"):
        w = params[name][...]
        assert w.sharding.shard_shape(w.shape)[0] == E // ep
        if ep > 1:
            assert w.sharding.spec[0] == "expert"


def emulated_ragged_all_to_all(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name, axis_index_groups=None
):
    """`jax.lax.ragged_all_to_all` semantics (one slice per peer) from all-gathers, for XLA:CPU."""
    del recv_sizes, axis_index_groups
    me = jax.lax.axis_index(axis_name)
    operands = jax.lax.all_gather(operand, axis_name)  # [peers, N, D]
    start, size, land = (
        jax.lax.all_gather(a, axis_name)[:, me]  # [peers] → me
        for a in (input_offsets, send_sizes, output_offsets)
    )
    row = jnp.arange(output.shape[0])
    inside = (row >= land[:, None]) & (row < (land + size)[:, None])  # [peers, M]
    source = jnp.argmax(inside, axis=0)
    got = operands[source, jnp.clip(start[source] + row - land[source], 0, operand.shape[0] - 1)]
    return jnp.where(inside.any(0)[:, None], got, output)


@pytest.mark.parametrize(
    "sizes,case", [(dict(data=2, expert=2, tensor=2), "softmax_raw"), (dict(fsdp=2, expert=4), "sigmoid_raw_shared")]
)
def test_ragged_dispatch_matches_unsharded(monkeypatch, sizes, case):
    monkeypatch.setattr(jax.lax, "ragged_all_to_all", emulated_ragged_all_to_all)
    _, out, _, _ = run_sharded(case, sizes, dispatch="ragged")
    assert_tree_close(out, unsharded(case))


def test_ragged_dispatch_traces_with_real_collective():
    mesh = make_mesh(dict(fsdp=2, expert=4))
    graphdef, params, rest = build("softmax_raw", dispatch="ragged")
    with use_sharding(mesh, DEFAULT_RULES):
        jaxpr = str(jax.make_jaxpr(layer_grad_fn(), static_argnums=0)(graphdef, params, rest, X, CT))
    assert jaxpr.count("ragged_all_to_all") >= 4  # 2 forward + 2 transposed


def test_sharded_capacity_applies_per_device_group():
    # fsdp=2, expert=4: each device holds one batch row (8 tokens), capacity ceil(8 * 2 / 8) = 2;
    # the dropped fraction of the mesh weighs each row by its real tokens.
    _, ((_, (y, aux)), _), _, _ = run_sharded("softmax_raw", dict(fsdp=2, expert=4), capacity_factor=1.0)
    graphdef, params, rest = build("softmax_raw", capacity_factor=1.0)
    rows = [FORWARD(graphdef, X[i : i + 1], params, rest, mask=MASK[i : i + 1]) for i in range(B)]
    np.testing.assert_allclose(y, np.concatenate([r[0] for r in rows]), rtol=1e-5, atol=1e-6)
    dropped = np.average([r[1]["dropped"] for r in rows], weights=ROW_LENGTHS)
    assert dropped > 0
    np.testing.assert_allclose(aux["dropped"], dropped, rtol=1e-6)


@pytest.mark.parametrize("form", ["tiled", "dense"])
def test_cpu_grouped_matmuls_equal_ragged_dot_with_grads(form):
    from posttrain.models.moe.experts import dense_grouped_matmul, tiled_grouped_matmul

    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(50, 8)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(4, 8, 6)), jnp.float32)
    sizes = jnp.asarray([7, 0, 30, 9], jnp.int32)  # 46 rows used, an empty group, 4 padding rows
    ref = lambda x, w: jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32)
    tiled = {
        "tiled": lambda x, w: tiled_grouped_matmul(x, w, sizes, tile=4),
        "dense": lambda x, w: dense_grouped_matmul(x, w, sizes),
    }[form]
    np.testing.assert_allclose(tiled(x, w), ref(x, w), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(tiled(x, w)[46:]).max()) == 0.0
    cot = jnp.asarray(rng.normal(size=(50, 6)), jnp.float32)
    for a, b in zip(
        jax.grad(lambda x, w: (tiled(x, w) * cot).sum(), (0, 1))(x, w),
        jax.grad(lambda x, w: (ref(x, w) * cot).sum(), (0, 1))(x, w),
    ):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [16, 300])  # fallback: every expert (16) or sorted rows (300)
@pytest.mark.parametrize("skewed", [False, True])  # skewed: expert 0 over capacity → the fallback
def test_cpu_expert_paths_match_naive_with_grads(tokens, skewed):
    """The sampler's CPU expert paths (padded, or its fallbacks) equal a naive loop; gradients too,
    although the sampler does not differentiate them (training takes the fallbacks directly)."""
    from posttrain.models.moe.dispatch import ExpertLayout, routed_experts, spare_capacity

    keys = jax.random.split(jax.random.key(3), 5)
    x = jax.random.normal(keys[0], (tokens, D))
    w_gate, w_up = (jax.random.normal(k, (E, D, F)) * 0.3 for k in keys[1:3])
    w_down = jax.random.normal(keys[3], (E, F, D)) * 0.3
    t = np.arange(tokens)
    experts = np.stack([np.zeros_like(t) if skewed else t % E, (t % (E - 1)) + 1], axis=1)
    weights = jax.nn.softmax(jax.random.normal(keys[4], (tokens, K)))
    load = np.bincount(experts.reshape(-1), minlength=E)
    assert (load.max() > spare_capacity(tokens * K, E)) == skewed

    def routed(x, *w):
        return routed_experts(
            x,
            jnp.asarray(experts, jnp.int32),
            weights,
            dict(zip(("w_gate", "w_up", "w_down"), w)),
            num_experts=E,
            capacity=None,
            layout=ExpertLayout(),
            inference=True,
        )[0]

    def naive(x, w_gate, w_up, w_down):
        combine = jnp.zeros((tokens, E)).at[t[:, None], experts].add(weights)
        return sum(combine[:, e : e + 1] * swiglu(x, w_gate[e], w_up[e], w_down[e]) for e in range(E))

    args = (x, w_gate, w_up, w_down)
    np.testing.assert_allclose(jax.jit(routed)(*args), naive(*args), rtol=1e-5, atol=1e-5)
    ct = jax.random.normal(jax.random.key(9), (tokens, D))
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(routed(*a) * ct), argnums=(0, 1, 2, 3)))(*args)
    expected = jax.grad(lambda *a: jnp.sum(naive(*a) * ct), argnums=(0, 1, 2, 3))(*args)
    for got, want in zip(grads, expected):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
