"""Stage `rejection_sampling` (issue 16 item 4): verified samples of the policy become SFT data.

The policy is a tiny decoder whose embedding and LM head are set so that it answers with random
strings over {"a", "b", " "} ending at `<eos>` with a fixed probability per token (so responses
are short, often repeated and sometimes differ only in whitespace); a deterministic user verifier
scores them by length. Every call of the verifier is recorded, so the kept records are checked
against what the stage really saw.
"""

from __future__ import annotations

import collections
import json
import math
import re
import sys
import textwrap

import fsspec
import jax
import numpy as np
import pytest
from flax import nnx

from posttrain import main
from posttrain.config import base_config
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.state import init_model_state
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.errors import UserError
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules, use_sharding
from posttrain.rl.envs.base import Task
from posttrain.stages import pipeline
from posttrain.stages import rejection_records as records
from posttrain.stages import rejection_sampling as rejection
from posttrain.stages import sft as stage_lib
from posttrain.stages.rejection_records import Candidate, select
from tests.support.typed_configs import TINY_DENSE, checked, typed

VERIFIER = '''
import threading
calls, lock = [], threading.Lock()

def by_length(prompt, response, record):
    """Even length (the empty response too): 1; a multiple of 3 otherwise: 0.5; else 0."""
    with lock:
        calls.append((prompt, response))
    return 1.0 if len(response) % 2 == 0 else 0.5 if len(response) % 3 == 0 else 0.0
'''


def score(response: str) -> float:
    return 1.0 if len(response) % 2 == 0 else 0.5 if len(response) % 3 == 0 else 0.0


def tiny(workdir, train_files, verifier, **rejection_kw):
    cfg = base_config()
    cfg.stage, cfg.workdir = "rejection_sampling", str(workdir)
    m = cfg.model
    m.update(TINY_DENSE)
    cfg.train.progress, cfg.train.steps, cfg.train.log_every, cfg.checkpoint.every = False, 2, 1, 0
    r = cfg.rl
    r.train_files, r.verifiers = train_files, verifier  # no rl.eval_files: none needed (rl.eval_every is 10)
    r.prompts_per_step, r.max_new_tokens, r.verifier_workers = 4, 10, 2
    cfg.rejection.update(dict(prompts=6, samples_per_prompt=6, keep_per_prompt=2, min_score=0.5))
    cfg.rejection.update(rejection_kw)
    return cfg


@pytest.fixture(scope="module")
def policy(tmp_path_factory):
    """A checkpoint (step 7) of a decoder that samples "a", "b" or " " (equally likely) or ends its
    turn (p ≈ 0.35) at every step: the residual stream is dominated by one direction u (a large
    shared component of every embedding row) and the head reads the logits off it."""
    root = tmp_path_factory.mktemp("policy")
    cfg = base_config()
    m = cfg.model
    m.update(TINY_DENSE)
    d, tok = m.embed_dim, ByteTokenizer()
    u = np.random.default_rng(0).standard_normal(d)
    u /= np.linalg.norm(u)
    logits = np.full(m.vocab_size, -30.0)
    logits[[tok.encode(c)[0] for c in "ab "]] = 0.0
    logits[tok.eos_id] = math.log(3 * 0.35 / 0.65)
    mesh, rules = mesh_and_rules(cfg)
    with use_sharding(mesh, rules):
        params, rest = init_model_state(lambda: Decoder(m, rngs=nnx.Rngs(0)), mesh, rules)
        flat = dict(nnx.to_flat_state(params))
        for name, value in (
            (("embed",), flat[("embed",)][...] + 100 * math.sqrt(d) * u),
            (("head",), np.outer(u, logits) / math.sqrt(d)),
        ):
            flat[name][...] = jax.device_put(np.asarray(value, np.float32), flat[name][...].sharding)
        ckpt = Checkpointer(str(root / "checkpoints"), every=1, keep=1, async_save=False)
        ckpt.save(7, {"params": params, "rest": rest})
        ckpt.close()
    return str(root)


@pytest.fixture
def user_tasks(tmp_path, monkeypatch):
    """Task records in two domains with difficulties, and the recording verifier on sys.path."""
    name = f"rsverifier_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(VERIFIER))
    monkeypatch.syspath_prepend(str(tmp_path))
    records = [
        {
            "prompt": f"Say something, {i}.",
            "verifier": "by_length",
            "domain": "alpha" if i < 4 else "beta",
            "difficulty": "easy" if i % 2 else "hard",
        }
        for i in range(8)
    ]
    path = tmp_path / "tasks.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    yield str(path), f"{name}:by_length", name
    sys.modules.pop(name, None)


