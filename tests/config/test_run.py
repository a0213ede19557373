"""Typed config sections (`posttrain.config`): built once from the ConfigDict, frozen, each checking
its values when built; errors in the order the start-up checks always gave them."""

import dataclasses
import subprocess
import sys

import ml_collections
import pytest

from posttrain.config import ModelConfig, MoEConfig, OptimConfig, RunConfig, StageConfig, base_config
from posttrain.config.fields import nested_sections
from posttrain.errors import UserError


def test_a_key_without_a_field_or_a_field_without_a_key_is_an_error():
    cfg = base_config()
    with cfg.unlocked():
        cfg.model.new_key = 1
    with pytest.raises(TypeError, match=r"config\.model and ModelConfig disagree: keys without a field: \['new_key'\]"):
        RunConfig.from_config(cfg)
    moe = base_config().model.moe.to_dict()
    del moe["every"]
    with pytest.raises(TypeError, match=r"fields without a key: \['every'\]"):
        MoEConfig.from_config(ml_collections.ConfigDict(moe))


def test_sections_are_frozen_and_check_themselves_when_built():
    run = RunConfig.from_config(base_config())
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.model.num_heads = 3
    with pytest.raises(UserError, match=r"config\.model\.num_kv_heads=3 must divide model\.num_heads=4") as e:
        dataclasses.replace(run.model, num_kv_heads=3)
    assert e.value.key == "model.num_kv_heads"
    cfg = base_config()
    cfg.model.moe.num_experts, cfg.model.moe.top_k = 4, 5
    with pytest.raises(UserError, match=r"config\.model\.moe\.top_k=5: expected <= model\.moe\.num_experts=4"):
        ModelConfig.from_config(cfg.model)
    with pytest.raises(UserError, match=r"config\.sft\.lr=-1\.0: expected >= 0"):
        dataclasses.replace(run.sft, lr=-1.0)
    optim = dataclasses.replace(run.optim, name="adafactor", factored_min_dim=64)  # adafactor's own key
    with pytest.raises(UserError, match=r"config\.optim\.b1=0\.5 applies to optim\.name='adamw' only"):
        dataclasses.replace(optim, b1=0.5)
    assert OptimConfig.from_config(base_config().optim) == run.optim


@pytest.mark.parametrize(
    "changes, key",
    [
        ({"train.steps": 0, "rl.advantage": "foo"}, "rl.advantage"),  # every enum before any range
        ({"model.num_kv_heads": 3, "rl.top_p": 0.0}, "rl.top_p"),  # every range before any rule
        ({"seed": -1, "distributed.process_id": -2}, "seed"),  # then in base_config's order
        ({"rl.is_cap": 0.0}, "rl.is_cap"),  # a cap <= 0 made every importance weight NaN
    ],
)
def test_the_first_error_is_an_enum_then_a_range_then_a_rule(changes, key):
    cfg = base_config()
    for dotted, value in changes.items():
        *path, leaf = dotted.split(".")
        node = cfg
        for part in path:
            node = node[part]
        node[leaf] = value
    with pytest.raises(UserError) as e:
        RunConfig.from_config(cfg)
    assert e.value.key == key


def test_stage_sections_are_the_registry_stages_with_their_own_steps():
    from posttrain.stages import registry

    sections = {name for name, cls in nested_sections(RunConfig).items() if issubclass(cls, StageConfig)}
    assert sections == {s.section for s in registry.STAGES if s.own_steps}


def test_checking_a_config_loads_no_jax():
    code = (
        "import sys; from posttrain.config import RunConfig, optim_config; import posttrain.config_schema; "
        "from posttrain.config import OptimConfig; OptimConfig.from_config(optim_config()); "
        "assert not {'jax', 'flax'} & set(sys.modules), sorted(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
