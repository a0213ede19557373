"""The command line: config loading, locked keys, and a short end-to-end training run."""

import json
import subprocess
import sys

import pytest

from posttrain.config import base_config
from posttrain.main import check_overrides
from tests.support.paths import ROOT


def test_misspelt_override_names_key_and_valid_keys():
    cfg = base_config()
    with pytest.raises(SystemExit, match=r"config\.model\.embed_dimm.*valid keys of config\.model: .*embed_dim"):
        check_overrides(["--config.model.embed_dimm=3"], cfg)
    with pytest.raises(SystemExit, match=r"config\.trian"):
        check_overrides(["--config.trian.steps=3"], cfg)
    check_overrides(["--config.model.moe.top_k=1", "--other=1"], cfg)


def test_config_file_typo_is_an_error():
    cfg = base_config()
    with pytest.raises(AttributeError):
        cfg.model.embed_dimm = 3


def test_cli_rejects_typo_before_compiling():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.main",
            "--config",
            str(ROOT / "configs/quickstart.py"),
            "--config.optim.lrr=1",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode != 0
    assert "unknown config key 'config.optim.lrr'" in out.stderr + out.stdout


def test_cli_checks_overrides_against_the_config_its_argument_builds(tmp_path):
    """`--config=FILE:ARG` is checked against `get_config(ARG)`, as ml_collections builds it: a config
    file whose get_config needs its argument (configs/hf.py:FOLDER) is not called without it."""
    config = tmp_path / "needs_arg.py"
    config.write_text(
        "from posttrain.config import base_config\n"
        "def get_config(folder):\n"
        "    assert folder == 'models/x', folder\n"
        "    return base_config()\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.main", f"--config={config}:models/x", "--config.optim.lrr=1"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode != 0
    assert "unknown config key 'config.optim.lrr'" in out.stderr + out.stdout, out.stderr[-2000:]


def test_cli_trains_and_writes_metrics(sft_cli_run):
    """A run through the real entry point (the session's tiny SFT run, tests/support/cli_runs.py):
    metrics.jsonl has every step's row with the loss, MoE and optimizer keys; TensorBoard events appear."""
    from tests.support.cli_runs import SFT_STEPS

    rows = [json.loads(line) for line in (sft_cli_run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(SFT_STEPS))
    assert all(k in r for r in rows for k in ("loss", "ce", "grad_norm", "lr", "moe/aux_loss", "moe/load"))
    assert len(rows[0]["moe/load"]) == 4
    assert list((sft_cli_run / "tensorboard").iterdir())


def load(name: str):
    import runpy

    return runpy.run_path(str(ROOT / "configs" / name))["get_config"]()


@pytest.mark.parametrize(
    "config_file, key, value, expected",
    [
        ("rlvr_tiny.py", "rl.advantage", "foo", "config.rl.advantage='foo': no such advantage estimator; registered"),
        ("sft_tiny.py", "train.steps", -1, "config.train.steps=-1: expected >= 1"),
        ("sft_tiny.py", "optim.lr", -1.0, "config.optim.lr=-1.0: expected > 0"),
        ("dpo_tiny.py", "dpo.steps", -5, "config.dpo.steps=-5: expected >= 0"),
        ("sft_tiny.py", "model.num_kv_heads", 3, "config.model.num_kv_heads=3 must divide model.num_heads=4"),
        ("sft_tiny.py", "model.moe.top_k", 5, "config.model.moe.top_k=5: expected <= model.moe.num_experts=4"),
        ("sft_tiny.py", "data.on_error", "ignore", "config.data.on_error='ignore': expected one of 'raise', 'skip'"),
        ("pipeline_tiny.py", "dpo.gate", "eval/reward_accuracy>>0.6", "dpo.gate"),  # the last stage's gate
        ("quickstart.py", "rl.kl_estimator", "k1", "rl.kl_estimator='k1' cannot take effect"),  # rl.* rules, a pipeline
        (
            "pipeline_tiny.py",
            "dpo.train_files",
            "mine/prefs.jsonl",
            "config.dpo.train_files='mine/prefs.jsonl': no such file",
        ),  # a later stage's data, up front
        (
            "quickstart.py",
            "rl.train_files",
            "tasks.jsonl",
            "config.rl.train_files='tasks.jsonl': no such file; name existing JSONL task files",
        ),  # the pipeline's rlvr stage, up front
        ("quickstart.py", "eval.suites", "arithmetic,mine=my.jsonl", "config.eval.suites='my.jsonl': no such file"),
        (
            "sft_tiny.py",
            "rl.env",
            "tools",
            "config.rl.env='tools': no such environment; registered: screen, single, tool",
        ),
        ("sft_tiny.py", "rejection.samples_per_prompt", 0, "config.rejection.samples_per_prompt=0: expected >= 1"),
        (
            "sft_tiny.py",
            "distributed.heartbeat_timeout_s",
            0,
            "config.distributed.heartbeat_timeout_s=0: expected >= 1",
        ),
    ],
)
def test_bad_values_fail_before_any_stage_runs_naming_the_key(
    tmp_path, capsys, monkeypatch, config_file, key, value, expected
):
    from posttrain import main
    from posttrain.config import stages as stage_table

    monkeypatch.setattr(stage_table.Stage, "runner", lambda self: lambda cfg, **kw: pytest.fail("a stage ran"))
    cfg = load(config_file)
    cfg.workdir = str(tmp_path / "W")
    section, *rest = key.split(".")
    node = cfg[section]
    for part in rest[:-1]:
        node = node[part]
    node[rest[-1]] = value
    assert main.run_cli(cfg) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("error: ") and expected in line and key in line, line


def test_cli_bad_enum_fails_at_once_and_command_line_steps_win_over_the_file(tmp_path):
    """`--config.train.steps=6` on rlvr_tiny (rl.steps=60 in the file) used to run 60 steps; the
    command line now wins (and says so). rl.advantage=foo fails before anything compiles."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.main",
            "--config",
            str(ROOT / "configs/rlvr_tiny.py"),
            f"--config.workdir={tmp_path}",
            "--config.train.steps=6",
            "--config.rl.advantage=foo",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert out.stderr.strip().splitlines()[-1].startswith("error: config.rl.advantage='foo'")
    assert "train.steps=6 from the command line replaces rl.steps=60 from the config file" in out.stderr
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "metrics.jsonl").exists()


def test_precedence_of_stage_keys_and_generic_keys():
    from posttrain.config import run_config
    from posttrain.config.command_line import apply_command_line_precedence, command_line_keys

    cfg = load("rlvr_tiny.py")
    assert cfg.rl.steps == 60 and run_config(cfg).for_stage("rlvr").train.steps == 60  # the file: stage key wins
    cfg.train.steps = 6
    apply_command_line_precedence(cfg, command_line_keys(["--config.train.steps=6", "--config.seed", "1"]))
    assert cfg.rl.steps == 0 and run_config(cfg).for_stage("rlvr").train.steps == 6  # the command line wins
    cfg = load("dpo_tiny.py")
    cfg.optim.lr, cfg.dpo.lr = 1e-2, 2e-4
    notes = apply_command_line_precedence(cfg, command_line_keys(["--config.optim.lr=1e-2", "--config.dpo.lr=2e-4"]))
    assert notes == [] and run_config(cfg).for_stage("dpo").optim.lr == 2e-4  # both given: the specific one
    assert run_config(cfg).for_stage("dpo").train.steps == 100


def test_module_enums_are_the_configs_and_names_are_registries():
    """Each enum key's values are defined once, in posttrain.config: the modules that implement
    them and read their own copy hold that very object, and so does the field that checks the key.
    Keys that name implementations (`registered` fields) name registries the modules fill."""
    import dataclasses

    import posttrain.rl.algo.kl  # noqa: F401 (the built-ins register)
    import posttrain.rl.algo.losses  # noqa: F401
    import posttrain.rl.tasks.registry  # noqa: F401
    from posttrain import config
    from posttrain.config.fields import CHECK, nested_sections
    from posttrain.config.registry import REGISTRIES
    from posttrain.core.alerts import MODES
    from posttrain.data.sources import ON_ERROR
    from posttrain.models.attention import ATTENTION_KERNELS
    from posttrain.models.decoder import REMAT_POLICIES
    from posttrain.models.moe.dispatch import DISPATCHES
    from posttrain.models.quant import QUANT_MODES
    from posttrain.models.vision import VISION_ENCODERS
    from posttrain.ops.context_parallel import CONTEXT_PARALLEL
    from posttrain.rl.algo.losses import AGGREGATIONS, RATIO_LEVELS
    from posttrain.rl.algo.offpolicy import IS_LEVELS, IS_MASKS
    from posttrain.rl.rollout.placement import PLACEMENTS
    from posttrain.rl.rollout.remote import ROLES
    from posttrain.rl.rollout.routing import ROUTING_REPLAY
    from posttrain.sampling.layout import SAMPLING_LAYOUTS
    from posttrain.stages.losses import DPO_LOSSES

    modules = {
        "model.attention": ATTENTION_KERNELS,
        "model.context_parallel": CONTEXT_PARALLEL,
        "model.moe.dispatch": DISPATCHES,
        "model.remat": config.REMAT_MODES,
        "model.moe.router": config.MOE_ROUTERS,
        "model.moe.routing_replay": ROUTING_REPLAY,
        "model.dtype": config.DTYPES,
        "model.param_dtype": config.DTYPES,
        "model.vision.encoder": VISION_ENCODERS,
        "data.on_error": ON_ERROR,
        "data.synthetic": config.SYNTHETIC_DATA,
        "dpo.loss_type": DPO_LOSSES,
        "alerts.on": MODES,
        "rl.aggregation": AGGREGATIONS,
        "rl.ratio_level": RATIO_LEVELS,
        "rl.is_level": IS_LEVELS,
        "rl.is_mask": IS_MASKS,
        "rl.placement": PLACEMENTS,
        "rl.role": ROLES,
        "sampling.quantize": QUANT_MODES,
        "sampling.layout": SAMPLING_LAYOUTS,
    }
    choices, named = {}, {}

    def walk(cls, prefix):
        for f in dataclasses.fields(cls):
            kind, *arg = f.metadata[CHECK]
            if f.name in nested_sections(cls):
                walk(nested_sections(cls)[f.name], f"{prefix}{f.name}.")
            elif kind == "choice":
                choices[prefix + f.name] = arg[0]
            elif kind == "registered":
                named[prefix + f.name] = arg[0]

    walk(config.RunConfig, "")
    assert modules.keys() <= choices.keys()  # the rest are read from the section only (optim.name, ...)
    for key, values in modules.items():
        assert choices[key] == values and set(choices[key]) == set(values), key
        assert choices[key] is values, key
    assert ("none", *REMAT_POLICIES) == config.REMAT_MODES  # a policy for each mode but none
    assert named == {k: k for k in ("rl.env", "rl.advantage", "rl.kl_estimator", "rl.loss_type")}
    assert {k: REGISTRIES[k].names() for k in named} == {
        "rl.env": ("single", "screen", "tool"),
        "rl.advantage": ("grpo", "drgrpo", "rloo", "gae"),
        "rl.kl_estimator": ("k1", "k2", "k3"),
        "rl.loss_type": ("ppo", "cispo"),
    }