def cand(index, response, s, *, tokens=None, truncated=False, error=None):
    return Candidate(
        "d",
        Task("t", ({"role": "user", "content": "p"},), None),
        index,
        response,
        len(response) if tokens is None else tokens,
        s,
        {"correct": s},
        truncated,
        error,
    )


class ShareWorker:
    """A RolloutWorker stand-in: a group of `num_samples` scored responses per task, of which it
    returns the share of process `self.process` (as `RolloutWorker.rollout` does across hosts)."""

    def __init__(self, monkeypatch, tok):
        self.monkeypatch, self.tok, self.process = monkeypatch, tok, 0

    def groups(self, tasks, num_samples):
        from types import SimpleNamespace

        from posttrain.rl.envs.base import Trajectory
        from posttrain.rl.reward import Reward

        def traj(task, s):
            answer = list(self.tok.encode(f"{task.id}/{s}")) + [self.tok.stop_ids[0]] * (s % 2)
            return Trajectory(
                task.id,
                [1, 2] + answer,
                [False, False] + [True] * len(answer),
                2,
                Reward(s / num_samples, {"correct": s / num_samples}),
                info={},
            )

        return [SimpleNamespace(trajectories=[traj(t, s) for s in range(num_samples)]) for _, t in tasks]

    def rollout(self, params, rest, tasks, key, *, num_samples, exact_share):
        from posttrain.rl.rollout.hosts import group_share

        self.monkeypatch.setattr(jax, "process_index", lambda: self.process)
        return type(
            "Batch", (), {"groups": self.groups(tasks, num_samples)[group_share(len(tasks), exact=exact_share)]}
        )


def test_candidates_of_several_processes_are_gathered_in_prompt_order(monkeypatch):
    """Two processes (simulated): each verifies a share of a chunk's groups; after the gather both
    hold every prompt's candidates in prompt order, equal to one process's."""
    tok = ByteTokenizer()
    pairs = [(f"d{i % 2}", Task(f"t{i}", ({"role": "user", "content": f"q{i}"},), None)) for i in range(7)]
    worker = ShareWorker(monkeypatch, tok)
    kw = dict(samples=3, chunk=3, tok=tok, progress=False)
    one = rejection.sample_candidates(worker, None, None, pairs, jax.random.key(0), **kw)
    monkeypatch.setattr(jax, "process_count", lambda: 2)

    def allgather_json(mine):  # process 1's share of the same chunk, computed as process 1 would
        worker.process = 1
        chunk = pairs[calls.pop(0) :][:3]
        theirs = [
            [records.candidate_fields(i, t, tok) for i, t in enumerate(g.trajectories)]
            for g in worker.rollout(None, None, chunk, None, num_samples=3, exact_share=False).groups
        ]
        worker.process = 0
        return [json.loads(json.dumps(mine)), json.loads(json.dumps(theirs))]

    calls = [0, 3, 6]
    monkeypatch.setattr(rejection, "allgather_json", allgather_json)
    two = rejection.sample_candidates(worker, None, None, pairs, jax.random.key(0), **kw)
    assert two == one and [c[0].task.id for c in two] == [f"t{i}" for i in range(7)]
    assert [c.response for c in one[4]] == ["t4/0", "t4/1", "t4/2"] and one[4][1].score == 1 / 3


def test_select_keeps_the_best_distinct_passing_responses_within_the_length_limit():
    cs = [
        cand(0, "long answer here", 1.0),
        cand(1, "ok", 1.0),
        cand(2, " ok  ", 1.0, tokens=5),
        cand(3, "meh", 0.5),
        cand(4, "no", 0.2),
        cand(5, "cut", 1.0, truncated=True),
        cand(6, "err", 1.0, error="timeout"),
        cand(7, "b  c", 1.0),
        cand(8, "b c", 1.0),
    ]
    kept, counts = select(cs, keep=3, min_score=0.5, max_tokens=10)
    # ranked: score, then length, then index; "ok" beats " ok  " (longer, same text); "b c" beats "b  c"
    assert [c.index for c in kept] == [1, 8, 3]
    assert dict(counts) == dict(
        candidates=9, passing=6, verifier_errors=1, truncated=1, too_long=1, duplicates=2, kept=3, prompts_with_kept=1
    )
    assert [c.index for c in select(cs, keep=1, min_score=0.5, max_tokens=10)[0]] == [1]
    assert [c.index for c in select(cs, keep=3, min_score=1.0, max_tokens=0)[0]] == [1, 8, 0]  # no length filter
    assert [c.index for c in select(cs, keep=3, min_score=0.1, max_tokens=2)[0]] == [1, 4]
    assert select(cs, keep=3, min_score=2.0, max_tokens=0) == (
        [],
        collections.Counter(candidates=9, passing=0, verifier_errors=1, truncated=1, kept=0, prompts_with_kept=0),
    )


