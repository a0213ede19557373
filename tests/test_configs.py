"""Every shipped config, and every `python -m posttrain.main` command of the README, passes the
start-up checks a run makes before anything compiles (its `RunConfig`'s own checks, then
`stages.checks.check_run`, with the data-file rules of `stages/data_files.py`): a config edited out
of step with a key's rules fails here, not minutes into a user's run. Nothing trains."""

import ast
import re
import runpy
import shlex
from pathlib import Path

import pytest

from posttrain.config import run_config
from posttrain.config import stages as stage_table
from posttrain.config.command_line import apply_command_line_precedence, command_line_keys
from posttrain.data.synthetic import SYNTHETIC
from posttrain.main import check_overrides
from posttrain.stages.checks import check_run
from posttrain.stages.data_files import SPLITS
from tests.support.paths import ROOT


def check_config(cfg) -> None:
    """What `posttrain.main.run` checks before any stage runs."""
    check_run(run_config(cfg))


def pod_specs() -> list[str]:
    pod = runpy.run_path(str(ROOT / "configs/pod/moe_shapes.py"))
    return [f"pod/moe_shapes.py:{m}:{mode}" for m in pod["MODELS"] for mode in pod["MODES"]]


# configs whose get_config reads a model folder it is given: test_config_of_a_hugging_face_folder_...
FOLDER_CONFIGS = ["hf.py", "smollm2_dpo.py", "smollm2_grpo.py", "smollm2_sft.py"]
# modes that change stages or data files (screen_tiny's first stage reads its own demonstrations)
MODES = ["screen_tiny.py:marked"]
CONFIGS = (
    sorted(p.name for p in (ROOT / "configs").glob("*.py") if p.name not in FOLDER_CONFIGS[1:]) + MODES + pod_specs()
)


def load(spec: str):
    """`configs/<file>[:arg]` as `--config` loads it."""
    path, _, arg = spec.partition(":")
    get = runpy.run_path(str(ROOT / "configs" / path))["get_config"]
    return get(arg) if arg else get()


def make_documented_files(cfg, doc: str) -> None:
    """Create (empty, in the current folder) the named local data files a config's docstring says
    how to make (e.g. `tools/agent_demos.py --out PATH`; for a glob, the documented paths it
    matches): the start-up checks require them."""
    import fnmatch

    for stage in (*(s.name for s in stage_table.STAGES if s.records), "rl"):  # rl: its task files
        for name, _ in SPLITS:
            value = cfg[stage][name]
            if not value or value == SYNTHETIC or "://" in value:
                continue
            for path in [value] if value in doc else [w for w in doc.split() if fnmatch.fnmatch(w, value)]:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
                Path(path).touch()


@pytest.mark.parametrize("spec", CONFIGS)
def test_config_passes_its_start_up_checks(spec, tmp_path, monkeypatch):
    """Data files included: "synthetic:" must be generable from data.synthetic, a named local
    file must exist (or be one the docstring says how to make)."""
    monkeypatch.syspath_prepend(str(ROOT))  # configs import configs.sft_tiny
    monkeypatch.chdir(tmp_path)
    cfg = load(spec)
    make_documented_files(cfg, runpy.run_path(str(ROOT / "configs" / spec.partition(":")[0])).get("__doc__") or "")
    check_config(cfg)


@pytest.mark.parametrize("config", FOLDER_CONFIGS)
def test_config_of_a_hugging_face_folder_passes_its_start_up_checks(config, tmp_path, monkeypatch):
    """The configs that take a model folder (`--config configs/hf.py:FOLDER`) build from a tiny
    Llama folder: its model section from config.json, its weights and tokenizer named by path."""
    import json

    from tests.support.hf import CHATML, make_hf_folder

    monkeypatch.syspath_prepend(str(ROOT))
    folder = make_hf_folder(str(tmp_path), {"chat_template": CHATML, "eos_token": "<|im_end|>"})
    llama = dict(
        architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=320, hidden_size=16,
        intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
    )  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(llama))
    cfg = load(f"{config}:{folder}")
    assert (cfg.model.embed_dim, cfg.model.num_layers, cfg.init_from) == (16, 2, f"hf:{folder}")
    check_config(cfg)


