"""tools/report.py: the page holds the curves of every stage, the eval table, every gate condition,
the alerts and a sample of rollouts, escaped (a response is untrusted text), with nothing external.
A run's files are written here by the project's own writers (MetricsWriter, check_gate, the eval
record writer); the real-run check in headless Chromium is in tests/e2e/test_notebook.py."""

import json
import os
import re
import subprocess
import sys

import pytest

from posttrain.core.metrics import MetricsWriter
from posttrain.eval.gates import GATES_FILE, GateFailed, check_gate
from posttrain.eval.long_context_eval import write_rows
from posttrain.eval.report import reward_parts, sample_rollouts, write_report
from posttrain.stages.eval import write_record
from tests.support.browser import find_chromium, render
from tests.support.paths import ROOT

HOSTILE = "<script>console.error('escaped?')</script>\x1b[31m & \"q\""


def rollout(step, sample, reward, response="\\boxed{7}"):
    return {
        "step": step,
        "policy_version": step,
        "domain": "arithmetic",
        "task_id": f"arithmetic/train/0:{sample}",
        "difficulty": None,
        "sample": sample,
        "prompt": "What is 3+4=",
        "response": response,
        "reward": reward,
        "parts": {"correct": reward, "format": 0.0, "length": 0.0, "tool_calls": 0.0},
        "verifier_parts": {},
        "error": None,
        "truncated": None,
        "turns": 1,
        "num_tokens": 9,
    }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A two-stage pipeline folder (SFT, RLVR with kept rollouts and an alert) and an eval stage."""
    root = tmp_path_factory.mktemp("report_run")
    sft = MetricsWriter(str(root / "0_sft"))
    for step in range(0, 30, 10):
        sft.write(
            step,
            {
                "loss": 2.0 / (step + 1),
                "ce": 1.9 / (step + 1),
                "lr": 1e-3,
                "tokens_per_s": 900.0 + step,
                "moe/load": [0.5, 0.5],
            },
        )
    sft.write(29, {"eval/loss": 0.5})
    sft.close()
    write_rows(  # eval.long_context's rows at two steps: the report draws the newest
        [
            {"kind": kind, "length": n, "depth": d, "accuracy": acc * n / 1024, "step": step}
            for step, acc in ((10, 0.1), (29, 0.9))
            for kind in ("needle", "multihop")
            for n in (256, 1024)
            for d in (0.0, 0.5)
        ],
        str(root / "0_sft" / "long_context.jsonl"),
    )
    rl = MetricsWriter(str(root / "1_rlvr"))
    for step in range(4):
        rl.write(
            step,
            {
                "loss": 0.1,
                "rl/reward_mean": 0.2 * step,
                "rl/kl": 0.01 * step,
                "rl/entropy": 1.0 - 0.1 * step,
                "rl/response_len_mean": 20.0 + step,
                "rl/gen_s": 1.0,
                "rl/verify_s": 0.1,
                "rl/update_s": 2.0,
                "rl/wait_s": 0.5,
                "rl/new_tokens": 500,
                "rl/device_idle_frac": 0.2,
            },
        )
    rl.event(2, "alert", rule="entropy_collapse", value=0.8, threshold=0.9, message="rl/entropy 0.8 < 0.9")
    rl.close()
    os.makedirs(root / "1_rlvr" / "rollouts")
    for step in (0, 2):
        with open(root / "1_rlvr" / "rollouts" / f"{step:07d}.jsonl", "w") as f:
            for s in range(10):
                f.write(json.dumps(rollout(step, s, float(s % 2), HOSTILE if s == 1 else "\\boxed{7}")) + "\n")
    for step, acc in ((100, 0.5), (200, 0.625)):
        write_record(
            str(root / "2_eval"),
            {
                "suite": "arithmetic",
                "version": "abc123",
                "checkpoint": "x",
                "step": step,
                "problems": 8,
                "samples": 4,
                "accuracy": acc,
                "mean_accuracy": 0.4,
                "pass@1": 0.4,
                "pass@4": 0.9,
                "response_len": 12.0,
                "greedy_response_len": 11.0,
                "verifier_errors": 0,
                "seconds": 3.5,
                "time": 0.0,
            },
        )
    ev = MetricsWriter(str(root / "2_eval"), resume_step=2**62)
    ev.write(100, {"eval/arithmetic/accuracy": 0.5})
    ev.write(200, {"eval/arithmetic/accuracy": 0.625})
    ev.close()
    check_gate("sft", "eval/loss<1", {"eval/loss": 0.5}, workdir=str(root))
    with pytest.raises(GateFailed):
        check_gate(
            "eval",
            "arithmetic_accuracy>=0.7, arithmetic/pass@4>=0.8",
            {"arithmetic_accuracy": 0.625, "arithmetic/pass@4": 0.9},
            workdir=str(root),
        )
    return root


def test_gate_outcomes_are_recorded_with_every_condition(run):
    sft, ev = [json.loads(l) for l in (run / GATES_FILE).read_text().splitlines()]
    assert sft["stage"] == "sft" and sft["passed"] and sft["conditions"][0]["value"] == 0.5
    assert ev["stage"] == "eval" and not ev["passed"]
    assert [(c["metric"], c["passed"]) for c in ev["conditions"]] == [
        ("arithmetic_accuracy", False),
        ("arithmetic/pass@4", True),
    ]


def test_report_holds_every_section(run):
    out = subprocess.run(
        [sys.executable, str(ROOT / "tools/report.py"), str(run), "--out", str(run / "r.html")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    page = (run / "r.html").read_text()
    titles = re.findall(r'<img alt="([^"]+)"', page)
    # SFT: loss, held-out loss (one point: no curve), throughput, lr; RL: its panels plus reward parts.
    assert titles[:3] == ["loss", "throughput (tokens/s)", "learning rate"]
    for t in (
        "reward",
        "KL to the reference",
        "entropy (nats/token)",
        "response length (tokens)",
        "seconds per step, by phase",
        "device-idle fraction",
        "reward parts (kept rollouts, mean)",
    ):
        assert t in titles[3:], t
    assert "held-out accuracy" in titles  # the eval stage's two checkpoints
    assert titles.count("long context 0_sft") == 1  # one figure: a heat map per kind, newest step
    assert "No long-context evaluation" not in page
    assert page.count('src="data:image/png;base64,') == len(titles)
    assert not re.search(r'(src|href)="(https?:)?//', page)  # self-contained
    for cell in ("abc123", "0.625", "pass@4", "<td>200</td>"):  # eval table across checkpoints
        assert cell in page
    assert page.index("<th>pass@1</th>") < page.index("<th>pass@4</th>")
    assert (
        "<tr class=fail><td>eval</td><td>FAILED</td><td>arithmetic_accuracy</td><td>&gt;= 0.7</td><td>0.625</td>"
        in page
    )
    assert "<tr class=pass><td>sft</td><td>passed</td><td>eval/loss</td>" in page
    assert "entropy_collapse" in page and "rl/entropy 0.8 &lt; 0.9" in page
    assert "&lt;script&gt;console.error(&#x27;escaped?&#x27;)&lt;/script&gt;\\x1b[31m &amp; &quot;q&quot;" in page
    assert "<script" not in page


def test_report_of_a_run_on_an_object_store(run):
    """A gs:// (here memory://) workdir: evals, gates, rollouts and config are read through
    posttrain.storage and the page is written there (plain open/glob saw nothing, then failed)."""
    import fsspec

    from posttrain import storage

    fsspec.filesystem("memory").put(str(run), "/report_store", recursive=True)
    check_gate(
        "rlvr", "rl/reward_mean>0.5", {"rl/reward_mean": 0.75}, workdir="memory:///report_store"
    )  # appended there
    out = write_report("memory:///report_store")
    assert out == "memory:///report_store/report.html" and not os.path.exists("memory:")
    page = storage.read_text(out)
    assert "memory:///report_store" in page and "abc123" in page and "<td>200</td>" in page  # eval table
    assert "<tr class=fail><td>eval</td><td>FAILED</td><td>arithmetic_accuracy</td>" in page  # gates
    assert "<tr class=pass><td>rlvr</td><td>passed</td><td>rl/reward_mean</td><td>&gt; 0.5</td><td>0.75</td>" in page
    assert "&lt;script&gt;console.error(&#x27;escaped?&#x27;)" in page  # rollouts


def test_rollout_sample_spreads_over_steps_and_parts_average_per_step():
    rows = [rollout(step, s, float(s % 2)) for step in (0, 5, 10) for s in range(8)]
    picked = sample_rollouts(rows, 5)
    assert [(r["step"], r["sample"]) for r in picked] == [(0, 0), (0, 1), (5, 0), (5, 1), (10, 0)]
    assert len(sample_rollouts(rows[:3], 12)) == 3
    assert reward_parts(rows)["reward part/correct"] == ([0, 5, 10], [0.5, 0.5, 0.5])


def test_report_of_a_folder_without_metrics_names_it(tmp_path):
    with pytest.raises(SystemExit, match="no metrics.jsonl in"):
        write_report(str(tmp_path))


def test_report_renders_in_headless_chromium_and_the_check_catches_errors(run, tmp_path):
    """The browser check itself can fail: a page with a script error, a console error and a missing
    image is caught; the report (with hostile rollout text) has none of these and all its plots."""
    binary = find_chromium()
    if binary is None:
        if os.environ.get("POSTTRAIN_REQUIRE_BROWSER"):
            pytest.fail("POSTTRAIN_REQUIRE_BROWSER is set but no Chromium was found (apt-get install chromium)")
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; or set POSTTRAIN_CHROMIUM)")
    bad = tmp_path / "bad.html"
    bad.write_text('<!DOCTYPE html><img src="missing.png"><script>console.error("boom"); nope();</script>')
    found = render(str(bad), binary)["problems"]
    assert any("ERR_FILE_NOT_FOUND" in p for p in found) and "console.error: boom" in found
    assert any(p.startswith("uncaught: ReferenceError: nope") for p in found)
    page = render(write_report(str(run), str(tmp_path / "report.html")), binary)
    assert page["problems"] == [] and page["external"] == []
    images = page["images"]
    assert len(images) >= 12 and all(i["tag"] == "img" and i["complete"] for i in images)
    assert all(i["natural_width"] >= 300 and i["natural_height"] >= 200 and i["width"] >= 300 for i in images)
    assert "entropy_collapse" in page["text"] and "escaped?" in page["text"] and "FAILED" in page["text"]
