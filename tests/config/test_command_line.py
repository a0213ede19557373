"""`posttrain.config.command_line`: the command line's ConfigDict becomes one RunConfig at the edge,
and no module below it sees a ConfigDict."""

import ast
import json
import runpy

import pytest

from posttrain.config import RunConfig, base_config, run_config
from posttrain.errors import UserError
from tests.support.paths import ROOT

EDGE = {"posttrain/main.py", "posttrain/config/command_line.py"}  # the only modules that touch a ConfigDict


def test_no_module_below_the_command_line_imports_or_names_a_configdict():
    offenders = []
    for path in sorted((ROOT / "posttrain").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        if rel in EDGE:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            imported = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            if any(name.split(".")[0] == "ml_collections" for name in imported):
                offenders.append(f"{rel}:{node.lineno} imports ml_collections")
            if isinstance(node, ast.Attribute | ast.Name) and "ConfigDict" in getattr(node, "attr", "") + getattr(
                node, "id", ""
            ):
                offenders.append(f"{rel}:{node.lineno} names ConfigDict")
            if isinstance(node, ast.Attribute) and node.attr in ("copy_and_resolve_references", "to_json_best_effort"):
                offenders.append(f"{rel}:{node.lineno} calls ConfigDict.{node.attr}")
    assert not offenders, "\n".join(offenders)


def test_every_config_file_becomes_the_runconfig_of_its_values():
    """Each configs/*.py, through the command line's ConfigDict, is a RunConfig holding exactly its
    values (and config.json keeps the ConfigDict's order and values)."""
    for path in sorted((ROOT / "configs").glob("*.py")):
        cfg = runpy.run_path(str(path))["get_config"]()
        typed = run_config(cfg)
        assert cfg.to_json_best_effort(indent=2) == json.dumps(typed.to_dict(), indent=2), path.name


def test_the_defaults_of_the_command_line_are_the_typed_defaults():
    assert RunConfig.from_dict(base_config().to_dict()) == RunConfig()
    assert base_config().is_locked


def test_a_runconfig_built_in_python_runs_through_the_same_checks():
    cfg = RunConfig(stage="rlvr").replace({"rl.group_size": 1})
    with pytest.raises(UserError, match="rl.group_size=1: a group-relative baseline needs at least 2 samples"):
        run_config(cfg)  # the rlvr stage's rules: checked when a run starts
    assert run_config(RunConfig(stage="rlvr")) == RunConfig(stage="rlvr")
