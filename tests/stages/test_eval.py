"""Stage eval and multi-condition gates: results equal a direct computation with the rollout
worker on a fixed tiny checkpoint; pass@k follows the combinatorial formula; suite versions track
their records; gates report every condition, are parsed at start-up and bind a stage run alone."""

import json
import math
import os

import jax
import numpy as np
import pytest
from flax import nnx

from posttrain.config import base_config
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.init import load_model_state
from posttrain.core.state import abstract_model, init_model_state
from posttrain.data.tokenizer import load_tokenizer
from posttrain.errors import UserError
from posttrain.eval.gates import GateFailed, check_gate, parse_gate, regression_drop
from posttrain.main import run as main_run
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules, use_sharding
from posttrain.rl.rollout.worker import RolloutWorker, evaluate
from posttrain.rl.tasks import suites as suite_lib
from posttrain.stages import eval as evaluation
from tests.support.typed_configs import TINY_DENSE, typed

PROMPTS = [f"What is {a} plus {b}?" for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (9, 1), (2, 2), (4, 4), (6, 1)]]


def config(tmp, run_dir, suites, **eval_kw):
    cfg = base_config()
    cfg.stage, cfg.workdir = "eval", str(tmp)
    m = cfg.model
    m.update(TINY_DENSE)
    cfg.train.progress = False
    cfg.rl.max_new_tokens, cfg.rl.verifier_workers = 16, 2
    cfg.eval.checkpoint, cfg.eval.suites, cfg.eval.samples, cfg.eval.pass_k = str(run_dir), suites, 4, "1,2,4"
    if "arithmetic" in suites:
        cfg.eval.size = 4
    cfg.eval.update(eval_kw)
    return cfg


def write_suite(path, answers):
    with open(path, "w") as f:
        for p, a in zip(PROMPTS, answers):
            f.write(json.dumps({"prompt": p, "answer": a}) + "\n")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A run with two checkpoints of a tiny random decoder (steps 1 and 2, different seeds) and a
    user suite. (A random model never ends its turn, so its accuracies are 0: the accuracy
    aggregation itself is checked on known rewards in test_suite_metrics_aggregate_rewards.)"""
    root = tmp_path_factory.mktemp("evalrun")
    cfg = config(root / "unused", root, "arithmetic")
    mesh, rules = mesh_and_rules(cfg)
    ckpt = Checkpointer(str(root / "checkpoints"), every=1, keep=5, async_save=False)
    with use_sharding(mesh, rules):
        for step, seed in ((1, 1), (2, 2)):
            params, rest = init_model_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(seed)), mesh, rules)
            ckpt.save(step, {"params": params, "rest": rest})
    ckpt.close()
    write_suite(root / "mine.jsonl", [str(i + 3) for i in range(len(PROMPTS))])
    return root


def direct(cfg, name, step=2):
    """The checkpoint evaluated by hand: the rollout worker's `evaluate`, and a hand loop for pass@k."""
    cfg = typed(cfg)
    tok = load_tokenizer(cfg.data.tokenizer)
    suites = suite_lib.make_suites(cfg, tok)
    mesh, rules = mesh_and_rules(cfg)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    graphdef = nnx.split(abstract_model(make), nnx.Param, ...)[0]
    sampling = evaluation.SamplingParams(
        temperature=1.0,
        max_new_tokens=cfg.rl.max_new_tokens,
        stop_ids=tuple(tok.stop_ids),
        num_samples=cfg.eval.samples,
    )
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(2) as pool, use_sharding(mesh, rules):
        params, rest, _ = load_model_state(cfg.eval.checkpoint, make, mesh, rules, step=step)
        worker = RolloutWorker(graphdef, suites, sampling, tok.pad_id, pool)
        pairs, key = [(name, t) for t in suites[name].tasks], jax.random.key(cfg.seed)
        metrics = evaluate(worker, params, rest, pairs, key, cfg.eval.samples)
        sampled = worker.rollout(params, rest, pairs, jax.random.fold_in(key, 1), num_samples=cfg.eval.samples)
    n = cfg.eval.samples
    counts = [sum(c >= 1.0 for c in g.correct) for g in sampled.groups]
    for k in (1, 2, 4):  # 1 − C(n−c, k) / C(n, k), averaged over problems
        metrics[f"hand/pass@{k}"] = float(np.mean([1 - math.comb(n - c, k) / math.comb(n, k) for c in counts]))
    return metrics


