"""tools/seeds.py: a recipe over initialisation seeds. One real run (a few steps of sft_tiny over
seeds 0 and 1, and seed 2 whose workdir is a file, so its run exits 1) is shared by the tests that
read it; the rest inject a fake runner."""

import importlib.util
import json
import shlex
import sys

import jax
import numpy as np
import pytest
from flax import nnx

from tests.support.paths import ROOT

TINY = [
    "--config.train.steps=4",
    "--config.train.log_every=1",
    "--config.train.batch_size=8",
    "--config.train.seq_len=64",
    "--config.train.eval_every=4",
    "--config.checkpoint.every=0",
    "--config.train.progress=False",
    "--config.data.synthetic_size=200",
    "--config.sft.gate=",
    "--config.sft.sample_tokens=0",
    "--config.model.moe.num_experts=0",  # dense, one layer: compiles in less time
    "--config.model.num_layers=1",
]
CONFIG = str(ROOT / "configs" / "sft_tiny.py")


def tool():
    """tools/seeds.py as a module (registered: its dataclass needs its module)."""
    spec = importlib.util.spec_from_file_location("seeds_tool", ROOT / "tools" / "seeds.py")
    module = sys.modules["seeds_tool"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def seeds_run(tmp_path_factory):
    """(tool, root, argv, exit status, printed lines, JSON table) of the real run."""
    seeds = tool()
    root = tmp_path_factory.mktemp("seeds")
    (root / "seed2").write_text("not a folder: this seed's run fails")
    argv = [CONFIG, "--seeds", "0,1,2", "--workdir_root", str(root), "--threshold", "eval/loss<100"]
    argv += ["--out", str(root / "table.md"), "--json", str(root / "table.json"), "--", *TINY]
    said = []
    status = seeds.main(argv, say=said.append)
    return seeds, root, argv, status, said, json.loads((root / "table.json").read_text())


def test_the_table_holds_each_seeds_last_eval_row(seeds_run):
    _, root, _, status, said, table = seeds_run
    assert status == 1  # one seed failed
    assert table["metrics"] == ["eval/loss"]  # the default: the last eval row's losses
    for s in table["seeds"][:2]:
        logged = [r["eval/loss"] for r in rows(root / f"seed{s['seed']}" / "metrics.jsonl") if "eval/loss" in r]
        assert s["status"] == "finished" and s["values"] == {"eval/loss": logged[-1]}
    got = [s["values"]["eval/loss"] for s in table["seeds"][:2]]
    assert table["summary"]["eval/loss"] == {"mean": np.mean(got), "min": min(got), "max": max(got), "n": 2}
    assert table["threshold"] == {"condition": "eval/loss<100", "passing": [0, 1], "seeds": 3}
    assert [line.split(":")[0] for line in said if line.startswith("seed ")] == ["seed 0", "seed 1", "seed 2"]


def test_seeds_differ_in_initialisation(seeds_run):
    from posttrain.core.hf_convert import read_run_config
    from posttrain.models.decoder import Decoder

    _, root, *_ = seeds_run
    first = [rows(root / f"seed{s}" / "metrics.jsonl")[0] for s in (0, 1)]
    assert first[0]["step"] == first[1]["step"] == 0 and first[0]["ce"] != first[1]["ce"]
    configs = [read_run_config(str(root / f"seed{s}")) for s in (0, 1)]
    assert [c.seed for c in configs] == [0, 1]
    # the model each run built: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed)) in stages/sft.py
    embed = [nnx.state(Decoder(c.model, rngs=nnx.Rngs(c.seed)), nnx.Param) for c in configs]
    leaves = [jax.tree.leaves(e) for e in embed]
    assert all(a.shape == b.shape for a, b in zip(*leaves))
    assert all(not np.allclose(a, b) for a, b in zip(*leaves) if np.asarray(a).std() > 0)


def test_a_failed_seed_is_a_row_with_its_exit_status_and_log(seeds_run):
    _, root, _, _, said, table = seeds_run
    failed = table["seeds"][2]
    assert failed["status"] == "failed" and failed["exit_status"] == 1 and failed["values"] == {}
    assert failed["log"] == str(root / "seed2.log") and "error:" in (root / "seed2.log").read_text()
    md = (root / "table.md").read_text()
    assert f"| 2 | failed | failed: exit status 1, log {root / 'seed2.log'} |" in md
    assert any(line.startswith("seed 2: FAILED (exit status 1") for line in said)


def test_the_markdown_starts_with_the_command_and_ends_with_mean_range_and_passing(seeds_run):
    _, root, argv, _, _, table = seeds_run
    md = (root / "table.md").read_text().splitlines()
    assert md[0] == "    " + shlex.join(["python", "tools/seeds.py", *argv]) == "    " + table["command"]
    assert md[2].startswith("Seeds: config.seed changes the initialisation")
    assert md[4:6] == ["| seed | `eval/loss` | run |", "| --- | --- | --- |"]
    v = [s["values"]["eval/loss"] for s in table["seeds"][:2]]
    assert md[6].startswith(f"| 0 | {v[0]:.4g} | ") and md[7].startswith(f"| 1 | {v[1]:.4g} | ")
    mean = f"| **mean (range)** | **{np.mean(v):.4g}** ({min(v):.4g}–{max(v):.4g}) | 2 of 3 seeds finished |"
    assert md[9] == mean
    assert md[-1] == "2 of 3 seeds pass `eval/loss<100` (seeds [0, 1])."


def test_a_rerun_skips_finished_seeds_and_reruns_the_failed_one_in_its_workdir(seeds_run):
    seeds, root, argv, *_ = seeds_run
    calls, said = [], []
    status = seeds.main(argv, runner=lambda run, cores: calls.append(run) or 3, say=said.append)
    assert status == 1 and [r.seed for r in calls] == [2]
    assert calls[0].workdir == root / "seed2" and f"--config.workdir={root / 'seed2'}" in calls[0].argv
    assert said[1:3] == [f"seed {s}: finished before, not rerun ({root / f'seed{s}'})" for s in (0, 1)]
    assert json.loads((root / "seed2.json").read_text())["exit_status"] == 3


def test_an_unknown_metric_lists_the_logged_ones(seeds_run, capsys):
    seeds, root, argv, *_ = seeds_run
    bad = [*argv[:5], "--metrics", "eval/nope", "--", *TINY]  # seed 2 is not rerun: --seeds 0,1
    bad[2] = "0,1"
    assert seeds.main(bad, runner=lambda run, cores: pytest.fail("a finished seed ran again")) == 2
    err = capsys.readouterr().err
    assert "['eval/nope'] not logged" in err and "sft:eval/loss" in err and "sft:ce" in err


def test_a_finished_seed_with_other_arguments_is_refused(seeds_run, capsys):
    seeds, root, argv, *_ = seeds_run
    other = [*argv[:5], "--", *TINY[:-1]]
    other[2] = "0"
    assert seeds.main(other, runner=lambda run, cores: pytest.fail("ran")) == 2
    assert f"seed 0: {root / 'seed0'} finished with other arguments" in capsys.readouterr().err


def fake_pipeline(run, cores) -> int:
    """A pipeline [sft, rlvr] whose held-out accuracy rises by the seed; seed 9 crashes."""
    if run.seed == 9:
        return 1
    for folder, rows_ in (
        ("0_sft", [{"step": 0, "loss": 2.0}, {"step": 10, "eval/loss": 1.0 + run.seed}]),
        (
            "1_rlvr",
            [
                {"step": 0, "eval/accuracy": 0.2, "eval/loss_x": [1, 2]},
                {"step": 5, "eval/accuracy": 0.5 + run.seed / 10},
            ],
        ),
    ):
        (run.workdir / folder).mkdir(parents=True)
        (run.workdir / folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows_))
    return 0


