"""configs/long_context_tiny.py end to end, very short: generated retrieval data, a staged-context
SFT run (128 → 256 tokens), the long-context evals at the end (metrics, JSONL, heat map, gate)
and on the checkpoint before the extension, and an export advertising the trained context."""

import json
import os
import runpy
import subprocess
import sys

import pytest

from posttrain.core import lineage
from posttrain.data.tokenizer import load_tokenizer
from posttrain.errors import UserError
from posttrain.eval.gates import GateFailed, check_gate
from posttrain.eval.long_context_eval import evaluate, summarize
from tests.support.paths import ROOT
from tests.support.typed_configs import typed


def tiny_config(tmp_path):
    cfg = runpy.run_path(str(ROOT / "configs/long_context_tiny.py"))["get_config"]()
    cfg.workdir = str(tmp_path / "run")
    cfg.data.synthetic_size = 24
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.seq_len_schedule = 4, 2, 256, "192:2,256"
    cfg.train.progress, cfg.train.log_every = False, 1
    cfg.checkpoint.every, cfg.checkpoint.async_save = 2, False
    cfg.eval.long_context.update(lengths="192,256", depths="0,1", samples=1, max_new_tokens=4)
    return cfg


def test_long_context_tiny_end_to_end(tmp_path):
    from posttrain.main import run

    cfg = tiny_config(tmp_path)
    result = run(cfg)
    [data] = (tmp_path / "run" / "synthetic").glob("long_context_train_*.jsonl")  # generated there
    records = [json.loads(line) for line in open(data)]
    assert len(records) == 24 and all(r["response"].lstrip("-").isdigit() for r in records)
    assert [r["seq_len"] for r in result.rows if "seq_len" in r] == [192, 192, 256, 256]
    assert result.train_step_compiles == 2
    for kind in ("needle", "multihop"):
        assert 0.0 <= result.eval[f"eval/long_ctx_{kind}"] <= 1.0
        assert f"eval/long_ctx_{kind}/len256" in result.eval
    rows = [json.loads(line) for line in open(os.path.join(cfg.workdir, "long_context.jsonl"))]
    assert len(rows) == 2 * 2 * 2 and {r["step"] for r in rows} == {4}
    # a cell's length is the whole context read: the prompt and the max_new_tokens (4) answer
    assert all(r["length"] - 4 - 48 < r["prompt_tokens"] <= r["length"] - 4 for r in rows)
    assert os.path.getsize(os.path.join(cfg.workdir, "long_context.png")) > 1000
    assert "passed" in check_gate("sft", "eval/long_ctx_needle>=0", result.eval)
    with pytest.raises(GateFailed, match="long_ctx_multihop"):
        check_gate("sft", "eval/long_ctx_multihop>1", result.eval)

    # before the extension: the checkpoint at the end of the 192-token stage, as the tool loads it
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        from long_context_eval import load_model
    finally:
        sys.path.pop(0)
    cfg = typed(cfg)
    model, step, _ = load_model(cfg, 2)
    # trained at 192 tokens so far: the tool's limit refuses the 256-token cells unless told
    limit = lineage.max_context(cfg, lineage.of_run(cfg.workdir, step=step))
    assert 0 < limit <= 192  # the longest sequence trained (packed rows may hold fewer tokens)
    with pytest.raises(UserError, match=r"sampling\.max_context: eval\.long_context\.lengths='192,256' needs 256"):
        evaluate(model, load_tokenizer("byte"), cfg.eval.long_context, step=step, max_context=limit)
    cfg = cfg.replace({"sampling.max_context": 256})  # told to (the tool's --max_context)
    limit = lineage.max_context(cfg, lineage.of_run(cfg.workdir, step=step))
    before = summarize(evaluate(model, load_tokenizer("byte"), cfg.eval.long_context, step=step, max_context=limit))
    assert step == 2 and set(before) == {k.removeprefix("eval/") for k in result.eval}


@pytest.mark.slow
def test_long_context_eval_cli(tmp_path):
    """The command line on a finished tiny run: JSONL and heat map written, means printed."""
    from posttrain.main import run

    cfg = tiny_config(tmp_path)
    cfg.eval.long_context.lengths = ""
    run(cfg)
    out = subprocess.run(
        [
            sys.executable,
            "tools/long_context_eval.py",
            f"--run={cfg.workdir}",
            "--step=2",
            "--lengths=200",
            "--max_context=200",  # past the 192 tokens trained by step 2, explicitly
            "--depths=0.5",
            "--samples=2",
            f"--out={tmp_path / 'lc'}",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout[out.stdout.index("{") :])
    assert summary["step"] == 2 and 0 <= summary["long_ctx_needle"] <= 1
    assert (tmp_path / "lc" / "long_context.png").exists() and (tmp_path / "lc" / "long_context.jsonl").exists()
