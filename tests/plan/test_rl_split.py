"""The RL learner / sampler split plan (`posttrain.plan.rl_split`, `tools/pod_plan.py --rl-split`):
analytic, no compile and no libtpu. It recommends the runnable split with the least time per step
(which is also the best balanced one), gives the sampler more chips when responses are longer,
charges the publish at DCN bandwidth when the sampler has a slice of its own, and never proposes
a split the placement refuses or that does not fit in HBM."""

import importlib.util
import runpy
import sys

import pytest

from posttrain.plan import aot, rl_split
from tests.support.paths import ROOT
from tests.support.typed_configs import typed


def qwen(prompts=256, samples=16, response=4096):
    cfg = runpy.run_path(str(ROOT / "configs" / "pod" / "moe_shapes.py"))["get_config"]("qwen3_30b_a3b:rl")
    return typed(cfg).replace({"rl.prompts_per_step": prompts, "rl.group_size": samples, "rl.max_new_tokens": response})


def test_the_recommendation_is_the_fastest_runnable_split_and_the_best_balanced():
    splits = rl_split.plan_split(qwen(), "v5p", 64)
    best = rl_split.recommend(splits)
    ok = [s for s in splits if not s.problem]
    assert best in ok and len(ok) >= 3
    assert best.step_s == min(s.step_s for s in ok)
    assert abs(best.gen_s - best.learn_s) == min(abs(s.gen_s - s.learn_s) for s in ok)
    assert best.step_s == pytest.approx(max(best.gen_s, best.learn_s) + best.publish_s)
    # more sampler chips never slow generation, more learner chips never slow learning
    assert all(a.gen_s >= b.gen_s and a.learn_s <= b.learn_s for a, b in zip(splits, splits[1:]))


def test_the_default_group_is_the_smallest_that_holds_the_learner_state():
    """qwen3-30B's learner state (params, gradients, AdamW moments, reference: ~305 GB in bf16)
    fits 8 v5p chips (95 GB) within the 80% headroom, but needs 32 v5e chips (16 GB)."""
    assert rl_split.default_group(qwen(), aot.CHIPS["v5p"], 64) == 8
    assert rl_split.default_group(qwen(), aot.CHIPS["v5e"], 256) == 32


def test_longer_responses_give_the_sampler_more_chips():
    short = rl_split.recommend(rl_split.plan_split(qwen(prompts=64, response=512), "v5p", 64))
    long = rl_split.recommend(rl_split.plan_split(qwen(prompts=64, response=8192), "v5p", 64))
    assert long.sampler_chips > short.sampler_chips
    assert long.gen_s > short.gen_s


def test_a_sampler_slice_of_its_own_is_published_to_over_dcn():
    """Two v5p slices of 64 chips: when the second slice holds only sampler chips a copy of the
    model crosses DCN (50 Gbps per chip, the Cloud TPU v5p figure), far slower than the ICI
    publish inside one slice; a learner spanning both slices pays DCN in its gradient reduction."""
    v5p = aot.CHIPS["v5p"]
    assert v5p.dcn_bytes_per_s == pytest.approx(50e9 / 8)
    one = {s.sampler_chips: s for s in rl_split.plan_split(qwen(), "v5p", 64)}
    two = {s.sampler_chips: s for s in rl_split.plan_split(qwen(), "v5p", 64, slices=2)}
    own = two[64]
    assert own.link == "DCN" and one[32].link == "ICI"
    assert own.publish_s >= own.publish_bytes / (64 * v5p.dcn_bytes_per_s)
    assert own.publish_s > 10 * one[32].publish_s
    big = {s.sampler_chips: s for s in rl_split.plan_split(qwen(), "v5p", 128)}  # one slice of 128
    assert two[32].link == "ICI" and two[32].learn_s > big[32].learn_s  # the same 96 learner chips
    with pytest.raises(ValueError, match="DCN"):
        rl_split.plan_split(qwen(), "v6e", 64, slices=2)


def test_only_splits_the_placement_accepts_are_proposed_and_unfit_ones_never_recommended():
    splits = rl_split.plan_split(qwen(), "v5p", 64, group=8)
    assert [s.sampler_chips for s in splits] == list(range(8, 64, 8))  # multiples of fsdp × expert
    assert all(s.sampler_chips + s.learner_chips == 64 for s in splits)
    unfit = [s for s in splits if s.problem]
    assert unfit and all("HBM" in s.problem for s in unfit)  # 8 chips cannot hold 256 × 16 rows of KV
    assert not rl_split.recommend(splits).problem
    assert rl_split.recommend(unfit) is None
    with pytest.raises(ValueError, match="group=12"):
        rl_split.plan_split(qwen(), "v5p", 64, group=12)


def test_pod_plan_rl_split_prints_the_table_and_the_recommendation(monkeypatch, capsys):
    spec = importlib.util.spec_from_file_location("pod_plan", ROOT / "tools" / "pod_plan.py")
    pod_plan = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pod_plan)
    argv = "pod_plan --rl-split --models qwen3_30b_a3b --topologies v5p-128 --prompts 256 --samples 16"
    monkeypatch.setattr(sys, "argv", (argv + " --response_len 4096").split())
    pod_plan.main()
    out = capsys.readouterr().out
    assert out.count("**recommended**") == 1 and "colocated: all 64" in out
    assert "recommended: rl.placement=split, rl.sampler_devices=32" in out
    assert "colocated, generation then learning on every chip, is faster here: ~133.9 s" in out