def test_a_pipelines_metrics_name_their_stage_and_the_first_row(tmp_path):
    seeds, said = tool(), []
    argv = [
        CONFIG,
        "--seeds",
        "0,1,9",
        "--workdir_root",
        str(tmp_path),
        "--parallel",
        "2",
        "--json",
        str(tmp_path / "t.json"),
    ]
    assert seeds.main(argv, runner=fake_pipeline, say=said.append) == 1
    table = json.loads((tmp_path / "t.json").read_text())
    assert table["metrics"] == ["rlvr:eval/accuracy"]  # the last stage's last eval row; vectors left out
    assert [s["values"] for s in table["seeds"]] == [{"rlvr:eval/accuracy": 0.5}, {"rlvr:eval/accuracy": 0.6}, {}]
    assert sorted(line.split(":")[0] for line in said if line.startswith("seed ")) == ["seed 0", "seed 1", "seed 9"]
    assert seeds.main([*argv[:2], "0,1", *argv[3:], "--metrics", "rlvr:eval/accuracy@first,eval/loss,sft:loss"]) == 0
    table = json.loads((tmp_path / "t.json").read_text())
    assert table["seeds"][1]["values"] == {"rlvr:eval/accuracy@first": 0.2, "eval/loss": 2.0, "sft:loss": 2.0}


