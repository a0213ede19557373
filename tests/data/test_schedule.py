"""Staged context extension (`train.seq_len_schedule`): parsing, data continuing across a stage
boundary re-packed to the new length, and a run resumed before, at or after the boundary
reproducing the uninterrupted run (one train-step compile per stage)."""

import json
import re
import shutil

import numpy as np
import pytest

from posttrain.data.pipeline import sft_batches
from posttrain.data.schedule import ScheduledBatches, parse_seq_len_schedule
from posttrain.data.tokenizer import load_tokenizer
from tests.support.typed_configs import run_cfg


def test_parse_schedule():
    s = parse_seq_len_schedule("256:20,512:5,1024", 1024, 100)
    assert s.lengths == (256, 512, 1024) and s.starts == (0, 20, 25)
    assert [s.length_at(t) for t in (0, 19, 20, 24, 25, 99)] == [256, 256, 512, 512, 1024, 1024]
    assert parse_seq_len_schedule("", 64, 10).lengths == (64,)


@pytest.mark.parametrize(
    "text, why",
    [
        ("256:20,512", "the last length 512 must equal train.seq_len=1024"),
        ("256:20", "should be length (the last"),
        ("256,1024", "should be length:steps"),
        ("256:20:3,1024", "should be length:steps"),
        ("256:x,1024", "not integers"),
        ("256:0,1024", "must be positive"),
        ("2048:5,1024", "decrease"),
        ("256:100,1024", "train.steps=100"),
    ],
)
def test_invalid_schedule_names_the_key(text, why):
    with pytest.raises(ValueError, match=r"train\.seq_len_schedule=.*" + re.escape(why)):
        parse_seq_len_schedule(text, 1024, 100)


def write_records(path, n: int = 40, seed: int = 0) -> str:
    """Conversations of mixed length: some fit 48 byte tokens, some only 128."""
    rng = np.random.default_rng(seed)
    with open(path, "w") as f:
        for i in range(n):
            k = int(rng.integers(1, 4 if i % 3 else 22))
            f.write(json.dumps({"prompt": f"q{i} " + "ab " * k, "response": "z" * int(rng.integers(1, 6))}) + "\n")
    return str(path)


def staged(files, tok, schedule):
    make = lambda n: sft_batches(files, tok, batch_size=2, seq_len=n, seed=3, final_seq_len=128)
    return ScheduledBatches(schedule, make(128), make, "sft")


def test_batches_continue_across_the_boundary_and_resume_anywhere(tmp_path):
    files, tok = write_records(tmp_path / "d.jsonl"), load_tokenizer("byte")
    schedule = parse_seq_len_schedule("48:4,128", 128, 12)
    full, states = staged(files, tok, schedule), {}
    batches = []
    for step in range(12):
        states[step] = full.get_state()
        batches.append(full.at(step))
    assert [b["inputs"].shape[1] for b in batches] == [48] * 4 + [128] * 8
    assert full.batches.deferred > 0  # long conversations waited for the long stage
    real = lambda b: (b["segment_ids"] > 0).sum(axis=1)
    assert max(real(b).max() for b in batches[4:]) > 48  # …and were trained there
    for at in (2, 4, 5):  # mid-stage, at the boundary, after it
        resumed = staged(files, tok, schedule)
        resumed.set_state(json.loads(json.dumps(states[at])))
        for step in range(at, 12):
            got = resumed.at(step)
            for k in got:
                np.testing.assert_array_equal(got[k], batches[step][k], err_msg=f"resume at {at}, step {step} {k}")


def test_stage_without_staged_data_is_an_error():
    with pytest.raises(ValueError, match=r"train\.seq_len_schedule: stage 'dpo'"):
        ScheduledBatches(parse_seq_len_schedule("8:1,16", 16, 4), iter(()), None, "dpo")


def sft_config(workdir, files, steps=5):
    return run_cfg(
        {
            "model.vocab_size": 264,
            **{"sft.train_files": files, "sft.sample_tokens": 0},
            **{"train.steps": steps, "train.batch_size": 2, "train.seq_len": 128, "train.seq_len_schedule": "48:3,128"},
            **{"train.log_every": 1, "train.progress": False},
            **{"checkpoint.every": 3, "checkpoint.keep": 2, "checkpoint.async_save": False},
        },
        stage="sft",
        workdir=str(workdir),
    )


def test_staged_run_resumes_at_the_boundary(tmp_path):
    """Resuming from the checkpoint at the boundary (its data state saved by the short stage, the
    next step in the long one) gives the uninterrupted run's losses; each stage compiles the train
    step once. (Resuming anywhere else is the data test above plus the plain resume path.)"""
    from posttrain.core import lineage
    from posttrain.stages.sft import run as sft

    files = write_records(tmp_path / "d.jsonl")
    full = sft(sft_config(tmp_path / "full", files))
    assert full.train_step_compiles == 2
    assert [r["seq_len"] for r in full.rows] == [48] * 3 + [128] * 2
    assert lineage.of_run(str(tmp_path / "full"))["trained_context"] > 48
    workdir = tmp_path / "resumed"
    shutil.copytree(tmp_path / "full" / "checkpoints", workdir / "checkpoints")
    shutil.rmtree(workdir / "checkpoints" / "5")
    resumed = sft(sft_config(workdir, files))
    assert resumed.train_step_compiles == 1
    want = {r["step"]: r for r in full.rows}
    assert [r["step"] for r in resumed.rows] == [3, 4]
    for r in resumed.rows:
        for k in ("loss", "grad_norm", "seq_len", "data/deferred"):
            np.testing.assert_allclose(r[k], want[r["step"]][k], rtol=1e-6, err_msg=f"step {r['step']} {k}")


def test_pipeline_refuses_a_schedule_some_stage_cannot_follow(tmp_path):
    from posttrain.stages import pipeline

    cfg = sft_config(tmp_path, "unused.jsonl").replace({"pipeline.stages": ("sft", "dpo")})
    with pytest.raises(ValueError, match=r"train\.seq_len_schedule='48:3,128'.*\['dpo'\]"):
        pipeline.check(cfg)  # main.run's start-up check (stages.checks.check_run), before the first stage
