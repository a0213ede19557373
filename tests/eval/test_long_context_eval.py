"""Long-context evals: generated problems (deterministic, at the asked length and depth, exact
answers, evaluation names disjoint from training data) and the grid evaluation's accounting."""

import json
import re

import numpy as np
import pytest

from posttrain.config import base_config
from posttrain.data.tokenizer import load_tokenizer
from posttrain.eval import long_context_eval
from posttrain.eval.long_context import (
    generate_problem,
    is_correct,
    multihop,
    names,
    needle,
    recall,
    recall_facts,
    recall_key_split,
    recall_keys,
)
from posttrain.eval.long_context_train import dense_recall_facts, training_records
from tests.support.typed_configs import typed

FACT = re.compile(r"The code of (\w+) is (?:(-?\d+)|the code of (\w+) (plus|minus) (\d+))\.")


def solve_multihop(prompt: str) -> str:
    """Reference solver: read every code fact, resolve the asked name through the chain."""
    facts = {m.group(1): m.groups()[1:] for m in FACT.finditer(prompt)}
    asked = re.search(r"What is the code of (\w+)\?", prompt).group(1)

    def value(name):
        base, prev, sign, step = facts[name]
        return int(base) if base else value(prev) + (int(step) if sign == "plus" else -int(step))

    return str(value(asked))


@pytest.mark.parametrize("length", [200, 1000, 4000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 1.0])
def test_problems_have_the_asked_length_depth_and_answer(length, depth):
    p = needle(length, depth, index=3)
    assert p == needle(length, depth, index=3)  # deterministic
    assert p.prompt != needle(length, depth, index=4).prompt
    n = len(p.prompt.encode())
    assert length - 60 < n <= length  # within one filler sentence
    fact = re.search(r"The magic number of \w+ is (\d+)\.", p.prompt)
    assert fact.group(1) == p.answer and p.prompt.count("magic number") == 2
    context = p.prompt.rsplit("\n", 1)[0]
    assert abs(fact.start() / len(context) - depth) < 0.1 + 60 / length
    hops = 4 if length >= 1000 else 2
    q = multihop(length, depth, hops=hops, index=1)
    assert solve_multihop(q.prompt) == q.answer
    assert len(q.fact_depths) == hops and q.fact_depths[0] == pytest.approx(depth, abs=0.1 + 60 / length)
    assert length - 60 < len(q.prompt.encode()) <= length


def test_too_short_is_an_error():
    with pytest.raises(ValueError, match="length=100: too short"):
        multihop(100, 0.5, hops=4)


def record_text(r: dict) -> str:
    """A training record's text: its prompt, or (recall) every turn."""
    return r["prompt"] if "prompt" in r else " ".join(m["content"] for m in r["messages"])


def test_eval_names_never_occur_in_training_data():
    rng = np.random.default_rng(0)
    eval_names = set(names(rng, "eval", 300))
    train_text = " ".join(map(record_text, training_records(200, 160, 400, seed=0)))
    train_text += " ".join(map(record_text, training_records(50, 160, 400, seed=7)))
    found = set(re.findall(r"[A-Z][a-z]+", train_text))
    assert len(found) > 100 and not eval_names & found
    for i in range(50):  # and the eval problems' own names
        for p in (needle(300, 0.5, index=i), multihop(300, 0.5, index=i)):
            asked = re.search(r"of (\w+)\?", p.prompt).group(1)
            assert asked not in train_text


RECALL_FACT = re.compile(r"\b([A-Z]{3})=(\d{4})\.")


@pytest.mark.parametrize("length", [256, 1024])
@pytest.mark.parametrize("depth", [0.0, 0.5, 1.0])
def test_recall_problems(length, depth):
    p = recall(length, depth, index=5)
    assert p == recall(length, depth, index=5) and p.kind == "recall"
    facts = dict(RECALL_FACT.findall(p.prompt))
    asked = re.fullmatch(r"([A-Z]{3})=\?", p.prompt.rsplit("\n", 1)[1]).group(1)
    assert len(facts) == recall_facts(length) and facts[asked] == p.answer  # distractors, one answer
    assert length - 60 < len(p.prompt.encode()) <= length
    at = p.prompt.index(f"{asked}={p.answer}.") / len(p.prompt.rsplit("\n", 1)[0])
    assert abs(at - depth) < 0.1 + 60 / length and p.fact_depths[0] == pytest.approx(depth, abs=0.1 + 60 / length)


KV_FACT = re.compile(r"\b([A-Z]{3})(\d{4})\.")


@pytest.mark.parametrize("length", [256, 1024])
def test_kv_recall_puts_the_value_right_after_the_key(length):
    """kind kv: recall without "=" ("QZX4821.", "QZX?"), the same keys' split, its own problems."""
    p = generate_problem("kv", length, 0.5, index=5, hops=3)
    assert p.kind == "kv" and "=" not in p.prompt and p.prompt != recall(length, 0.5, index=5).prompt
    facts = dict(KV_FACT.findall(p.prompt))
    asked = re.fullmatch(r"([A-Z]{3})\?", p.prompt.rsplit("\n", 1)[1]).group(1)
    assert len(facts) == recall_facts(length) and facts[asked] == p.answer and recall_key_split(asked) == "eval"
    assert length - 60 < len(p.prompt.encode()) <= length
    [r] = training_records(1, 200, 200, seed=2, kinds=("kv",))
    msgs = r["messages"]
    facts = dict(KV_FACT.findall(msgs[0]["content"]))
    for q, a in zip(msgs[::2], msgs[1::2]):
        key = q["content"].rsplit("\n", 1)[-1].removesuffix("?")
        assert a["content"] == f"{key}{facts[key]}" and is_correct(a["content"], facts[key])  # "QZX4821"


