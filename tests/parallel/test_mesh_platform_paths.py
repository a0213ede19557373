"""Every platform branch exercised here: `POSTTRAIN_ACCELERATOR_PATHS=1` (`parallel.accelerator_paths`)
makes the CPU take the GPU/TPU paths that can run on it; the stacked `extend` (speculative decoding,
the prefix cache) equals the unrolled one at every draft depth and stays one unit of layers deep;
MoE layers and multi-turn episodes agree on both branches; and every sampler program is traced for
a TPU slice, where the branches that cannot run on the CPU (ragged all-to-all, Pallas kernels) live.
The other samplers on both branches: tests/test_sampling.py::test_accelerator_layer_path_equals_cpu_path."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.models.decoder import Decoder
from posttrain.parallel import accelerator_paths, make_mesh, use_sharding
from posttrain.parallel.mesh import ACCELERATOR_PATHS_ENV
from posttrain.parallel.sharding import abstract_model
from posttrain.plan import aot
from posttrain.sampling import engine, kv_cache
from tests.support import typed_configs as configs

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(), reason="libtpu not installed (pip install -e '.[tpu]'): no TPU compiler"
)


def tiny_model_config(num_layers=2, moe_every=0, num_experts=4):
    """A tiny decoder; `moe_every` > 0: every that many layers is MoE (units of dense + MoE blocks)."""
    shape = dict(vocab_size=64, embed_dim=16, num_heads=4, num_kv_heads=2, head_dim=8, mlp_dim=32)
    moe = dict(num_experts=num_experts, top_k=2, expert_mlp_dim=16, every=moe_every) if moe_every else {}
    return configs.model({f"moe.{k}": v for k, v in moe.items()}, num_layers=num_layers, **shape)


def random_weights(cfg, seed=0):
    """(graphdef, state) of a Decoder with random weights drawn on the host: no initialiser is
    compiled (eagerly initialising a tiny MoE costs ~15 s of CPU here)."""
    graphdef, state = nnx.split(abstract_model(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    return graphdef, jax.tree.map(lambda s: (0.3 * rng.normal(size=s.shape)).astype(s.dtype), state)


def test_the_switch_makes_the_cpu_take_the_accelerator_paths(monkeypatch):
    """Off: the CPU's paths (unrolled decode, dense experts); on: the stacked cache and `ragged_dot`
    on the CPU too, and the sampler's compile key says which; a TPU mesh takes them either way; a
    value other than on/off is refused naming the variable."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh

    from posttrain.models.moe.experts import grouped_matmul
    from posttrain.sampling.generate import sharding_key

    graphdef, state = nnx.split(abstract_model(lambda: Decoder(tiny_model_config(), rngs=nnx.Rngs(0))))
    # fresh functions each time: jax reuses a function's trace, whatever the switch said then
    unrolled = lambda: jax.eval_shape(lambda s: engine.decode_layers(nnx.merge(graphdef, s)), state) is not None
    tpu = AbstractMesh((2,), ("data",), abstract_device=AbstractDevice("TPU v5", 1, "tpu"))
    cpu = make_mesh(dict(data=-1))
    x, w, sizes = jnp.zeros((8, 4)), jnp.zeros((2, 4, 3)), jnp.array([5, 3])
    ragged = lambda: "ragged_dot" in str(jax.make_jaxpr(lambda *a: grouped_matmul(*a))(x, w, sizes))
    monkeypatch.delenv(ACCELERATOR_PATHS_ENV, raising=False)
    off_key = sharding_key()
    assert not accelerator_paths(cpu) and accelerator_paths(tpu)
    assert unrolled() and not ragged()
    for value in ("1", "true", "ON"):
        monkeypatch.setenv(ACCELERATOR_PATHS_ENV, value)
        assert accelerator_paths(cpu) and accelerator_paths(tpu)
    assert not unrolled() and ragged()
    assert sharding_key() != off_key  # a program traced on one branch is never reused on the other
    for value in ("0", "off", ""):
        monkeypatch.setenv(ACCELERATOR_PATHS_ENV, value)
        assert not accelerator_paths(cpu)
    monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "tpu")
    with pytest.raises(ValueError, match=f"{ACCELERATOR_PATHS_ENV}='tpu'"):
        accelerator_paths(cpu)