def check_records(records, calls, cfg, policy):
    """Each prompt's kept records are exactly the best distinct passing responses the verifier saw."""
    r = cfg.rejection
    seen = collections.defaultdict(list)
    for prompt, response in calls:
        seen[prompt].append(response)
    by_prompt = collections.defaultdict(list)
    for rec in records:
        by_prompt[rec["prompt"]].append(rec)
        p = rec["provenance"]
        assert p["policy_checkpoint"] == policy and p["policy_step"] == 7 and p["verifier"] == "by_length"
        assert p["score"] == score(rec["response"]) >= r.min_score and 0 <= p["sample_index"] < r.samples_per_prompt
        assert rec["response"] in seen[rec["prompt"]]
        assert (not r.max_tokens or len(rec["response"]) <= r.max_tokens) and p["response_tokens"] == len(
            rec["response"]
        )
    assert len(by_prompt) <= r.prompts
    for prompt, responses in seen.items():
        best = {}
        for text in responses:
            if score(text) >= r.min_score and (not r.max_tokens or len(text) <= r.max_tokens):
                key = " ".join(text.split())
                best[key] = min(best.get(key, (9, 99)), (-score(text), len(text)))
        kept = by_prompt.get(prompt, [])
        assert len({" ".join(k["response"].split()) for k in kept}) == len(kept)  # no duplicates
        assert len(kept) == min(r.keep_per_prompt, len(best))
        ranks = sorted(best.values())
        assert sorted((-k["provenance"]["score"], len(k["response"])) for k in kept) == ranks[: len(kept)]


class SFTReadProducedData(Exception):
    """Raised by the spy once the sft stage has read its first batch: the training itself is sft's own test."""


def sft_spy(monkeypatch, read: list):
    """Make the sft stage record which files it reads and the tokens of its first batch, then stop."""
    real = stage_lib.sft_batches

    def spy(files, *args, **kw):
        read.append((files, next(real(files, *args, **kw))["inputs"]))
        raise SFTReadProducedData

    monkeypatch.setattr(stage_lib, "sft_batches", spy)


