"""MoE routing replay (`model.moe.routing_replay = sampler`): the MoE layer on given experts against a
float32 reference (values and gradients, every expert path and the sharded layer); the sampler's
recorded experts; a quantised sampler routes some tokens differently from the float learner, and with
replay the learner routes exactly as the sampler did; with a float sampler replay changes nothing;
a learner update on replayed routing; the config checks."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.config import run_config
from posttrain.core.optim import make_optimizer
from posttrain.core.state import create_train_state
from posttrain.errors import UserError
from posttrain.models.decoder import Decoder
from posttrain.models.moe.dispatch import ExpertLayout
from posttrain.models.moe.layer import MoE, RoutingSpec, moe_block
from posttrain.models.quant import quantize_params
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.parallel.mesh import ACCELERATOR_PATHS_ENV, accelerator_paths_forced
from posttrain.rl.algo.learner import batch_rows, compute_advantages, learner_logprobs, rl_batch
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.rollout.routing import trajectory_routing
from posttrain.rl.tasks.scheduler import Group
from posttrain.sampling import SamplingParams, generate
from posttrain.stages.checks import check_run
from tests.support.learner import make_learner, update
from tests.support.typed_configs import model, run_cfg, typed

E, K = 8, 2
PROMPTS = [[5, 9, 3], [7, 1, 4, 4, 2, 8, 6, 3, 9, 1, 5], [2, 60], [3, 3, 8, 1, 12], [9, 9, 41, 17]]
G, NEW = 2, 8
SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=NEW, num_samples=G, record_routing=True)


def moe_cfg(router="softmax", norm=True):
    return model(
        {
            "moe.num_experts": E,
            "moe.top_k": K,
            "moe.expert_mlp_dim": 32,
            "moe.first_dense": 1,
            "moe.router": router,
            "moe.norm_topk_prob": norm,
            "moe.routed_scaling": 1.0 if norm else 2.5,
        },
        vocab_size=64,
        embed_dim=32,
        num_layers=3,
        num_heads=2,
        num_kv_heads=1,
        head_dim=16,
        mlp_dim=64,
    )


def check_config(cfg):
    """A run's start-up checks of its config: its sections and the rules of the stages it reaches
    (`run_config`), then each stage's own (`stages.checks.check_run`)."""
    check_run(run_config(cfg))


def reference_moe(x, params, experts, router, norm, scaling):
    """Float32 y [T, D] of the experts given per token: Σ_j w_tj · SwiGLU_{e_tj}(x_t), the weights the
    router's own probabilities (softmax over all experts, or sigmoid scores) of those experts."""
    logits = x @ params["router"]
    scores = jax.nn.softmax(logits, -1) if router == "softmax" else jax.nn.sigmoid(logits)
    w = jnp.take_along_axis(scores, experts, -1)
    w = w / w.sum(-1, keepdims=True) if norm else w
    gate, up, down = (params[k][experts] for k in ("w_gate", "w_up", "w_down"))  # [T, k, ...]
    h = jax.nn.silu(jnp.einsum("td,tkdf->tkf", x, gate)) * jnp.einsum("td,tkdf->tkf", x, up)
    return jnp.einsum("tk,tkd->td", w * scaling, jnp.einsum("tkf,tkfd->tkd", h, down))


