"""Task scheduler (mixture, pass rates, bands, dynamic sampling, resume) and the data-set domains."""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from posttrain.data.sources import DataError
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs import SingleTurnEnv, Task, run_episode
from posttrain.rl.reward import default_reward_function
from posttrain.rl.tasks.domains import (
    Domain,
    arithmetic_domain,
    gsm8k_domain,
    gsm8k_tasks,
    humaneval_domain,
    shared_data_dir,
)
from posttrain.rl.tasks.scheduler import Group, TaskScheduler, informative
from posttrain.rl.verifiers import MathTask
from posttrain.sandbox import Sandbox

TOK = ByteTokenizer()


def domain(name: str, n: int) -> Domain:
    tasks = [Task(f"{name}{i}", ({"role": "user", "content": f"{name} {i}"},), MathTask(str(i))) for i in range(n)]
    return Domain(name, tasks, make_env=lambda: None)


def domains(**sizes: int) -> dict[str, Domain]:
    return {name: domain(name, n) for name, n in sizes.items()}


def ids(batch) -> list[tuple[str, str]]:
    return [(d, t.id) for d, t in batch]


def test_mixture_proportions():
    sched = TaskScheduler(domains(a=10, b=20, c=5), {"a": 1.0, "b": 2.0, "c": 7.0}, seed=3)
    n = 20 * 500
    counts = Counter(d for _ in range(20) for d, _ in sched.next_batch(500))
    for name, p in {"a": 0.1, "b": 0.2, "c": 0.7}.items():
        assert abs(counts[name] / n - p) < 4 * np.sqrt(p * (1 - p) / n), (name, counts)
    within = Counter(t.id for _ in range(10) for d, t in sched.next_batch(500) if d == "b")
    assert len(within) == 20, "uniform within a domain reaches every task"
    sched.set_weights({"a": 1.0})
    assert {d for d, _ in sched.next_batch(100)} == {"a"}
    with pytest.raises(ValueError, match="unknown keys \\['z'\\]"):
        TaskScheduler(domains(a=1), {"z": 1.0})
    with pytest.raises(ValueError, match="positive total"):
        TaskScheduler(domains(a=1), {"a": 0.0})


def test_pass_rates_bands_and_metrics():
    sched = TaskScheduler(domains(a=4, b=2), seed=0, band_edges=(0.25, 0.75), min_attempts=4)
    sched.record("a", "a0", [1.0, 1.0, 1.0, 1.0])
    sched.record("a", "a1", [0.0, 0.0, 0.0, 0.0])
    sched.record("a", "a2", [1.0, 0.0, 0.9, 0.2])  # 0.9 passes (threshold 0.5)
    sched.record("a", "a3", [1.0, 0.0])  # too few samples: still new
    assert sched.pass_rate("a", "a0") == 1.0 and sched.pass_rate("a", "a2") == 0.5
    assert sched.pass_rate("b", "b0") is None
    m = sched.metrics()
    assert m["tasks/a/samples"] == 14 and m["tasks/a/passes"] == 7 and m["tasks/a/pass_rate"] == 0.5
    assert m["tasks/a/groups"] == 4 and m["tasks/b/samples"] == 0
    assert [m[f"tasks/a/band_{b}"] for b in ("new", "hard", "medium", "easy")] == [1, 1, 1, 1]
    sched.record("a", "a3", [1.0, 1.0])  # now 3 of 4: rate 0.75 is medium
    assert sched.metrics()["tasks/a/band_medium"] == 2
    with pytest.raises(KeyError, match="no task 'zz'"):
        sched.record("a", "zz", [1.0])
    with pytest.raises(KeyError, match="unknown domain 'q'"):
        sched.record("q", "a0", [1.0])


def test_curriculum_band_weights():
    sched = TaskScheduler(domains(a=6), seed=1, band_weights={"medium": 1.0, "hard": 0.0})
    for i, rewards in enumerate([[1, 0], [1, 0], [0, 0], [1, 1], [1, 1], [1, 1]]):
        sched.record("a", f"a{i}", rewards)
    assert {t.id for _, t in sched.next_batch(200)} == {"a0", "a1"}
    only_zero = TaskScheduler(domains(a=3), seed=1, band_weights={"medium": 1.0})
    assert len({t.id for _, t in only_zero.next_batch(200)}) == 3, "no weighted band left: uniform"
    with pytest.raises(ValueError, match="unknown keys \\['tricky'\\]"):
        TaskScheduler(domains(a=1), band_weights={"tricky": 1.0})


def test_filter_groups_drops_all_equal_rewards():
    sched = TaskScheduler(domains(a=3))
    tasks = sched.domains["a"].tasks
    groups = [
        Group("a", tasks[0], [1.0, 1.0, 1.0]),
        Group("a", tasks[1], [1.0, 0.0, 1.0]),
        Group("a", tasks[2], [0.0, 0.0]),
        Group("a", tasks[0], [0.5]),
    ]
    kept, dropped = sched.filter_groups(groups)
    assert kept == [groups[1]] and dropped == [groups[0], groups[2], groups[3]]
    assert sched.metrics()["tasks/a/dropped_groups"] == 3
    assert not informative([0.3, 0.3 + 1e-9]) and informative([0.0, 1.0])


