"""Programs compiled for a TPU slice on the CPU (libtpu's compiler, abstract devices): the tiny MoE
config's train step, RL learner step and sampler take the TPU paths, and their argument memory is
the hand-counted parameter and optimizer bytes per device."""

import re

import pytest

from posttrain.plan import aot
from tests.support.tpu import TOPOLOGY, hand_param_bytes, needs_libtpu, pod_like_tiny_config, tiny_moe_config
from tests.support.typed_configs import typed


@pytest.fixture(scope="module")
def compiled():
    """One compile per program, shared by the asserts."""
    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp

    cfg = tiny_moe_config()
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices(TOPOLOGY))
    rules = parse_rules(cfg.sharding.rules)
    with use_sharding(mesh, rules):
        programs = cp.build_programs(cfg, mesh, rules, ("sft", "rl_learner", "sampler"), prompt_len=8)
    out = {}
    for p in programs:
        c, _ = cp.compile_program(p, mesh, rules)
        out[p.name] = (c, cp.program_report(p, c, aot.CHIPS["v5p"], mesh.size))
    return cfg, mesh, rules, out


@needs_libtpu
def test_tpu_paths_are_compiled(compiled):
    from flax import nnx

    from posttrain.core.state import abstract_model
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import mesh_platform, use_sharding
    from posttrain.sampling import engine

    cfg, mesh, rules, out = compiled
    with use_sharding(mesh, rules):
        assert mesh_platform() == "tpu"
        # decode slices each layer's weights where they are used, inside the loop
        assert engine.decode_layers(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)))) is None
    for name in ("sft", "rl_learner", "sampler"):
        hlo = out[name][0].as_text()
        assert "ragged-dot" in hlo, f"{name}: experts not on ragged_dot"
        assert re.search(r"ragged-all-to-all\(", hlo), f"{name}: expert parallelism not on ragged_all_to_all"
        assert out[name][1]["collectives"]["all-to-all"] > 0


