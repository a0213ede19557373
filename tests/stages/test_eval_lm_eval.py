"""lm-eval tasks as suites of stage eval (`eval.suites=lm_eval:<task>`): their metrics are logged,
recorded, gated and reported like built-in suites' and equal lm-eval's own run of the task on the
same weights; names and gate metrics are checked at start-up."""

import json

import pytest
from flax import nnx

pytest.importorskip("lm_eval")

from posttrain.config import base_config  # noqa: E402
from posttrain.core.checkpoint import Checkpointer  # noqa: E402
from posttrain.core.state import init_model_state  # noqa: E402
from posttrain.errors import UserError  # noqa: E402
from posttrain.eval import lm_harness  # noqa: E402
from posttrain.eval.lm_model import load_checkpoint  # noqa: E402
from posttrain.eval.report import write_report  # noqa: E402
from posttrain.main import run as main_run  # noqa: E402
from posttrain.models.decoder import Decoder  # noqa: E402
from posttrain.parallel import mesh_and_rules, use_sharding  # noqa: E402
from posttrain.rl.tasks.suites import parse_suites  # noqa: E402
from tests.support.typed_configs import TINY_DENSE

CHOICE, GEN = "lm_eval:posttrain_arithmetic_choice", "lm_eval:posttrain_arithmetic"


def config(workdir, checkpoint, suites: str, gate: str = ""):
    cfg = base_config()
    cfg.stage, cfg.workdir = "eval", str(workdir)
    m = cfg.model
    m.update(TINY_DENSE)
    cfg.train.progress = False
    cfg.eval.checkpoint, cfg.eval.suites, cfg.eval.size, cfg.eval.gate = str(checkpoint), suites, 4, gate
    cfg.eval.lm_eval_batch_size = 4
    return cfg


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with one checkpoint of a tiny random byte-tokenizer decoder and its saved config."""
    root = tmp_path_factory.mktemp("lm_eval_run")
    cfg = config(root, root, CHOICE)
    mesh, rules = mesh_and_rules(cfg)
    ckpt = Checkpointer(str(root / "checkpoints"), every=1, keep=1, async_save=False)
    with use_sharding(mesh, rules):
        params, rest = init_model_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(3)), mesh, rules)
        ckpt.save(1, {"params": params, "rest": rest})
    ckpt.close()
    (root / "config.json").write_text(json.dumps(cfg.to_dict(), default=list))
    return root


def test_lm_eval_suites_are_gated_recorded_and_reported(run_dir, tmp_path):
    gate = f"{CHOICE}/acc>=0, {CHOICE}/acc_norm<=1, {GEN}/exact_match@first-number>=0"
    result = main_run(config(tmp_path, run_dir, f"{CHOICE}, {GEN}", gate)).eval
    assert {f"{CHOICE}/acc", f"{CHOICE}/acc_norm", f"{CHOICE}/seconds", f"{GEN}/exact_match@first-number"} <= set(
        result
    )
    # the same numbers as lm-eval's own run of the task on the checkpoint loaded by the lm-eval model
    mesh, rules = mesh_and_rules(config(tmp_path, run_dir, CHOICE))  # the stage's: its programs are reused
    lm = lm_harness.PosttrainLM(model=load_checkpoint(str(run_dir), mesh=mesh, rules=rules), batch_size=4)
    own = lm_eval_results(lm, CHOICE.removeprefix("lm_eval:"))
    assert result[f"{CHOICE}/acc"] == own["acc"] and result[f"{CHOICE}/acc_norm"] == own["acc_norm"]
    record = json.loads((tmp_path / "eval" / f"{CHOICE}.jsonl").read_text().splitlines()[-1])
    assert record["harness"] == "lm-eval" and record["problems"] == 4 and record["acc"] == own["acc"]
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert any(f"eval/{GEN}/exact_match@first-number" in r for r in rows)
    html = open(write_report(str(tmp_path))).read()
    assert "exact_match@first-number" in html and "acc_norm" in html
    with pytest.raises(SystemExit, match=rf"FAIL  {CHOICE}/acc"):
        main_run(config(tmp_path / "again", run_dir, CHOICE, f"{CHOICE}/acc>1.5"))


def lm_eval_results(lm, task: str) -> dict:
    import lm_eval

    kw = dict(limit=4, task_manager=lm_harness.task_manager(), bootstrap_iters=0, log_samples=False)
    return lm_harness.suite_metrics(lm_eval.simple_evaluate(model=lm, tasks=[task], **kw), task)


def test_gate_metric_the_task_does_not_report_fails_at_start_up(run_dir, tmp_path):
    with pytest.raises(UserError, match=rf"does not report \['{GEN}/acc'\].*{GEN}/exact_match@first-number"):
        main_run(config(tmp_path, run_dir, GEN, f"{GEN}/acc>=0"))


def test_unknown_task_is_refused_naming_posttrains(run_dir, tmp_path, monkeypatch):
    monkeypatch.setattr(lm_harness, "task_manager", lambda include_defaults=False: original())  # no 20 s scan
    with pytest.raises(UserError, match=r"unknown lm-eval task\(s\) \['nope'\].*posttrain_gsm8k"):
        main_run(config(tmp_path, run_dir, "lm_eval:nope"))


original = lm_harness.task_manager


def test_suite_names_and_the_batch_key():
    assert parse_suites(f"arithmetic, {GEN}") == [("arithmetic", ""), (GEN, "")]
    with pytest.raises(ValueError, match="bad lm-eval task"):
        parse_suites("lm_eval:")
    cfg = base_config()
    cfg.stage, cfg.eval.lm_eval_batch_size = "eval", 4
    with pytest.raises(UserError, match="lm_eval_batch_size"):
        main_run(cfg)
