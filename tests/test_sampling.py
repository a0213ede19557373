"""The sampler against plain references: full recomputation, the learner's log-probs, the exact
sampling distribution, repeated prompts and static batching — on a sharded 8-device mesh."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.core.state import shardings_for
from posttrain.models.decoder import Decoder
from posttrain.models.logprobs import token_logprobs
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from posttrain.sampling import ContinuousBatcher, SamplingParams, generate, kv_cache, sample_token, sampling_logprobs
from posttrain.sampling.generate import generate_program
from tests.support.sampling import PROMPTS, model_config, reference_distribution


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(dict(data=2, expert=2, tensor=2))


@pytest.fixture(scope="module", params=["dense", "moe"])
def sharded(request, mesh):
    """(graphdef, params, rest) of a tiny model, placed on the mesh as the learner holds them."""
    graphdef, params, rest = nnx.split(Decoder(model_config(request.param), rngs=nnx.Rngs(0)), nnx.Param, ...)
    params = jax.device_put(params, shardings_for(params, mesh, DEFAULT_RULES))
    rest = jax.device_put(rest, shardings_for(rest, mesh, DEFAULT_RULES))
    return request.param, graphdef, params, rest


def full_forward(graphdef):
    """Logits of whole right-padded rows [B, T] with lengths [B]: the learner's forward."""

    @jax.jit
    def fn(params, rest, tokens, lengths):
        segment_ids = (jnp.arange(tokens.shape[1])[None] < lengths[:, None]).astype(jnp.int32)
        return nnx.merge(graphdef, params, rest)(tokens, None, segment_ids)[0]

    return fn


def learner_logprobs(forward, params, rest, prompts, samples, width=32):
    """token_logprobs of a full forward on prompt + completion, at the completion's tokens."""
    rows = [list(p) + samples.completion(i) for i, p in enumerate(prompts)]
    tokens = np.zeros((len(rows), width), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)] = r
    logits = forward(params, rest, tokens, np.array([len(r) for r in rows]))
    lps = np.asarray(token_logprobs(logits[:, :-1], jnp.asarray(tokens[:, 1:])))
    return [lps[i, len(p) - 1 : len(r) - 1] for i, (p, r) in enumerate(zip(prompts, rows))], logits


def test_greedy_with_cache_equals_recomputation_and_learner_logprobs(sharded, mesh):
    kind, graphdef, params, rest = sharded
    forward, max_new = full_forward(graphdef), 8
    with use_sharding(mesh, DEFAULT_RULES):
        # Reference: argmax of a full forward pass at every step, no cache.
        seqs = [list(p) for p in PROMPTS]
        for _ in range(max_new):
            tokens = np.zeros((len(seqs), 32), np.int32)
            for i, s in enumerate(seqs):
                tokens[i, : len(s)] = s
            logits = np.asarray(forward(params, rest, tokens, np.array([len(s) for s in seqs])))
            for i, s in enumerate(seqs):
                s.append(int(logits[i, len(s) - 1].argmax()))
        reference = [s[len(p) :] for s, p in zip(seqs, PROMPTS)]
        stop = reference[0][3]  # makes row 0 stop at step 4 (others wherever it occurs)
        samples = generate(
            graphdef,
            params,
            rest,
            PROMPTS,
            SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_ids=(stop,)),
            jax.random.key(0),
        )
        learner, _ = learner_logprobs(forward, params, rest, PROMPTS, samples)
    for i, ref in enumerate(reference):
        expected = ref[: ref.index(stop) + 1] if stop in ref else ref
        assert samples.completion(i) == expected, (kind, i)
        assert samples.stop_reason_name(i) == ("stop" if stop in ref else "length")
        np.testing.assert_allclose(samples.logprobs[i, : len(expected)], learner[i], atol=1e-5, err_msg=kind)
        assert not samples.logprobs[i, len(expected) :].any()
    generated = np.arange(max_new)[None] < samples.lengths[:, None]
    np.testing.assert_array_equal(samples.sampling_logprobs[generated], 0.0)  # greedy: probability 1