def test_stacked_extend_equals_the_unrolled_one_at_every_draft_depth():
    """Layers [dense, MoE, dense, MoE, dense] scan as ((dense, MoE) × 2, dense × 1): a draft of 1
    layer stops inside the first unit, of 3 after a whole repeat and a part, of 5 in the second
    stack. Hidden states and every layer's cache (written or not) equal the unrolled extend's."""
    cfg = tiny_model_config(num_layers=5, moe_every=2)
    graphdef, state = random_weights(cfg)
    depths = (1, 3, 5)

    @jax.jit
    def run(state, tokens, lengths, new, positions):
        model = nnx.merge(graphdef, state)
        segments = engine.stack_segments(model)
        out = {}
        for stacked in (False, True):
            layers = None if stacked else model.layers()
            _, kv = engine.prefill(model, tokens, lengths, layers)
            cache = kv_cache.allocate(kv, 16)
            for n in depths:
                h, c = engine.extend(model, layers, new, positions, cache, n)
                out[stacked, n] = (h, kv_cache.to_layers(c, segments) if stacked else c)
        return out

    tokens = jnp.array([[3, 9, 4, 1, 7, 2], [5, 8, 0, 0, 0, 0]])
    lengths = jnp.array([6, 2])
    new = jnp.array([[11, 12, 13], [14, 15, 16]])
    out = jax.device_get(run(state, tokens, lengths, new, lengths[:, None] + jnp.arange(3)))
    model = nnx.merge(graphdef, state)
    assert engine.stack_segments(model) == ((2, 2), (1, 1)) and engine.depth(model) == 5
    for n in depths:
        (h0, c0), (h1, c1) = out[False, n], out[True, n]
        np.testing.assert_allclose(h1, h0, atol=1e-5, err_msg=f"draft of {n} layers")
        for layer, (a, b) in enumerate(zip(c0, c1)):
            for x, y in zip(a, b):
                np.testing.assert_allclose(y, x, atol=1e-5, err_msg=f"depth {n}, layer {layer}")
    # layers past the draft keep the prefill's entries at the new positions: zeros in an allocated cache
    assert not np.any(out[True, 1][1][1][0][..., 6:9]) and np.any(out[True, 1][1][0][0][..., 6:9])
    # the conversions invert each other on host arrays, and refuse a cache of other stacks
    per_layer = out[False, 5][1]
    stacked = kv_cache.to_stacked(per_layer, ((2, 2), (1, 1)), np.stack)
    assert [a.shape[0] for a, _ in stacked] == [2, 2, 1]
    for a, b in zip(kv_cache.to_layers(stacked, ((2, 2), (1, 1))), per_layer):
        np.testing.assert_array_equal(a[0], b[0])
    with pytest.raises(ValueError, match="stacks"):
        kv_cache.to_layers(stacked, ((1, 5),))
    with pytest.raises(ValueError, match="not stacked as the model's stacks"):  # a per-layer cache
        engine.extend(model, None, new, jnp.zeros((2, 3), jnp.int32), per_layer)


def test_moe_training_gradients_are_the_same_on_both_branches(monkeypatch):
    """The expert branches serve training too: a tiny MoE decoder's loss and gradients (experts on
    the CPU's dense forms, or on `ragged_dot` after the general exchange) agree across branches."""
    graphdef, state = random_weights(tiny_model_config(num_layers=1, moe_every=1))
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, 64, (4, 8)))

    def loss(state):
        logits, aux = nnx.merge(graphdef, state)(tokens)
        targets = jax.nn.one_hot(jnp.roll(tokens, -1, axis=1), logits.shape[-1])
        return -jnp.mean(jnp.sum(targets * jax.nn.log_softmax(logits), -1)) + aux["moe/aux_loss"]

    grads = {}
    for branch in ("0", "1"):
        monkeypatch.setenv(ACCELERATOR_PATHS_ENV, branch)
        grads[branch] = jax.device_get(jax.jit(lambda s: jax.value_and_grad(loss)(s))(state))  # traced anew
    np.testing.assert_allclose(grads["1"][0], grads["0"][0], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(grads["0"][1]), jax.tree.leaves(grads["1"][1])):
        np.testing.assert_allclose(b, a, atol=1e-5)


def test_speculative_round_stays_one_unit_deep_on_the_accelerator_path(monkeypatch):
    """Traced with the switch, the speculative program of a 2-layer and an 8-layer model are the
    same size (every extend loops over the stack); the CPU's unrolled program grows with depth."""
    from posttrain.sampling import SamplingParams
    from posttrain.sampling.generate import sharding_key
    from posttrain.sampling.speculative import speculative_program

    sampling = SamplingParams(temperature=1.0, max_new_tokens=4, speculative_k=2, draft_layers=1)

    def size(num_layers):
        graphdef, params, rest = nnx.split(
            abstract_model(lambda: Decoder(tiny_model_config(num_layers), rngs=nnx.Rngs(0))), nnx.Param, ...
        )
        i32 = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.int32)
        args = (params, rest, i32(2, 8), i32(2), i32(2), i32(), jax.eval_shape(lambda: jax.random.key(0)))
        text = speculative_program.trace(
            graphdef, *args, sampling=sampling, pad_id=0, rules=sharding_key()
        ).jaxpr.pretty_print()
        return len(text.splitlines())

    monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "1")
    assert size(8) == size(2)
    monkeypatch.delenv(ACCELERATOR_PATHS_ENV)
    assert size(8) > 2 * size(2)


