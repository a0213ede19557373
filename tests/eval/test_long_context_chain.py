"""Two-hop key-value chains (kind `kvchain`, posttrain/eval/long_context.py): determinism,
answers a reference solver reads off the text, held-out keys (intermediate hops included) absent
from every training record, exact verifiers, and completions a policy could try scoring 0."""

from __future__ import annotations

import importlib.util
import json
import re
import runpy

import numpy as np
import pytest

from posttrain.config import base_config
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.eval.long_context import chain_count, chain_problems, generate_problem, is_correct, recall_key_split
from posttrain.eval.long_context_train import training_records
from posttrain.rl.algo.learner import rl_batch
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.tasks.scheduler import Group
from posttrain.rl.verifiers.math import MathTask, MathVerifier
from tests.support.paths import ROOT

_spec = importlib.util.spec_from_file_location("long_context_tasks", ROOT / "tools" / "long_context_tasks.py")
tasks_tool = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(tasks_tool)

KEY = r"(?<![A-Z])[A-Z]{3}(?![A-Z])"


def keys_in(text: str) -> set[str]:
    """Every three-capital key a text mentions."""
    return set(re.findall(KEY, text))


def solve(prompt: str) -> tuple[str, list[str]]:
    """Follow the asked key's pointers through the context's facts ("A>B.", "B1234."), parsed
    from the text alone: (value, keys visited)."""
    context, question = prompt.rsplit("\n", 1)
    pointers = dict(re.findall(rf"({KEY})>({KEY})\.", context))
    values = dict(re.findall(rf"({KEY})(\d+)\.", context))
    key, seen = question.removesuffix("?"), []
    while key in pointers:
        seen.append(key)
        key = pointers[key]
    seen.append(key)
    return values[key], seen


def test_problems_are_deterministic_and_solvable_from_the_text_alone():
    for hops in (1, 2, 3):
        for index in range(12):
            p = generate_problem("kvchain", 512, (index % 5) / 4, index=index, hops=hops)
            assert p == generate_problem("kvchain", 512, (index % 5) / 4, index=index, hops=hops)
            value, seen = solve(p.prompt)
            assert value == p.answer and len(seen) == hops
            assert p.response == ">".join(seen) + value  # the training answer writes the chain
            assert len(p.prompt.encode()) <= 512
            assert len(keys_in(p.prompt)) == chain_count(512) * hops  # distinct keys, every chain
    assert (
        generate_problem("kvchain", 512, 0.5, index=0).prompt != generate_problem("kvchain", 512, 0.5, index=1).prompt
    )
    assert generate_problem("kvchain", 512, 0.5, seed=1).prompt != generate_problem("kvchain", 512, 0.5).prompt


def test_every_chain_of_a_context_is_asked_and_the_first_fact_sits_at_depth():
    problems = chain_problems(1024, 0.0, hops=2, index=3)
    assert len(problems) == chain_count(1024) == 5
    assert len({p.answer for p in problems}) == 5 and len({p.prompt.rsplit("\n", 1)[1] for p in problems}) == 5
    context = problems[0].prompt.rsplit("\n", 1)[0]
    assert all(p.prompt.rsplit("\n", 1)[0] == context for p in problems)
    assert context.startswith(problems[0].response.split(">")[0] + ">")  # depth 0: the first sentence
    end = chain_problems(1024, 1.0, hops=2, index=3)[0]
    assert end.fact_depths == (1.0,)


def test_the_answer_never_follows_the_asked_key():
    """Two hops or more: the asked key is followed by ">" (a pointer), never by its answer; a
    one-hop chain is plain kv recall."""
    for index in range(30):
        p = generate_problem("kvchain", 256, 0.5, index=index, hops=2)
        key = p.prompt.rsplit("\n", 1)[1].removesuffix("?")
        assert key + p.answer not in p.prompt and re.search(rf"{key}\d", p.prompt) is None
        assert f"{key}>" in p.prompt and p.prompt.count(p.answer) == 1