def test_recall_density_adds_distractor_facts_and_questions():
    """training_records(recall_density=d): from recall_facts(length) up to d facts per 64 tokens per
    context (each asked while turns fit); 0 leaves the records as they were."""
    plain = training_records(60, 64, 232, seed=1, kinds=("recall",))
    assert plain == training_records(60, 64, 232, seed=1, kinds=("recall",), recall_density=0.0)
    dense = training_records(60, 64, 232, seed=1, kinds=("recall",), recall_density=4.0)
    count = lambda recs: [len(RECALL_FACT.findall(r["messages"][0]["content"])) for r in recs]
    assert all(d >= p for d, p in zip(count(dense), count(plain))) and sum(count(dense)) > 1.5 * sum(count(plain))
    assert sum(map(len, (r["messages"] for r in dense))) > sum(map(len, (r["messages"] for r in plain)))
    rng = np.random.default_rng(0)
    drawn = [dense_recall_facts(256, 4.0, rng) for _ in range(200)]
    assert min(drawn) == recall_facts(256) and max(drawn) == 16


def test_recall_keys_split_by_a_hash_of_the_key():
    """Held out by meaning: a key's split is a function of its canonical (upper-case) form, so the
    evaluation keys (about RECALL_EVAL_PERCENT of them) never occur in any training record."""
    rng = np.random.default_rng(0)
    assert all(recall_key_split(k) == "eval" for k in recall_keys(rng, "eval", 200))
    assert recall_key_split("qzx") == recall_key_split("QZX") == recall_key_split(" QZX ")
    share = np.mean([recall_key_split(a + b + "Q") == "eval" for a in "ABCDEFGHIJKLM" for b in "NOPQRSTUVWXYZ"])
    assert 0.15 < share < 0.35
    records = training_records(120, 160, 1000, seed=1, kinds=("recall",))
    text = "".join(m["content"] for r in records for m in r["messages"])
    train_keys = {k for k, _ in RECALL_FACT.findall(text)}
    assert len(train_keys) > 500 and all(recall_key_split(k) == "train" for k in train_keys)
    eval_keys = {
        re.search(r"([A-Z]{3})=\?$", recall(n, 0.5, index=i).prompt).group(1) for i in range(40) for n in (256, 1024)
    }
    assert eval_keys and not eval_keys & train_keys