def test_dynamic_sampling_fills_the_batch_and_caps_resampling():
    sched = TaskScheduler(domains(a=10), seed=5)
    solved = {f"a{i}" for i in range(5)}  # always right: all-equal groups, no signal
    rounds = []

    def sample_groups(batch):
        rounds.append(len(batch))
        return [Group(d, t, [1.0, 1.0] if t.id in solved else [1.0, 0.0]) for d, t in batch]

    kept = sched.dynamic_sample(sample_groups, 8, max_rounds=50)
    assert len(kept) == 8 and all(g.task.id not in solved for g in kept)
    assert rounds[0] == 8 and all(b <= a for a, b in zip(rounds, rounds[1:])) and sum(rounds) > 8
    m = sched.metrics()
    assert m["tasks/a/groups"] == sum(rounds) and m["tasks/a/dropped_groups"] == sum(rounds) - 8
    rounds.clear()
    solved |= {f"a{i}" for i in range(10)}
    assert sched.dynamic_sample(sample_groups, 8, max_rounds=3) == [] and rounds == [8, 8, 8]
    assert sched.metrics()["tasks/short_batches"] == 1


def test_state_round_trip_reproduces_the_sequence():
    def make():
        return TaskScheduler(
            domains(a=30, b=10),
            {"a": 2.0, "b": 1.0},
            seed=11,
            band_weights={"new": 1.0, "medium": 2.0, "easy": 0.2, "hard": 0.5},
        )

    def play(sched, steps, rng):
        out = []
        for _ in range(steps):
            batch = sched.next_batch(6)
            out.append(ids(batch))
            for d, t in batch:
                sched.record(d, t.id, rng.integers(0, 2, size=4).astype(float).tolist())
        return out

    a = make()
    play(a, 5, np.random.default_rng(0))
    a.set_weights({"a": 1.0, "b": 3.0})
    state = json.loads(json.dumps(a.get_state()))
    b = make()
    b.set_state(state)
    assert b.get_state() == a.get_state() and b.metrics() == a.metrics()
    assert play(a, 5, np.random.default_rng(1)) == play(b, 5, np.random.default_rng(1))
    other = TaskScheduler(domains(a=30, b=10), seed=12)
    with pytest.raises(ValueError, match="seed=11"):
        other.set_state(state)


# --- domains ----------------------------------------------------------------------------------


def require_shared_data() -> str:
    path = shared_data_dir()
    if not Path(path, "gsm8k", "test.jsonl").exists() or not Path(path, "humaneval", "HumanEval.jsonl.gz").exists():
        pytest.skip(f"shared data folder {path} is absent (set POSTTRAIN_DATA to it)")
    return path


def test_gsm8k_and_humaneval_domains_load_and_verify():
    data = require_shared_data()
    with Sandbox(max_workers=2) as sb:
        reward_fn = default_reward_function(sandbox=sb)
        make_env = lambda: SingleTurnEnv(TOK, reward_fn, max_turn_tokens=4096)
        gsm8k = gsm8k_domain(make_env, data_dir=data, split="test")
        humaneval = humaneval_domain(make_env, data_dir=data)
        arithmetic = arithmetic_domain(make_env, n=50, seed=0)
        assert len(gsm8k.tasks) == 1319 and len(humaneval.tasks) == 124 and len(arithmetic.tasks) == 50
        assert gsm8k.tasks[0].id == "gsm8k/test:1" and humaneval.tasks[0].id == "HumanEval/0"  # a train problem
        with open(Path(data, "gsm8k", "test.jsonl")) as f:
            reference = json.loads(f.readline())["answer"]
        solved = run_episode(gsm8k.make_env(), gsm8k.tasks[0], lambda ctx: TOK.encode(reference) + [TOK.eos_id])
        assert solved.reward.score == 1.0
        with gzip.open(Path(data, "humaneval", "HumanEval.jsonl.gz"), "rt") as f:
            canonical = json.loads(f.readline())["canonical_solution"]
        prompt = humaneval.tasks[0].target.prompt
        reply = TOK.encode(f"```python\n{prompt}{canonical}```") + [TOK.eos_id]
        assert run_episode(humaneval.make_env(), humaneval.tasks[0], lambda ctx: reply).reward.score == 1.0
        sched = TaskScheduler({d.name: d for d in (gsm8k, humaneval, arithmetic)}, seed=0)
        assert {d for d, _ in sched.next_batch(60)} == {"gsm8k", "humaneval", "arithmetic"}


def test_arithmetic_answers_and_bad_records(tmp_path):
    arithmetic = arithmetic_domain(lambda: None, n=20, seed=1)
    for t in arithmetic.tasks:
        a, op, b = re.match(r"What is (\d+)([+-])(\d+)\?", t.prompt[0]["content"]).groups()
        assert int(t.target.answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
    (tmp_path / "gsm8k").mkdir()
    lines = [
        {"question": "1+1?", "answer": "2\n#### 2"},
        {"question": "no answer", "answer": "2"},
        {"answer": "#### 3"},
    ]
    (tmp_path / "gsm8k" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DataError, match="train.jsonl:2: .*####"):
        gsm8k_tasks(str(tmp_path))
    assert [t.id for t in gsm8k_tasks(str(tmp_path), on_error="skip")] == ["gsm8k/train:1"]
    with pytest.raises(ValueError, match="two tasks with id 'x'"):
        Domain("d", [Task("x", (), None), Task("x", (), None)], lambda: None)
