"""configs/long_context_recall.py: the 256-token run trains a few steps on its generated recall
conversations, and every `:extend:<scaling>` variant passes the start-up checks from that
checkpoint, with the RoPE scaling it names. Slow (issue 46): the kv and needle matches form, and
carry to 1024 tokens, from an initialisation the benchmarks did not use (seed 3; BENCHMARKS ran 0,
1, 2), at reduced length: `python -m pytest --runslow -m slow tests/e2e/test_long_context_recall.py`
(each at 256, then its checkpoint extended to 1024: kv ~23 min on a free core, needle ~25 min; kv's
extension then trains two hops and runs RL on them, ~35 + 25 min more)."""

import json
import os
import runpy

import pytest

from posttrain.config import run_config
from posttrain.stages.checks import check_run
from tests.support.cli_runs import run_as_user
from tests.support.paths import ROOT
from tests.support.typed_configs import typed

CONFIG = runpy.run_path(str(ROOT / "configs/long_context_recall.py"))


def test_long_context_recall_smoke(tmp_path, monkeypatch):
    from posttrain.main import run
    from posttrain.stages.common import run_max_context

    monkeypatch.chdir(tmp_path)  # the extension's init_from is the relative runs/long_context_recall
    cfg = CONFIG["get_config"]()
    cfg.data.synthetic_size, cfg.train.steps, cfg.train.batch_size = 16, 2, 2
    cfg.train.progress, cfg.train.log_every, cfg.checkpoint.async_save = False, 1, False
    cfg.eval.long_context.lengths = ""  # the grid is measured by hand (see the config's docstring)
    result = run(cfg)
    assert [r["step"] for r in result.rows] == [0, 1] and all(r["loss"] < 10 for r in result.rows)
    [data] = (tmp_path / cfg.workdir / "synthetic").glob("long_context_train_*density3_hops2_kv.jsonl")
    first = json.loads(data.open().readline())["messages"]
    key = first[0]["content"].rsplit("\n", 1)[1].removesuffix("?")
    assert len(first) >= 4 and first[1]["content"][:3] == key and first[1]["content"][3:].isdigit()  # "QZX4821"
    for scaling in CONFIG["SCALINGS"]:
        ext = CONFIG["get_config"](f"extend:{scaling}")
        check_run(run_config(ext))
        assert ext.model.rope_scaling.type == ("" if scaling == "none" else scaling)
        assert run_max_context(typed(ext)) == 1024 and ext.init_from == cfg.workdir != ext.workdir  # trained at 256
        assert ext.data.synthetic_min_length == 256 and ext.model.to_dict() | {"rope_scaling": 0} == (
            cfg.model.to_dict() | {"rope_scaling": 0}
        )  # the extension trains from the trained length up, on the checkpoint's shapes
    for bad in ("extend:rotary", "more"):
        with pytest.raises(ValueError, match="expected '' or 'extend:"):
            CONFIG["get_config"](bad)


def test_synthetic_min_length_sets_the_shortest_generated_context(tmp_path):
    """data.synthetic_min_length: recall contexts drawn from [min, train.seq_len - 24] tokens instead
    of from 64 (the default, kept: its file name does not change), so the mix can sit at the length
    evaluated (configs/long_context_recall.py's `:extend:<scaling>` runs, from 256 tokens)."""
    from posttrain.config import base_config
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.stages.data_files import _long_context_file

    cfg = base_config()
    cfg.train.seq_len, cfg.data.synthetic_size, cfg.eval.long_context.kinds = 256, 60, "recall"
    tok = load_tokenizer("byte")
    shortest = {}
    for lo in (0, 200):
        cfg.data.synthetic_min_length = lo
        path = _long_context_file(typed(cfg), str(tmp_path), "train", tok, write=True)
        assert ("_min" in os.path.basename(path)) == bool(lo)
        with open(path) as f:
            shortest[lo] = min(len(json.loads(line)["messages"][0]["content"]) for line in f)
    assert shortest[0] < 100 and shortest[200] > 150  # (filler comes in whole sentences)


def test_long_context_data_with_no_kinds_is_refused_by_name(tmp_path):
    """data.synthetic=long_context generates the kinds eval.long_context.kinds names: none is an
    error naming the key (it was a ZeroDivisionError deep in the generator)."""
    from posttrain.config import base_config
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.stages.data_files import _long_context_file

    cfg = base_config()
    cfg.eval.long_context.kinds = " , "
    with pytest.raises(ValueError, match="eval.long_context.kinds=' , ' names none"):
        _long_context_file(typed(cfg), str(tmp_path), "train", load_tokenizer("byte"), write=True)