@pytest.mark.parametrize(("router", "norm", "paths"), [("softmax", True, ("0", "1")), ("sigmoid", False, ("0",))])
def test_given_experts_equal_a_float_reference_in_values_and_gradients(router, norm, paths, monkeypatch):
    rng = np.random.default_rng(0)
    t, d, f = 24, 16, 8
    params = {
        "router": rng.normal(size=(d, E)) / 4,
        "w_gate": rng.normal(size=(E, d, f)) / 4,
        "w_up": rng.normal(size=(E, d, f)) / 4,
        "w_down": rng.normal(size=(E, f, d)) / 3,
    }
    params = {k: jnp.asarray(v, jnp.float32) for k, v in params.items()}
    if router == "sigmoid":  # a bias changes the choice, never the weights: replay ignores it
        params["bias"] = jnp.asarray(rng.normal(size=(E,)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    given = jnp.asarray(np.argsort(rng.random((t, E)), axis=1)[:, :K], jnp.uint8)  # distinct, not the top-k
    cot = jnp.asarray(rng.normal(size=(t, d)), jnp.float32)
    cfg = moe_cfg(router, norm).moe
    spec = RoutingSpec.from_config(cfg)

    def ours(x, params):
        y, aux = moe_block(x, params, spec=spec, layout=ExpertLayout(), experts=given)
        return jnp.sum(y * cot), (y, aux["experts"])

    def ref(x, params):
        y = reference_moe(x, params, given.astype(jnp.int32), router, norm, cfg.routed_scaling)
        return jnp.sum(y * cot), y

    (_, y_ref), g_ref = jax.jit(jax.value_and_grad(ref, argnums=(0, 1), has_aux=True))(x, params)
    assert float(jnp.abs(g_ref[1]["router"]).max()) > 1e-3  # the gate weights carry the router's gradient
    for path in paths:  # the CPU's dense experts; the accelerators' sorted rows on ragged_dot
        monkeypatch.setenv(ACCELERATOR_PATHS_ENV, path)
        (_, (y, used)), g = jax.jit(jax.value_and_grad(ours, argnums=(0, 1), has_aux=True))(x, params)  # traced anew
        np.testing.assert_array_equal(used, given)
        np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
        for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(g_ref)):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5 * float(jnp.abs(b).max()))


def test_the_expert_parallel_layer_replays_as_the_single_device_one():
    layer = MoE(moe_cfg(), rngs=nnx.Rngs(0))
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.normal(size=(4, 6, 32)), jnp.float32)
    given = jnp.asarray(np.argsort(rng.random((4, 6, E)), axis=-1)[..., :K], jnp.int32)
    y, aux = layer(x, experts=given)
    mesh = make_mesh(dict(data=2, expert=2, tensor=2))
    with use_sharding(mesh, parse_rules({})):
        y8, aux8 = jax.jit(lambda x, e: layer(x, experts=e))(x, given)
    np.testing.assert_array_equal(aux8["experts"], given)
    np.testing.assert_allclose(y8, y, rtol=1e-5, atol=1e-6)
    assert not np.array_equal(aux["experts"], layer(x)[1]["experts"])  # the given experts were not its own


@pytest.fixture(scope="module")
def setup():
    """The tiny MoE policy's train state on one device, as tests/rl/algo/test_learner.py's `setup`."""
    mesh, rules = make_mesh(dict(data=1), devices=jax.devices()[:1]), parse_rules({})
    cfg = run_cfg({"optim.lr": 3e-3, "optim.warmup_steps": 0})
    with use_sharding(mesh, rules):
        tx = make_optimizer(cfg.optim, 100)
        graphdef, state, shardings = create_train_state(lambda: Decoder(moe_cfg(), rngs=nnx.Rngs(0)), tx, mesh, rules)
    return mesh, rules, graphdef, state, shardings, cfg.optim, tx


@pytest.fixture(scope="module")
def quantised(setup):
    """Samples of the int8 sampler (`sampling.quantize`) of the policy, with their routing."""
    graphdef, state = setup[2], setup[3]
    qparams = jax.jit(quantize_params, static_argnums=1)(state.params, "int8")  # one compile, not one per leaf op
    return generate(graphdef, qparams, state.rest, PROMPTS, SAMPLING, jax.random.key(0))


