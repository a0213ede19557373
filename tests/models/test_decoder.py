"""Decoder numerics against a plain reference written without scan, GQA tricks or sharding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models.attention import apply_rope, attention_mask
from posttrain.models.decoder import Decoder, layer_kinds, scan_segments
from tests.support.typed_configs import model


def tiny_cfg(changes=None, **kw):
    tiny = dict(vocab_size=32, embed_dim=16, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=24)
    return model(changes, **{**tiny, **kw})


def rms(x, w, eps):
    return x / jnp.sqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def rope_complex(x, pos, theta):
    """RoPE as complex rotation of pairs (x_i, x_{i+d/2}) — independent of apply_rope's formula."""
    d = x.shape[-1]
    z = x[..., : d // 2] + 1j * x[..., d // 2 :]
    freq = theta ** (-np.arange(0, d, 2) / d)
    z = z * np.exp(1j * pos[:, :, None, None] * freq)
    return np.concatenate([z.real, z.imag], -1)


def ref_block(p, x, pos, seg, cfg):
    b, s, d = x.shape
    h, kv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    a = rms(x, p["attn_norm"]["scale"], cfg.norm_eps)
    q = (a @ p["attn"]["q"].reshape(d, h * hd)).reshape(b, s, h, hd)
    k = (a @ p["attn"]["k"].reshape(d, kv * hd)).reshape(b, s, kv, hd)
    v = (a @ p["attn"]["v"].reshape(d, kv * hd)).reshape(b, s, kv, hd)
    if cfg.qk_norm:
        q, k = rms(q, p["attn"]["q_norm"]["scale"], cfg.norm_eps), rms(k, p["attn"]["k_norm"]["scale"], cfg.norm_eps)
    q, k = rope_ref(q, pos, cfg.rope_theta), rope_ref(k, pos, cfg.rope_theta)
    k, v = jnp.repeat(k, h // kv, axis=2), jnp.repeat(v, h // kv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
    i, j = np.arange(s)[:, None], np.arange(s)[None, :]
    mask = (j <= i)[None] & (seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] != 0)
    scores = jnp.where(mask[:, None], scores, -1e30)
    probs = jax.nn.softmax(scores, -1) * mask[:, None].any(-1, keepdims=True)
    o = jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, s, h * hd) @ p["attn"]["o"].reshape(h * hd, d)
    x = x + o
    m = rms(x, p["mlp_norm"]["scale"], cfg.norm_eps)
    w = p["mlp"]
    return x + (jax.nn.silu(m @ w["gate"]) * (m @ w["up"])) @ w["down"]


def rope_ref(x, pos, theta):
    d = x.shape[-1]
    freq = theta ** (-jnp.arange(0, d, 2) / d)
    ang = pos[:, :, None, None] * freq
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return jnp.concatenate([x1 * jnp.cos(ang) - x2 * jnp.sin(ang), x1 * jnp.sin(ang) + x2 * jnp.cos(ang)], -1)


def ref_forward(params, tokens, pos, seg, cfg):
    """Plain layer-by-layer forward over the nested param dict (layers unstacked by hand)."""
    x = params["embed"][tokens]
    for stack, (kinds, repeats) in zip(params["stacks"].values(), scan_segments(layer_kinds(cfg))):
        for r in range(repeats):
            for j in range(len(kinds)):
                p = jax.tree.map(lambda a: a[r], stack["blocks"][j])
                x = ref_block(p, x, pos, seg, cfg)
    x = rms(x, params["final_norm"]["scale"], cfg.norm_eps)
    w = params["embed"].T if params.get("head") is None else params["head"]
    return x @ w


def test_rope_matches_complex_rotation():
    x = np.random.default_rng(0).normal(size=(2, 5, 3, 8)).astype(np.float32)
    pos = np.array([[0, 1, 2, 3, 4], [7, 0, 1, 2, 9]])
    inv = 1.0 / (10_000.0 ** (np.arange(0, 8, 2) / 8))
    np.testing.assert_allclose(
        apply_rope(jnp.asarray(x), jnp.asarray(pos), jnp.asarray(inv, jnp.float32)),
        rope_complex(x.astype(np.float64), pos, 10_000.0),
        atol=1e-5,
    )


def test_attention_mask_is_causal_within_segments():
    seg = jnp.array([[1, 1, 2, 2, 0]])
    m = np.asarray(attention_mask(seg))[0, 0]
    expected = np.array([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]], bool)
    np.testing.assert_array_equal(m, expected)