def test_pipeline_stage_writes_the_best_distinct_passing_candidates_and_feeds_the_next_sft(
    policy, user_tasks, tmp_path, monkeypatch
):
    """sft.train_files is mixed with the kept records (rejection.mix_original) and the sft stage
    after rejection_sampling reads the mixed file; kept records are exactly the best distinct
    passing ones within rejection.max_tokens, with provenance; the report's counts match."""
    files, verifier, module = user_tasks
    original = tmp_path / "orig.jsonl"
    original.write_text(json.dumps({"prompt": "hi", "response": "hello"}) + "\n")
    cfg = tiny(tmp_path / "pipe", files, verifier, max_tokens=3, mix_original=True, prompts=8)
    cfg.stage, cfg.pipeline.stages, cfg.init_from = "pipeline", ("rejection_sampling", "sft"), policy
    cfg.sft.train_files, cfg.rejection.gate = str(original), "rejection/yield>=0.5"
    read = []
    sft_spy(monkeypatch, read)
    with pytest.raises(SFTReadProducedData):
        main.run(cfg)
    out = tmp_path / "pipe" / "0_rejection_sampling"
    kept_lines = (out / "sft.jsonl").read_text().splitlines()
    assert (out / "sft.mixed.jsonl").read_text().splitlines() == original.read_text().splitlines() + kept_lines
    assert [f for f, _ in read] == [str(out / "sft.mixed.jsonl")]  # not sft.train_files
    tok = ByteTokenizer()
    assert any(b"Say something" in bytes(t - tok.OFFSET for t in row if t >= tok.OFFSET) for row in read[0][1])

    calls, records = sys.modules[module].calls, [json.loads(line) for line in kept_lines]
    assert records and len({p for p, _ in calls}) == 8
    check_records(records, calls, cfg, policy)
    report = json.loads((out / "rejection_report.json").read_text())
    total = report["total"]
    assert total["prompts"] == 8 and total["candidates"] == 48 and total["kept"] == len(records)  # 8 × 6
    assert total["truncated"] == 48 - len(calls) and total["verifier_errors"] == 0
    assert total["passing"] == sum(score(resp) >= 0.5 for _, resp in calls)
    assert total["too_long"] == sum(score(resp) >= 0.5 and len(resp) > 3 for _, resp in calls) > 0
    assert total["prompts_with_kept"] == len({r["prompt"] for r in records})
    assert total["yield"] == total["prompts_with_kept"] / 8 and total["duplicates"] > 0
    assert {d: r["prompts"] for d, r in report["domains"].items()} == {"alpha": 4, "beta": 4}
    for d, r in report["domains"].items():
        assert r["kept"] == sum(rec["provenance"]["domain"] == d for rec in records)
        assert sum(x["prompts"] for x in report["difficulty"][d].values()) == 4
        for label, x in report["difficulty"][d].items():
            assert x["kept"] == sum(
                rec["provenance"]["domain"] == d and rec["provenance"]["difficulty"] == label for rec in records
            )
    # the sft stage starts from the policy that sampled (rejection_sampling has no checkpoint); by
    # default it trains on the kept records alone
    sft_cfg = pipeline.stage_config(typed(cfg), "sft", "w", policy, sft_files="x.jsonl")
    assert sft_cfg.sft.train_files == "x.jsonl" and sft_cfg.init_from == policy
    cfg.rejection.mix_original = False
    assert (
        rejection.next_sft_files(pipeline.stage_config(typed(cfg), "rejection_sampling", "w", policy)) == "w/sft.jsonl"
    )


def test_stage_alone_other_settings(policy, user_tasks, tmp_path, monkeypatch):
    """Fewer prompts, more kept per prompt, no length filter, an output URL; a low temperature
    (sampled through continuous batching, sampling.continuous_batching)."""
    files, verifier, module = user_tasks
    out = f"memory://{tmp_path.name}/o/mine.jsonl"  # any fsspec URL (gs://, ...)
    cfg = tiny(tmp_path / "rs", files, verifier, keep_per_prompt=3, prompts=4, output=out)
    cfg.init_from = policy
    result = main.run(cfg)
    calls = sys.modules[module].calls
    read = lambda: [json.loads(line) for line in fsspec.open(out, "r").open().read().splitlines()]
    records = read()
    check_records(records, calls, cfg, policy)
    assert max(collections.Counter(r["prompt"] for r in records).values()) == 3
    assert not (tmp_path / "rs" / "sft.jsonl").exists()
    total = json.loads((tmp_path / "rs" / "rejection_report.json").read_text())["total"]
    assert total["candidates"] == 24 and total["too_long"] == 0 and result.eval["rejection/kept"] == len(records)
    # run again (a resumed pipeline): the records are there, nothing is sampled again
    n = len(calls)
    assert main.run(cfg).eval == result.eval and len(calls) == n
    # at temperature 0.05 the policy ends its turn at once (its stop logit is the largest): one empty answer each
    cfg.rejection.temperature = 0.05
    cfg.sampling.continuous_batching, cfg.sampling.num_slots = True, 8
    from posttrain.rl.rollout import worker as rollout

    slots, real = [], rollout.generate
    monkeypatch.setattr(rollout, "generate", lambda *a, **kw: slots.append(kw["slots"]) or real(*a, **kw))
    main.run(cfg)
    assert [r["response"] for r in read()] == [""] * 4 and slots and slots[0].num_slots == 8


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("prompts", 0, "config.rejection.prompts=0: expected >= 1"),
        ("samples_per_prompt", -1, "config.rejection.samples_per_prompt=-1: expected >= 1"),
        ("keep_per_prompt", 9, "rejection.keep_per_prompt=9: at most rejection.samples_per_prompt=6"),
        ("min_score", float("nan"), "config.rejection.min_score=nan: expected a finite number"),
        ("max_tokens", -2, "config.rejection.max_tokens=-2: expected >= 0"),
        ("max_tokens", 10, "rejection.max_tokens=10 cannot take effect"),
        ("temperature", -0.5, "config.rejection.temperature=-0.5: expected >= 0"),
        ("temperature", 0.0, "rejection.temperature=0 (greedy)"),
        ("output", "out.txt", "rejection.output='out.txt': expected a .jsonl path"),
        ("mix_original", True, "rejection.mix_original=True mixes in sft.train_files"),
    ],
)
def test_bad_values_fail_at_start_up_naming_the_key(key, value, message, tmp_path):
    cfg = tiny(tmp_path / "bad", "", "")
    cfg.rejection[key] = value
    with pytest.raises(ValueError, match="^" + re.escape(message)):
        checked(cfg)
    with pytest.raises(Exception, match="rejection"):  # main checks before anything compiles
        main.run(cfg)
    cfg.stage, cfg.pipeline.stages = "pipeline", ("sft", "rejection_sampling", "sft")
    with pytest.raises(Exception, match="rejection"):
        main.run(cfg)
    assert not (tmp_path / "bad" / "0_sft").exists()