def test_accelerator_layer_path_equals_cpu_path(sharded, mesh, monkeypatch):
    """On GPU/TPU, and on the CPU under `POSTTRAIN_ACCELERATOR_PATHS=1` (`parallel.accelerator_paths`),
    prefill and decode run each stack of layers under a scan, the KV cache stacked per stack
    (`Decoder.decode_stacked`), and MoE experts run on `ragged_dot`; on the CPU the layers run
    unrolled, sliced once, and experts take the CPU's dense forms. Both must sample the same tokens
    with the same log-probs: static batches, and (dense) continuous batching (queued and grouped)
    and the decode layout (`sampling.layout = "tensor"`). Speculative decoding, the prefix cache and
    episodes on both paths: tests/sampling/test_speculative.py, tests/parallel/test_mesh_platform_paths.py."""
    from posttrain.parallel import decode_rules
    from posttrain.parallel.mesh import ACCELERATOR_PATHS_ENV
    from posttrain.sampling.generate import SlotConfig
    from posttrain.sampling.layout import publish_weights

    kind, graphdef, params, rest = sharded
    sampling = SamplingParams(temperature=1.0, max_new_tokens=6)
    key = jax.random.key(11)
    monkeypatch.delenv(ACCELERATOR_PATHS_ENV, raising=False)
    with use_sharding(mesh, DEFAULT_RULES):
        cpu = generate(graphdef, params, rest, PROMPTS, sampling, key)
        monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "1")
        outs = [generate(graphdef, params, rest, PROMPTS, sampling, key)]
        if kind == "dense":
            batcher = ContinuousBatcher(graphdef, sampling, num_slots=2, prefill_batch=2)
            for p in PROMPTS:
                batcher.submit(p)
            outs.append(batcher.run(params, rest, key))
            outs.append(generate(graphdef, params, rest, PROMPTS, sampling, key, slots=SlotConfig(2, 1)))
            published = publish_weights(params, mesh, DEFAULT_RULES, "tensor")
            with use_sharding(mesh, decode_rules(DEFAULT_RULES)):
                outs.append(generate(graphdef, published, rest, PROMPTS, sampling, key))
    for out in outs:
        np.testing.assert_array_equal(out.tokens, cpu.tokens, err_msg=kind)
        np.testing.assert_allclose(out.logprobs, cpu.logprobs, atol=1e-5, err_msg=kind)
        np.testing.assert_allclose(out.sampling_logprobs, cpu.sampling_logprobs, atol=1e-5, err_msg=kind)


def test_sampled_logprobs_match_learner_for_any_padding_side(mesh):
    cfg = model_config("dense")
    graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(1)), nnx.Param, ...)
    params = jax.device_put(params, shardings_for(params, mesh, DEFAULT_RULES))
    sampling = SamplingParams(temperature=0.7, top_k=20, top_p=0.9, max_new_tokens=10, stop_ids=(1, 2))
    key = jax.random.key(3)
    with use_sharding(mesh, DEFAULT_RULES):
        samples = generate(graphdef, params, rest, PROMPTS, sampling, key)
        compiled = generate_program._cache_size()
        # The same prompts left-padded in an array, and a new batch: no recompilation.
        width = max(map(len, PROMPTS))
        left = np.array([[0] * (width - len(p)) + p for p in PROMPTS])
        mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in PROMPTS])
        from_array = generate(graphdef, params, rest, left, sampling, key, prompt_mask=mask)
        generate(graphdef, params, rest, [[4] * 9, [9], [6, 1, 2]], sampling, key)  # same buckets
        assert generate_program._cache_size() == compiled
        learner, logits = learner_logprobs(full_forward(graphdef), params, rest, PROMPTS, samples)
        cache = jax.jit(lambda kv: kv_cache.allocate(kv, 24))(((jnp.zeros((8, 2, 8, 16)), jnp.zeros((8, 2, 16, 8))),))
    assert cache[0][0].sharding.spec == P(("data", "expert"), "tensor")
    assert cache[0][0].shape == (8, 2, 8, 24) and cache[0][1].shape == (8, 2, 24, 8)
    np.testing.assert_array_equal(from_array.tokens, samples.tokens)
    np.testing.assert_allclose(from_array.logprobs, samples.logprobs, atol=1e-6)
    assert len(set(samples.lengths.tolist())) > 1  # stop tokens ended some rows early
    for i, p in enumerate(PROMPTS):
        n = samples.lengths[i]
        np.testing.assert_allclose(samples.logprobs[i, :n], learner[i], atol=1e-5)
        # The behaviour log-prob: under temperature, top-k and top-p of the learner's logits.
        expected = sampling_logprobs(logits[i, len(p) - 1 : len(p) - 1 + n], sampling)
        np.testing.assert_allclose(
            samples.sampling_logprobs[i, :n],
            np.take_along_axis(np.asarray(expected), samples.tokens[i, :n, None], 1)[:, 0],
            atol=1e-5,
        )