@needs_libtpu
def test_argument_memory_is_the_hand_count(compiled):
    cfg, _, _, out = compiled
    params = hand_param_bytes(cfg, expert_shards=2)
    b, s = cfg.train.batch_size, cfg.train.seq_len
    sft = out["sft"][1]
    # params + Adam's two moments; the batch is 5 int32 [B, S] arrays split over 4 devices
    assert sft["arguments"] == pytest.approx(3 * params + 5 * 4 * b * s // 4, rel=0.1)
    assert sft["parts"]["params"] == pytest.approx(params, rel=0.01)
    assert sft["fits"] and 0 < sft["total"] < aot.CHIPS["v5p"].hbm_bytes
    # the learner also holds the KL reference: a fourth copy of the weights
    assert out["rl_learner"][1]["arguments"] == pytest.approx(4 * params, rel=0.1)
    assert out["sampler"][1]["arguments"] == pytest.approx(params, rel=0.1)
    assert sft["xla_flops"] > 0 and sft["collectives"]["all-reduce"] > 0


@pytest.mark.parametrize(
    "kind, platform, want",
    [
        ("cpu", "cpu", "padded"),
        ("TPU v5", "tpu", "ragged"),
        ("TPU v5 lite", "tpu", "padded"),
        ("NVIDIA H100", "gpu", "ragged"),
    ],
)
def test_auto_dispatch_follows_the_meshs_device_kind(kind, platform, want):
    """'auto' takes the padded all-to-all on the CPU and on v5e (whose compiler fails on the ragged
    one at scale), from the mesh's devices, not the host's backend; an explicit kind is kept."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from posttrain.models.moe.dispatch import expert_layout

    mesh = AbstractMesh((2, 2), ("data", "expert"), abstract_device=AbstractDevice(kind, 1, platform))
    layout = lambda dispatch: expert_layout(mesh, P(("data", "expert")), P(), P("expert"), P("expert"), dispatch)
    assert layout("auto").dispatch == want
    assert layout("ragged").dispatch == "ragged" and layout("padded").dispatch == "padded"
    with pytest.raises(ValueError, match="moe.dispatch='all'"):
        layout("all")


@needs_libtpu
def test_v5e_compiles_the_expert_parallel_step_with_the_padded_all_to_all():
    """The tiny MoE train step compiles for v5e (data 2 · expert 2) with expert parallelism on
    the padded all-to-all; `model.moe.dispatch='ragged'` would choose the ragged one."""
    from posttrain.parallel import make_mesh, mesh_device_kind, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp

    cfg = tiny_moe_config()
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices("v5e:2x2"))
    rules = parse_rules(cfg.sharding.rules)
    assert mesh_device_kind(mesh) == "TPU v5 lite"
    with use_sharding(mesh, rules):
        (program,) = cp.build_programs(cfg, mesh, rules, ("sft",), prompt_len=8)
        compiled, _ = cp.compile_program(program, mesh, rules)
    hlo = compiled.as_text()
    assert "ragged-dot" in hlo, "experts not on ragged_dot"
    assert not re.search(r"ragged-all-to-all\(", hlo)
    assert len(re.findall(r" all-to-all(?:-start)?\(", hlo)) >= 4  # rows and ids there, rows back, transposed
    report = cp.program_report(program, compiled, aot.CHIPS["v5e"], mesh.size)
    assert report["fits"] and report["collectives"]["all-to-all"] > 0
    # the analytic model counts the padded exchange's buffers (rows both ways, ids) exactly
    from posttrain.plan import cost_model

    analytic = cost_model.program_cost(cfg, mesh, rules, "sft", 8, aot.CHIPS["v5e"])
    assert analytic["collectives"]["all-to-all"] == pytest.approx(report["collectives"]["all-to-all"], rel=0.01)


@needs_libtpu
def test_analytic_cost_model_matches_the_compiled_program():
    """`cost_model.program_cost` (FLOPs and collective bytes from the shapes, mesh and rules) against
    the compiled pod-like step: the expert all-to-all within 1%, the weight gathers and the
    gradient reduction (reduce-scatter + all-reduce: XLA merges small reductions) within 10%."""
    import jax

    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp
    from posttrain.plan import cost_model

    cfg = pod_like_tiny_config()
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices(TOPOLOGY))
    rules = parse_rules(cfg.sharding.rules)
    # bf16 as a pod run computes it (conftest asks 'highest', which Mosaic rejects for bf16 operands)
    with use_sharding(mesh, rules), jax.default_matmul_precision("default"):
        (program,) = cp.build_programs(cfg, mesh, rules, ("sft",), prompt_len=8)
        compiled, _ = cp.compile_program(program, mesh, rules)
    got = cp.program_report(program, compiled, aot.CHIPS["v5p"], mesh.size)["collectives"]
    analytic = cost_model.program_cost(cfg, mesh, rules, "sft", 8, aot.CHIPS["v5p"])
    want = analytic["collectives"]
    assert analytic["model_flops_per_device"] == program.model_flops / mesh.size
    assert want["all-to-all"] == pytest.approx(got["all-to-all"], rel=0.01)
    assert want["reduce-scatter"] + want["all-reduce"] == pytest.approx(
        got["reduce-scatter"] + got["all-reduce"], rel=0.1
    )
    assert want["all-gather"] == pytest.approx(got["all-gather"], rel=0.1)
    assert 0 < analytic["mfu"] <= analytic["ceiling"] < 1 and analytic["step_s"] >= analytic["compute_s"] > 0


def test_analytic_cost_model_matches_the_cpu_compiled_program():
    """Where libtpu is absent: the same pod-like step compiled for 4 CPU devices (the padded
    exchange, the CPU's path) against `cost_model.program_cost`: the all-to-all buffers within
    1%, the gradient reduction (reduce-scatter + all-reduce) within 10%; XLA:CPU gathers the dense
    weights of the backward once less than XLA:TPU (the model counts TPU's), so only a bound."""
    import jax

    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp
    from posttrain.plan import cost_model

    cfg = pod_like_tiny_config()
    mesh = make_mesh(cfg.mesh.to_dict(), jax.devices()[:4])
    rules = parse_rules(cfg.sharding.rules)
    with use_sharding(mesh, rules):
        (program,) = cp.build_programs(cfg, mesh, rules, ("sft",), prompt_len=8)
        got, _ = aot.collective_bytes(cp.compile_program(program, mesh, rules)[0].as_text())
    want = cost_model.program_cost(cfg, mesh, rules, "sft", 8, aot.CHIPS["v5p"])["collectives"]
    assert want["all-to-all"] == pytest.approx(got["all-to-all"], rel=0.01)
    assert want["reduce-scatter"] + want["all-reduce"] == pytest.approx(
        got["reduce-scatter"] + got["all-reduce"], rel=0.1
    )
    assert 0.6 * want["all-gather"] <= got["all-gather"] <= want["all-gather"]
    cfg = cfg.replace({"mesh.tensor": 2, "mesh.fsdp": 1})
    with pytest.raises(ValueError, match="tensor"):
        cost_model.program_cost(
            cfg, make_mesh(cfg.mesh.to_dict(), jax.devices()[:4]), rules, "sft", 8, aot.CHIPS["v5p"]
        )


def test_analytic_flops_are_the_programs_model_flops():
    """The cost model's model FLOPs per chip are those `compile_plan` builds each train program with
    (SFT, DPO with its reference, the RL learner with its KL reference); the reference and LoRA
    change them as stated."""
    import jax

    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp
    from posttrain.plan import cost_model

    cfg = pod_like_tiny_config()
    mesh = make_mesh(cfg.mesh.to_dict(), jax.devices()[:4])
    rules = parse_rules(cfg.sharding.rules)
    names = ("sft", "dpo", "rl_learner")
    with use_sharding(mesh, rules):
        programs = cp.build_programs(cfg, mesh, rules, names, prompt_len=8)
    cost = {n: cost_model.program_cost(cfg, mesh, rules, n, 8, aot.CHIPS["v5p"]) for n in names}
    for p in programs:
        assert cost[p.name]["model_flops_per_device"] == pytest.approx(p.model_flops / mesh.size, rel=1e-9), p.name
        assert cost[p.name]["executed_flops_per_device"] == pytest.approx(p.executed_flops / mesh.size, rel=1e-9)
    assert cost["rl_learner"]["collectives"]["all-gather"] > 0
    cfg = cfg.replace({"lora.rank": 4, "lora.targets": ("q", "k", "v", "o")})
    lora = cost_model.program_cost(cfg, mesh, rules, "sft", 8, aot.CHIPS["v5p"])
    assert lora["model_flops_per_device"] == pytest.approx(cost["sft"]["model_flops_per_device"] * 4 / 6)
    # remat full recomputes the forward: executed above model, and LoRA's below full fine-tuning's
    assert lora["model_flops_per_device"] < lora["executed_flops_per_device"] < cost["sft"]["executed_flops_per_device"]
    assert cost["sft"]["model_flops_per_device"] < cost["sft"]["executed_flops_per_device"]
    assert lora["collectives"]["reduce-scatter"] + lora["collectives"]["all-reduce"] < (
        cost["sft"]["collectives"]["reduce-scatter"] + cost["sft"]["collectives"]["all-reduce"]
    )


def test_collective_bytes_follow_loops_and_kinds():
    hlo = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %g = f32[32]{0} all-gather(%x), dimensions={0}
  %r = f32[8]{0} reduce-scatter(%g), dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %r)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %s = bf16[4,4]{1,0} all-reduce(%a), to_apply=%add
  %buf = f32[64]{0} broadcast(%a), dimensions={}
  %rr = f32[64]{0} ragged-all-to-all(%a, %buf, %o1, %o2, %o3, %o4), replica_groups={{0,1}}
  %w = (s32[], f32[8]) while(%t0), condition=%cond, body=%body
  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    counts, unknown = aot.collective_bytes(hlo)
    # a ragged all-to-all sends at most its input (32 bytes); its output buffer is only a bound
    assert counts == {
        "all-gather": 3 * 128,
        "reduce-scatter": 3 * 128,
        "all-to-all": 32,
        "all-reduce": 32,
        "collective-permute": 0,
    }
    assert not unknown
    counts, unknown = aot.collective_bytes(
        hlo.replace("%n = s32[] constant(3)", "%n = s32[] get-tuple-element(%p), index=0")
    )
    assert unknown and counts["all-gather"] == 128


def test_loop_iteration_bytes_count_one_decode_step():
    """A decode loop (data-dependent trip count) around a scan over 3 layers: one iteration is the
    scan's collectives times 3 plus the loop body's own; what runs outside (prefill) is not in it."""
    hlo = """HloModule m

%cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %g = f32[32]{0} all-gather(%x), dimensions={0}
  ROOT %t = (s32[], f32[8]) tuple(%i, %x)
}

%decode_cond (p: (s32[], f32[8])) -> pred[] {
  %p = (s32[], f32[8]) parameter(0)
  %d = pred[] get-tuple-element(%p), index=0
  ROOT %any = pred[] and(%d, %d)
}

%decode (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %s = f32[8]{0} all-reduce(%x), to_apply=%add
  %w = (s32[], f32[8]) while(%p), condition=%cond, body=%body
  ROOT %t = (s32[], f32[8]) tuple(%i, %s)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %prefill = f32[64]{0} all-gather(%a), dimensions={0}
  %w = (s32[], f32[8]) while(%t0), condition=%decode_cond, body=%decode
  ROOT %o = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    step = aot.loop_iteration_bytes(hlo)
    assert step == {
        "all-gather": 3 * 128,
        "reduce-scatter": 0,
        "all-to-all": 0,
        "all-reduce": 32,
        "collective-permute": 0,
    }
    counts, unknown = aot.collective_bytes(hlo)
    assert unknown and counts["all-gather"] == 256 + 3 * 128
    assert (
        aot.loop_iteration_bytes(hlo.replace("condition=%decode_cond", "condition=%cond")) == {}
    )  # every loop counted


def test_topology_names():
    assert aot.parse_topology("v5p-128") == ("v5p", "v5p:4x4x4")
    assert aot.parse_topology("v5p-8") == ("v5p", "v5p:2x2x1")
    assert aot.parse_topology("v5e-256") == ("v5e", "v5e:16x16")
    with pytest.raises(ValueError, match="v5p:2x2"):
        aot.parse_topology("v5p:2x2")


@pytest.mark.parametrize(
    "model, billions",
    [
        ("qwen3_30b_a3b", 30.5),
        ("qwen3_235b_a22b", 235.1),
        ("deepseek_v3", 674.8),
        ("kimi_k2", 1028.3),
        ("llama3_8b", 8.03),
    ],
)
def test_pod_shapes_have_the_published_sizes(model, billions):
    """The pod configs' parameter counts (abstract, nothing allocated): Qwen3 exactly as published,
    DeepSeek-V3 / Kimi-K2 within 1% of 671B / 1.03T with the GQA stand-in for MLA."""
    import runpy

    import jax
    from flax import nnx

    from posttrain.core.state import abstract_model
    from posttrain.models.decoder import Decoder

    cfg = typed(runpy.run_path("configs/pod/moe_shapes.py")["get_config"](f"{model}:sft_full"))
    params = nnx.state(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) / 1e9 == pytest.approx(billions, abs=0.1)
    with pytest.raises(ValueError, match="MODEL:MODE"):
        runpy.run_path("configs/pod/moe_shapes.py")["get_config"](f"{model}:pretrain")


@needs_libtpu
@pytest.mark.parametrize("attention,sequence", [("splash", 1), ("blockwise", 2)], ids=["splash", "ring"])
def test_long_context_attention_compiles_for_tpu(attention, sequence):
    """The TPU attention paths lower and compile for a TPU slice: splash attention (a Pallas TPU
    kernel) on one sequence shard, ring attention (collective-permutes) over two."""
    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp

    cfg = tiny_moe_config(
        {
            **{"model.moe.num_experts": 0, "model.attention": attention, "model.context_parallel": "ring"},
            "model.attention_block": 128,
            **{"mesh.data": 4 // sequence, "mesh.expert": 1, "mesh.sequence": sequence},
            "train.seq_len": 256,
        }
    )
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices(TOPOLOGY))
    rules = parse_rules(cfg.sharding.rules)
    with use_sharding(mesh, rules):
        (program,) = cp.build_programs(cfg, mesh, rules, ("sft",), prompt_len=8)
        hlo = cp.compile_program(program, mesh, rules)[0].as_text()
    if attention == "splash":
        assert "tpu_custom_call" in hlo
    else:
        assert "collective-permute" in hlo


@needs_libtpu
def test_scanned_decode_over_a_sequence_axis_compiles_for_tpu():
    """The sampler (prefill, then the decode loop with `Decoder.decode_stacked`: layers under
    `lax.scan`) on a mesh whose `sequence` axis is 2: the KV cache's time axis is split over it,
    each decode step attends to its half and combines the halves (`ops.decode`), never gathering
    the cache."""
    from flax import nnx

    from posttrain.core.state import abstract_model
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp
    from posttrain.sampling import engine

    cfg = tiny_moe_config({"mesh.data": 1, "mesh.expert": 2, "mesh.sequence": 2})
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices(TOPOLOGY))
    rules = parse_rules(cfg.sharding.rules)
    with use_sharding(mesh, rules):
        assert engine.decode_layers(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)))) is None
        (program,) = cp.build_programs(cfg, mesh, rules, ("sampler",), prompt_len=8)
    compiled, _ = cp.compile_program(program, mesh, rules)
    report = cp.program_report(program, compiled, aot.CHIPS["v5p"], mesh.size)
    step = report["loop_iteration_collectives"]  # one decode step
    m = cfg.model
    row_keys = m.num_kv_heads * m.head_dim * (8 + cfg.rl.max_new_tokens) // 2 * 4  # one row's key half, one layer
    assert report["fits"] and step["all-reduce"] > 0 and step["all-gather"] < row_keys


@needs_libtpu
def test_decode_layout_moves_no_weights_per_token_on_tpu():
    """The sampler compiled for TPU with ZeRO-3 weights (fsdp 2): served from the learner's layout,
    each decode step all-gathers the weight shards again (more bytes than a chip's params); from
    the decode layout (`sampling.layout = "tensor"`) it gathers nothing of the kind."""
    from posttrain.parallel import make_mesh, parse_rules, use_sharding
    from posttrain.plan import compile_plan as cp

    step, params, devices = {}, {}, aot.tpu_devices(TOPOLOGY)  # one device set: meshes over new device objects clash
    for layout in ("learner", "tensor"):
        cfg = tiny_moe_config({"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2, "sampling.layout": layout})
        mesh = make_mesh(cfg.mesh.to_dict(), devices)
        rules = parse_rules(cfg.sharding.rules)
        with use_sharding(mesh, rules):
            (program,) = cp.build_programs(cfg, mesh, rules, ("sampler",), prompt_len=8)
        report = cp.program_report(program, cp.compile_program(program, mesh, rules)[0], aot.CHIPS["v5p"], mesh.size)
        step[layout], params[layout] = report["loop_iteration_collectives"], report["parts"]["params"]
    assert step["learner"]["all-gather"] > params["learner"]
    assert step["tensor"]["all-gather"] < params["learner"] / 100 and step["tensor"]["all-reduce"] > 0


@needs_libtpu
def test_restore_target_is_the_train_steps_input_layout(compiled):
    """A resume reads every array of the train state straight into the shards the compiled train
    step takes (no resharding after restore), and the restore report checks every array."""
    import dataclasses

    import jax

    from posttrain.plan import compile_plan as cp

    cfg, mesh, rules, out = compiled
    target, restore_args = cp.restore_plan(cfg, mesh, rules)
    state_shardings = out["sft"][0].input_shardings[0][0]
    for item, tree in target.items():
        want = jax.tree.leaves(getattr(state_shardings, item))
        got = jax.tree.leaves(tree)
        assert len(got) == len(want) and (got or item == "rest"), item  # rest: router biases, if any
        for x, s in zip(got, want):
            assert x.sharding.is_equivalent_to(s, len(x.shape)), (item, x.sharding, s)
        assert all(a.sharding == x.sharding for a, x in zip(jax.tree.leaves(restore_args[item]), got))
    report = cp.restore_report(target, restore_args, mesh, aot.CHIPS["v5p"])
    assert report["fits"] and not report["problems"]
    assert report["parts"]["params"] == out["sft"][1]["parts"]["params"]
    assert report["parts"]["opt_state"] == pytest.approx(2 * report["parts"]["params"], rel=0.01)
    # an array whose sharding is not on the plan's mesh is named
    single = jax.sharding.SingleDeviceSharding(mesh.devices.flat[0])
    first = jax.tree.leaves(restore_args["params"])[0]
    bad = jax.tree.map(lambda a: dataclasses.replace(a, sharding=single) if a is first else a, restore_args)
    assert "no sharding on the plan's mesh" in cp.restore_report(target, bad, mesh, aot.CHIPS["v5p"])["problems"][0]


def test_analytic_sampler_cost_refuses_the_decode_layout():
    """The analytic model counts the sampler's weight gathers per decode step (learner layout);
    with sampling.layout='tensor' (`tools/pod_plan.py --sampling_layout tensor`) it would give the
    learner layout's numbers for a layout that gathers no weights, so it refuses instead."""
    import jax

    from posttrain.parallel import make_mesh, parse_rules
    from posttrain.plan import cost_model

    cfg = pod_like_tiny_config()
    mesh = make_mesh(cfg.mesh.to_dict(), jax.devices()[:4])
    rules = parse_rules(cfg.sharding.rules)
    learner = cost_model.program_cost(cfg, mesh, rules, "sampler", 8, aot.CHIPS["v5p"])
    assert learner["collectives"]["all-gather"] > 0
    cfg = cfg.replace({"sampling.layout": "tensor"})
    with pytest.raises(ValueError, match="sampling.layout='tensor'.*not modelled"):
        cost_model.program_cost(cfg, mesh, rules, "sampler", 8, aot.CHIPS["v5p"])
    assert (
        cost_model.program_cost(cfg, mesh, rules, "sft", 8, aot.CHIPS["v5p"])["collectives"]
        == cost_model.program_cost(pod_like_tiny_config(), mesh, rules, "sft", 8, aot.CHIPS["v5p"])["collectives"]
    )


@needs_libtpu
def test_pod_plan_rows_for_programs_the_analytic_model_does_not_cover(monkeypatch, capsys):
    """`tools/pod_plan.py --programs publish,sampler --sampling_layout tensor` (BENCHMARKS "Decode
    layout"): the publish reshard and the decode-layout sampler have no analytic model; their rows
    say so instead of the tool stopping with the model's ValueError; `restore` (nothing compiled)
    has its own row instead of a KeyError."""
    import importlib.util
    import sys

    spec = importlib.util.spec_from_file_location("pod_plan", "tools/pod_plan.py")
    pod_plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pod_plan)
    monkeypatch.setattr(
        sys,
        "argv",
        [
            "pod_plan",
            "--models",
            "qwen3_30b_a3b",
            "--modes",
            "rl",
            "--topologies",
            "v5p-128",
            "--programs",
            "publish,sampler,restore",
            "--sampling_layout",
            "tensor",
        ],
    )
    pod_plan.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| qwen3_30b_a3b")]
    assert [r.split(" | ")[2] for r in rows] == ["restore", "publish", "sampler"]
    assert "shards evenly" in rows[0] and all("not modelled" in r for r in rows[1:])


@pytest.mark.parametrize(
    "key, value", [("continuous_batching", True), ("prefix_cache", 64), ("speculative_k", 2), ("quantize", "int8")]
)
def test_compile_plan_sampler_refuses_the_samplers_it_does_not_compile(key, value):
    """The compile plan's sampler is the static `generate_program`: a config whose rollouts run
    another sampler program (continuous batching, prefix cache, speculative, quantised) is
    refused, not planned as the static one."""
    import jax

    from posttrain.parallel import make_mesh, parse_rules
    from posttrain.plan import compile_plan as cp

    cfg = tiny_moe_config({f"sampling.{key}": value})
    mesh = make_mesh(cfg.mesh.to_dict(), jax.devices()[:4])
    with pytest.raises(ValueError, match=f"sampling.{key}={value!r}"):
        cp.build_programs(cfg, mesh, parse_rules(cfg.sharding.rules), ("sampler",), prompt_len=8)


@needs_libtpu
def test_adafactor_state_is_factored_and_restores_into_its_shards():
    """optim.name=adafactor on the TPU slice's mesh (no compile): the optimizer state is the factored
    vectors (a few % of the params, AdamW's is 2x), each sharded along its parameter's kept axes,
    and the restore plan finds every array shardable."""
    import jax
    from jax.sharding import PartitionSpec as P

    from posttrain.parallel import make_mesh, parse_rules
    from posttrain.plan import compile_plan as cp

    cfg = tiny_moe_config({"optim.name": "adafactor"})
    mesh = make_mesh(cfg.mesh.to_dict(), aot.tpu_devices(TOPOLOGY))
    target, restore_args = cp.restore_plan(cfg, mesh, parse_rules(cfg.sharding.rules))
    report = cp.restore_report(target, restore_args, mesh, aot.CHIPS["v5p"])
    assert report["fits"] and not report["problems"]
    assert 0 < report["parts"]["opt_state"] < 0.1 * report["parts"]["params"]
    v_row = target["opt_state"][1][0].v_row["stacks"][0]["blocks"][0]["mlp"]["w_gate"]  # [L, E, D, F] minus F
    assert len(v_row.shape) == 3 and v_row.sharding.spec == P(None, "expert")
    assert jax.tree.leaves(target["opt_state"])


@needs_libtpu
def test_compile_plan_shows_the_context_parallel_choice_a_real_run_makes(monkeypatch):
    """`auto` in a pod plan: the abstract v5p devices cannot be asked, so the chip's memory comes
    from the device-kind table (95 GiB, not the 16 GiB fallback), and the plan reports the
    strategy with its numbers; the CLI prints it."""
    import importlib.util

    from posttrain.parallel import use_sharding
    from posttrain.plan import compile_plan as cp

    cfg = tiny_moe_config(
        {
            **{"model.moe.num_experts": 0, "model.attention": "blockwise", "model.context_parallel": "auto"},
            "model.attention_block": 128,
            **{"mesh.data": 2, "mesh.expert": 1, "mesh.sequence": 2},
            "train.seq_len": 256,
        }
    )

    def lower_only(program, mesh, rules):  # the choice is made while tracing: no need to compile
        with use_sharding(mesh, rules):
            return program.fn.lower(*program.args), 0.0

    monkeypatch.setattr(cp, "compile_program", lower_only)
    monkeypatch.setattr(cp, "program_report", lambda program, compiled, chip, n: {"program": program.name})
    (report,) = cp.plan(cfg, TOPOLOGY, ("sft",), log=lambda s: None)
    (choice,) = report["context_parallel"]
    assert choice["mode"] == "auto" and choice["strategy"] == "all_gather"
    assert choice["device_bytes"] == 95 * 2**30 and choice["device_source"] == "table (TPU v5)"
    assert choice["layers"] == (cfg.model.num_layers if cfg.model.remat == "none" else 1)
    spec = importlib.util.spec_from_file_location("compile_plan_cli", "tools/compile_plan.py")
    cli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cli)
    line = cli.context_parallel_line(report)
    assert line.startswith("sft: context parallelism auto -> all_gather (gathered K/V ") and "table (TPU v5)" in line