def records(workdir, suite):
    with open(os.path.join(workdir, "eval", f"{suite}.jsonl")) as f:
        return [json.loads(l) for l in f]


def test_eval_equals_direct_computation_on_a_fixed_checkpoint(run_dir, tmp_path):
    root = run_dir
    cfg = config(tmp_path, root, f"arithmetic,mine={root / 'mine.jsonl'}")
    result = evaluation.run(typed(cfg))
    for name in ("arithmetic", "mine"):
        want = direct(cfg, name)
        (rec,) = records(tmp_path, name)
        assert rec["step"] == 2 and rec["checkpoint"] == str(root) and rec["samples"] == 4 and rec["seconds"] > 0
        assert rec["problems"] == (4 if name == "arithmetic" else len(PROMPTS))
        assert rec["accuracy"] == want["eval/accuracy"]
        assert rec["mean_accuracy"] == want["eval/mean_accuracy"]
        assert rec["response_len"] == want["eval/response_len"]
        for k in (1, 2, 4):
            assert rec[f"pass@{k}"] == pytest.approx(want[f"hand/pass@{k}"], abs=1e-12)
        assert rec["pass@4"] == pytest.approx(want["eval/pass@4"])
        assert result.eval[f"{name}/accuracy"] == rec["accuracy"] and result.eval[f"{name}/version"] == rec["version"]
    assert records(tmp_path, "mine")[0]["response_len"] > 0
    assert result.eval["arithmetic_accuracy"] == result.eval["arithmetic/accuracy"]
    assert "regression_drop" not in result.eval  # one checkpoint, no baseline


def test_every_checkpoint_is_evaluated_and_compared_with_the_previous(run_dir, tmp_path):
    root = run_dir
    cfg = config(tmp_path, root, f"mine={root / 'mine.jsonl'}", steps="all", pass_k="2")
    result = evaluation.run(typed(cfg))
    recs = records(tmp_path, "mine")
    assert [r["step"] for r in recs] == [1, 2] and recs[0]["version"] == recs[1]["version"]
    assert "pass@2" in recs[0] and "pass@4" not in recs[0]
    rows = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["eval/mine/accuracy"] == recs[1]["accuracy"]
    assert result.eval["regression_drop"] == pytest.approx(recs[0]["accuracy"] - recs[1]["accuracy"])
    first = evaluation.run(typed(config(tmp_path / "one", root, f"mine={root / 'mine.jsonl'}", steps="1")))
    assert records(tmp_path / "one", "mine")[0]["step"] == 1 and first.eval["mine/accuracy"] == recs[0]["accuracy"]


class FakeWorker:
    """Rollouts with given correctness: greedy[i] for problem i, sampled[i] its samples'; each
    sample's shaped reward is its correctness minus 0.25 (a penalty that must not count)."""

    def __init__(self, greedy, sampled):
        self.greedy, self.sampled = greedy, sampled

    def rollout(self, params, rest, pairs, key, *, num_samples, greedy=False, exact_share=True):
        from posttrain.rl.rollout.worker import RolloutBatch
        from posttrain.rl.tasks.scheduler import Group

        assert not exact_share  # across processes a suite's problems are shared out nearly evenly
        rewards = [[g] for g in self.greedy] if greedy else self.sampled
        assert len(pairs) == len(rewards) and all(len(r) == num_samples for r in rewards)
        groups = [Group(d, t, [x - 0.25 for x in r], [], r) for (d, t), r in zip(pairs, rewards)]
        return RolloutBatch(groups, [], {"response_len_mean": 7.0 if greedy else 9.5, "verifier_errors": 1})


