"""The sampler's decode layout (`sampling.layout = "tensor"`): weights resharded from the learner's
ZeRO-3 layout into tensor parallelism at publish time sample the same tokens with the same
log-probs as the learner's layout and as one device, static and continuous batching, on 8
simulated CPU devices."""

import types

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.config import run_config
from posttrain.core.state import abstract_model, init_model_state
from posttrain.models.decoder import Decoder
from posttrain.parallel import DEFAULT_RULES, decode_rules, logical_spec, make_mesh, shardings_for, use_sharding
from posttrain.sampling import ContinuousBatcher, SamplingParams, generate
from posttrain.sampling.layout import check_layout, publish_weights, sampler_rules
from tests.support.sampling import PROMPTS, model_config
from tests.support.typed_configs import run_cfg, typed


def bare_components(cfg, mesh):
    """The RL loop's Components with only the config and the learner's layout (what `weights` reads)."""
    import dataclasses

    from posttrain.stages.rlvr import Components

    required = {f.name: None for f in dataclasses.fields(Components) if f.default is dataclasses.MISSING}
    return Components(**{**required, "cfg": cfg, "learner_sharding": (mesh, RULES)})


RULES = {**DEFAULT_RULES, "embed": ("fsdp",)}
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=8, stop_ids=tuple(range(1, 9)))  # some stop early
TP = ("tensor", "fsdp")


@pytest.fixture(scope="module")
def mesh():
    return make_mesh(dict(fsdp=2, expert=2, tensor=2))  # ZeRO-3 over fsdp, experts over 2, tensor 2


@pytest.fixture(scope="module")
def model(mesh):
    """(graphdef, learner params, decode params, rest) of the tiny MoE model (a dense layer first)."""
    make = lambda: Decoder(model_config("moe"), rngs=nnx.Rngs(3))
    learner, rest = init_model_state(make, mesh, RULES)
    return nnx.graphdef(abstract_model(make)), learner, publish_weights(learner, mesh, RULES, "tensor"), rest


def test_decode_rules_move_zero3_axes_to_tensor_parallelism():
    rules = decode_rules({**DEFAULT_RULES, "embed": ("fsdp", "expert")})
    assert rules["embed"] == () and rules["experts"] == ("expert",)
    for name in ("heads", "kv_heads", "mlp", "expert_mlp", "vocab", "vocab_lookup", "activation_heads"):
        assert rules[name] == TP, name
    assert rules["batch"] == rules["activation_batch"] == ("data", "expert")
    assert sampler_rules(RULES, "learner") == RULES
    with pytest.raises(ValueError, match="sampling.layout='zero3'"):
        check_layout("zero3")


def test_sampling_layout_key_is_checked():
    with pytest.raises(ValueError, match="sampling.layout='zero3'"):
        run_cfg({"sampling.layout": "zero3"}, stage="rlvr")
    cfg = run_config(run_cfg({"sampling.layout": "tensor"}, stage="rlvr"))
    with pytest.raises(ValueError, match="sampling.layout='tensor'.*no rlvr stage"):  # nothing else samples with it
        run_config(cfg.replace(stage="sft"))


def test_published_params_have_the_decode_shardings(model, mesh):
    _, learner, published, _ = model
    want = shardings_for(learner, mesh, decode_rules(RULES))
    for (path, x), s in zip(jax.tree_util.tree_leaves_with_path(published), jax.tree.leaves(want)):
        assert x.sharding.spec == s.spec, jax.tree_util.keystr(path)
    layer = published["stacks"][1]["blocks"][0]  # the MoE layers' stack
    assert layer["attn"]["q"][...].sharding.spec == P(None, None, TP)  # [L, D, H, Dh]: heads
    assert layer["attn"]["o"][...].sharding.spec == P(None, TP)  # [L, H, Dh, D]
    assert layer["mlp"]["w_gate"][...].sharding.spec == P(None, "expert", None, TP)  # [L, E, D, F]
    assert published["embed"][...].sharding.spec == P(TP)  # [V, D]: vocab
    assert learner["embed"][...].sharding.spec == P("tensor", "fsdp")  # the learner's: unchanged
    np.testing.assert_array_equal(np.asarray(published["embed"][...]), np.asarray(learner["embed"][...]))
    with pytest.raises(ValueError, match="logical axis names"):
        publish_weights(jax.tree.leaves(learner), mesh, RULES, "tensor")


def test_loop_publishes_the_decode_layout(model, mesh):
    """`stages.rlvr.Components.weights` (what rollouts, evals and the async producer sample with)
    reshards into the layout `sampling.layout` names."""
    from posttrain.stages.rlvr import RLState

    _, learner, _, rest = model
    state = types.SimpleNamespace(params=learner, frozen=None, rest=rest)
    for layout in ("learner", "tensor"):
        c = bare_components(run_cfg({"sampling.layout": layout}), mesh)
        params, _ = c.weights(RLState(state, 0))
        spec = params["embed"][...].sharding.spec
        assert spec == (P("tensor", "fsdp") if layout == "learner" else P(TP)), layout