def test_episodes_are_the_same_on_both_branches(tiny_rl_policy, monkeypatch):
    """Multi-turn episodes (contexts of different lengths, growing turn by turn): on the
    accelerator branch, with later turns served by the prefix cache from stacked KV, the
    same tokens, loss masks, rewards and behaviour log-probs as the CPU branch's plain sampling."""
    from posttrain.sampling.prefix_cache import PrefixCache
    from tests.support.episodes import assert_same_rollouts, episodes

    key = jax.random.key(5)  # rl/rollout/test_episodes' lockstep episodes: the CPU branch's programs shared
    monkeypatch.delenv(ACCELERATOR_PATHS_ENV, raising=False)
    cpu, *_ = episodes(tiny_rl_policy, 1, key)
    monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "1")
    cache = PrefixCache(4096, block=8)
    accelerator, _, worker, _ = episodes(tiny_rl_policy, 1, key, prefix_cache=cache)
    assert_same_rollouts(cpu, accelerator)
    assert cache.stats.hits > 0 and len(worker.calls) == 3  # turns 2 and 3 hit their earlier turns' KV


def tpu_sampler_programs(mesh, rules, layout):
    """Every sampler program (static, speculative, prefix-cached without and with a hit, queued and
    grouped continuous batching) of the tiny MoE model with abstract weights in the `layout`'s
    rules, as (name, jitted function, static kwargs, abstract args): 2 prompts of 8 tokens, 2
    samples each, continuous batching in 4 slots (one row per device)."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from posttrain.plan import compile_plan as cp
    from posttrain.sampling import SamplingParams
    from posttrain.sampling.continuous_programs import continuous_program, grouped_continuous_program
    from posttrain.sampling.generate import generate_program, sharding_key
    from posttrain.sampling.layout import sampler_rules
    from posttrain.sampling.prefix_cache import cached_program
    from posttrain.sampling.speculative import speculative_program
    from tests.support.tpu import tiny_moe_config

    cfg = tiny_moe_config()
    rules = sampler_rules(rules, layout)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))
    graphdef = nnx.graphdef(abstract_model(make))
    params, rest = cp.abstract_weights(make, mesh, rules)
    spec = lambda shape, dtype=jnp.int32: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    key = spec((), jax.eval_shape(lambda: jax.random.key(0)).dtype)
    sampling = SamplingParams(temperature=1.0, top_k=8, max_new_tokens=4, num_samples=2, stop_ids=(0,))
    b, p = 2, 8
    weights = (graphdef, params, rest)
    prompts = (spec((b, p)), spec((b,)), spec((b,)), spec(()), key)  # tokens, lengths, limits, count, key
    with use_sharding(mesh, rules):
        model = lambda w, r: nnx.merge(graphdef, w, r)
        prefill = lambda m, t, n: engine.prefill(m, t, n, engine.decode_layers(m))[1]
        kv = jax.eval_shape(lambda w, r, t, n: prefill(model(w, r), t, n), params, rest, prompts[0], prompts[1])
        common = dict(sampling=sampling, pad_id=0, rules=sharding_key())
    prefix = jax.tree.map(lambda a: spec(a.shape, a.dtype), kv)
    cached = lambda prefix: (*weights, prefix, prompts[0], spec((b,)), *prompts[1:])  # prefix, suffix, starts, ..
    queue = (spec((2 * b, p)), spec((2 * b,)), spec((2 * b,)), spec((2 * b,)), spec(()), key)  # + sample ids
    speculative = dataclasses.replace(sampling, speculative_k=2, draft_layers=1)
    return rules, [
        ("generate", generate_program, common, (*weights, *prompts)),
        ("speculative", speculative_program, {**common, "sampling": speculative}, (*weights, *prompts)),
        ("prefix miss", cached_program, {**common, "capacity": 2 * p + 4}, cached(None)),
        ("prefix hit", cached_program, {**common, "capacity": 2 * p + 4}, cached(prefix)),
        ("continuous", continuous_program, {**common, "num_slots": 4, "prefill_batch": 2}, (*weights, *queue)),
        ("grouped", grouped_continuous_program, {**common, "num_slots": 4, "refill_batch": 2}, (*weights, *prompts)),
    ]


@needs_libtpu
def test_every_sampler_program_is_traced_for_a_tpu_slice():
    """Each sampler program of the tiny MoE model, in both sampling layouts, lowered for a v5p
    slice (data 2 · expert 2) as a pod would run it: the stacked KV cache, experts on `ragged_dot`
    and exchanged by the ragged all-to-all (a TPU-only collective, like the Pallas kernels:
    tests/plan/test_compile_plan.py compiles them and the static sampler with libtpu). Lowered only: a
    libtpu compile of the speculative program takes ~15 s of CPU here."""
    from posttrain.parallel import parse_rules
    from tests.support.tpu import tiny_moe_config

    # ZeRO-3 weights in the learner's layout: the layouts differ
    cfg = tiny_moe_config({"mesh.data": 1, "mesh.fsdp": 2})
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices("v5p:2x2x1"))
    rules = parse_rules(cfg.sharding.rules)
    texts = {}
    for layout in ("learner", "tensor"):
        layout_rules, programs = tpu_sampler_programs(mesh, rules, layout)
        for name, fn, kwargs, args in programs:
            with use_sharding(mesh, layout_rules):
                texts[layout, name] = text = fn.lower(*args, **kwargs).as_text()
            assert "ragged_dot" in text and "ragged_all_to_all" in text, (layout, name)
    assert all(texts["learner", name] != texts["tensor", name] for _, name in texts)