def test_suite_metrics_aggregate_rewards():
    """Accuracy counts verdict correctness 1 (partial credit is not correct; a shaping penalty does
    not make a right answer wrong); pass@k is 1 − C(n−c,k)/C(n,k) per problem; the shaped score
    is reported beside."""
    greedy, sampled = [1.0, 0.0, 0.5], [[1.0, 0.0, 0.0, 1.0], [0.0] * 4, [1.0, 1.0, 1.0, 0.9]]
    from posttrain.rl.envs.base import Task

    m = evaluation.evaluate_suite(
        FakeWorker(greedy, sampled),
        None,
        None,
        "s",
        [Task(x, (), None) for x in "abc"],
        jax.random.key(0),
        4,
        [1, 2, 3],
    )
    assert m["accuracy"] == pytest.approx(1 / 3) and m["mean_accuracy"] == pytest.approx(5 / 12)
    for k in (1, 2, 3):
        want = np.mean([1 - math.comb(4 - c, k) / math.comb(4, k) for c in (2, 0, 3)])
        assert m[f"pass@{k}"] == pytest.approx(want, abs=1e-12)
    assert m["response_len"] == 9.5 and m["greedy_response_len"] == 7.0 and m["verifier_errors"] == 2
    assert m["score_mean"] == pytest.approx(np.mean(sampled) - 0.25)


def test_suite_version_changes_when_a_record_changes(tmp_path):
    write_suite(tmp_path / "a.jsonl", ["3", "7", "11"])
    write_suite(tmp_path / "b.jsonl", ["3", "8", "11"])
    a, b = (suite_lib.user_tasks("s", str(tmp_path / f"{x}.jsonl")) for x in "ab")
    assert suite_lib.suite_version(a) == suite_lib.suite_version(suite_lib.user_tasks("s", str(tmp_path / "a.jsonl")))
    assert suite_lib.suite_version(a) != suite_lib.suite_version(b)
    assert suite_lib.suite_version(a) != suite_lib.suite_version(a[:2])


def test_eval_key_errors(run_dir, tmp_path):
    root = run_dir
    with pytest.raises(ValueError, match="eval.suites: unknown suite 'nope'"):
        evaluation.run(typed(config(tmp_path, root, "nope")))
    with pytest.raises(ValueError, match=r"eval.pass_k='8'.*1..eval.samples=4"):
        evaluation.run(typed(config(tmp_path, root, "arithmetic", pass_k="8")))
    with pytest.raises(ValueError, match=r"eval.steps='3'.*has \[1, 2\]"):
        evaluation.run(typed(config(tmp_path, root, "arithmetic", steps="3")))
    with pytest.raises(ValueError, match="eval.steps='all' cannot take effect"):
        evaluation.checkpoint_steps(config(tmp_path, "hf:/nowhere", "arithmetic", steps="all"), "hf:/nowhere")
    with pytest.raises(ValueError, match="eval.checkpoint is empty"):
        evaluation.run(typed(config(tmp_path, "", "arithmetic")))
    with pytest.raises(ValueError, match=r"config.eval.gate=.*does not report \['arithmetic/acuracy'\]"):
        evaluation.run(typed(config(tmp_path, root, "arithmetic", gate="arithmetic/acuracy>0.5")))
    with pytest.raises(ValueError, match="eval.size=4 cannot take effect"):
        evaluation.run(typed(config(tmp_path, root, f"mine={root / 'mine.jsonl'}", size=4)))
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:1"):
        evaluation.run(typed(config(tmp_path, root, f"bad={tmp_path / 'bad.jsonl'}")))


