"""What a run tells its user: eval results on the console, truncation counts, a bar that says it is
compiling, and a `--help` that lists the stages and config sections."""

import json
import logging
import runpy
import subprocess
import sys

from posttrain.data.synthetic import arithmetic_records
from tests.support.paths import ROOT


def test_sft_reports_evals_truncation_and_compilation(tmp_path, monkeypatch, caplog):
    from posttrain.core import harness
    from posttrain.main import run

    descriptions = []

    class Bar(harness.tqdm):
        def set_description(self, desc=None, refresh=True):
            descriptions.append((desc, self.n))
            super().set_description(desc, refresh)

    monkeypatch.setattr(harness, "tqdm", Bar)
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records("sft", 64, 1, max_value=20)))
    cfg = runpy.run_path(str(ROOT / "configs/sft_tiny.py"))["get_config"]()
    cfg.workdir, cfg.sft.train_files, cfg.sft.eval_files, cfg.sft.gate = str(tmp_path / "W"), str(data), str(data), ""
    cfg.data.synthetic, cfg.data.truncate, cfg.sft.sample_tokens = "", True, 0
    cfg.train.progress, cfg.train.log_every, cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = (
        False,
        1,
        2,
        8,
        32,
    )
    cfg.model.num_layers, cfg.checkpoint.every = 1, 0
    with caplog.at_level(logging.INFO):
        result = run(cfg)
    assert descriptions == [("sft (compiling…)", 0), ("sft", 0)]  # back to the name after the first step
    assert "sft: compiling the first step" in caplog.text
    truncated = [r["data/truncated"] for r in result.rows if "data/truncated" in r]
    assert len(truncated) == 2 and 0 < truncated[0] <= truncated[1]  # most records are longer than 32 tokens
    assert f"sft step 0: {truncated[0]} examples so far were longer than train.seq_len" in caplog.text
    line = next(m for m in caplog.messages if m.startswith("sft step 2: "))
    assert f"eval/loss={result.eval['eval/loss']:.4g}" in line  # one console line per eval


def test_help_lists_stages_sections_and_environment():
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.main", "--help"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    text = out.stdout + out.stderr
    lines = {l.strip().split(".{", 1)[0]: l for l in text.splitlines() if ".{" in l}
    for section, key in (
        ("train", "steps"),
        ("optim", "lr"),
        ("rl", "advantage"),
        ("data", "synthetic"),
        ("checkpoint", "every"),
        ("mesh", "data"),
        ("model", "moe.*"),
    ):
        assert key in lines[section].split("{", 1)[1].replace(",", " ").replace("}", " ").split(), (section, key)
    assert "stage, one of: dpo, eval, lm, pipeline, rejection_sampling, reward_model, rlvr, sft" in text
    assert all(
        f"${name}" in text for name in ("POSTTRAIN_DATA", "POSTTRAIN_COMPILATION_CACHE", "POSTTRAIN_ACCELERATOR_PATHS")
    )