def test_publish_program_reshards_into_the_decode_layout(model, mesh):
    """`compile_plan`'s "publish" program (what pod plans compile to cost the reshard) lands the
    learner's weights in the shardings `publish_weights` gives."""
    from posttrain.plan import compile_plan as cp

    _, learner, published, _ = model
    cfg = run_cfg({"sampling.layout": "tensor"}, model=model_config("moe"))
    (program,) = cp.build_programs(cfg, mesh, RULES, ("publish",), prompt_len=8)
    compiled, _ = cp.compile_program(program, mesh, RULES)
    got = [s.spec for s in jax.tree.leaves(compiled.output_shardings)]
    assert got == [x.sharding.spec for x in jax.tree.leaves(published)]


def test_sampler_programs_are_keyed_on_the_rules_in_force(mesh, monkeypatch):
    """jit keys its traces on shapes and the mesh, not on our rules: a sampler program traced under
    the learner's rules would be reused, with their sharding constraints, under the decode rules
    (same mesh and shapes) unless the rules are a static argument."""
    import importlib

    from posttrain.parallel.mesh import accelerator_paths_forced
    from posttrain.sampling import engine

    gen = importlib.import_module("posttrain.sampling.generate")  # the module (the package exports the function)
    seen = []

    def program(graphdef, params, rest, tokens, *args, sampling, pad_id, rules):
        seen.append(rules)
        return engine.Outputs.empty(tokens.shape[0] * sampling.num_samples, sampling.max_new_tokens, pad_id)

    monkeypatch.setattr(gen, "generate_program", program)
    for rules in (RULES, decode_rules(RULES)):
        with use_sharding(mesh, rules):
            gen.generate(None, None, None, PROMPTS, SAMPLING, jax.random.key(0))
    gen.generate(None, None, None, PROMPTS, SAMPLING, jax.random.key(0))
    rules, switch = zip(*seen)  # `sharding_key`: (the rules, the accelerator-path switch)
    assert dict(rules[0]) == RULES and dict(rules[1]) == decode_rules(RULES) and rules[2] is None
    assert switch == (accelerator_paths_forced(),) * 3


@pytest.fixture(scope="module")
def samples(model, mesh):
    """The same prompts and key sampled on one device, in the learner layout and in the decode
    layout (static batching), and in the decode layout by continuous batching."""
    graphdef, learner, published, rest = model
    key = jax.random.key(7)
    with use_sharding(make_mesh({}, jax.devices()[:1]), RULES):
        single = generate(graphdef, *jax.device_put((learner, rest), jax.devices()[0]), PROMPTS, SAMPLING, key)
    with use_sharding(mesh, RULES):
        learner_layout = generate(graphdef, learner, rest, PROMPTS, SAMPLING, key)
    batcher = ContinuousBatcher(graphdef, SAMPLING, num_slots=2, prefill_batch=2)
    for p in PROMPTS:
        batcher.submit(p)
    with use_sharding(mesh, decode_rules(RULES)):
        decode_layout = generate(graphdef, published, rest, PROMPTS, SAMPLING, key)
        continuous = batcher.run(published, rest, key)
    return single, learner_layout, decode_layout, continuous


def test_decode_layout_samples_as_the_learner_layout_and_one_device(samples):
    single, learner_layout, out, _ = samples
    assert len(set(map(tuple, out.tokens.tolist()))) > 2 and set(out.stop_reason.tolist()) == {0, 1}
    for other in (learner_layout, single):
        np.testing.assert_array_equal(out.tokens, other.tokens)
        np.testing.assert_array_equal(out.lengths, other.lengths)
        np.testing.assert_allclose(out.logprobs, other.logprobs, atol=1e-5)
        np.testing.assert_allclose(out.sampling_logprobs, other.sampling_logprobs, atol=1e-5)


def test_decode_layout_continuous_batching_equals_static(samples):
    _, learner_layout, _, continuous = samples
    np.testing.assert_array_equal(continuous.tokens, learner_layout.tokens)
    np.testing.assert_array_equal(continuous.lengths, learner_layout.lengths)
    np.testing.assert_allclose(continuous.logprobs, learner_layout.logprobs, atol=1e-5)


def test_decode_layout_shards_the_cache_by_rows_and_kv_heads(mesh):
    """The KV cache [B, K, Dh, T] under the decode rules: rows over the batch axes left (expert),
    KV heads over the tensor axes that divide them."""
    from posttrain.sampling.kv_cache import K_NAMES

    spec = logical_spec(K_NAMES, mesh, decode_rules(RULES), (8, 2, 8, 16))
    assert spec == P("expert", "tensor")
    assert logical_spec(K_NAMES, mesh, decode_rules(RULES), (8, 4, 8, 16)) == P("expert", TP)