def _train_one_seed(
    tmp_path, seed: int, *overrides: str, variant: str = "", config: str = "long_context_recall.py", devices: int = 1
) -> list[dict]:
    """configs/`config`'s recipe (`variant`: e.g. ":extend:llama3") as a user runs it (`python -m
    posttrain.main`, as tools/seeds.py does): `devices` devices (one unless the recipe splits its
    sequence) and the optimised build, not this session's 8 simulated devices at -O0, in
    tmp_path/seed{seed}{variant with "_" for ":"}. Returns metrics.jsonl."""
    workdir = tmp_path / f"seed{seed}{variant.replace(':', '_')}"
    command = ["-m", "posttrain.main", "--config", str(ROOT / "configs" / config) + variant]
    command += [f"--config.seed={seed}", f"--config.workdir={workdir}", "--config.train.progress=false", *overrides]
    run_as_user(command, devices=devices)
    return [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def _curve(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows if key in r}


@pytest.mark.slow
def test_kv_match_forms_extends_to_1024_then_two_hops_and_rl_from_another_initialisation(tmp_path):
    """kv recall at 256, 1200 of the recipe's 3200 steps, seed 3; then that checkpoint extended to 1024
    tokens (the config's `:extend:llama3`, its 200 steps). The benchmark's seeds 0 / 1 / 2 stood at kv
    0.83 / 0.69 / 0.41 and loss 0.013 / 0.057 / 0.155 at step 1200, from 0.01-0.02 and ~0.7-0.77 at
    step 400 (the loss floor before the match: the value's digits are random); extended from their
    3200-step runs (0.95 / 0.94 / 0.89 at 256), kv at 1024 was 0.99 / 0.90 / 0.73 (BENCHMARKS, "kv
    extended to 1024, two hops and long-context RL over initialisations"). Without the match a model
    scores ~0 (a 4-digit value). This test's first run: 0.007 / 0.39 / 0.82 at steps 400 / 800 / 1200,
    then 0.61 at 1024 (0.91 at 256, 0.83 at 512).

    Then two hops (configs/long_context_hops.py) from that extension: `:warm` at half the recipe's
    2400 steps (1200, a constant lr) and `:anneal` (its 300), held-out kvchain at 512 (51 problems;
    chance 1/3: a document holds 3 chains, so 3 values). The second hop must form during `:warm`
    (≥ 0.5 at one of its four evaluations, not at a fixed step: at a constant lr accuracy wanders
    there) and read ≥ 0.7 after the anneal. The benchmark's seeds 0 / 1 / 2 after 1200 steps of
    `:warm` and the anneal: 1.00 / 0.90 / 0.78; over five chains 0.47-1.00, which the recipe's 2400
    steps lift (BENCHMARKS, "Two hops: a 2400-step `:warm` ...").

    Then long-context RL (`:rl`, its 100 updates, on 2 simulated devices as the recipe splits the
    sequence) from the anneal: greedy held-out accuracy on 128 problems must not fall, and the
    training reward must rise (the last 10 updates against the first 10, by ≥ 0.03, or both ≥ 0.95).
    The benchmark's seeds 0 / 1 / 2 went 0.984 / 0.875 / 0.578 → 0.992 / 0.930 / 0.617, their
    training reward 0.99 / 0.85 / 0.50 → 1.00 / 0.96 / 0.81.

    Its run (2026-12-05, pinned to one core, 5350 s): kv 0.013 / 0.36 / 0.73 at steps 400 / 800 /
    1200, 0.63 at 1024; `:warm` 0.41 / 0.37 / 0.67 / 0.73 at steps 300-1200; `:anneal` 0.88 / 0.92 at
    150 / 300; `:rl` greedy 0.875 / 0.914 / 0.898 / 0.898 / 0.898 at updates 0-100, training reward
    0.82 → 0.92. The same chain by hand, RL killed at update 81 and resumed, gave the same figures.
    An earlier run of this test, with `:warm` at 600 steps and `:anneal` at 150, failed on this chain
    (0.37 at `:warm` step 600; 0.69 after that anneal, by hand); RL at the test's former 50 updates
    (a cosine over 50), by hand on this chain: training reward 0.82 → 0.83, short of the +0.03."""
    rows = _train_one_seed(tmp_path, 3, "--config.train.steps=1200")
    kv, loss = _curve(rows, "eval/long_ctx_kv"), _curve(rows, "loss")
    assert sorted(kv) == [400, 800, 1200], kv
    assert kv[1200] >= 0.3 and kv[1200] - kv[400] >= 0.25, kv
    assert loss[max(loss)] < 0.3, loss  # the last update's row (step 1199: a loss row's step counts from 0)
    rows = _train_one_seed(tmp_path, 3, f"--config.init_from={tmp_path / 'seed3'}", variant=":extend:llama3")
    at_1024 = _curve(rows, "eval/long_ctx_kv/len1024")
    assert sorted(at_1024) == [200], at_1024
    assert at_1024[200] >= 0.3, at_1024
    extension, hops = f"--config.init_from={tmp_path / 'seed3_extend_llama3'}", "long_context_hops.py"
    rows = _train_one_seed(tmp_path, 3, extension, "--config.train.steps=1200", variant=":warm", config=hops)
    chain = _curve(rows, "eval/long_ctx_kvchain/len512")
    assert sorted(chain) == [300, 600, 900, 1200] and max(chain.values()) >= 0.5, chain
    warm = f"--config.init_from={tmp_path / 'seed3_warm'}"
    rows = _train_one_seed(tmp_path, 3, warm, variant=":anneal", config=hops)
    chain = _curve(rows, "eval/long_ctx_kvchain/len512")
    assert sorted(chain) == [150, 300] and chain[300] >= 0.7, chain
    tasks = tmp_path / "tasks"  # the recipe's task files (its docstring's command)
    run_as_user(
        [str(ROOT / "tools/long_context_tasks.py"), "--out", str(tasks), "--lengths", "512"]
        + ["--kinds", "kvchain", "--hops", "2", "--train", "512", "--eval", "128"]
    )
    rl = [f"--config.init_from={tmp_path / 'seed3_anneal'}"]
    rl += [f"--config.rl.train_files={tasks / 'train.jsonl'}", f"--config.rl.eval_files={tasks / 'eval.jsonl'}"]
    rows = _train_one_seed(tmp_path, 3, *rl, variant=":rl", config=hops, devices=2)
    held_out, reward = _curve(rows, "eval/accuracy"), [r["rl/reward_mean"] for r in rows if "rl/reward_mean" in r]
    assert sorted(held_out) == [0, 25, 50, 75, 100] and held_out[100] >= held_out[0], held_out
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert len(reward) == 100 and (last >= first + 0.03 or min(first, last) >= 0.95), reward


@pytest.mark.slow
def test_needle_match_forms_and_extends_to_1024_from_another_initialisation(tmp_path):
    """needle at 256, 800 of the benchmark's 1200 steps, seed 3; then that checkpoint extended to 1024
    tokens (llama3 RoPE scaling, 200 of the benchmark's 600 steps on 512-1000-token contexts). The
    benchmark's seeds 0 / 1 / 2 stood at needle 0.99 / 0.87 / 0.94 and loss 0.001 / 0.054 / 0.016 at
    step 800, from 0.77 / 0.27 / 0.20 and 0.21-0.62 at step 400, and after 200 extension steps (from
    their 1200-step runs) at 0.99 / 0.93 / 0.95 at 1024 (BENCHMARKS, "Needle at 256 and at 1024 over
    initialisations"). A model that does not use its context scores ~0 (4-digit numbers). This test's
    run: 0.18 / 0.75 at steps 400 / 800, then 0.84 at 1024 (0.83 at 256 and at 512)."""
    needle_kind = "--config.eval.long_context.kinds=needle"
    rows = _train_one_seed(tmp_path, 3, needle_kind, "--config.train.steps=800")
    needle, loss = _curve(rows, "eval/long_ctx_needle"), _curve(rows, "loss")
    assert sorted(needle) == [400, 800], needle
    assert needle[800] >= 0.6, needle
    assert loss[max(loss)] < 0.2, loss
    extension = ["--config.train.steps=200", "--config.data.synthetic_min_length=512"]
    extension += [f"--config.init_from={tmp_path / 'seed3'}", needle_kind]
    rows = _train_one_seed(tmp_path, 3, *extension, variant=":extend:llama3")
    at_1024 = _curve(rows, "eval/long_ctx_needle/len1024")
    assert sorted(at_1024) == [200], at_1024
    assert at_1024[200] >= 0.7, at_1024
