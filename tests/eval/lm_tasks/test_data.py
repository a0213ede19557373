"""The offline data of posttrain's lm-eval tasks: GSM8K and HumanEval from the shared data folder,
held-out arithmetic (never a training-split problem), and HumanEval's sandboxed pass@1."""

import os

import pytest

pytest.importorskip("datasets")

from posttrain.data.sources import shared_data_dir  # noqa: E402
from posttrain.data.synthetic import arithmetic_split  # noqa: E402
from posttrain.eval.lm_tasks import data  # noqa: E402


def test_arithmetic_is_held_out_and_choices_hold_the_answer():
    test = data.arithmetic(size=16)["test"]
    assert len(test) == 16 and len(set(test["question"])) == 16
    assert all(arithmetic_split(q) == "test" for q in test["question"])
    assert all(arithmetic_split(q) == "train" for q in data.arithmetic(size=16)["train"]["question"])
    for row in data.arithmetic_choice(size=16)["test"]:
        assert row["choices"][row["label"]] == row["answer"] and len(set(row["choices"])) == 3


def test_shared_sets_and_humaneval_pass_at_1():
    if not os.path.isdir(shared_data_dir()):
        pytest.skip(f"the shared data folder {shared_data_dir()} is absent (set POSTTRAIN_DATA)")
    gsm8k = data.gsm8k()
    assert (len(gsm8k["train"]), len(gsm8k["test"])) == (7473, 1319)
    doc = data.humaneval()["test"][0]
    assert data.humaneval_results(doc, [doc["canonical_solution"]]) == {"pass@1": 1.0}
    assert data.humaneval_results(doc, ["    return None\n"]) == {"pass@1": 0.0}
    with pytest.raises(FileNotFoundError, match="POSTTRAIN_DATA"):
        data.gsm8k(data_dir="/nonexistent")
