"""The training loop (posttrain/core/loop.py): `train.eval_first` evaluates before the first update."""

import pytest

from posttrain.config import base_config, run_config
from posttrain.errors import UserError
from tests.support.typed_configs import TINY_DENSE


def sft_config(workdir, **train):
    """A tiny SFT run on generated arithmetic conversations, held-out loss from the test split."""
    cfg = base_config()
    cfg.stage, cfg.workdir = "sft", str(workdir)
    cfg.model.update(TINY_DENSE)
    cfg.data.synthetic, cfg.data.synthetic_size = "arithmetic", 64
    cfg.sft.train_files = cfg.sft.eval_files = "synthetic:"
    cfg.sft.sample_tokens = 4
    cfg.train.update(steps=6, batch_size=8, seq_len=64, log_every=1, progress=False, **train)
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.checkpoint.every = 1e-2, 0, 0
    return cfg


def test_eval_first_evaluates_the_starting_weights_before_the_first_update(tmp_path):
    import json

    from posttrain.main import run

    result = run(sft_config(tmp_path, eval_first=True, eval_every=3))
    evals = [(r["step"], r["eval/loss"]) for r in result.rows if "eval/loss" in r]
    assert [step for step, _ in evals] == [0, 3, 6]
    assert evals[0][1] > evals[1][1] > evals[2][1]  # the starting weights, then learning
    samples = [json.loads(line)["step"] for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert sorted(set(samples)) == [0, 3, 6]  # the greedy samples of each evaluation, at its step


def test_eval_first_without_an_evaluating_stage_is_refused_naming_the_key(tmp_path):
    cfg = sft_config(tmp_path, eval_first=True)
    cfg.sft.eval_files = ""
    with pytest.raises(UserError, match="train.eval_first=True: no stage of this run \\(sft\\) evaluates"):
        run_config(cfg).check_stages()


def test_a_resume_from_the_checkpoint_of_an_evaluation_logs_that_evaluation_again(tmp_path):
    """The evaluation after `done` updates is logged before the checkpoint at `done` and a resume
    drops the rows at or past its checkpoint's step: a run resumed from the step of an evaluation
    (or after its last step) logs that evaluation again, so metrics.jsonl and samples.jsonl read as
    the uninterrupted run's (the evaluation at step 3 was missing from the resumed run)."""
    import json
    import shutil

    from posttrain.main import run

    def logged(workdir):
        rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
        samples = [json.loads(line) for line in (workdir / "samples.jsonl").read_text().splitlines()]
        return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in rows], samples

    def config(workdir):
        cfg = sft_config(workdir, eval_every=3)
        cfg.checkpoint.update(every=3, async_save=False)
        return cfg

    full = run(config(tmp_path))
    assert [r["step"] for r in full.rows if "eval/loss" in r] == [3, 6]
    uninterrupted = logged(tmp_path)
    shutil.rmtree(tmp_path / "checkpoints" / "6")  # killed after step 3's checkpoint
    resumed = run(config(tmp_path))
    assert logged(tmp_path) == uninterrupted and resumed.eval == full.eval
    again = run(config(tmp_path))  # resumed after the last step: the final evaluation again
    assert logged(tmp_path) == uninterrupted and again.eval == full.eval
