"""notebooks/quickstart.ipynb runs end to end on the CPU (nbclient, a real kernel): install cell,
SFT → GRPO → eval with its gate, curves, sampling and the report, with the notebook's parameters
cell replaced by smaller sizes (the code under it is the notebook's own). The report it writes of
that real run is then checked in headless Chromium."""

import json
import os

import pytest

from tests.support.paths import ROOT

nbformat = pytest.importorskip("nbformat", reason="the test extra (pip install -e '.[test]') brings nbformat")
nbclient = pytest.importorskip("nbclient", reason="the test extra (pip install -e '.[test]') brings nbclient")

from tests.support.browser import find_chromium, render  # noqa: E402

# MODEL has one layer (the notebook's first_dense=1 makes it dense): what is under test is the
# notebook's workflow, and a second (MoE) layer cost a third of the run's CPU time. MoE end to end
# is covered by test_cli (SFT through the CLI, moe/load logged), stages/test_lm[moe] and stages/test_rlvr.
SMALL = """WORKDIR = {workdir!r}
SFT_STEPS, RL_STEPS = 12, 2
EVAL_SIZE = 8
MODEL = dict(embed_dim=32, num_layers=1, mlp_dim=64, num_experts=4, expert_mlp_dim=32)
GATE = "arithmetic_accuracy>=0, arithmetic/response_len>0"
"""


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """The notebook executed in a fresh kernel (cwd: a temporary folder); (notebook, workdir)."""
    tmp = tmp_path_factory.mktemp("notebook")
    nb = nbformat.read(ROOT / "notebooks/quickstart.ipynb", as_version=4)
    (params,) = [c for c in nb.cells if "parameters" in c.metadata.get("tags", [])]
    params.source = SMALL.format(workdir=str(tmp / "run"))
    # The kernel sees the machine's one CPU device (as a user would), not the tests' 8 simulated ones;
    # it imports posttrain from this checkout (CI: also installed).
    env = {
        **os.environ,
        "XLA_FLAGS": "",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    client = nbclient.NotebookClient(nb, timeout=900, kernel_name="python3", resources={"metadata": {"path": str(tmp)}})
    try:
        client.execute(env=env)
    finally:  # what ran, for a failure's post-mortem
        nbformat.write(nb, tmp / "executed.ipynb")
    return nb, tmp / "run"


def text_of(cell) -> str:
    return "".join(o.get("text", "") for o in cell.outputs if o.output_type == "stream")


def test_quickstart_notebook_runs_end_to_end(executed):
    nb, run = executed
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not any(o.output_type == "error" for o in c.outputs) for c in code)
    assert "posttrain from" in text_of(code[0])  # the install cell: already installed, skipped
    assert [json.loads(l)["passed"] for l in (run / "gates.jsonl").read_text().splitlines()] == [True]
    (rec,) = [json.loads(l) for l in (run / "2_eval/eval/arithmetic.jsonl").read_text().splitlines()]
    assert rec["problems"] == 8 and rec["step"] == 2  # the RL stage's final checkpoint
    rl_rows = [json.loads(l) for l in (run / "1_rlvr/metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rl_rows if "rl/reward_mean" in r) == 1  # two updates, steps 0 and 1
    assert [r["step"] for r in rl_rows if "eval/accuracy" in r][-1] == 2  # the eval after them
    assert os.listdir(run / "1_rlvr/rollouts") == ["0000000.jsonl"]  # rl.rollouts_every=25
    images = [o for c in code for o in c.outputs if "image/png" in o.get("data", {})]
    assert len(images) == 2  # the notebook's curves and metrics.png
    sampled = [c for c in code if "policy after" in text_of(c)]
    assert len(sampled) == 1 and "policy after 2 GRPO updates" in text_of(sampled[0])
    assert sum(line[:1] in ("✓", "✗") for line in text_of(sampled[0]).splitlines()) == 8
    assert (run / "report.html").exists()


def test_report_of_the_notebook_run_renders_in_headless_chromium(executed, tmp_path):
    """A real run's report: loads with no console error, exception or failed load; every plot is a
    decoded image with a visible size; the eval table, the gate and the rollouts are on the page."""
    binary = find_chromium()
    if binary is None:
        if os.environ.get("POSTTRAIN_REQUIRE_BROWSER"):
            pytest.fail("POSTTRAIN_REQUIRE_BROWSER is set but no Chromium was found (apt-get install chromium)")
        pytest.skip("no Chromium on this machine (Debian: apt-get install chromium; or set POSTTRAIN_CHROMIUM)")
    _, run = executed
    page = render(str(run / "report.html"), binary, screenshot=str(tmp_path / "report.png"))
    assert page["problems"] == [] and page["external"] == []
    images = page["images"]
    assert len(images) >= 10, [i["alt"] for i in images]
    assert all(
        i["natural_width"] >= 300 and i["natural_height"] >= 200 and i["width"] >= 300 and i["height"] >= 150
        for i in images
    )
    alts = {i["alt"] for i in images}
    assert {
        "loss",
        "reward",
        "entropy (nats/token)",
        "response length (tokens)",
        "seconds per step, by phase",
        "device-idle fraction",
        "held-out accuracy",
    } <= alts
    for text in ("arithmetic_accuracy", "PASS", "arithmetic/train", "during training: 1_rlvr"):
        assert text in page["text"], text
    assert (tmp_path / "report.png").stat().st_size > 20_000