@pytest.mark.slow
def test_rl_run_in_the_decode_layout_equals_the_learner_layout(tmp_path):
    """Two on-policy RLVR steps on a ZeRO-3 mesh: sampling from the decode-layout copy made at
    each publish gives the same metrics as sampling from the learner's arrays."""
    from posttrain.stages import rlvr as loop
    from tests.support.rl_runs import TIMING, rows, tiny

    runs = {}
    for layout in ("learner", "tensor"):
        changes = {"mesh.data": 1, "mesh.fsdp": 2, "train.steps": 2, "sampling.layout": layout}
        cfg = typed(tiny(tmp_path / layout)).replace(changes)
        loop.run(cfg)
        runs[layout] = rows(tmp_path / layout)
    assert len(runs["tensor"]) == 2
    for x, y in zip(runs["learner"], runs["tensor"]):
        for k in x:
            if k not in TIMING:
                np.testing.assert_allclose(y[k], x[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_rollout_worker_in_the_decode_layout_continuous_and_prefix_cache(model, mesh, samples, monkeypatch):
    """What `RolloutWorker.sample` runs with sampling.layout='tensor' and continuous batching
    (the grouped continuous program) or the prefix cache (the cached program; the second call is
    served from the first's KV): each traced under the decode rules, each sampling as the learner
    layout's static batch."""
    import importlib

    from posttrain.parallel import rules_key
    from posttrain.parallel.mesh import accelerator_paths_forced
    from posttrain.rl.rollout.worker import RolloutWorker
    from posttrain.sampling.generate import SlotConfig
    from posttrain.sampling.layout import sampling_sharding
    from posttrain.sampling.prefix_cache import PrefixCache

    graphdef, _, published, rest = model
    _, learner_layout, _, _ = samples
    traced = []
    for module, name in (("generate", "grouped_continuous_program"), ("prefix_cache", "cached_program")):
        mod = importlib.import_module(f"posttrain.sampling.{module}")
        program = getattr(mod, name)
        monkeypatch.setattr(
            mod, name, lambda *a, _p=program, _n=name, **kw: (traced.append((_n, kw["rules"])), _p(*a, **kw))[1]
        )
    cache = PrefixCache(4096, block=4)
    workers = [
        RolloutWorker(graphdef, {}, SAMPLING, 0, None, rules=decode_rules(RULES), continuous=SlotConfig(2, 1)),
        RolloutWorker(graphdef, {}, SAMPLING, 0, None, rules=decode_rules(RULES), prefix_cache=cache),
    ]
    with use_sharding(mesh, RULES), sampling_sharding(workers[0].rules):  # as RolloutWorker.generate runs them
        outs = [w.sample(published, rest, PROMPTS, SAMPLING, jax.random.key(7)) for w in workers + workers[1:]]
    key = (rules_key(decode_rules(RULES)), accelerator_paths_forced())  # `generate.sharding_key`
    assert traced == [("grouped_continuous_program", key)] + [("cached_program", key)] * 2
    assert cache.stats.hits == 2  # the second call hits the two prompts longer than a block
    for out in outs:
        np.testing.assert_array_equal(out.tokens, learner_layout.tokens)
        np.testing.assert_array_equal(out.lengths, learner_layout.lengths)
        np.testing.assert_allclose(out.sampling_logprobs, learner_layout.sampling_logprobs, atol=1e-5)


def test_int8_weights_in_the_decode_layout_sample_as_in_the_learner_layout(mesh):
    """sampling.quantize='int8' with sampling.layout='tensor' (dense model): the loop's weights
    (`Components.weights`: reshard, then quantise) sample as the quantised learner-layout weights."""
    from posttrain.stages.rlvr import RLState

    make = lambda: Decoder(model_config("dense"), rngs=nnx.Rngs(3))
    learner, rest = init_model_state(make, mesh, RULES)
    graphdef, state = nnx.graphdef(abstract_model(make)), types.SimpleNamespace(params=learner, frozen=None, rest=rest)
    outs = {}
    for layout in ("learner", "tensor"):
        cfg = run_cfg({"sampling.quantize": "int8", "sampling.layout": layout})
        params, _ = bare_components(cfg, mesh).weights(RLState(state, 0))
        assert params["embed"][...].sharding.spec == (P("tensor", "fsdp") if layout == "learner" else P(TP))
        with use_sharding(mesh, sampler_rules(RULES, layout)):
            outs[layout] = generate(graphdef, params, rest, PROMPTS, SAMPLING, jax.random.key(7))
    np.testing.assert_array_equal(outs["tensor"].tokens, outs["learner"].tokens)
    np.testing.assert_allclose(outs["tensor"].sampling_logprobs, outs["learner"].sampling_logprobs, atol=1e-5)
