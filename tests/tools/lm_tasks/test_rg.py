"""tools/lm_tasks: an rg run's held-out tasks as lm-eval's `posttrain_rg` task — the same problems
the run holds out (none a training task by meaning), scored by RL's verifier through lm-eval."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("reasoning_gym")

from posttrain.rl.tasks.rg_domain import meaning, rg_tasks  # noqa: E402

TASKS = str(Path(__file__).parents[3] / "tools" / "lm_tasks")
sys.path.insert(0, TASKS)
import rg  # noqa: E402

METADATA = {"dataset": "chain_sum", "seed": 3, "size": 12, "levels": "0"}


def test_held_out_is_the_runs_test_split_and_disjoint_from_training():
    docs = rg.held_out(**METADATA)["test"]
    test = rg_tasks("chain_sum", "test", 12, run_seed=3, levels=[0])
    assert [d["id"] for d in docs] == [t.id for t in test] and len(docs) == 12
    assert [d["question"] for d in docs] == [t.prompt[0]["content"] for t in test]
    keys = {meaning("chain_sum", t.target.entry) for t in test}
    train = rg_tasks("chain_sum", "train", 100, run_seed=3, levels=[0], held_out=frozenset(keys))
    assert train and not keys & {meaning("chain_sum", t.target.entry) for t in train}
    both = rg.held_out(**{**METADATA, "dataset": "chain_sum,basic_arithmetic"})["test"]
    assert both["id"][:12] == docs["id"] and len(both) == 24 and both["id"][12].startswith("rg:basic_arithmetic/test")
    with pytest.raises(ValueError, match="dataset"):
        rg.held_out()


def oracle(respond):
    """An lm-eval model answering every request with `respond(answer)` for its document."""
    from lm_eval.api.model import LM

    class Oracle(LM):
        def generate_until(self, requests):
            return [respond(r.doc["answer"]) for r in requests]

        def loglikelihood(self, requests):
            raise NotImplementedError

        loglikelihood_rolling = loglikelihood

    return Oracle()


@pytest.mark.parametrize(
    "respond, accuracy",
    [
        (lambda a: f"So the total is \\boxed{{{a}}}.", 1.0),
        (lambda a: f"\\boxed{{{int(a) + 1}}}", 0.0),
        (lambda a: f"It is {a} or {int(a) + 1}: \\boxed{{{a}}} \\boxed{{{int(a) + 1}}}", 0.0),  # hedged
    ],
)
def test_scored_through_lm_eval_by_the_rl_verifier(respond, accuracy):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out = lm_eval.simple_evaluate(
        model=oracle(respond),
        tasks=["posttrain_rg"],
        task_manager=TaskManager(include_path=TASKS, include_defaults=False, metadata=METADATA),
        bootstrap_iters=0,
        log_samples=True,
    )
    assert out["results"]["posttrain_rg"]["accuracy,none"] == accuracy
    samples = out["samples"]["posttrain_rg"]
    assert len(samples) == 12 and json.loads(samples[0]["doc"]["task"])["dataset"] == "chain_sum"
