"""Every shipped config, and every `python -m posttrain.main` command of the README, passes the
start-up checks a run makes before anything compiles (`config_schema.check_config`, the data-file
rules of `train/data_files.py`): a config edited out of step with a key's rules fails here, not
minutes into a user's run. Nothing trains."""

import ast
import re
import runpy
import shlex
from pathlib import Path

import pytest

from posttrain.config_schema import apply_command_line_precedence, check_config, command_line_keys, stages_of
from posttrain.data.synthetic import SYNTHETIC
from posttrain.main import check_overrides
from posttrain.train.data_files import SPLITS, _generate, check_named_files

ROOT = Path(__file__).resolve().parents[1]
DATA_STAGES = {"sft": "sft", "reward_model": "preference", "dpo": "preference"}    # stage → data kind


def pod_specs() -> list[str]:
    pod = runpy.run_path(str(ROOT / "configs/pod/moe_shapes.py"))
    return [f"pod/moe_shapes.py:{m}:{mode}" for m in pod["MODELS"] for mode in pod["MODES"]]


CONFIGS = sorted(p.name for p in (ROOT / "configs").glob("*.py")) + pod_specs()


def load(spec: str):
    """`configs/<file>[:arg]` as `--config` loads it."""
    path, _, arg = spec.partition(":")
    get = runpy.run_path(str(ROOT / "configs" / path))["get_config"]
    return get(arg) if arg else get()


def check_data_files(cfg, doc: str) -> None:
    """What `resolve_data_files` checks at each data stage's start, for every stage the run reaches:
    "synthetic:" must be generable from `data.synthetic`; a named local file must exist, or be one
    the config's docstring says how to make (e.g. tools/agent_demos.py --out PATH)."""
    for stage in stages_of(cfg):
        if stage not in DATA_STAGES:
            continue
        for name, split in SPLITS:
            key, value = f"{stage}.{name}", cfg[stage][name]
            if value == SYNTHETIC:
                _generate(cfg, key, DATA_STAGES[stage], split, tok=None, write=False)
            elif value and value not in doc:
                check_named_files(value, key)


@pytest.mark.parametrize("spec", CONFIGS)
def test_config_passes_its_start_up_checks(spec):
    cfg = load(spec)
    check_config(cfg)
    check_data_files(cfg, runpy.run_path(str(ROOT / "configs" / spec.partition(":")[0])).get("__doc__") or "")


def readme_commands() -> list[list[str]]:
    """The README's `python -m posttrain.main ...` commands (continued lines joined) as argv."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        m = re.search(r"python -m posttrain\.main (--config[^`#]*)", line)
        if m:
            command = m.group(1).replace("$i", "0").strip()
            if command.count('"') % 2:          # the end of a quoted remote command (gcloud ... --command="...")
                command = command.removesuffix('"')
            out.append(shlex.split(command))
    return out


def set_override(cfg, key: str, text: str) -> None:
    """`--config.key=text` as ml_collections' config flags set it (the field's type decides)."""
    *path, leaf = key.split(".")
    node = cfg
    for part in path:
        node = node[part]
    old = node[leaf]
    if isinstance(old, bool):
        value = text.lower() in ("true", "1")
    elif isinstance(old, (tuple, list)):
        value = tuple(ast.literal_eval(text))
    else:
        value = type(old)(text)
    node[leaf] = value


def test_readme_commands_pass_the_start_up_checks():
    commands = readme_commands()
    assert len(commands) >= 10, commands
    checked = 0
    for argv in commands:
        spec = next(a.split("=", 1)[1] if "=" in a else argv[i + 1] for i, a in enumerate(argv)
                    if a.startswith("--config") and not a.startswith("--config."))
        spec = spec.removeprefix("configs/")
        if spec.startswith("hf.py:"):      # needs a Hugging Face folder; its keys are checked on the base config
            spec = "hf.py"
        cfg = load(spec)
        overrides = [a for a in argv if a.startswith("--config.")]
        check_overrides(overrides, cfg)
        for arg in overrides:
            key, _, text = arg[len("--config."):].partition("=")
            set_override(cfg, key, text)
        apply_command_line_precedence(cfg, command_line_keys(overrides))
        check_config(cfg)
        checked += 1
    assert checked == len(commands)