def test_held_out_keys_intermediate_hops_included_occur_in_no_training_record(tmp_path):
    held_out = [
        generate_problem("kvchain", L, d, index=i, hops=h)
        for L in (256, 512)
        for d in (0, 1)
        for i in range(10)
        for h in (2, 3)
    ]
    tasks = tasks_tool.task_records("eval", 40, (256, 512), ("kvchain",), hops=2)
    eval_keys = set().union(*(keys_in(p.prompt) for p in held_out), *(keys_in(r["prompt"]) for r in tasks))
    assert len(eval_keys) > 300 and {recall_key_split(k) for k in eval_keys} == {"eval"}
    records = training_records(200, 64, 520, kinds=("kvchain", "kv"), hops=2, recall_density=2.0)
    train_tasks = tasks_tool.task_records("train", 40, (256, 512), ("kvchain",), hops=2)
    text = json.dumps(records) + json.dumps(train_tasks)
    train_keys = keys_in(text)
    assert len(train_keys) > 1000 and {recall_key_split(k) for k in train_keys} == {"train"}
    assert not eval_keys & train_keys


def test_training_conversations_ask_every_chain_with_the_chain_written_out_and_fit():
    tok = ByteTokenizer()
    records = training_records(40, 64, 520, kinds=("kvchain",), hops=2, recall_density=2.0)
    for r in records:
        msgs = r["messages"]
        context = msgs[0]["content"].rsplit("\n", 1)[0]
        for q, a in zip(msgs[::2], msgs[1::2]):
            prompt = f"{context}\n{q['content'].rsplit(chr(10), 1)[-1]}"
            value, seen = solve(prompt)
            assert a["content"] == ">".join(seen) + value
        assert len(tok.encode_chat(msgs)[0]) <= 544  # the config's train.seq_len (520 + 24)
    assert max(len(r["messages"]) // 2 for r in records) > 3  # dense contexts: several chains asked


def test_verifiers_pay_the_final_value_exactly_and_nothing_a_policy_could_try():
    p = generate_problem("kvchain", 512, 0.5, index=7, hops=2)
    key = p.prompt.rsplit("\n", 1)[1].removesuffix("?")
    middle = p.response.split(">")[1].rstrip("0123456789")
    others = [q.answer for q in chain_problems(512, 0.5, hops=2, index=7)[1:]]
    verifier, task = MathVerifier(), MathTask(p.answer)
    right = [p.response, p.answer, f"{key}>{middle} {p.answer}"]
    wrong = [
        f"{key}?",  # restating the question
        f"{key}>{middle}",  # the first hop alone
        p.response[:-1],  # a digit short
        p.response + "0",  # a digit long
        f"{key}>{middle}{others[0]}",  # another chain's value
        ", ".join([p.answer, *others]),  # every value of the context
        "",
    ]
    for text in right:
        assert is_correct(text, p.answer) and verifier.verify(task, text).correct == 1.0, text
    for text in wrong:
        assert verifier.verify(task, text).correct == 0.0, text
    assert not any(is_correct(t, p.answer) for t in wrong[:5])


def test_synthetic_long_context_data_and_rl_tasks_carry_the_chain_kind(tmp_path):
    from posttrain.stages.data_files import _long_context_file

    cfg = base_config()
    cfg.train.seq_len, cfg.data.synthetic_size = 300, 16
    cfg.eval.long_context.kinds, cfg.eval.long_context.hops = "kvchain,kv", 2
    path = _long_context_file(cfg, str(tmp_path), "train", ByteTokenizer(), True)
    records = [json.loads(line) for line in open(path)]
    assert len(records) == 16 and ">" in records[0]["messages"][1]["content"]
    assert re.fullmatch(r"[A-Z]{3}\d{4}", records[1]["messages"][1]["content"])  # kv alternates
    tasks_tool.main(
        ["--out", str(tmp_path / "t"), "--kinds", "kvchain", "--lengths", "256", "--train", "4", "--eval", "4"]
    )
    task = json.loads(open(tmp_path / "t" / "eval.jsonl").readline())
    assert task["domain"] == "long_context_kvchain" and solve(task["prompt"])[0] == task["answer"]


def test_long_context_eval_accepts_the_chain_kind():
    from posttrain.eval.long_context_eval import parse_grid

    lc = base_config().eval.long_context
    lc.kinds, lc.lengths = "kvchain,multihop", "512"
    assert parse_grid(lc)["kinds"] == ["kvchain", "multihop"]
    with pytest.raises(ValueError, match="kinds"):
        lc.kinds = "chain"
        parse_grid(lc)


HOPS = runpy.run_path(str(ROOT / "configs" / "long_context_hops.py"))
RECALL = runpy.run_path(str(ROOT / "configs" / "long_context_recall.py"))


def test_hops_config_trains_then_runs_rl_on_long_prompts_split_over_the_sequence(tmp_path, monkeypatch):
    """configs/long_context_hops.py: SFT (`:warm`, a constant lr after warm-up) on kvchain + kv up to 544
    tokens from the kv model extended to 1024 (its shapes and RoPE scaling), `:anneal` from its end
    (the lr decayed), then `:rl` from the anneal's end on 512-token kvchain task files with
    `mesh.sequence = 2` and continuous batching."""
    from posttrain.config import run_config
    from posttrain.stages.checks import check_run
    from posttrain.stages.common import run_max_context
    from tests.support.typed_configs import typed

    monkeypatch.chdir(tmp_path)
    sft, anneal, rl = (HOPS["get_config"](mode) for mode in ("warm", "anneal", "rl"))
    extended = RECALL["get_config"]("extend:llama3")
    assert sft.init_from == extended.workdir and HOPS["get_config"]("more").init_from == HOPS["get_config"]().workdir
    assert sft.model.to_dict() == extended.model.to_dict()  # the checkpoint's shapes and RoPE scaling
    assert sft.stage == "sft" and sft.eval.long_context.kinds == "kvchain,kv" and sft.eval.long_context.hops == 2
    tasks_tool.main(["--out", HOPS["TASKS"], "--kinds", "kvchain", "--lengths", "512", "--train", "2", "--eval", "2"])
    for cfg in (sft, anneal, rl):
        check_run(run_config(cfg))
    assert anneal.init_from == sft.workdir != anneal.workdir and anneal.model.to_dict() == sft.model.to_dict()
    assert sft.optim.min_lr_ratio == 1.0 > anneal.optim.min_lr_ratio and anneal.train.steps < sft.train.steps
    assert rl.stage == "rlvr" and rl.init_from == anneal.workdir != rl.workdir and rl.mesh.sequence == 2
    assert rl.optim.min_lr_ratio == 0.1  # RL's schedule as measured (cosine over rl.steps), not :warm's constant lr
    assert rl.sampling.continuous_batching and rl.model.to_dict() == sft.model.to_dict()
    prompt = json.loads(open(f"{HOPS['TASKS']}/eval.jsonl").readline())["prompt"]
    need = len(ByteTokenizer().encode_chat([{"role": "user", "content": prompt}], add_generation_prompt=True)[0])
    assert need + rl.rl.max_new_tokens <= run_max_context(typed(sft))  # RL prompts within the SFT context
    longest = Trajectory("t", [1] * (need + rl.rl.max_new_tokens), [False] * need + [True] * rl.rl.max_new_tokens, need)
    rows = rl_batch(
        [Rollout(Group("d", None, [0.0], [longest]), 0, [np.zeros(len(longest.tokens))])],
        pad_id=0,
        sequence_shards=rl.mesh.sequence,
        seq_bucket=rl.rl.seq_bucket,
    )
    assert len(longest.tokens) - 1 <= rows["inputs"].shape[1] < 1024  # learner rows of 576 tokens, not 1024
    with pytest.raises(ValueError, match="expected one of"):
        HOPS["get_config"]("ppo")
