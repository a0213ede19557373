"""User-facing errors are one line naming the config key, the path and what to do (traceback in
{workdir}/error.log, or with --verbose); checked per case at the `main` boundary."""

import logging
import runpy
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from fsspec.spec import AbstractFileSystem

from posttrain.errors import UserError
from posttrain.main import run_cli
from tests.support.paths import ROOT
from tests.support.typed_configs import typed


def sft_config(tmp_path, **overrides):
    cfg = runpy.run_path(str(ROOT / "configs/sft_tiny.py"))["get_config"]()
    cfg.workdir, cfg.sft.eval_files, cfg.sft.gate, cfg.data.synthetic = str(tmp_path / "W"), "", "", ""
    cfg.train.progress = False
    for key, value in overrides.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def one_line_error(capsys, cfg, status=2) -> str:
    assert run_cli(cfg) == status
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) >= 1 and err[-1].startswith("error: ") and not any("Traceback" in l for l in err), err
    return err[-1]


def test_empty_data_file_names_key_and_path(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    line = one_line_error(capsys, sft_config(tmp_path, **{"sft.train_files": str(tmp_path / "empty.jsonl")}))
    assert f"{tmp_path}/empty.jsonl: no records" in line and "[config.sft.train_files]" in line
    assert "Traceback" in (tmp_path / "W" / "error.log").read_text()  # the traceback is kept there


class UnreachableGCS(AbstractFileSystem):
    """What gcsfs does without credentials or network, minus the 222 lines and the DNS wait."""

    protocol = ("gs", "gcs")

    def _open(self, path, mode="rb", **kwargs):
        raise OSError("Cannot connect to host storage.googleapis.com:443 ssl:default [Name or service not known]")

    def info(self, path, **kwargs):
        self._open(path)

    def isdir(self, path):
        self._open(path)


def test_unreachable_gs_path_names_key_and_path(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules["fsspec.registry"]._registry, "gs", UnreachableGCS)
    line = one_line_error(capsys, sft_config(tmp_path, **{"sft.train_files": "gs://some-bucket/sft/train.jsonl"}))
    assert "gs://some-bucket/sft/train.jsonl: cannot read (OSError: Cannot connect" in line
    assert "credentials" in line and "[config.sft.train_files]" in line
    line = one_line_error(
        capsys, sft_config(tmp_path, **{"init_from": "gs://some-bucket/runs/sft", "data.synthetic": "arithmetic"})
    )
    assert line.startswith("error: init_from=gs://some-bucket/runs/sft: cannot be read (OSError: Cannot connect")


def test_init_from_missing_path_is_an_error_and_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no_such_run"
    line = one_line_error(
        capsys,
        sft_config(
            tmp_path,
            **{
                "init_from": str(missing),
                "sft.train_files": "synthetic:",
                "data.synthetic": "arithmetic",
                "data.synthetic_size": 32,
            },
        ),
    )
    assert line.startswith(f"error: init_from='{missing}': no such folder") and not missing.exists()


def test_init_from_a_differently_shaped_model_names_parameter_shapes_and_key(tmp_path):
    from posttrain.config import base_config
    from posttrain.core.checkpoint import Checkpointer
    from posttrain.core.init import load_model_state
    from posttrain.core.state import abstract_model
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import DEFAULT_RULES, make_mesh

    small, big = base_config().model, base_config().model
    big.mlp_dim = small.mlp_dim * 2
    mesh = make_mesh(dict(data=1), devices=jax.devices()[:1])
    _, params, rest = nnx.split(abstract_model(lambda: Decoder(small, rngs=nnx.Rngs(0))), nnx.Param, ...)
    params, rest = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), (params, rest))  # no compile
    ckpt = Checkpointer(str(tmp_path / "checkpoints"), every=1, keep=1, async_save=False)
    ckpt.save(3, {"params": params, "rest": rest})
    ckpt.close()
    with pytest.raises(
        UserError,
        match=rf"init_from='{tmp_path}' is a different model: .*params/.*has shape "
        rf"\(.*{small.mlp_dim}.*\), the model expects \(.*{big.mlp_dim}.*\)",
    ) as e:
        load_model_state(str(tmp_path), lambda: Decoder(big, rngs=nnx.Rngs(0)), mesh, DEFAULT_RULES)
    assert e.value.key == "init_from" and "\n" not in str(e.value)


