"""Quantised sampler experts on a multi-device mesh (8 simulated CPU devices): int8 / int4 values
sharded as the float weights are, their scales with them, against the single-device quantised
layer and sampler."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import posttrain.models.quant as quant
from posttrain.models.decoder import Decoder
from posttrain.models.moe import MoE
from posttrain.models.quant import QArray, quantize_params, quantize_weight, quantized_spec, split_single_groups
from posttrain.parallel import DEFAULT_RULES, logical_spec, make_mesh, shardings_for, use_sharding
from posttrain.sampling import SamplingParams, generate
from tests.support.typed_configs import model

D, F, E, B, S = 16, 32, 8, 8, 8
GROUP = 8  # int4 groups of 8 (not 128): several scale groups along the sharded dims
X = jax.random.normal(jax.random.key(1), (B, S, D))
MASK = jnp.asarray(np.arange(S)[None, :] < np.array([8, 5, 0, 8, 3, 8, 1, 6])[:, None])
LAYER = jax.jit(
    lambda graphdef, params, rest, x, mask: nnx.merge(graphdef, params, rest)(x, mask, inference=True), static_argnums=0
)


def moe_layer():
    moe = dict(num_experts=E, top_k=2, expert_mlp_dim=F, shared_mlp_dim=F, num_shared_experts=1)
    cfg = model({f"moe.{k}": v for k, v in moe.items()}, embed_dim=D)
    return nnx.split(MoE(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)


# quantised with a fresh jit each time: INT4_GROUP is read when tracing, and the tests change it


def on_mesh(tree, mesh):
    return jax.device_put(tree, shardings_for(tree, mesh, DEFAULT_RULES))


def test_quantized_spec_keeps_scales_with_their_values():
    w = jnp.ones((E, D, F))
    q8, q4 = quantize_weight(w, "int8", (-2,)), quantize_weight(w, "int4", (-2,))  # scales [E,1,F] / [E,1,F]
    spec, sizes = P("expert", "fsdp", "tensor"), {"expert": 2, "fsdp": 2, "tensor": 2}
    assert quantized_spec(q8, spec, sizes) == QArray(spec, P("expert", None, "tensor"), qtype=jnp.int8)
    assert quantized_spec(q4, spec, sizes).scale == P("expert", None, "tensor")  # one group of 16
    grouped = QArray(jnp.ones((E, 384, F), jnp.int8), jnp.ones((E, 3, F)))  # 3 groups of 128
    assert quantized_spec(grouped, P(None, "fsdp"), {"fsdp": 3}).scale == P(None, "fsdp", None)
    assert quantized_spec(grouped, P(None, "fsdp"), {"fsdp": 2}, whole=(1,)).scale == P(None, None, None)
    split = split_single_groups(grouped, P(None, "tensor"), {"tensor": 3})  # one group per shard
    assert split.scale.shape == (E, 6, F)
    np.testing.assert_array_equal(quant.dequantize(split, jnp.float32), quant.dequantize(grouped, jnp.float32))
    assert split_single_groups(grouped, P(None, "fsdp"), {"fsdp": 3}, whole=(1,)).scale.shape == (E, 3, F)
    with pytest.raises(ValueError, match=r"moe.w_down \(8, 384, 32\) has 3 scale groups along dim 1"):
        quantized_spec(grouped, P(None, "tensor"), {"tensor": 2}, "moe.w_down")


@pytest.mark.parametrize(
    "mode,group",
    [("int8", None), ("int4", GROUP), ("int4", 2 * GROUP)],
    ids=["int8", "int4-groups-of-8", "int4-groups-of-16"],
)
@pytest.mark.parametrize(
    "sizes", [dict(fsdp=2, expert=4), dict(data=2, expert=2, tensor=2)], ids=["fsdp2-expert4", "data2-expert2-tensor2"]
)
def test_sharded_quantised_experts_match_one_device(monkeypatch, mode, group, sizes):
    """Expert parallelism + ZeRO-3 gathers of the embed dim (values; scales whole) + expert
    hidden dim over tensor (partial sums of the down projection, its group scales sharded): the
    quantised layer's outputs equal the single-device quantised layer's. Groups of 16 leave one
    down-projection group per tensor shard (`split_single_groups`)."""
    monkeypatch.setattr(quant, "INT4_GROUP", group or GROUP)
    graphdef, params, rest = moe_layer()
    qparams = quantize_params(params, mode)
    assert isinstance(qparams["w_down"].get_value(), QArray)
    want = LAYER(graphdef, qparams, rest, X, MASK)
    mesh = make_mesh(sizes)
    with use_sharding(mesh, DEFAULT_RULES):
        sharded = jax.jit(lambda p: quantize_params(p, mode))(on_mesh(params, mesh))  # as the RL loop does
        x = jax.device_put(X, NamedSharding(mesh, logical_spec(("batch", "length", None), mesh, DEFAULT_RULES)))
        got = LAYER(graphdef, sharded, on_mesh(rest, mesh), x, MASK)
    w = sharded["w_gate"].get_value()
    assert w.qvalue.sharding.shard_shape(w.shape)[0] == E // mesh.shape["expert"]
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5), got, want)
    # the quantisation is in effect: the float layer differs
    full = LAYER(graphdef, params, rest, X, MASK)[0]
    assert np.abs(np.asarray(full) - np.asarray(want[0])).max() > 1e-4


def sampler_config():
    shape = dict(vocab_size=64, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    moe = dict(num_experts=8, top_k=2, expert_mlp_dim=16, first_dense=1)
    return model({f"moe.{k}": v for k, v in moe.items()}, **shape, qk_norm=True, tie_embeddings=False)


@pytest.mark.slow  # two sampler compiles per mode on 8 devices (~2 min loaded)
@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_sharded_quantised_sampler_matches_one_device(monkeypatch, mode):
    """generate() with quantised weights, experts sharded on data2-expert2-tensor2, against one
    device: the same tokens, log-probs within 1e-5 (int4: one down-projection group per tensor
    shard)."""
    monkeypatch.setattr(quant, "INT4_GROUP", GROUP)
    graphdef, params, rest = nnx.split(Decoder(sampler_config(), rngs=nnx.Rngs(0)), nnx.Param, ...)
    prompts, sampling = (
        [[5, 9, 3], [7, 1, 4, 4, 2, 8], [2], [3, 3, 8, 1]],
        SamplingParams(temperature=1.0, max_new_tokens=8),
    )
    want = generate(graphdef, quantize_params(params, mode), rest, prompts, sampling, jax.random.key(3))
    mesh = make_mesh(dict(data=2, expert=2, tensor=2))
    with use_sharding(mesh, DEFAULT_RULES):
        qparams = jax.jit(lambda p: quantize_params(p, mode))(on_mesh(params, mesh))
        got = generate(graphdef, qparams, on_mesh(rest, mesh), prompts, sampling, jax.random.key(3))
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_allclose(got.logprobs, want.logprobs, atol=1e-5)
