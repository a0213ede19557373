"""`posttrain.config.registry`: extension points are registries of named entries, each with its own
config keys. A policy loss registered from outside the package trains through the rlvr stage with
its own field (`rl.options.<name>`); a name no entry has is refused, naming the registered ones."""

import json
import runpy

import jax.numpy as jnp
import pytest

from posttrain.config import RunConfig, Section, base_config, run_config
from posttrain.config.fields import bounded, section
from posttrain.config.registry import ADVANTAGES, KL_ESTIMATORS, POLICY_LOSSES, check_registered
from posttrain.errors import UserError
from posttrain.main import run
from posttrain.rl.algo.losses import Surrogate
from tests.support.paths import ROOT


@section
class ToyLossOptions(Section):
    """The toy loss's own key: `rl.options.toy.scale`."""

    KEY = "rl.options.toy"
    scale: float = bounded(1.0, gt=0)


def toy_loss(logp, ratio, adv, rl) -> Surrogate:
    """REINFORCE × `scale`; it reports its scale as the low-clip fraction so a run shows the key arrived."""
    scale = rl.options["toy"].scale
    return Surrogate(-scale * adv * logp, jnp.full(logp.shape, scale / 4), jnp.zeros(logp.shape, bool))


@pytest.fixture
def toy():
    POLICY_LOSSES.register("toy", toy_loss, options=ToyLossOptions)
    yield
    POLICY_LOSSES.unregister("toy")


def test_a_registered_loss_takes_its_own_key_on_the_command_line_and_in_python(toy):
    cfg = base_config()  # made after the registration: it has the toy's key
    cfg.rl.options.toy.scale = 3.0
    typed = run_config(cfg)
    assert typed.rl.options["toy"] == ToyLossOptions(scale=3.0)
    assert RunConfig().replace({"rl.options.toy.scale": 2.0}).rl.options["toy"].scale == 2.0
    with pytest.raises(UserError, match=r"config\.rl\.options\.toy\.scale=-1\.0: expected > 0"):
        RunConfig().replace({"rl.options.toy.scale": -1.0})


def test_a_loss_from_outside_the_package_trains_through_rlvr_with_its_own_field(toy, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT))  # configs import configs.sft_tiny
    cfg = runpy.run_path(str(ROOT / "configs" / "rlvr_tiny.py"))["get_config"]()
    small = {"rl.steps": 2, "rl.gate": "", "rl.eval_every": 0, "rl.eval_size": 128, "rl.prompts_per_step": 4}
    small |= {"rl.group_size": 4}
    small |= {"rl.max_new_tokens": 16, "rl.overlong_buffer": 14, "train.batch_size": 8, "train.seq_len": 64}
    small |= {"train.progress": False, "checkpoint.every": 0, "data.synthetic_size": 200, "rl.arithmetic_size": 100}
    cfg.update_from_flattened_dict({**small, "rl.loss_type": "toy", "workdir": str(tmp_path / "toy")})
    cfg.rl.options.toy.scale = 2.0
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "toy" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "rl/pg_loss" in r]
    assert [r["step"] for r in trained] == [0, 1]
    assert all(r["rl/clip_frac_low"] == 0.5 for r in trained)  # scale 2 / 4: the field reached the loss
    assert all(jnp.isfinite(r["rl/loss"]) for r in trained)


@pytest.mark.parametrize(
    "key, registry", [("rl.loss_type", POLICY_LOSSES), ("rl.advantage", ADVANTAGES), ("rl.kl_estimator", KL_ESTIMATORS)]
)
def test_an_unknown_name_is_refused_naming_the_registered_ones(key, registry):
    import posttrain.rl.algo.advantages  # noqa: F401 (the built-ins register)
    import posttrain.rl.algo.losses  # noqa: F401
    import posttrain.rl.tasks.registry  # noqa: F401

    cfg = RunConfig(stage="rlvr").replace({key: "nonesuch"})
    with pytest.raises(UserError, match=rf"config\.{key}='nonesuch': no such .*; registered: ") as e:
        check_registered(cfg.rl)
    assert all(name in str(e.value) for name in registry.names())
    assert e.value.key == key


def test_options_of_an_entry_nobody_registered_are_refused():
    with pytest.raises(UserError, match=r"unknown config key 'config\.rl\.options\.toy'"):
        RunConfig().replace({"rl.options": {"toy": {"scale": 2.0}}})