def test_no_config_is_one_line_naming_the_flag():
    out = subprocess.run(
        [sys.executable, "-m", "posttrain.main"], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert out.stderr.strip().splitlines()[-1].startswith("error: no config given: pass --config")


def test_verbose_shows_the_traceback(tmp_path):
    """Without --verbose the same error is one line (test_empty_data_file_names_key_and_path)."""
    (tmp_path / "empty.jsonl").write_text("")
    loud = subprocess.run(
        [
            sys.executable,
            "-m",
            "posttrain.main",
            "--config",
            str(ROOT / "configs/sft_tiny.py"),
            f"--config.workdir={tmp_path}/W",
            f"--config.sft.train_files={tmp_path}/empty.jsonl",
            "--config.data.synthetic=",
            "--config.sft.eval_files=",
            "--verbose",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )
    assert loud.returncode != 0 and "Traceback" in loud.stderr and "UserError" in loud.stderr
    assert "no records" in loud.stderr


@pytest.mark.parametrize("named", ["mydata/trian.jsonl", "mydata/none_*.jsonl"])
def test_mistyped_data_path_with_synthetic_data_on_is_an_error_and_creates_nothing(
    tmp_path, capsys, monkeypatch, named
):
    """sft_tiny generates arithmetic data; a mistyped user path used to receive it (and a glob a file
    named `none_*.jsonl`). Now: an error naming the key and the path, nothing written."""
    monkeypatch.chdir(tmp_path)
    cfg = sft_config(tmp_path, **{"data.synthetic": "arithmetic", "sft.train_files": named})
    line = one_line_error(capsys, cfg)
    assert line.startswith(f"error: config.sft.train_files={named!r}: no ") and "synthetic:" in line
    assert not (tmp_path / "mydata").exists() and not (tmp_path / "W" / "synthetic").exists()


def test_synthetic_data_goes_to_the_workdir_only(tmp_path, monkeypatch, caplog):
    from posttrain.stages.data_files import resolve_data_files

    monkeypatch.chdir(tmp_path)
    cfg = sft_config(
        tmp_path,
        **{
            "data.synthetic": "arithmetic",
            "data.synthetic_size": 40,
            "sft.train_files": "synthetic:",
            "sft.eval_files": "synthetic:",
        },
    )
    cfg = resolve_data_files(typed(cfg), "sft", "sft")
    made = sorted((tmp_path / "W" / "synthetic").iterdir())
    assert [str(p) for p in made] == sorted([cfg.sft.train_files, cfg.sft.eval_files])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["W"]  # nothing anywhere else
    assert len((tmp_path / "W" / "synthetic" / Path(cfg.sft.train_files).name).read_text().splitlines()) == 40
    cfg2 = sft_config(
        tmp_path, **{"data.synthetic": "arithmetic", "data.synthetic_size": 60, "sft.train_files": "synthetic:"}
    )
    cfg2 = resolve_data_files(typed(cfg2), "sft", "sft")  # another size: another file, never a stale one
    assert (
        cfg2.sft.train_files != cfg.sft.train_files and len(Path(cfg2.sft.train_files).read_text().splitlines()) == 60
    )
    own = tmp_path / "own.jsonl"
    own.write_text('{"prompt": "a", "response": "b"}\n')
    cfg4 = sft_config(
        tmp_path, **{"data.synthetic": "arithmetic", "sft.train_files": str(own), "sft.eval_files": "synthetic:"}
    )
    with caplog.at_level(logging.WARNING):
        cfg4 = resolve_data_files(typed(cfg4), "sft", "sft")
    assert cfg4.sft.train_files == str(own) and "sft.eval_files='synthetic:' evaluates on" in caplog.text
    cfg3 = sft_config(tmp_path, **{"sft.train_files": "synthetic:"})  # data.synthetic empty
    with pytest.raises(
        UserError,
        match=r"config.sft.train_files='synthetic:' asks for generated data but "
        "data.synthetic is empty",
    ) as e:
        resolve_data_files(typed(cfg3), "sft", "sft")
    assert e.value.key == "sft.train_files"