def leaves(node, prefix=""):
    """(dotted key, value) of every leaf of a ConfigDict (a free-form group like sharding.rules: one leaf)."""
    for key in node.keys():
        value = node[key]
        if hasattr(value, "keys") and key != "rules":
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield prefix + key, value.to_dict() if hasattr(value, "to_dict") else value


@pytest.mark.parametrize("spec", ["base"] + CONFIGS)
def test_config_builds_its_typed_run_config(spec, monkeypatch):
    """`run_config`: a field for every key (or it fails), each holding the key's value."""
    import functools

    from posttrain.config import base_config

    monkeypatch.syspath_prepend(str(ROOT))
    cfg = base_config() if spec == "base" else load(spec)
    run = run_config(cfg)
    for key, value in leaves(cfg):
        typed = functools.reduce(getattr, key.split("."), run)
        assert typed == (tuple(value) if isinstance(value, list) else value), key


def readme_commands() -> list[list[str]]:
    """The README's `python -m posttrain.main ...` commands (continued lines joined) as argv."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        m = re.search(r"python -m posttrain\.main (--config[^`#]*)", line)
        if m:
            command = m.group(1).replace("$i", "0").strip()
            if command.count('"') % 2:  # the end of a quoted remote command (gcloud ... --command="...")
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


def test_readme_commands_pass_the_start_up_checks(tmp_path, monkeypatch):
    """Local .jsonl files a command names (the user's own data) are created empty first."""
    monkeypatch.syspath_prepend(str(ROOT))
    monkeypatch.chdir(tmp_path)
    commands = readme_commands()
    assert len(commands) >= 10, commands
    checked = 0
    for argv in commands:
        spec = next(
            a.split("=", 1)[1] if "=" in a else argv[i + 1]
            for i, a in enumerate(argv)
            if a.startswith("--config") and not a.startswith("--config.")
        )
        spec = spec.removeprefix("configs/")
        if spec.startswith("hf.py:"):  # needs a Hugging Face folder; its keys are checked on the base config
            spec = "hf.py"
        cfg = load(spec)
        make_documented_files(cfg, runpy.run_path(str(ROOT / "configs" / spec.partition(":")[0])).get("__doc__") or "")
        overrides = [a for a in argv if a.startswith("--config.")]
        for arg in overrides:  # "a.jsonl", "x.jsonl,y.jsonl", "arithmetic,mine=my.jsonl"
            for value in (p.rpartition("=")[2] for p in arg.partition("=")[2].split(",")):
                if value.endswith(".jsonl") and "://" not in value and "*" not in value:
                    Path(value).parent.mkdir(parents=True, exist_ok=True)
                    Path(value).touch()
        check_overrides(overrides, cfg)
        for arg in overrides:
            key, _, text = arg[len("--config.") :].partition("=")
            set_override(cfg, key, text)
        apply_command_line_precedence(cfg, command_line_keys(overrides))
        check_config(cfg)
        checked += 1
    assert checked == len(commands)


def test_notebook_config_passes_the_start_up_checks(tmp_path, monkeypatch):
    """The quickstart notebook's parameters and config cells, run as written, give a config the
    start-up checks accept (the notebook's end-to-end run is tests/e2e/test_notebook.py)."""
    import json

    monkeypatch.chdir(tmp_path)
    cells = [
        c for c in json.loads((ROOT / "notebooks/quickstart.ipynb").read_text())["cells"] if c["cell_type"] == "code"
    ]
    (params,) = [c for c in cells if "parameters" in c["metadata"].get("tags", [])]
    (config,) = [c for c in cells if "RunConfig(" in "".join(c["source"])]
    scope: dict = {}
    for cell in (params, config):
        exec("".join(cell["source"]), scope)
    assert scope["cfg"].stage == "pipeline" and scope["cfg"].data.synthetic == "arithmetic"
    check_config(scope["cfg"])
