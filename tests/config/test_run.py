"""`RunConfig` (posttrain/config/run.py) and its sections: frozen, typed, every field declaring its
check or why it has none, each section checking itself when built; errors in a fixed order (types,
then choices, then ranges, then syntax, then rules), each naming its key."""

import dataclasses
import subprocess
import sys

import pytest

from posttrain.config import ModelConfig, OptimConfig, RunConfig, base_config, run_config
from posttrain.config import stages as stage_table
from posttrain.config.fields import free, nested_sections, undeclared
from posttrain.errors import UserError


def test_every_field_declares_its_check_or_why_it_has_none():
    assert undeclared(RunConfig) == []
    with pytest.raises(TypeError, match="say why"):
        free("", "")


def test_an_unknown_key_is_refused_naming_the_valid_ones_and_a_missing_one_takes_its_default():
    values = RunConfig().to_dict()
    values["model"]["new_key"] = 1
    with pytest.raises(UserError, match=r"unknown config key 'config\.model\.new_key'; valid keys of config\.model: "):
        RunConfig.from_dict(values)
    moe = RunConfig().to_dict()["model"]["moe"]
    del moe["every"]  # a config saved before the key existed
    assert ModelConfig.from_dict({"moe": moe}).moe.every == 1


def test_sections_are_frozen_and_check_themselves_when_built():
    run = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model.num_heads = 3
    with pytest.raises(UserError, match=r"config\.model\.num_kv_heads=3 must divide model\.num_heads=4") as e:
        dataclasses.replace(run.model, num_kv_heads=3)
    assert e.value.key == "model.num_kv_heads"
    with pytest.raises(UserError, match=r"config\.model\.moe\.top_k=5: expected <= model\.moe\.num_experts=4"):
        run.replace({"model.moe.num_experts": 4, "model.moe.top_k": 5})
    with pytest.raises(UserError, match=r"config\.sft\.lr=-1\.0: expected >= 0"):
        dataclasses.replace(run.sft, lr=-1.0)
    with pytest.raises(UserError, match=r"config\.train\.steps=1\.5: expected a value of type int"):
        run.replace({"train.steps": 1.5})
    assert run.replace({"optim.lr": 1}).optim.lr == 1.0 and isinstance(run.replace({"optim.lr": 1}).optim.lr, float)
    optim = dataclasses.replace(run.optim, name="adafactor", factored_min_dim=64)  # adafactor's own key
    with pytest.raises(UserError, match=r"config\.optim\.b1=0\.5 applies to optim\.name='adamw' only"):
        dataclasses.replace(optim, b1=0.5)
    assert OptimConfig.from_dict(base_config().optim.to_dict()) == run.optim


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"train.steps": 0, "rl.aggregation": "foo"}, "rl.aggregation"),  # every choice before any range
        ({"model.num_kv_heads": 3, "rl.top_p": 0.0}, "rl.top_p"),  # every range before any rule
        ({"seed": -1, "distributed.process_id": -2}, "seed"),  # then in the fields' order
        ({"rl.is_cap": 0.0}, "rl.is_cap"),  # a cap <= 0 made every importance weight NaN
        ({"sft.gate": "loss<", "train.steps": 0}, "train.steps"),  # ranges before syntax
        ({"sft.gate": "loss<", "model.num_kv_heads": 3}, "sft.gate"),  # syntax before rules
    ],
)
def test_the_first_error_is_a_choice_then_a_range_then_a_syntax_then_a_rule(changes, key):
    with pytest.raises(UserError) as e:
        RunConfig().replace(changes)
    assert e.value.key == key


def test_the_rules_of_a_stage_are_checked_for_runs_that_reach_it():
    """rl.* rules bind a run with the rlvr stage; a run without one does not read them."""
    inert = {"rl.clip_low": 0.1}  # the ratio is 1 with one optimizer step per batch
    RunConfig(stage="sft").replace(inert).check_stages()
    with pytest.raises(UserError, match=r"config\.rl\.clip_low=0\.1 cannot take effect: the ratio"):
        RunConfig(stage="rlvr").replace(inert).check_stages()
    pipeline = RunConfig(stage="pipeline").replace({"pipeline.stages": ("sft", "rlvr"), **inert})
    with pytest.raises(UserError, match="rl.clip_low"):
        pipeline.check_stages()
    with pytest.raises(UserError, match=r"pipeline\.stages: unknown \['lm'\]"):
        RunConfig(stage="pipeline").replace({"pipeline.stages": ("sft", "lm")})


def test_stage_sections_are_the_stage_tables_with_their_own_steps():
    own = {s.section for s in stage_table.STAGES if s.own_steps}
    assert own == {
        name
        for name, cls in nested_sections(RunConfig).items()
        if {"steps", "lr", "gate"} <= set(cls.__dataclass_fields__)
    }
    cfg = RunConfig().replace({"rl.steps": 7, "rl.lr": 1e-4, "train.steps": 3})
    assert (cfg.for_stage("rlvr").train.steps, cfg.for_stage("rlvr").optim.lr) == (7, 1e-4)
    assert cfg.for_stage("sft").train.steps == 3  # sft.steps 0: train.steps stays


def test_checking_a_config_loads_no_jax():
    code = (
        "import sys; from posttrain.config import run_config, base_config; run_config(base_config()); "
        "assert not {'jax', 'flax'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
    assert run_config(base_config()) == RunConfig()
