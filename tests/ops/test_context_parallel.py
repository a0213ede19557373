"""The decoder with context parallelism: loss, logits and gradients with the length sharded over
`sequence` (zig-zag batches, ring and all-gather) equal the unsharded reference; the
`model.attention*` / `model.context_parallel` switches take effect or fail clearly."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.core.state import shardings_for
from posttrain.core.step import lm_loss
from posttrain.models.attention import AttentionKernel, attention_mask, dot_product_attention
from posttrain.models.decoder import Decoder
from posttrain.ops.context_parallel import choose, gathered_kv_bytes
from posttrain.ops.fused import splash_attention
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from posttrain.parallel.zigzag import unzigzag, zigzag_batch
from tests.support.typed_configs import model


def model_config(**kw):
    shape = dict(vocab_size=64, embed_dim=16, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    return model(**{**shape, **kw})


def packed_batch(b=2, s=32, seed=0):
    """Rows of packed segments (positions restarting, segment 0 padding at the end of row 0)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, 64, (b, s + 1))
    seg = np.ones((b, s), np.int32)
    seg[0, 11:25], seg[0, 25:] = 2, 0
    seg[1, 19:] = 2
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        for i in range(1, s):
            pos[r, i] = 0 if seg[r, i] != seg[r, i - 1] else pos[r, i - 1] + 1
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": pos,
        "segment_ids": seg,
        "loss_mask": (seg != 0).astype(np.int32) * (rng.random((b, s)) < 0.9),
    }


def loss_logits_grads(graphdef, params, rest, batch):
    def f(params):
        model = nnx.merge(graphdef, params, rest)
        logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"])
        loss, _ = lm_loss(model, batch, None)
        return loss, logits

    (loss, logits), grads = jax.value_and_grad(f, has_aux=True)(params)
    return loss, logits, grads


@pytest.fixture(scope="module")
def reference():
    """Loss, logits and gradients of the xla reference on one device."""
    graphdef, params, rest = nnx.split(Decoder(model_config(), rngs=nnx.Rngs(0)), nnx.Param, ...)
    batch = jax.tree.map(jnp.asarray, packed_batch())
    return params, rest, batch, jax.jit(functools.partial(loss_logits_grads, graphdef))(params, rest, batch)


LAYOUTS = [(dict(data=2, sequence=4), "ring"), (dict(data=2, sequence=4), "all_gather")]


@pytest.mark.parametrize(
    "sizes,mode", LAYOUTS, ids=lambda x: x if isinstance(x, str) else ",".join(f"{k}={v}" for k, v in x.items())
)
def test_context_parallel_model_matches_single_device(reference, sizes, mode):
    params, rest, batch, (loss, logits, grads) = reference
    n = sizes["sequence"]
    mesh = make_mesh(sizes)
    # Layers rematerialised under the ring (its custom_vjp inside jax.checkpoint), as long contexts run.
    cfg = model_config(
        attention="blockwise", attention_block=3, context_parallel=mode, remat="full" if mode == "ring" else "none"
    )
    with use_sharding(mesh, DEFAULT_RULES):
        graphdef = nnx.split(Decoder(cfg, rngs=nnx.Rngs(0)), nnx.Param, ...)[0]
        sh_params = jax.device_put(params, shardings_for(params, mesh, DEFAULT_RULES))
        sh_rest = jax.device_put(rest, shardings_for(rest, mesh, DEFAULT_RULES))
        zz = jax.tree.map(jnp.asarray, zigzag_batch(packed_batch(), n))  # built once, on the host
        compiled = jax.jit(functools.partial(loss_logits_grads, graphdef)).lower(sh_params, sh_rest, zz).compile()
        s_loss, s_logits, s_grads = compiled(sh_params, sh_rest, zz)
    assert ("collective-permute" in compiled.as_text()) == (mode == "ring")
    np.testing.assert_allclose(s_loss, loss, rtol=1e-5)
    np.testing.assert_allclose(unzigzag(s_logits, n), logits, rtol=1e-4, atol=1e-5)
    for (path, a), r in zip(jax.tree_util.tree_leaves_with_path(s_grads), jax.tree.leaves(grads)):
        np.testing.assert_allclose(a, r, rtol=1e-4, atol=1e-6, err_msg=jax.tree_util.keystr(path))


def test_attention_switches_fail_clearly():
    with pytest.raises(ValueError, match=r"model.attention='flash': expected one of"):
        AttentionKernel.from_config(model_config(attention="flash"))
    with pytest.raises(ValueError, match=r"model.context_parallel='striped': expected one of"):
        AttentionKernel.from_config(model_config(context_parallel="striped"))
    with pytest.raises(ValueError, match=r"model.attention_block=0"):
        AttentionKernel.from_config(model_config(attention="blockwise", attention_block=0))
    with pytest.raises(ValueError, match=r"model.attention='cudnn' computes in bfloat16 or float16"):
        AttentionKernel.from_config(model_config(attention="cudnn"))
    with pytest.raises(ValueError, match=r"model.attention='cudnn' needs a GPU.*'cpu'"):
        AttentionKernel.from_config(model_config(attention="cudnn", dtype="bfloat16"))
    with pytest.raises(ValueError, match=r"model.attention='splash' needs a TPU"):
        AttentionKernel.from_config(model_config(attention="splash"))
    # A fused kernel does not shard the length: asking for it with sequence > 1 is an error.
    kernel = dataclasses.replace(AttentionKernel.from_config(model_config()), kind="splash")
    x = jnp.zeros((1, 16, 4, 8))
    with use_sharding(make_mesh(dict(data=2, sequence=4)), DEFAULT_RULES):
        with pytest.raises(ValueError, match="use model.attention='blockwise'"):
            kernel(x, x[:, :, :2], x[:, :, :2], jnp.zeros((1, 16), jnp.int32), jnp.ones((1, 16), jnp.int32))