def rows_of(samples):
    """The learner's rollouts of `samples` (one group per prompt), with routing and behaviour log-probs."""
    out = []
    for j, p in enumerate(PROMPTS):
        trajs, behav, routing = [], [], []
        for i in range(j * G, (j + 1) * G):
            n = int(samples.lengths[i])
            trajs.append(Trajectory(f"t{j}", p + samples.completion(i), [False] * len(p) + [True] * n, len(p)))
            behav.append(np.concatenate([np.zeros(len(p)), samples.sampling_logprobs[i, :n]]).astype(np.float32))
            routing.append(trajectory_routing(samples, i, trajs[-1]))
        out.append(Rollout(Group("arithmetic", None, [float(i % 2) for i in range(G)], trajs), 0, behav, routing))
    return out


@functools.partial(jax.jit, static_argnums=(0, 4))
def learner_pass(graphdef, params, rest, batch, paths):
    """The learner's log-probs of the batch's targets (replaying batch["routing"] when there is one)
    and the experts it used, [N, S, layers, k]. `paths`: the accelerator-path switch it is traced under."""
    model = nnx.merge(graphdef, params, rest)
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    used = model(*args, routing=batch.get("routing"), experts_out=True)[1]["moe/experts"]
    return learner_logprobs(model, batch, SAMPLING, update_bias=False)[0], used


def own_and_replayed(setup, batch):
    """learner_pass without and with the batch's routing, on the host."""
    graphdef, state = setup[2], setup[3]
    paths = accelerator_paths_forced()
    own = learner_pass(graphdef, state.params, state.rest, {k: v for k, v in batch.items() if k != "routing"}, paths)
    return jax.device_get((own, learner_pass(graphdef, state.params, state.rest, batch, paths)))


def test_a_quantised_sampler_routes_differently_and_replay_makes_the_learner_route_as_it_did(setup, quantised):
    samples = quantised
    assert samples.routing.shape == (len(PROMPTS) * G, NEW, 2, K) and samples.routing.dtype == np.uint8
    assert samples.prompt_routing.shape[:2] == (len(PROMPTS) * G, 16)
    batch = rl_batch(rows_of(samples), pad_id=0)
    real = batch["segment_ids"] > 0
    (own_lp, own), (replay_lp, replayed) = own_and_replayed(setup, batch)
    differs = np.any(own != batch["routing"], axis=(-1, -2))[real]  # per token: some layer chose otherwise
    print(f"tokens routed differently by the int8 sampler: {differs.mean():.3f} of {differs.size}")
    assert 0 < differs.mean() < 0.5
    np.testing.assert_array_equal(replayed[real], batch["routing"][real])
    gen = batch["loss_mask"] > 0  # replay moves the learner's log-probs towards the sampler's
    gap = lambda lp: np.abs(lp - batch["behav_logp"])[gen].mean()
    print(f"mean |learner - sampler| log-prob: own routing {gap(own_lp):.4f}, replayed {gap(replay_lp):.4f}")
    assert gap(replay_lp) < gap(own_lp)


def test_with_a_float_sampler_replay_changes_nothing(setup, monkeypatch):
    graphdef, state = setup[2], setup[3]
    monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "1")  # recorded by the stacked prefill and decode (lax.scan)
    samples = generate(graphdef, state.params, state.rest, PROMPTS, SAMPLING, jax.random.key(1))
    monkeypatch.setenv(ACCELERATOR_PATHS_ENV, "0")  # the learner as in the test above (its compiled passes)
    batch = rl_batch(rows_of(samples), pad_id=0)
    real, gen = batch["segment_ids"] > 0, batch["loss_mask"] > 0
    (own_lp, own), (replay_lp, _) = own_and_replayed(setup, batch)
    np.testing.assert_array_equal(own[real], batch["routing"][real])  # the sampler recorded what it used
    np.testing.assert_allclose(replay_lp[real], own_lp[real], rtol=0, atol=1e-6)
    np.testing.assert_allclose(own_lp[gen], batch["behav_logp"][gen], atol=1e-4)