def test_recall_training_records_ask_every_fact_within_the_length():
    tok = load_tokenizer("byte")
    records = training_records(40, 160, 1000, seed=3, kinds=("recall",), count=lambda s: len(tok.encode(s)))
    # contexts as long as evaluated ones are trained too (the first turn is an evaluation problem's
    # shape at its length), with fewer questions when fewer fit
    assert max(len(r["messages"][0]["content"]) for r in records) > 900
    asked_all = [len(r["messages"]) // 2 == len(RECALL_FACT.findall(r["messages"][0]["content"])) for r in records]
    assert any(asked_all) and not all(asked_all) and max(len(r["messages"]) for r in records) >= 8
    for r in records:
        msgs = r["messages"]
        ids, trainable = tok.encode_chat(msgs)
        assert len(ids) <= 1000 + 8  # the turns fit the drawn length (+ chat markers)
        facts = dict(RECALL_FACT.findall(msgs[0]["content"]))
        asked = [m["content"].rsplit("\n", 1)[-1][:3] for m in msgs[::2]]
        assert set(asked) <= set(facts) and [m["content"] for m in msgs[1::2]] == [f"{k}={facts[k]}" for k in asked]
        assert all(is_correct(m["content"], facts[k]) for m, k in zip(msgs[1::2], asked))  # the number is checked


def test_exact_answer_check():
    assert is_correct("4821", "4821") and is_correct(" 4821.", "4821") and is_correct("It is -3", "-3")
    assert not is_correct("482", "4821") and not is_correct("48210", "4821") and not is_correct("", "1")


def lc_config(**kw):
    lc = base_config().eval.long_context
    lc.update(lengths="192,256", depths="0,1", samples=3, max_new_tokens=4, **kw)
    return lc


def test_grid_accuracy_accounting(monkeypatch):
    """Accuracy per cell and the means come from the exact check of what the sampler returned:
    an oracle answering only deep needles and short multi-hop problems scores exactly that."""
    tok = load_tokenizer("byte")
    calls, sizes = [], []
    monkeypatch.setattr(long_context_eval, "CALL_PROMPTS", 4)  # 6 problems per length: calls of 4 and 2

    def fake_generate(graphdef, params, rest, prompts, sampling, key, *, pad_id):
        calls.append(max(map(len, prompts)))
        sizes.append(len(prompts))
        texts = [tok.decode(p) for p in prompts]
        answers = []
        for t in texts:
            if "magic number" in t:
                num = re.search(r"magic number of \w+ is (\d+)", t)
                answers.append(num.group(1) if num.start() > t.rfind("\n") / 2 else "0")
            else:
                answers.append(solve_multihop(t) if len(t) < 200 else "x")
        return _Samples([tok.encode(a) for a in answers])

    monkeypatch.setattr(long_context_eval, "generate", fake_generate)
    monkeypatch.setattr(long_context_eval.nnx, "split", lambda model, *a: (None, None, None))
    rows = long_context_eval.evaluate(object(), tok, lc_config(), step=7)
    assert len(rows) == 2 * 2 * 2 and all(r["n"] == 3 and r["step"] == 7 for r in rows)
    assert all(r["prompt_tokens"] <= r["length"] for r in rows) and max(calls) <= 256
    assert sizes == [4, 2] * 4  # each (kind, length) in sampler calls of at most CALL_PROMPTS
    acc = {(r["kind"], r["length"], r["depth"]): r["accuracy"] for r in rows}
    assert acc == {
        ("needle", 192, 0.0): 0.0,
        ("needle", 192, 1.0): 1.0,
        ("needle", 256, 0.0): 0.0,
        ("needle", 256, 1.0): 1.0,
        ("multihop", 192, 0.0): 1.0,
        ("multihop", 192, 1.0): 1.0,
        ("multihop", 256, 0.0): 0.0,
        ("multihop", 256, 1.0): 0.0,
    }
    s = long_context_eval.summarize(rows)
    assert s["long_ctx_needle"] == 0.5 and s["long_ctx_multihop"] == 0.5 and s["long_ctx_multihop/len192"] == 1.0


class _Samples:
    def __init__(self, completions):
        self.completions = completions

    def completion(self, i):
        return self.completions[i]


@pytest.mark.parametrize(
    "key, value, why",
    [
        ("lengths", "0,12", "positive"),
        ("depths", "0,1.5", r"\[0, 1\]"),
        ("kinds", "needle,haystack", "subset"),
        ("lengths", "a", "integers"),
    ],
)
def test_bad_grid_names_the_key(key, value, why):
    lc = lc_config()
    lc[key] = value
    with pytest.raises(ValueError, match=rf"eval\.long_context\.{key}=.*{why}"):
        long_context_eval.parse_grid(lc)


def test_heat_map_and_jsonl(tmp_path):
    rows = [
        {"kind": k, "length": n, "depth": d, "accuracy": a, "n": 1, "correct": int(a), "prompt_tokens": n, "step": 3}
        for k in ("needle", "multihop")
        for n in (128, 256)
        for d, a in ((0.0, 0.0), (1.0, 1.0))
    ]
    long_context_eval.write_rows(rows, str(tmp_path / "lc.jsonl"))
    assert [json.loads(line) for line in open(tmp_path / "lc.jsonl")] == rows
    out = long_context_eval.plot_heatmaps(rows, str(tmp_path / "lc.png"), "t")
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_stages_that_cannot_generate_refuse_the_eval():
    from posttrain.stages import lm, reward_model

    cfg = base_config()
    cfg.eval.long_context.lengths = "256"
    for run in (reward_model.run, lm.run):
        with pytest.raises(ValueError, match=r"eval\.long_context\.lengths"):
            run(typed(cfg))


def test_wilson_interval_and_effective_context():
    """Effective context: the longest length up to which accuracy (pooled over depths, the newest
    step) stays >= 90%; a dip at a shorter length ends it. Intervals: Wilson, sensible at 0 and n."""
    assert long_context_eval.wilson_interval(0, 50) == (0.0, pytest.approx(0.0713, abs=1e-3))
    lo, hi = long_context_eval.wilson_interval(45, 50)
    assert lo == pytest.approx(0.786, abs=1e-3) and hi == pytest.approx(0.957, abs=1e-3)
    assert long_context_eval.wilson_interval(50, 50)[1] == 1.0

    def row(length, depth, correct, step=2, kind="kv"):
        return {"kind": kind, "length": length, "depth": depth, "correct": correct, "n": 50, "step": step}

    rows = [row(256, 0, 50), row(256, 1, 44), row(512, 0, 46), row(512, 1, 45), row(1024, 0, 20), row(1024, 1, 50)]
    rows += [row(256, 0, 0, step=1), row(256, 0, 0, kind="multihop")]  # an older step, another kind
    assert long_context_eval.accuracy_by_length(rows, "kv") == {256: (94, 100), 512: (91, 100), 1024: (70, 100)}
    assert long_context_eval.effective_context(rows, "kv") == 512
    assert long_context_eval.effective_context(rows, "kv", threshold=0.5) == 1024
    dip = [row(256, 0, 40), row(512, 0, 50)]  # below at 256: nothing is usable, whatever comes after
    assert (
        long_context_eval.effective_context(dip, "kv") == 0 and long_context_eval.effective_context(rows, "needle") == 0
    )
