"""Accuracy from correctness (issue 25 item 5): held-out accuracy, pass@k and the eval stage's
gate headlines count a sample as solved when its verdict's correctness is 1, whatever the reward
shaping (format penalty, overlong ramp) took off its score; the shaped score is reported beside
it. Runs the real environment, reward function and `evaluate` on fixed completions (no model)."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace

import jax
import numpy as np
import pytest

from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs import SingleTurnEnv
from posttrain.rl.envs.base import Task
from posttrain.rl.reward import RewardConfig, RewardFunction, compose
from posttrain.rl.rollout.worker import Pending, RolloutWorker, evaluate
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.verifiers.base import Verdict
from posttrain.rl.verifiers.math import MathTask, MathVerifier
from posttrain.stages import eval as eval_stage

TOK = ByteTokenizer()
MAX_TOKENS, BUFFER = 40, 30  # the overlong ramp starts after 10 tokens
SHORT, LONG = "\\boxed{85}", "Adding 37 and 48 gives \\boxed{85}"  # 11 and 34 tokens with the stop token
UNBOXED, WRONG = "85", "\\boxed{84}"


class FixedWorker(RolloutWorker):
    """The rollout worker with the sampler replaced by fixed completions: greedy → `greedy`,
    sampled → `sampled` (one list per call, cycled over the samples of every task)."""

    greedy: str = SHORT
    sampled: tuple[str, ...] = ()

    def generate(self, params, rest, tasks, key, *, num_samples=None, greedy=False):
        g = num_samples or 1
        texts = [self.greedy] if greedy else list(self.sampled)
        envs = [[self.domains[d].make_env() for _ in range(g)] for d, _ in tasks]
        for row, (_, t) in zip(envs, tasks):
            [e.reset(t) for e in row]
        rows = [TOK.encode(texts[i % g]) + [TOK.eos_id] for i in range(len(tasks) * g)]
        width = max(map(len, rows))
        tokens = np.zeros((len(rows), width), np.int32)
        for i, r in enumerate(rows):
            tokens[i, : len(r)] = r
        samples = SimpleNamespace(
            completion=lambda i: rows[i],
            sampling_logprobs=np.zeros((len(rows), width), np.float32),
            lengths=np.array([len(r) for r in rows]),
            stop_reason=np.zeros(len(rows), np.int32),
            routing=None,  # (`Samples.routing`: none recorded)
            versions=None,  # (`Samples.versions`: no in-flight updates)
        )
        return Pending(tasks, envs, samples, 0.0)


def shaped_reward_fn() -> RewardFunction:
    return RewardFunction(
        {MathTask: MathVerifier()}, RewardConfig(format_penalty=0.5, max_tokens=MAX_TOKENS, overlong_buffer=BUFFER)
    )


def test_compose_keeps_the_verdict_correctness_beside_the_shaped_score():
    config = RewardConfig(correct_weight=2.0, format_penalty=0.5, max_tokens=MAX_TOKENS, overlong_buffer=BUFFER)
    reward = compose(Verdict(1.0, False), config, num_tokens=34)
    assert reward.score == pytest.approx(2.0 - 0.5 - 0.8) and reward.correct == 1.0
    assert compose(Verdict(0.25, True), config, num_tokens=5).correct == 0.25


def test_accuracy_and_pass_at_k_count_correct_answers_that_shaping_penalised():
    reward_fn = shaped_reward_fn()
    task = Task("t", ({"role": "user", "content": "What is 37+48?"},), MathTask("85"))
    domain = Domain("arithmetic", [task], lambda: SingleTurnEnv(TOK, reward_fn, max_turn_tokens=MAX_TOKENS))
    held_out = [("arithmetic", domain.tasks[0])]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        worker = FixedWorker(None, {"arithmetic": domain}, None, 0, pool)
        worker.greedy, worker.sampled = LONG, (LONG, UNBOXED, SHORT, WRONG)
        m = evaluate(worker, None, None, held_out, jax.random.key(0), 4)
        # scores: LONG in the ramp (34 tokens: -0.8), UNBOXED without the format (-0.5), SHORT and
        # WRONG one token into the ramp (-1/30)
        scores = [1 - 24 / 30, 0.5, 1 - 1 / 30, -1 / 30]
        assert m["eval/accuracy"] == 1.0  # counted wrong while accuracy was score >= 1
        assert m["eval/mean_accuracy"] == 0.75 and m["eval/pass@4"] == 1.0
        assert m["eval/score_mean"] == pytest.approx(np.mean(scores))
        suite = eval_stage.evaluate_suite(
            worker, None, None, "arithmetic", list(domain.tasks), jax.random.key(0), 4, [1, 4]
        )
    assert suite["accuracy"] == 1.0 and suite["mean_accuracy"] == 0.75 and suite["pass@1"] == 0.75
    assert suite["pass@4"] == 1.0 and suite["score_mean"] == pytest.approx(np.mean(scores))


def test_greedy_accuracy_is_reported_per_difficulty_label():
    """`eval/accuracy/<label>` for each label of the held-out tasks (a screen task's kind), none when
    a task has no string label (it would mix labelled and unlabelled tasks)."""
    reward_fn = shaped_reward_fn()

    def task(i, answer, label):
        return Task(f"t{i}", ({"role": "user", "content": f"What is {i}?"},), MathTask(answer), label)

    tasks = [task(0, "85", "easy"), task(1, "84", "hard"), task(2, "85", "hard")]
    domain = Domain("arithmetic", tasks, lambda: SingleTurnEnv(TOK, reward_fn, max_turn_tokens=MAX_TOKENS))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        worker = FixedWorker(None, {"arithmetic": domain}, None, 0, pool)
        worker.greedy, worker.sampled = SHORT, (SHORT, WRONG)
        m = evaluate(worker, None, None, [("arithmetic", t) for t in tasks], jax.random.key(0), 2)
        assert m["eval/accuracy"] == pytest.approx(2 / 3)
        assert m["eval/accuracy/easy"] == 1.0 and m["eval/accuracy/hard"] == 0.5
        unlabelled = [("arithmetic", tasks[0]), ("arithmetic", task(3, "85", None))]
        m = evaluate(worker, None, None, unlabelled, jax.random.key(0), 2)
    assert not [k for k in m if k.startswith("eval/accuracy/")]
