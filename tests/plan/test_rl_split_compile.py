"""A split of the RL split plan compiled (`posttrain.plan.rl_split_compile`, `tools/pod_plan.py --rl-split
--compile`): the tiny MoE config's learner program on the learner's chips and sampler program on
the sampler mesh of an 8-chip v5p slice, with libtpu's compiler on abstract devices (one compile
of each, ~20 s on this CPU), their per-chip memory and the weight bytes one publish moves."""

import importlib.util
import sys

import jax
import pytest

from posttrain.plan import aot, rl_split, rl_split_compile
from tests.support.paths import ROOT
from tests.support.tpu import hand_param_bytes, needs_libtpu, tiny_moe_config

TOPOLOGY = "v5p:2x2x2"  # 8 chips


def pod_plan():
    spec = importlib.util.spec_from_file_location("pod_plan", ROOT / "tools" / "pod_plan.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_configure(*args, **kwargs):
    """pod_plan's `configure` for the tiny config: the ConfigDict the tool edits (its command-line edge)."""
    from posttrain.config.command_line import to_config_dict

    return to_config_dict(tiny_moe_config())


def tiny_splits():
    cfg = tiny_moe_config()  # expert = 2: model-parallel group 2, sampler chips 2, 4, 6
    return cfg, rl_split.plan_split(cfg, "v5p", 8, group=2, prompt_len=8)


@pytest.fixture(scope="module")
def compiled():
    cfg, splits = tiny_splits()
    (four,) = [s for s in splits if s.sampler_chips == 4]
    return cfg, rl_split_compile.compile_split(cfg, TOPOLOGY, four, group=2, prompt_len=8, log=lambda s: None)


def test_the_learner_pads_its_minibatch_rows_as_the_plan_charges_them():
    cfg = tiny_moe_config()  # 2 prompts × 4 samples = 8 rows
    assert rl_split_compile.learner_config(cfg, 4).rl.prompts_per_step == 2  # 8 rows on 4 chips
    assert rl_split_compile.learner_config(cfg, 6).rl.prompts_per_step == 3  # lcm(6, 4) = 12 rows
    cfg = cfg.replace({"rl.prompts_per_step": 8, "rl.minibatches": 4})  # 8 rows per minibatch, × 4 minibatches
    c = rl_split_compile.learner_config(cfg, 6)
    assert c.rl.minibatches == 4 and c.rl.prompts_per_step * 4 // 4 == 12


@needs_libtpu
def test_the_meshes_divide_the_slice_as_split_placement_does():
    learner, sampler = rl_split_compile.split_meshes(TOPOLOGY, 2, group=2, expert=2)
    assert dict(learner.shape) == dict(data=3, fsdp=1, expert=2, tensor=1, sequence=1)
    assert dict(sampler.shape) == dict(data=1, fsdp=1, expert=2, tensor=1, sequence=1)
    every = [d.id for d in aot.tpu_devices(TOPOLOGY)]
    assert [d.id for d in learner.devices.flat] == every[:6] and [d.id for d in sampler.devices.flat] == every[6:]
    with pytest.raises(ValueError, match="multiple of the model-parallel group 2"):
        rl_split_compile.split_meshes(TOPOLOGY, 3, group=2, expert=2)


@needs_libtpu
def test_both_programs_compile_on_their_own_chips_with_the_publishs_bytes(compiled):
    cfg, c = compiled
    learn, sample = c.learner, c.sampler
    assert learn["program"] == "rl_learner" and sample["program"] == "sampler"
    assert learn["mesh"] == sample["mesh"] == dict(data=2, fsdp=1, expert=2, tensor=1, sequence=1)
    # float32 weights, experts split over the expert axis, on both sides (the sampler keeps the degrees)
    assert learn["parts"]["params"] == sample["parts"]["params"] == hand_param_bytes(cfg, 2)
    assert learn["parts"]["optimizer"] >= 2 * hand_param_bytes(cfg, 2)  # AdamW's moments
    assert learn["parts"]["reference"] == hand_param_bytes(cfg, 2)  # rl.kl_coef > 0
    assert c.model_bytes == hand_param_bytes(cfg, 1) and c.publish_bytes_per_chip == hand_param_bytes(cfg, 2)
    assert c.learner_total == learn["total"] >= learn["arguments"] > 0
    assert c.sampler_total == sample["total"] + c.publish_bytes_per_chip  # the next weights landing
    assert learn["fits"] and sample["fits"] and learn["step_s"] > 0 and sample["step_s"] > 0
    # the analytic floors are floors of what compiles: state (learner), two weight copies + KV (sampler)
    assert c.learner_total >= c.split.learner_gb * 1e9 and c.sampler_total >= c.split.sampler_gb * 1e9 * 0.99


@needs_libtpu
def test_pod_plan_compiles_the_chosen_split_and_reports_an_unfit_program(compiled, monkeypatch, capsys):
    """`--rl-split --compile --sampler-chips 4` on the tiny config (`configure` swapped in):
    the compiled table and the publish line; a program the TPU compiler refuses for HBM is a
    row that says so (with the advice to raise rl.minibatches), not a crash."""
    from posttrain.plan import compile_plan

    tool = pod_plan()
    cfg, result = compiled
    monkeypatch.setattr(tool, "configure", tiny_configure)
    calls, compile_split = [], rl_split_compile.compile_split
    monkeypatch.setattr(rl_split_compile, "compile_split", lambda *a, **k: calls.append(a[2].sampler_chips) or result)
    argv = "pod_plan --rl-split --compile --models tiny --topologies v5p:2x2x2 --prompts 2 --samples 4"
    monkeypatch.setattr(sys, "argv", (argv + " --response_len 8 --prompt_len 8 --group 2 --sampler-chips 4").split())
    tool.main()
    out = capsys.readouterr().out
    assert calls == [4] and "compiled: 4 sampler chips, 4 learner chips" in out
    rows = [line for line in out.splitlines() if line.startswith(("| rl_learner |", "| sampler |"))]
    assert len(rows) == 2 and all(" | 4 | d2·e2 | " in r and "| yes |" in r for r in rows)
    assert f"publish: {hand_param_bytes(cfg, 1) / 1e9:.2f} GB of weights per step" in out

    def refuse(program, mesh, rules):  # as libtpu refuses a program over HBM
        raise jax.errors.JaxRuntimeError(f"RESOURCE_EXHAUSTED: Ran out of memory on HBM ({program.name})")

    monkeypatch.setattr(compile_plan, "compile_program", refuse)
    _, splits = tiny_splits()
    c = compile_split(cfg, TOPOLOGY, splits[1], group=2, prompt_len=8, log=lambda s: None)
    assert c.learner_total is None and c.sampler_total is None and "(rl_learner)" in c.learner["error"]
    assert c.model_bytes == result.model_bytes  # the publish's bytes need no compile
    monkeypatch.setattr(rl_split_compile, "compile_split", lambda *a, **k: c)
    tool.main()
    out = capsys.readouterr().out
    assert "| rl_learner | 4 | d2·e2 | – | – | **does not compile**: RESOURCE_EXHAUSTED" in out
    assert "more rl.minibatches (--minibatches)" in out


def test_pod_plan_refuses_sampler_chips_without_compile_and_a_split_it_does_not_list(monkeypatch, capsys):
    tool = pod_plan()
    monkeypatch.setattr(sys, "argv", "pod_plan --rl-split --sampler-chips 32".split())
    with pytest.raises(SystemExit):
        tool.main()
    assert "only with --rl-split --compile" in capsys.readouterr().err
    monkeypatch.setattr(tool, "configure", tiny_configure)
    argv = "pod_plan --rl-split --compile --models tiny --topologies v5p:2x2x2 --prompts 2 --samples 4 --group 2"
    monkeypatch.setattr(sys, "argv", (argv + " --sampler-chips 3").split())
    with pytest.raises(SystemExit, match=r"--sampler-chips 3: expected one of \[2, 4, 6\]"):
        tool.main()


def test_pod_plan_minibatches_set_the_learners_minibatch_or_are_refused(monkeypatch, capsys):
    """--minibatches is rl.minibatches: the learner compiles (and is charged for) that many smaller
    minibatches per step; one that does not divide prompts × samples is refused."""
    tool = pod_plan()
    monkeypatch.setattr(tool, "configure", tiny_configure)
    seen, plan = [], rl_split.plan_split
    monkeypatch.setattr(rl_split, "plan_split", lambda cfg, *a: seen.append(cfg.rl.minibatches) or plan(cfg, *a))
    argv = "pod_plan --rl-split --models tiny --topologies v5p:2x2x2 --prompts 2 --samples 4 --group 2 --minibatches"
    monkeypatch.setattr(sys, "argv", (argv + " 2").split())
    tool.main()
    assert seen == [2] and "**recommended**" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", (argv + " 3").split())
    with pytest.raises(SystemExit, match="--minibatches 3: must divide prompts × samples"):
        tool.main()