def test_dynamic_rope_samples_as_the_learner_past_the_original_context():
    """Dynamic NTK scaling takes its base from the extended context, not from each call's longest
    position (as transformers does): the KV-cached sampler, whose prefill and decode steps are
    calls of different lengths, draws the learner's log-probs past `original_max_position_embeddings`
    (was a 0.086 gap), and a row's logits do not depend on the longest row of its batch."""
    dynamic = dict(type="dynamic", factor=4.0, original_max_position_embeddings=6)
    cfg = model_config("dense", {f"rope_scaling.{k}": v for k, v in dynamic.items()})
    graphdef, params, rest = nnx.split(Decoder(cfg, rngs=nnx.Rngs(1)), nnx.Param, ...)
    samples = generate(graphdef, params, rest, PROMPTS, SamplingParams(max_new_tokens=10), jax.random.key(3))
    forward = full_forward(graphdef)
    learner, logits = learner_logprobs(forward, params, rest, PROMPTS, samples)
    assert max(len(p) + n for p, n in zip(PROMPTS, samples.lengths)) > 2 * 6  # well past the original context
    for i in range(len(PROMPTS)):
        np.testing.assert_allclose(samples.logprobs[i, : samples.lengths[i]], learner[i], atol=1e-5)
    row = [*PROMPTS[2], *samples.completion(2)]  # the shortest row, without the batch's longest
    alone = forward(params, rest, np.asarray([row + [0] * (32 - len(row))]), np.array([len(row)]))
    np.testing.assert_allclose(alone[0, : len(row)], logits[2, : len(row)], atol=1e-5)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.5, 3, 1.0), (1.5, 0, 0.8), (2.0, 4, 0.6)])
def test_sampling_rules_draw_from_the_right_distribution(temperature, top_k, top_p):
    logits = jnp.array([2.0, 1.5, 0.3, -0.4, 1.0, -2.0, 0.9, 0.0])
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
    expected = reference_distribution(logits, temperature, top_k, top_p)
    np.testing.assert_allclose(np.exp(sampling_logprobs(logits, params)), expected, atol=1e-6)
    n = 40_000
    draw = jax.jit(jax.vmap(lambda k: sample_token(k, logits, params)))
    tokens, policy, behaviour = draw(jax.random.split(jax.random.key(0), n))
    freq = np.bincount(np.asarray(tokens), minlength=len(logits)) / n
    # 5 standard errors: a wrong temperature, cut-off or ordering moves some bin by far more.
    np.testing.assert_array_less(np.abs(freq - expected), 5 * np.sqrt(expected * (1 - expected) / n) + 1e-9)
    np.testing.assert_allclose(policy, jax.nn.log_softmax(logits)[tokens], atol=1e-6)
    np.testing.assert_allclose(behaviour, np.log(expected[np.asarray(tokens)]), atol=1e-5)