def test_tool_episodes_are_refused_at_start_up(tmp_path):
    """Candidates are single-turn answers: a multi-turn env would be scored on its first turn alone."""
    cfg = tiny(tmp_path / "tool", "", "")
    cfg.rl.env = "tool"
    with pytest.raises(ValueError, match=r"^rl.env='tool': stage rejection_sampling samples one answer"):
        checked(cfg)
    with pytest.raises(UserError, match="rl.env='tool'") as e:  # main names the key before anything compiles
        main.run(cfg)
    assert e.value.key == "rl.env" and not (tmp_path / "tool" / "sft.jsonl").exists()


def test_mix_original_reads_generated_sft_data(tmp_path):
    """sft.train_files='synthetic:' (the quickstart's) is generated as the sft stage would, then mixed in."""
    cfg = tiny(tmp_path / "mix", "", "", mix_original=True)
    cfg.data.synthetic, cfg.data.synthetic_size, cfg.sft.train_files = "arithmetic", 6, "synthetic:"
    checked(cfg)
    sub = rejection.original_sft_files(typed(cfg), ByteTokenizer())
    assert sub.sft.train_files.startswith(str(tmp_path / "mix" / "synthetic" / "arithmetic_sft_train_n6"))
    assert (
        cfg.sft.train_files == "synthetic:" and len(list((tmp_path / "mix" / "synthetic").iterdir())) == 1
    )  # no eval split
    records = list(rejection.original_sft_records(sub))
    assert len(records) == 6 and all(r.get("messages") or r.get("prompt") for r in records)


def test_bad_gate_fails_at_start_up(tmp_path):
    cfg = tiny(tmp_path / "gate", "", "")
    cfg.rejection.gate = "rejection/yield >> 1"
    with pytest.raises(Exception, match="config.rejection.gate"):
        main.run(cfg)


def test_pipeline_chain_sft_rejection_sampling_sft_rlvr(tmp_path, monkeypatch):
    """Which policy and data each stage of ("sft", "rejection_sampling", "sft", "rlvr") gets (stages faked)."""
    from posttrain.core.harness import Result

    seen = []

    def fake(name):
        def run(cfg):
            seen.append((name, cfg.init_from, cfg.sft.train_files))
            return Result(None, None, [], {})

        return run

    monkeypatch.setattr(pipeline, "run_stage", lambda name, cfg, baseline=None: fake(name)(cfg))
    monkeypatch.setattr(pipeline, "plot", lambda *a: "")
    cfg = tiny(tmp_path, "", "")
    cfg.stage, cfg.pipeline.stages, cfg.init_from = "pipeline", ("sft", "rejection_sampling", "sft", "rlvr"), "base"
    cfg.sft.train_files = "orig.jsonl"
    pipeline.run(typed(cfg))
    w = str(tmp_path)
    assert seen == [
        ("sft", "base", "orig.jsonl"),
        ("rejection_sampling", f"{w}/0_sft", "orig.jsonl"),
        ("sft", f"{w}/0_sft", f"{w}/1_rejection_sampling/sft.jsonl"),
        ("rlvr", f"{w}/2_sft", "orig.jsonl"),
    ]
    seen.clear()
    cfg.rejection.mix_original, cfg.rejection.output = True, "gs://bucket/rs/data.jsonl"
    pipeline.run(typed(cfg))
    assert seen[2] == ("sft", f"{w}/0_sft", "gs://bucket/rs/data.mixed.jsonl")