def test_a_learner_update_on_replayed_routing_is_finite(setup, quantised):
    learner = make_learner(setup, SAMPLING, group_size=G, prompts_per_step=8)
    batch = rl_batch(rows_of(quantised), pad_id=0, num_rows=batch_rows(len(PROMPTS), learner.rl_cfg))
    assert batch["routing"].shape == (*batch["inputs"].shape, 2, K)
    batch["advantages"] = compute_advantages(batch, learner.rl_cfg)
    new_state, metrics = update(setup, learner, batch, len(PROMPTS) * G)
    assert all(np.all(np.isfinite(v)) for v in metrics.values()), metrics
    assert metrics["rl/optimizer_steps"] == 1
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new_state.params, setup[3].params)
    assert max(jax.tree.leaves(moved)) > 0


def test_routing_replay_is_refused_where_it_cannot_take_effect():
    def cfg_with(stage="rlvr", experts=4, **keys):
        changes = {"model.moe.num_experts": experts, "model.moe.routing_replay": "sampler"}
        return run_cfg({**changes, **{key.replace("__", "."): value for key, value in keys.items()}}, stage=stage)

    check_config(cfg_with())
    refusals = [  # (a refused config is refused as it is built: its sections check themselves)
        (dict(experts=0), "routing_replay='sampler' needs a Mixture-of-Experts model"),
        (dict(stage="sft"), "only the rlvr stage's learner replays"),
        *(
            ({key: value}, f"routing_replay='sampler' with {key.replace('__', '.')}=")
            for key, value in (
                ("sampling__continuous_batching", True),
                ("sampling__speculative_k", 2),
                ("sampling__prefix_cache", 256),
                ("rl__env", "tool"),
            )
        ),
    ]
    for keys, message in refusals:
        with pytest.raises(UserError, match=message) as e:
            check_config(cfg_with(**keys))
        assert e.value.key == "model.moe.routing_replay", message
    check_config(cfg_with(rl__placement="disaggregated", rl__role="learner"))  # carried (workqueue)
    with pytest.raises(UserError, match="routing_replay"):
        check_config(cfg_with().replace({"model.moe.routing_replay": "learner"}))


def test_samplers_that_do_not_record_routing_refuse_to(setup):
    from posttrain.sampling.generate import SlotConfig

    graphdef, params, rest = setup[2], setup[3].params, setup[3].rest
    with pytest.raises(ValueError, match="record_routing"):
        generate(graphdef, params, rest, PROMPTS, dataclasses.replace(SAMPLING, speculative_k=2), jax.random.key(0))
    with pytest.raises(ValueError, match="routing is recorded by the static sampler"):
        generate(graphdef, params, rest, PROMPTS, SAMPLING, jax.random.key(0), slots=SlotConfig(4, 2))


@pytest.mark.slow  # three tiny rlvr runs, ~2 min on a loaded 2-core machine
def test_rlvr_with_routing_replay_end_to_end(tmp_path):
    """The rlvr stage on 8 devices (data, expert and tensor parallel MoE): with the float sampler,
    replay gives the run without it (the sampler's routing is the learner's); with an int8 sampler
    the replayed run trains and stays finite."""
    from posttrain.stages import rlvr as loop
    from tests.support.rl_runs import TIMING, rows, tiny

    def run(name, replay="off", quantize="none"):
        cfg = tiny(tmp_path / name, steps=2)
        cfg.train.steps = 2
        cfg.model.moe.num_experts, cfg.model.moe.top_k = 4, 2
        cfg.model.moe.routing_replay, cfg.sampling.quantize = replay, quantize
        check_config(cfg)
        loop.run(typed(cfg))
        return rows(tmp_path / name)

    off, replay = run("off"), run("replay", "sampler")
    assert len(off) == len(replay) == 2
    for a, b in zip(off, replay):
        for k in a.keys() - set(TIMING):
            np.testing.assert_allclose(b[k], a[k], rtol=1e-6, err_msg=k)
    quantised = run("int8", "sampler", "int8")
    assert len(quantised) == 2 and all(np.isfinite(r["loss"]) and np.isfinite(r["grad_norm"]) for r in quantised)
