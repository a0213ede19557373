"""configs/long_context_recall.py, smoke only (the measured runs take minutes each): the 256-token
run trains a few steps on its generated recall conversations, and every `:extend:<scaling>`
variant passes the start-up checks from that checkpoint, with the RoPE scaling it names."""

import json
import os
import runpy

import pytest

from posttrain.config import run_config
from posttrain.stages.checks import check_run
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
