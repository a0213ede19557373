"""A checkpoint written before the restructure into `core/` and `stages/` (issue 24) still resumes:
`tests/data/pre_restructure_sft/checkpoints/2` is the step-2 checkpoint of a tiny 3-step SFT run
written by that code (634dbe3, in a workdir named `run`: the data state records relative file paths),
and resuming it logs at step 2 what that code's uninterrupted run logged there (`step2.json`). Its
data are a fixed file (`train.jsonl`, arithmetic records of the "train" split), not generated: the
generator's split is a property of the code (issue 25 moved it), the checkpoint's layout is not."""

import json
import runpy
import shutil

import numpy as np

from posttrain.main import run
from tests.support.paths import ROOT

DATA = ROOT / "tests" / "data" / "pre_restructure_sft"
# The command line that wrote it: configs/sft_tiny.py with these overrides.
OVERRIDES = {
    "sft.eval_files": "",
    "sft.gate": "",
    "sft.steps": 0,
    "train.log_every": 1,
    "train.batch_size": 4,
    "train.seq_len": 64,
    "train.progress": False,
    "data.synthetic_size": 40,
    "model.num_layers": 1,
    "model.embed_dim": 32,
    "model.mlp_dim": 64,
    "model.moe.expert_mlp_dim": 32,
    "checkpoint.every": 2,
    "checkpoint.async_save": False,
    "train.steps": 3,
    "sft.train_files": "train.jsonl",
}


def test_a_checkpoint_of_the_old_layout_resumes_to_the_same_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = runpy.run_path(str(ROOT / "configs" / "sft_tiny.py"))["get_config"]()
    cfg.update_from_flattened_dict({**OVERRIDES, "workdir": "run"})
    shutil.copytree(DATA / "checkpoints", tmp_path / "run" / "checkpoints")
    shutil.copy(DATA / "train.jsonl", tmp_path / "train.jsonl")
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2]  # resumed at 2: only the third step ran
    want = json.loads((DATA / "step2.json").read_text())
    for key, value in want.items():
        if key != "tokens_per_s":
            np.testing.assert_allclose(rows[0][key], value, rtol=1e-6, err_msg=key)


# A checkpoint of the rlvr stage written before the typed config (issue 41; b6ec6cc, configs/rlvr_tiny.py
# with these overrides, in a workdir named `run`): its scheduler, optimizer and reward state resume, and
# step 2 logs what that code's uninterrupted run logged there (`step2.json`; timings aside).
RL_DATA = ROOT / "tests" / "data" / "pre_typed_config_rlvr"
RL_OVERRIDES = {
    **{"rl.steps": 0, "rl.gate": "", "rl.prompts_per_step": 2, "rl.group_size": 4, "rl.max_new_tokens": 12},
    **{"rl.eval_every": 0, "rl.eval_size": 128, "rl.arithmetic_size": 50, "rl.overlong_buffer": 10},
    **{"rl.kl_coef": 0.05, "rl.updates_per_batch": 2, "train.log_every": 1, "train.batch_size": 4},
    **{"train.seq_len": 64, "train.progress": False, "model.num_layers": 1, "model.embed_dim": 32},
    **{"model.mlp_dim": 64, "model.moe.expert_mlp_dim": 32, "checkpoint.every": 2, "checkpoint.async_save": False},
    "train.steps": 3,
}


def test_an_rl_checkpoint_written_before_the_typed_config_resumes_to_the_same_step(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(ROOT))  # configs import configs.sft_tiny
    cfg = runpy.run_path(str(ROOT / "configs" / "rlvr_tiny.py"))["get_config"]()
    cfg.update_from_flattened_dict({**RL_OVERRIDES, "workdir": "run"})
    shutil.copytree(RL_DATA / "checkpoints", tmp_path / "run" / "checkpoints")
    run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [2]  # resumed at 2: only the third step ran
    want = json.loads((RL_DATA / "step2.json").read_text())
    assert sorted(rows[0]) == sorted(want)
    for key, value in want.items():
        if not key.endswith(("_s", "_per_s", "device_idle_frac")):
            np.testing.assert_allclose(rows[0][key], value, rtol=1e-5, atol=4e-6, err_msg=key)