def test_bad_input_is_named(tmp_path, capsys):
    seeds = tool()
    cases = {
        ("--seeds", "0,x"): "--seeds='0,x'",
        ("--seeds", "1,1"): "distinct",
        ("--threshold", "eval/loss=3"): "--threshold='eval/loss=3'",
        ("--metrics", "eval/loss@best"): "metric 'eval/loss@best'",
        ("--", "--config.seed=3"): "the tool sets config.seed per seed",
        ("--", "train.steps=3"): "--config.KEY=VALUE",
    }
    for args, message in cases.items():
        assert seeds.main([CONFIG, "--workdir_root", str(tmp_path), *args], runner=lambda r, c: 0) == 2
        assert message in capsys.readouterr().err, args
    assert seeds.main(["configs/nope.py"]) == 2 and "no such file" in capsys.readouterr().err


def test_cores_are_split_between_runs_and_init_from_is_one_initialisation(monkeypatch):
    seeds = tool()
    monkeypatch.setattr(seeds.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert seeds.core_slots(0, 0) == (1, [None])
    assert seeds.core_slots(2, 0) == (2, [{0, 1}, {2, 3}])
    assert seeds.core_slots(0, 1) == (4, [{0}, {1}, {2}, {3}])
    # the slots come from this process's cores: `taskset -c 2,3 python tools/seeds.py` keeps off 0 and 1
    monkeypatch.setattr(seeds.os, "sched_getaffinity", lambda pid: {2, 3})
    assert seeds.core_slots(0, 1) == (2, [{2}, {3}])
    note = seeds.initialisation_note(str(ROOT / "configs" / "long_context_recall.py:extend:llama3"), [])
    assert note.startswith("every seed starts from one checkpoint (init_from=runs/long_context_recall)")
    assert "one initialisation" in seeds.initialisation_note(CONFIG, ["--config.init_from=runs/x"])
    assert seeds.config_name("configs/long_context_recall.py:extend:llama3") == "long_context_recall_extend_llama3"
    assert seeds.config_name("configs/smollm2_rg.py:models/smollm2") == "smollm2_rg_models_smollm2"


def test_seed_in_an_override_chains_each_seed_to_its_own_earlier_run(tmp_path):
    seeds = tool()
    override = f"--config.init_from={tmp_path}/base/seed{{seed}}"
    runs = seeds.plan(seeds.parse_args([CONFIG, "--seeds", "1,2", "--workdir_root", str(tmp_path), "--", override]))
    assert [r.argv[-1] for r in runs] == [f"--config.init_from={tmp_path}/base/seed{s}" for s in (1, 2)]
    assert seeds.initialisation_note(CONFIG, [override]).startswith("each seed starts from its own earlier run")