def test_a_reasoning_gym_suite_is_the_held_out_split_rl_draws(run_dir, tmp_path):
    """eval.suites=rg:<dataset>: the held-out tasks an rlvr run of the seed draws for the dataset
    (same ids), scored and gated like a built-in suite; an unknown dataset is refused by name."""
    pytest.importorskip("reasoning_gym")
    from posttrain.rl.tasks.registry import make_domains, make_reward_fn

    cfg = config(tmp_path, run_dir, "rg:chain_sum", size=4, gate="rg:chain_sum/accuracy>=0")
    cfg.rl.rg_settings = "chain_sum.max_terms=2"
    result = evaluation.run(typed(cfg))
    (rec,) = records(tmp_path, "rg:chain_sum")
    assert rec["problems"] == 4 and result.eval["rg:chain_sum/accuracy"] == rec["accuracy"]
    rl = typed(cfg).replace({"rl.domains": "rg:chain_sum", "rl.eval_size": 4})
    _, held_out = make_domains(rl, load_tokenizer(rl.data.tokenizer), make_reward_fn(rl.rl))
    suite = suite_lib.make_suites(typed(cfg), load_tokenizer(rl.data.tokenizer))["rg:chain_sum"]
    assert [t.id for t in suite.tasks] == [t.id for _, t in held_out]
    with pytest.raises(ValueError, match="rg:no_such_dataset"):
        suite_lib.parse_suites("rg:no_such_dataset")


# --- gates ---

GATE = "unit_test_pass>=0.6, tool_success_rate>=0.5, long_ctx_multihop>=0.3"


def test_three_condition_gate_passes_and_fails_reporting_every_condition():
    good = {"unit_test_pass": 0.7, "tool_success_rate": 0.5, "long_ctx_multihop": 0.9}
    assert "PASS  long_ctx_multihop = 0.9" in check_gate("eval", GATE, good)
    with pytest.raises(GateFailed) as e:
        check_gate("eval", GATE, {**good, "unit_test_pass": 0.59, "long_ctx_multihop": 0.29})
    report = str(e.value)
    assert "FAIL  unit_test_pass = 0.59 (needs >= 0.6)" in report
    assert "PASS  tool_success_rate = 0.5 (needs >= 0.5)" in report
    assert "FAIL  long_ctx_multihop = 0.29 (needs >= 0.3)" in report
    with pytest.raises(GateFailed, match="FAIL  tool_success_rate = — .*not reported"):
        check_gate("eval", GATE, {"unit_test_pass": 0.7, "long_ctx_multihop": 0.9})


def test_regression_drop_against_the_baseline():
    base = {
        "a/accuracy": 0.8,
        "a/version": "v1",
        "b/accuracy": 0.5,
        "b/version": "v1",
        "c/accuracy": 0.9,
        "c/version": "x",
    }
    cur = {
        "a/accuracy": 0.79,
        "a/version": "v1",
        "b/accuracy": 0.45,
        "b/version": "v1",
        "c/accuracy": 0.1,
        "c/version": "y",
    }
    assert regression_drop(cur, base) == pytest.approx(0.05)  # c changed version: not compared
    check_gate("eval", "regression_drop<=0.06", cur, baseline=base)
    with pytest.raises(GateFailed, match=r"FAIL  regression_drop = 0.05 \(needs <= 0.02\)"):
        check_gate("eval", "regression_drop<=0.02", cur, baseline=base)
    with pytest.raises(GateFailed, match="no suite evaluated in both with the same version"):
        check_gate("eval", "regression_drop<=0.02", {"c/accuracy": 1.0, "c/version": "z"}, baseline=base)
    assert "n/a: no earlier evaluation" in check_gate("eval", "regression_drop<=0.02", cur)


@pytest.mark.parametrize("spec", ["eval/loss<<1", "eval/loss<1,", "acc >= high", "acc = 1"])
def test_bad_gate_syntax_fails_at_start_up_naming_the_key(spec, tmp_path):
    with pytest.raises(ValueError, match="config.rl.gate="):
        parse_gate(spec, "config.rl.gate")
    cfg = base_config()
    cfg.stage, cfg.workdir = "pipeline", str(tmp_path / "run")
    cfg.pipeline.stages = ("sft", "dpo")
    cfg.dpo.gate = spec
    with pytest.raises(UserError, match="config.dpo.gate="):
        main_run(cfg)
    assert not os.path.exists(os.path.join(cfg.workdir, "config.json"))  # nothing ran


