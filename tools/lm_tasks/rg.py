"""The held-out tasks of an `rl.domains=rg:<dataset>` run as an lm-eval task (`posttrain_rg.yaml`),
scored by the verifier RL trains with, so a posttrain checkpoint can be scored through lm-eval on
exactly the problems its run held out:

    python -m posttrain.eval.lm_eval_cli --model posttrain --model_args checkpoint=RUN \\
        --include_path tools/lm_tasks --tasks posttrain_rg --apply_chat_template \\
        --metadata '{"dataset": "chain_sum", "seed": 1, "size": 64, "levels": "0"}'

`dataset` (or several, "chain_sum,basic_arithmetic": the run's held-out tasks of each, whose mean
is the run's `eval/accuracy`), `seed` (the run's `config.seed`), `size` (`rl.eval_size`), `levels`
(`rl.curriculum.rg_levels`) and `settings` (`rl.rg_settings` as {dataset: {setting: value}}) select
the split as `rg_tasks` draws it for that run; the prompt is the user turn RL samples from (the
question and the math instruction). Lives in tools/, not the package: it joins the RL task layer
(`posttrain.rl`) to lm-eval (`posttrain.eval`), which the package keeps apart.
"""

from __future__ import annotations

import functools
import json

from posttrain.config.syntax import parse_ints
from posttrain.rl.tasks.rg_domain import rg_tasks
from posttrain.rl.verifiers.rg import RGTask, RGVerifier


def held_out(dataset: str = "", seed: int = 0, size: int = 64, levels: str = "", settings: dict | None = None, **_):
    """The run's held-out tasks of rg:`dataset` ("a,b": of each, `size` per dataset, as `rl.eval_size`)
    as split `test` (fields id, question, answer, task); `settings`: {dataset: {setting: value}}."""
    import datasets

    if not dataset:
        raise ValueError("posttrain_rg needs --metadata '{\"dataset\": NAME, ...}' (an rg dataset posttrain serves)")
    tasks = [
        task
        for name in dataset.split(",")
        for task in rg_tasks(
            name, "test", size, run_seed=seed, settings=(settings or {}).get(name), levels=parse_ints(levels) or None
        )
    ]
    rows = [
        {
            "id": t.id,
            "question": t.prompt[0]["content"],
            "answer": t.target.answer,
            "task": json.dumps(dataclass_record(t.target), sort_keys=True),
        }
        for t in tasks
    ]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(rows)})


def dataclass_record(task: RGTask) -> dict:
    """The record `RGTask.from_record` rebuilds the task from."""
    return {
        "dataset": task.dataset,
        "settings": json.loads(task.settings),
        "question": task.question,
        "answer": task.answer,
        "metadata": dict(task.metadata),
    }


@functools.cache
def _verifier() -> RGVerifier:
    return RGVerifier()


def results(doc: dict, generations: list[str]) -> dict[str, float]:
    """accuracy: 1.0 when RL's verifier (the guard, then the dataset's scorer) pays the greedy
    completion in full, else 0.0."""
    task = RGTask.from_record(json.loads(doc["task"]))
    return {"accuracy": _verifier().verify(task, generations[0]).correct}