@pytest.mark.parametrize("kw", [dict(), dict(qk_norm=True, tie_embeddings=True), dict(remat="full")])
def test_decoder_matches_reference_logits_and_grads(kw):
    cfg = tiny_cfg(**kw)
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 7)))
    pos = jnp.asarray([[0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6]])
    seg = jnp.asarray([[1, 1, 1, 1, 2, 2, 0], [1, 1, 1, 1, 1, 1, 1]])
    cot = jnp.asarray(rng.normal(size=(2, 7, cfg.vocab_size)), jnp.float32)

    def ours(params):
        return nnx.merge(graphdef, params, rest)(tokens, pos, seg)[0]

    def ref(params):
        return ref_forward(nnx.to_pure_dict(params), tokens, pos, seg, cfg)

    np.testing.assert_allclose(ours(params), ref(params), atol=2e-5, rtol=2e-5)
    g_ours = jax.grad(lambda p: (ours(p) * cot).sum())(params)
    g_ref = jax.grad(lambda p: (ref(p) * cot).sum())(params)
    for (path, a), (_, b) in zip(
        jax.tree_util.tree_leaves_with_path(g_ours), jax.tree_util.tree_leaves_with_path(g_ref)
    ):
        np.testing.assert_allclose(a, b, atol=5e-5, rtol=5e-5, err_msg=jax.tree_util.keystr(path))


def test_packed_segments_do_not_attend_across():
    cfg = tiny_cfg()
    model = Decoder(cfg, rngs=nnx.Rngs(0))
    rng = np.random.default_rng(2)
    a, b = rng.integers(0, 32, (1, 4)), rng.integers(0, 32, (1, 3))
    packed = jnp.asarray(np.concatenate([a, b], 1))
    logits, _ = model(packed, jnp.asarray([[0, 1, 2, 3, 0, 1, 2]]), jnp.asarray([[1, 1, 1, 1, 2, 2, 2]]))
    la, _ = model(jnp.asarray(a))
    lb, _ = model(jnp.asarray(b))
    np.testing.assert_allclose(logits[:, :4], la, atol=1e-5)
    np.testing.assert_allclose(logits[:, 4:], lb, atol=1e-5)


def test_layer_kinds_and_segments():
    cfg = tiny_cfg({"moe.num_experts": 4}, num_layers=6)
    assert layer_kinds(cfg) == ("moe",) * 6
    assert scan_segments(layer_kinds(cfg)) == [(("moe",), 6)]
    cfg = cfg.replace({"moe.every": 2})
    assert scan_segments(layer_kinds(cfg)) == [(("dense", "moe"), 3)]
    cfg = cfg.replace({"moe.every": 1, "moe.first_dense": 2})
    assert scan_segments(layer_kinds(cfg)) == [(("dense",), 2), (("moe",), 4)]
    cfg = cfg.replace({"moe.first_dense": 0, "moe.dense_layers": (3,)})
    assert layer_kinds(cfg) == ("moe", "moe", "moe", "dense", "moe", "moe")
    cfg = cfg.replace({"moe.dense_layers": (9,)})
    with pytest.raises(ValueError, match="dense_layers"):
        layer_kinds(cfg)


def test_moe_statistics_and_router_bias_ignore_padding():
    # Rows of padding (segment id 0) change neither the MoE statistics nor the router-bias step:
    # both equal those of the batch with the padding rows removed.
    moe = dict(num_experts=4, top_k=2, expert_mlp_dim=16, router="sigmoid", bias_update_rate=0.01)
    cfg = tiny_cfg({f"moe.{k}": v for k, v in moe.items()}, num_layers=2)
    rng = np.random.default_rng(3)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (4, 6)))
    pos = jnp.broadcast_to(jnp.arange(6), (4, 6))
    seg = jnp.asarray([[1] * 6, [1] * 6, [0] * 6, [0] * 6])
    step = nnx.jit(lambda m, t, p, s: m(t, p, s, update_bias=True)[1])
    padded, pruned = Decoder(cfg, rngs=nnx.Rngs(0)), Decoder(cfg, rngs=nnx.Rngs(0))
    aux = step(padded, tokens, pos, seg)
    ref = step(pruned, tokens[:2], pos[:2], seg[:2])
    for k in ref:
        np.testing.assert_allclose(aux[k], ref[k], rtol=1e-5, atol=1e-6, err_msg=k)
    bias = lambda m: [np.asarray(l.mlp.router_bias[...]) for l in m.layers() if l.is_moe]
    np.testing.assert_allclose(bias(padded), bias(pruned), atol=1e-7)
    assert np.abs(bias(padded)).max() > 0
