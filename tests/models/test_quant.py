"""Weight-only quantised sampler weights (w8a16, w4a16): the matmul against a float64 reference of
the dequantised weight, and the quantised sampler against the float32 policy on a fixed model."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.config import run_config
from posttrain.models.decoder import Decoder
from posttrain.models.logprobs import token_logprobs
from posttrain.models.quant import QArray, quantize_params, quantize_weight, weight_einsum
from posttrain.sampling import SamplingParams, generate
from tests.support.typed_configs import model, run_cfg

# Measured on this fixed model (seed 0, 8 prompts × 12 greedy tokens), then loosened a little:
# |quantised sampler log-prob − float32 learner log-prob| on the sampler's own tokens, and the
# fraction of those tokens that the float32 policy's argmax also picks in the same context.
# Measured (max, mean, agreement): dense int8 0.020, 0.0079, 0.990; int4 0.40, 0.12, 0.80;
# MoE int8 0.19, 0.010, 0.990 (the max is a token whose top-2 experts flipped); int4 0.51, 0.16, 0.81.
BOUNDS = {  # kind: {mode: (max gap, mean gap, min argmax agreement)}
    "dense": {"int8": (0.04, 0.015, 0.97), "int4": (0.6, 0.18, 0.75)},
    "moe": {"int8": (0.3, 0.02, 0.95), "int4": (0.8, 0.25, 0.75)},
}


def bf16(a):
    return np.asarray(jnp.asarray(a, jnp.float32).astype(jnp.bfloat16).astype(jnp.float32), np.float64)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_weight_einsum_is_the_dequantised_matmul(mode):
    """Scales per output channel (int8) or per group of 128 along the contracting axis (int4); the
    matmul equals float64 x·dequant(w) with bfloat16 inputs, and stays close to x·w."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(3, 5, 256)).astype(np.float32)
    w = (rng.normal(size=(256, 4, 8)) / 16).astype(np.float32)
    q = quantize_weight(jnp.asarray(w), mode, (-3,))
    assert isinstance(q, QArray)
    assert q.scale.shape == ((1, 4, 8) if mode == "int8" else (2, 4, 8))
    deq = np.asarray(q.qvalue, np.float64) * np.repeat(np.asarray(q.scale, np.float64), 256 // q.scale.shape[0], 0)
    y = np.asarray(weight_einsum("bsd,dhk->bshk", jnp.asarray(x), q, jnp.float32))
    ref = np.einsum("bsd,dhk->bshk", bf16(x), bf16(deq) if mode == "int4" else deq)
    np.testing.assert_allclose(y, ref, rtol=2e-2, atol=2e-2)  # bf16 rounding of the result (XLA:CPU)
    exact = np.einsum("bsd,dhk->bshk", x.astype(np.float64), w.astype(np.float64))
    rel = np.linalg.norm(y - exact) / np.linalg.norm(exact)
    assert rel < (0.01 if mode == "int8" else 0.12), rel
    w2 = w.reshape(256, 32)  # the MLP's form, with a leading "..."
    q2 = quantize_weight(jnp.asarray(w2), mode, (-2,))
    np.testing.assert_allclose(
        weight_einsum("...d,df->...f", jnp.asarray(x), q2, jnp.float32), y.reshape(3, 5, 32), rtol=2e-2, atol=2e-2
    )
    experts = (rng.normal(size=(4, 256, 8)) / 16).astype(np.float32)  # MoE experts: batched over e
    qe = quantize_weight(jnp.asarray(experts), mode, (-2,))
    rows = x.reshape(3, 5, 256)[:, :4].transpose(1, 0, 2)  # [e, r, d]
    ye = np.asarray(weight_einsum("erd,edf->erf", jnp.asarray(rows), qe, jnp.float32))
    exact_e = np.einsum("erd,edf->erf", rows.astype(np.float64), experts.astype(np.float64))
    assert np.linalg.norm(ye - exact_e) / np.linalg.norm(exact_e) < (0.01 if mode == "int8" else 0.12)
    # a float weight takes the model's old path, unchanged
    np.testing.assert_array_equal(
        weight_einsum("bsd,dhk->bshk", jnp.asarray(x), jnp.asarray(w), jnp.float32),
        jnp.einsum("bsd,dhk->bshk", jnp.asarray(x), jnp.asarray(w)),
    )


def model_config(kind):
    shape = dict(vocab_size=64, embed_dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16, mlp_dim=128)
    moe = dict(num_experts=8, top_k=2, expert_mlp_dim=64, first_dense=1, num_shared_experts=1, shared_mlp_dim=32)
    changes = {f"moe.{k}": v for k, v in moe.items()} if kind == "moe" else {}
    return model(changes, **shape, qk_norm=True, tie_embeddings=False)


PROMPTS = [
    [5, 9, 3],
    [7, 1, 4, 4, 2, 8, 6, 3, 9, 1, 5],
    [2],
    [3, 3, 8, 1, 12],
    [9, 9],
    [1, 2, 3, 4, 5, 6],
    [40, 41],
    [63, 0, 17],
]


@pytest.mark.parametrize("kind", ["dense", pytest.param("moe", marks=pytest.mark.slow)])  # MoE: ~3 min loaded
def test_quantised_sampler_stays_close_to_the_float_policy(kind):
    graphdef, params, rest = nnx.split(Decoder(model_config(kind), rngs=nnx.Rngs(0)), nnx.Param, ...)

    @jax.jit
    def forward(params, tokens):
        return nnx.merge(graphdef, params, rest)(tokens)[0]

    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    measured = {}
    for mode in BOUNDS[kind]:
        qparams = quantize_params(params, mode)
        assert {type(qparams["head"].get_value())} == {QArray}
        out = generate(graphdef, qparams, rest, PROMPTS, greedy, jax.random.key(0))
        rows = np.zeros((len(PROMPTS), 32), np.int32)
        for i, p in enumerate(PROMPTS):
            rows[i, : len(p) + out.lengths[i]] = p + out.completion(i)
        logits = forward(params, rows)
        lp = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(rows[:, 1:])))
        best = np.asarray(jnp.argmax(logits, -1))
        gaps, same = [], []
        for i, p in enumerate(PROMPTS):
            span = slice(len(p) - 1, len(p) - 1 + out.lengths[i])
            gaps.append(np.abs(lp[i, span] - out.logprobs[i, : out.lengths[i]]))
            same.append(best[i, span] == rows[i, len(p) : len(p) + out.lengths[i]])
        gaps, same = np.concatenate(gaps), np.concatenate(same)
        measured[mode] = (gaps.max(), gaps.mean(), same.mean())
    print(kind, {m: tuple(round(float(v), 4) for v in r) for m, r in measured.items()})
    for mode, (max_gap, mean_gap, agree) in BOUNDS[kind].items():
        assert measured[mode][0] < max_gap and measured[mode][1] < mean_gap and measured[mode][2] >= agree, mode
        assert measured[mode][0] > 1e-4  # the quantised weights were used


def test_sampling_quantize_key_is_checked_and_used():
    with pytest.raises(ValueError, match="sampling.quantize='int3'"):
        run_cfg({"sampling.quantize": "int3"}, stage="rlvr")
    cfg = run_config(run_cfg({"sampling.quantize": "int8"}, stage="rlvr"))
    with pytest.raises(ValueError, match="no rlvr stage"):
        run_config(cfg.replace(stage="sft"))
    # the rlvr loop's sampler weights follow the key; the learner's stay float
    from posttrain.stages.rlvr import Components

    params = nnx.split(Decoder(model_config("dense"), rngs=nnx.Rngs(0)), nnx.Param, ...)[1]
    rl = types.SimpleNamespace(train=types.SimpleNamespace(params=params, frozen=None, rest="rest"))
    for mode, kind in (("none", jax.Array), ("int8", QArray), ("int4", QArray)):
        cfg = cfg.replace({"sampling.quantize": mode})
        sampler_params, rest = Components.weights(types.SimpleNamespace(cfg=cfg, learner_sharding=None), rl)
        assert isinstance(sampler_params["stacks"][0]["blocks"][0]["attn"]["q"].get_value(), kind)
        assert rest == "rest"