def test_attention_block_sets_the_tiles():
    """model.attention_block=8 over 32 tokens: 4 key/value tiles per query tile; 512: one."""
    batch = packed_batch()

    def jaxpr(block):
        model = Decoder(model_config(attention="blockwise", attention_block=block), rngs=nnx.Rngs(0))
        return str(
            jax.make_jaxpr(lambda t, p, s: model(t, p, s)[0])(batch["inputs"], batch["positions"], batch["segment_ids"])
        )

    assert "length=4" in jaxpr(8) and "length=4" not in jaxpr(512)


def test_auto_context_parallel_rule():
    kv = gathered_kv_bytes((1, 4096, 8, 128), n=8, itemsize=2)  # one layer's gathered K/V + grads
    assert kv == 2 * 8 * 4096 * 8 * 128 * (2 + 4)
    assert choose("auto", kv, 16 * 2**30) == "all_gather"
    assert choose("auto", 64 * kv, 16 * 2**30) == "ring"
    assert choose("ring", 0, 1) == "ring" and choose("all_gather", 2**40, 1) == "all_gather"


def test_splash_kernel_matches_reference_in_interpret_mode():
    """The TPU splash path (GQA by kv head, segment ids, padding zeroed), run by the Pallas
    interpreter on the CPU."""
    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(1, 128, 4, 16)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(1, 128, 2, 16)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.repeat([[1, 2, 0]], [50, 60, 18], axis=1), jnp.int32)
    got = splash_attention(q, k, v, seg, block_size=128, interpret=True)
    np.testing.assert_allclose(got, dot_product_attention(q, k, v, attention_mask(seg)), rtol=1e-5, atol=1e-5)
    # On a mesh the Mosaic kernel runs per device inside shard_map (the compiler cannot partition
    # it): rows over data, whole GQA groups over tensor.
    from posttrain.ops.fused import on_local_shards

    q2, k2, v2, seg2 = (jnp.concatenate([x, x[:, ::-1]]) for x in (q, k, v, seg))
    kernel = functools.partial(splash_attention, block_size=128, interpret=True)
    with use_sharding(make_mesh(dict(data=2, tensor=2, fsdp=2)), DEFAULT_RULES):
        sharded = jax.jit(lambda *a: on_local_shards(kernel, *a))(q2, k2, v2, seg2)
    np.testing.assert_allclose(sharded, dot_product_attention(q2, k2, v2, attention_mask(seg2)), rtol=1e-5, atol=1e-5)


PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 3, 9, 1, 5], [2], [3, 3, 8, 1, 12]]


def test_sampler_with_sequence_sharded_prefill_and_cache_matches_one_device():
    """Prefill with the length over `sequence` = 4 (ring), then decoding against a cache whose
    time axis is sharded over `sequence`: the same tokens and log-probs as one device."""
    from posttrain.sampling import SamplingParams, generate, kv_cache

    cfg = model_config(attention="blockwise", attention_block=4, context_parallel="ring")
    graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(2)), nnx.Param, ...)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, num_samples=2)  # cache: 16 + 8 entries
    key = jax.random.key(5)
    with use_sharding(make_mesh(dict(data=1), devices=jax.devices()[:1]), DEFAULT_RULES):
        single = generate(graphdef, params, rest, PROMPTS, sampling, key)
    mesh = make_mesh(dict(data=2, sequence=4))
    with use_sharding(mesh, DEFAULT_RULES):
        sh_params = jax.device_put(params, shardings_for(params, mesh, DEFAULT_RULES))
        sharded = generate(graphdef, sh_params, rest, PROMPTS, sampling, key)
        cache = kv_cache.shard(tuple((jnp.zeros((8, 2, 8, 24)), jnp.zeros((8, 2, 24, 8))) for _ in range(2)))
        step = jax.jit(
            lambda params, tokens, positions, cache: nnx.merge(graphdef, params, rest).decode(tokens, positions, cache)[
                1
            ]
        )
        hlo = step.lower(sh_params, jnp.zeros((8, 1), jnp.int32), jnp.arange(8), cache).compile().as_text()
    np.testing.assert_array_equal(sharded.tokens, single.tokens)
    np.testing.assert_allclose(sharded.logprobs, single.logprobs, atol=1e-5)
    assert cache[0][0].sharding.spec == P("data", None, None, "sequence")
    # A decode step: per device the cache is 4 rows × 2 kv heads × 8 dims × 24/4 entries, no op
    # gathers it whole, and the parts combine by all-reduces (pmax, psum).
    assert "f32[4,2,8,6]" in hlo and "all-reduce" in hlo
    assert not [line for line in hlo.splitlines() if "all-gather" in line and "24]" in line.split("=")[1][:40]]
