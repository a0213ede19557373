"""The datasets of posttrain's lm-eval tasks (`custom_dataset` in the YAML files beside this one),
read offline: GSM8K and HumanEval from the shared data folder ($POSTTRAIN_DATA, else
`shared/data` beside the repo; `--metadata '{"data_dir": ...}'` overrides it), and the held-out
("test") split of the synthetic arithmetic problems, as posttrain's `arithmetic` suite draws them.
HumanEval completions are run against their tests in posttrain's sandbox (`humaneval_results`)."""

from __future__ import annotations

import functools
import gzip
import json
import os

import numpy as np

from posttrain.data.sources import shared_data_dir
from posttrain.data.synthetic import arithmetic_problem, arithmetic_problem_count

ARITHMETIC_MAX_VALUE = 99
ARITHMETIC_SIZE = 128


def _rows(path: str) -> list[dict]:
    """The records of a JSONL file (gzip when it ends in .gz); a missing file is an error naming it."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (set $POSTTRAIN_DATA or --metadata '{{\"data_dir\": ...}}')")
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _dataset(splits: dict[str, list[dict]]):
    import datasets

    return datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()})


def gsm8k(data_dir: str = "", **_):
    """GSM8K's train and test files (fields question, answer)."""
    root = os.path.join(data_dir or shared_data_dir(), "gsm8k")
    return _dataset({s: _rows(os.path.join(root, f"{s}.jsonl")) for s in ("train", "test")})


def humaneval(data_dir: str = "", **_):
    """HumanEval's 164 problems (task_id, prompt, canonical_solution, test, entry_point) as split test."""
    return _dataset({"test": _rows(os.path.join(data_dir or shared_data_dir(), "humaneval", "HumanEval.jsonl.gz"))})


def arithmetic(size: int = ARITHMETIC_SIZE, seed: int = 0, **_):
    """`size` distinct held-out arithmetic problems ("37+48=", answer "85"), drawn with `seed` like
    the built-in suite's, plus a train split of as many for few-shot examples."""
    out = {}
    for split in ("train", "test"):
        available = arithmetic_problem_count(ARITHMETIC_MAX_VALUE, split)
        rng, rows, seen = np.random.default_rng([seed, split == "test"]), [], set()
        while len(rows) < min(size, available):
            question, answer = arithmetic_problem(rng, ARITHMETIC_MAX_VALUE, split=split)
            if question not in seen:
                seen.add(question)
                rows.append({"question": question, "answer": answer})
        out[split] = rows
    return _dataset(out)


def arithmetic_choice(size: int = ARITHMETIC_SIZE, seed: int = 0, **_):
    """The held-out arithmetic problems as three-way multiple choice: the answer and two near
    misses (answer + 1, answer + 10) in an order drawn with `seed`; `label` is the answer's index."""
    data, rng = arithmetic(size, seed), np.random.default_rng(seed)
    out = {}
    for split in data:
        rows = []
        for row in data[split]:
            value = int(row["answer"])
            choices = [str(value), str(value + 1), str(value + 10)]
            order = rng.permutation(3)
            rows.append({**row, "choices": [choices[i] for i in order], "label": int(np.argmin(order))})
        out[split] = rows
    return _dataset(out)


@functools.cache
def _sandbox():
    from posttrain.sandbox import Sandbox

    return Sandbox()


def humaneval_results(doc: dict, results: list[str]) -> dict[str, float]:
    """pass@1 of one greedy completion: 1.0 when prompt + completion + test + `check(entry_point)`
    exits cleanly in posttrain's sandbox (5 s CPU, 10 s wall), else 0.0."""
    from posttrain.sandbox import Job, Limits, Status, sandbox_python

    program = f"{doc['prompt']}{results[0]}\n\n{doc['test']}\ncheck({doc['entry_point']})\n"
    job = Job(argv=(sandbox_python(), "-I", "-c", program), limits=Limits(cpu_s=5, wall_s=10.0))
    return {"pass@1": float(_sandbox().submit(job).result().status is Status.PASS)}