def test_greedy_and_bad_params():
    token, _, behaviour = sample_token(jax.random.key(0), jnp.array([0.1, 3.0, 2.9]), SamplingParams(temperature=0))
    assert int(token) == 1 and float(behaviour) == 0.0
    for bad in (dict(temperature=-1), dict(top_p=0.0), dict(top_k=-2), dict(max_new_tokens=0), dict(num_samples=0)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SamplingParams(**bad)
    with pytest.raises(ValueError, match="top_k=9"):
        sampling_logprobs(jnp.zeros((4,)), SamplingParams(top_k=9))
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        generate(None, None, None, [[1], []], SamplingParams(), jax.random.key(0))
    with pytest.raises(ValueError, match="max_new_tokens=\\[5\\]"):
        ContinuousBatcher(None, SamplingParams(max_new_tokens=4)).submit([1], 5)


@pytest.fixture(scope="module")
def dense(mesh):
    graphdef, params, rest = nnx.split(Decoder(model_config("dense"), rngs=nnx.Rngs(2)), nnx.Param, ...)
    return graphdef, jax.device_put(params, shardings_for(params, mesh, DEFAULT_RULES)), rest


# Stop tokens 1..8 of 64 end most samples early and leave a few at the limit.
GROUP_SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=12, stop_ids=tuple(range(1, 9)), num_samples=4)


def test_groups_share_prefill_and_equal_repeated_prompts(dense, mesh):
    graphdef, params, rest = dense
    prompts = PROMPTS[:3]
    key = jax.random.key(5)
    with use_sharding(mesh, DEFAULT_RULES):
        grouped = generate(graphdef, params, rest, prompts, GROUP_SAMPLING, key)
        repeated = generate(
            graphdef,
            params,
            rest,
            [p for p in prompts for _ in range(4)],
            dataclasses.replace(GROUP_SAMPLING, num_samples=1),
            key,
        )
    np.testing.assert_array_equal(grouped.prompt_index, np.repeat(np.arange(3), 4))
    np.testing.assert_array_equal(grouped.tokens, repeated.tokens)
    np.testing.assert_array_equal(grouped.lengths, repeated.lengths)
    np.testing.assert_allclose(grouped.logprobs, repeated.logprobs, atol=1e-5)
    assert len({tuple(grouped.completion(i)) for i in range(4)}) > 1  # a group's samples differ


def test_continuous_batching_returns_each_request_once_as_static_batching(dense, mesh):
    graphdef, params, rest = dense
    rng = np.random.default_rng(0)
    prompts = [rng.integers(9, 64, rng.integers(1, 12)).tolist() for _ in range(12)]
    sampling = dataclasses.replace(GROUP_SAMPLING, num_samples=1)
    key = jax.random.key(5)
    batcher = ContinuousBatcher(graphdef, sampling, num_slots=4, prefill_batch=2)
    limits = [12, 12, 3] * 4  # per-request caps too
    with use_sharding(mesh, DEFAULT_RULES):
        static = generate(graphdef, params, rest, prompts, sampling, key, max_new_tokens=limits)
        ids = [batcher.submit(p, limits[i]) for i, p in enumerate(prompts[:9])]
        first = batcher.run(params, rest, key)
        ids += [batcher.submit(p, limits[i]) for i, p in enumerate(prompts[9:], 9)]
        second = batcher.run(params, rest, key)
    assert first.prompt_index.tolist() == ids[:9] and second.prompt_index.tolist() == ids[9:] == [9, 10, 11]
    assert len(set(static.lengths.tolist())) > 2 and set(static.stop_reason.tolist()) == {0, 1}
    assert (static.lengths <= limits).all() and (static.lengths[2::3] == 3).any()
    for i in range(12):
        out, j = (first, i) if i < 9 else (second, i - 9)
        assert out.completion(j) == static.completion(i), i
        assert out.stop_reason[j] == static.stop_reason[i]
        np.testing.assert_allclose(out.logprobs[j], static.logprobs[i], atol=1e-5)
    with pytest.raises(ValueError, match="no requests"):
        batcher.run(params, rest, key)