def test_pipeline_checks_the_eval_gate_metrics_before_training(tmp_path):
    cfg = base_config()
    cfg.stage, cfg.workdir = "pipeline", str(tmp_path / "run")
    cfg.pipeline.stages = ("sft", "eval")
    cfg.eval.gate = "arithmetic/accuracy>=0.5, unit_test_pass>=0.6"  # no humaneval suite
    with pytest.raises(UserError, match=r"config.eval.gate=.*does not report \['unit_test_pass'\]"):
        main_run(cfg)
    assert not os.path.exists(os.path.join(cfg.workdir, "config.json"))


def test_standalone_stage_below_its_gate_exits_non_zero(run_dir, tmp_path):
    root, expected = run_dir, 0.0
    cfg = config(tmp_path, root, f"mine={root / 'mine.jsonl'}")
    cfg.eval.gate = f"mine/accuracy>={expected}, mine/pass@4>=0, mine/response_len>1000"
    with pytest.raises(SystemExit) as e:
        main_run(cfg)
    assert "FAIL  mine/response_len" in str(e.value) and "PASS  mine/accuracy" in str(e.value)
    cfg.eval.gate = f"mine/accuracy>={expected}, mine/pass@4>=0, mine/response_len>0"
    assert main_run(cfg).eval["mine/accuracy"] == expected
    gates = [json.loads(l) for l in (tmp_path / "gates.jsonl").read_text().splitlines()]  # for tools/report.py
    assert [g["passed"] for g in gates] == [False, True]
    assert [c["passed"] for c in gates[0]["conditions"]] == [True, True, False]


def test_pipeline_eval_stages_compare_with_the_previous_eval(run_dir, tmp_path):
    """Two eval stages of the same checkpoint: the first has no baseline (n/a), the second a drop of 0."""
    from posttrain.stages import pipeline

    cfg = config(tmp_path, "", f"mine={run_dir / 'mine.jsonl'}")
    cfg.stage, cfg.init_from, cfg.pipeline.stages = "pipeline", str(run_dir), ("eval", "eval")
    cfg.eval.gate = "regression_drop<=0.0, mine/response_len>0"
    results = pipeline.run(typed(cfg))
    assert results["eval"]["regression_drop"] == 0.0
    assert [r["step"] for r in records(tmp_path / "1_eval", "mine")] == [2]
    cfg.eval.gate = "regression_drop<-0.5"
    with pytest.raises(GateFailed, match=r"FAIL  regression_drop = 0 \(needs < -0.5\)"):
        pipeline.run(typed(cfg))
    gates = [json.loads(l) for l in (tmp_path / "gates.jsonl").read_text().splitlines()]  # every gate checked
    assert [(g["stage"], g["passed"]) for g in gates] == [("eval", True)] * 3 + [("eval", False)]
    assert gates[2]["conditions"][0]["note"].startswith("n/a") and gates[3]["conditions"][0]["value"] == 0.0


def test_long_context_grid_runs_beside_the_suites_and_gates_on_it(run_dir, tmp_path):
    cfg = config(tmp_path, run_dir, f"mine={run_dir / 'mine.jsonl'}", gate="long_ctx_multihop>=0, long_ctx_needle>=0")
    lc = cfg.eval.long_context
    lc.lengths, lc.depths, lc.samples = "160", "0", 1
    result = main_run(cfg)
    assert {"long_ctx_needle", "long_ctx_multihop"} <= set(result.eval)
    assert (tmp_path / "long_context.jsonl").exists()
    cfg.eval.gate = "long_ctx_needle>=1.5"
    with pytest.raises(SystemExit, match=r"FAIL  long_ctx_needle = 0 \(needs >= 1.5\)"):
        main_run(cfg)


# --- multi-turn suites (repo_fix: tool episodes) ---


