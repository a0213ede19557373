"""The command line: config loading, locked keys, and a short end-to-end training run."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.config import base_config
from posttrain.main import check_overrides

ROOT = Path(__file__).resolve().parents[1]


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
    out = subprocess.run([sys.executable, "-m", "posttrain.main", "--config", str(ROOT / "configs/quickstart.py"),
                          "--config.optim.lrr=1"], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode != 0
    assert "unknown config key 'config.optim.lrr'" in out.stderr + out.stdout


def test_cli_trains_and_writes_metrics(tmp_path):
    """A few steps through the real entry point: metrics.jsonl and TensorBoard events appear."""
    cmd = [sys.executable, "-m", "posttrain.main", "--config", str(ROOT / "configs/sft_tiny.py"),
           f"--config.workdir={tmp_path}",
           "--config.sft.eval_files=", "--config.sft.gate=", "--config.data.synthetic_size=100",
           "--config.train.steps=3", "--config.train.log_every=1", "--config.train.batch_size=8",
           "--config.train.seq_len=64", "--config.train.progress=False"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(k in rows[0] for k in ("loss", "ce", "grad_norm", "lr", "moe/aux_loss", "moe/load"))
    assert len(rows[0]["moe/load"]) == 4
    assert list((tmp_path / "tensorboard").iterdir())