class ScriptedSampler:
    """Stands in for the sampler in the episode loop: reads each episode's context and writes the
    next turn of a script (cat the test and a missing file: a failing call; then the fix, right
    only when the asserted value is a multiple of 3; then "Done."), so the solved set is known."""

    def __init__(self, tok):
        self.tok = tok

    def turn(self, context: str) -> str:
        import re

        module = re.search(r"Fix (\w+)\.py\.", context).group(1)
        shown = re.search(r"assert (\w+) == (\d+)", context.split("<output>", 1)[-1])
        if context.count("<output>") == 0:
            return f"<tool>sh\ncat test_{module}.py missing.txt\n</tool>"
        if context.count("<output>") == 1:
            name, value = shown.group(1), int(shown.group(2))
            return f"<tool>sh\necho '{name} = {value if value % 3 == 0 else value + 1}' > {module}.py\n</tool>"
        return "Done."

    def __call__(self, worker, params, rest, contexts, sampling, key):
        """`RolloutWorker.sample`'s signature: the next turn of every context."""
        turns = [self.tok.encode(self.turn(self.tok.decode(c))) + [self.tok.stop_ids[0]] for c in contexts]

        class Samples:
            sampling_logprobs = np.zeros((len(turns), max(map(len, turns))), np.float32)

            @staticmethod
            def completion(j):
                return turns[j]

        return Samples()


def test_multi_turn_suite_reports_episode_metrics_and_gates_on_them(run_dir, tmp_path, monkeypatch):
    """Stage eval on repo_fix's held-out episodes (real sandboxed calls and final checks, the
    sampler scripted): solved = the final check passed, although the failing first call's penalty
    leaves the reward below 1; the episode metrics are reported and gated on. The episodes run in
    2 cohorts (rl.episode_cohorts): sampler calls of half the episodes, the same results."""
    from posttrain.rl.rollout.worker import RolloutWorker
    from posttrain.rl.tasks import repo_domain

    tok = load_tokenizer(base_config().data.tokenizer)
    scripted, calls = ScriptedSampler(tok), []
    monkeypatch.setattr(RolloutWorker, "sample", lambda worker, *a: calls.append(len(a[2])) or scripted(worker, *a))
    cfg = config(tmp_path, run_dir, "repo_fix", samples=2, pass_k="1,2", size=4)
    cfg.rl.max_new_tokens, cfg.rl.invalid_tool_call_penalty, cfg.rl.episode_cohorts = 64, 0.1, 2
    cfg.eval.gate = "tool_success_rate>=0.5, repo_fix/turns_per_episode<=3, repo_fix/tool_call_ok_rate>=0.5"
    want = np.mean(
        [repo_domain.task_fields(t)[3] % 3 == 0 for t in suite_lib.make_suites(typed(cfg), tok)["repo_fix"].tasks]
    )
    assert want == 0.5  # the seed's 4 held-out tasks: 2 multiples of 3
    result = main_run(cfg)
    assert max(calls) == 4 and calls[:2] == [2, 2]  # greedy: 4 episodes in 2 cohorts; sampled: 8 in 2
    (rec,) = records(tmp_path, "repo_fix")
    assert rec["problems"] == 4 and rec["accuracy"] == rec["tool_success_rate"] == want
    assert rec["mean_accuracy"] == rec["tool_success_rate_sampled"] == rec["pass@2"] == want
    assert rec["turns_per_episode"] == 3 and rec["calls_per_turn"] == pytest.approx(2 / 3)
    assert rec["tool_call_ok_rate"] == 0.5  # cat of a missing file exits 1: invalid, penalised
    assert result.eval["tool_success_rate"] == result.eval["repo_fix/tool_success_rate"] == want
    with pytest.raises(GateFailed, match=r"FAIL  tool_success_rate = 0.5 \(needs >= 0.99\)"):
        check_gate("eval", "tool_success_rate>=0.99", result.eval)
    cfg.eval.gate = "arithmetic/tool_success_rate>=0"  # episode metrics only for multi-turn suites
    cfg.eval.suites, cfg.eval.size = "repo_fix,arithmetic", 4
    with pytest.raises(UserError, match=r"does not report \['arithmetic/tool_success_rate'\]"):
        main_run(cfg)
