"""Held-out evaluation sets are disjoint from all training data, by construction, for every
built-in domain (issue 11 item 8): the quickstart's arithmetic (RL tasks, SFT and preference files,
the lm task), GSM8K test vs train, HumanEval's reserved problems. Arithmetic is held out by meaning
(issue 25 item 4): every equivalent surface form of a problem ('48+37', '37 + 48') is in one split,
and the sets are compared by canonical form, never by spelling."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path

import pytest

from posttrain.data.synthetic import (
    arithmetic_canonical,
    arithmetic_lm_batch,
    arithmetic_problem_count,
    arithmetic_problems,
    arithmetic_split,
    canonical_text,
    ensure_arithmetic_file,
)
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.tasks.domains import gsm8k_tasks, humaneval_tasks, shared_data_dir
from posttrain.rl.tasks.registry import make_domains
from posttrain.stages.data_files import resolve_data_files
from tests.support.paths import ROOT
from tests.support.typed_configs import typed

PROBLEM = re.compile(r"What is (\d+[+-]\d+)\?")


def quickstart_config(tmp_path):
    cfg = runpy.run_path(str(ROOT / "configs/quickstart.py"))["get_config"]()
    cfg.workdir = str(tmp_path)
    for stage in ("sft", "reward_model", "dpo"):
        cfg[stage].train_files = cfg[stage].eval_files = "synthetic:"
    return typed(cfg)


def problems(path: Path) -> list[str]:
    return [PROBLEM.match(json.loads(line)["prompt"]).group(1) for line in path.read_text().splitlines()]


def spellings(q: str) -> list[str]:
    """Equivalent surface forms of a generated problem ('37+48='): spaced, zero-padded, without
    '=', full-width, with a unicode minus, and (additions) commuted."""
    a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", q).groups()
    forms = [q, q[:-1], f" {a} {op} {b} = ", f"0{a}{op}00{b}", q.translate(FULLWIDTH), q.replace("-", "\u2212")]
    if op == "+":
        forms += [f"{b}+{a}=", f"{b} + {a}", f"{b}+{a}".translate(FULLWIDTH)]
    return forms


FULLWIDTH = str.maketrans("0123456789+-=", "０１２３４５６７８９＋－＝")


@pytest.mark.parametrize("max_value, problems, held_out", [(29, 930, 130), (99, 10100, 1496)])
def test_every_form_of_a_problem_is_in_one_split(max_value, problems, held_out):
    """Every problem the generator can draw, at the quickstart's operands (0-29) and the default
    (0-99): each equivalent spelling has the split of the others (literal hashing put 86 of the
    133 held-out problems at 0-29 in the test split while their commuted twin trained)."""
    by_meaning: dict[str, set[str]] = {}
    for q in arithmetic_problems(max_value):
        splits = {arithmetic_split(form) for form in spellings(q)}
        assert len(splits) == 1, (q, {form: arithmetic_split(form) for form in spellings(q)})
        assert {arithmetic_canonical(form) for form in spellings(q)} == {arithmetic_canonical(q)}, q
        by_meaning.setdefault(arithmetic_canonical(q), set()).add(splits.pop())
    assert all(len(s) == 1 for s in by_meaning.values())
    test = [c for c, s in by_meaning.items() if s == {"test"}]
    assert (len(by_meaning), len(test)) == (problems, held_out)
    assert arithmetic_problem_count(max_value) == problems
    assert arithmetic_problem_count(max_value, "test") == held_out
    assert arithmetic_problem_count(max_value, "train") == problems - held_out


def test_canonical_text_sorts_only_what_commutes():
    assert canonical_text("What is 48 + 37 ?") == canonical_text("what is 37+48?") == "what is 37+48?"
    assert canonical_text("3 × 2 * 1") == "1*2*3"
    assert canonical_text("48 \u2212 37") == "48-37" != canonical_text("37-48")
    # part of a longer expression or token: the order stays (sorting would change the value)
    for text in ("-5+3", "7-2+1", "x-2+1", "4+3*x", "2+3^2", "1,000+2", "x2+3"):
        assert canonical_text(text) == text, text
    assert canonical_text("(3+2)*4") == "(2+3)*4"


def test_arithmetic_eval_problems_are_in_no_training_data(tmp_path):
    cfg = quickstart_config(tmp_path)
    domains, held_out = make_domains(cfg, ByteTokenizer(), None)
    evals = [arithmetic_canonical(PROBLEM.match(t.prompt[0]["content"]).group(1)) for _, t in held_out]
    assert len(evals) == len(set(evals)) == cfg.rl.eval_size  # distinct problems, by meaning
    assert {arithmetic_split(q) for q in evals} == {"test"}
    train = {PROBLEM.match(t.prompt[0]["content"]).group(1) for t in domains["arithmetic"].tasks}
    cfg = resolve_data_files(cfg, "sft", "sft")
    cfg = resolve_data_files(cfg, "dpo", "preference")
    sft, preference = set(problems(Path(cfg.sft.train_files))), set(problems(Path(cfg.dpo.train_files)))
    lm = {
        q
        for step in range(20)
        for row in arithmetic_lm_batch(0, step, 8, 128)["inputs"]
        for q in re.findall(r"(?:^|;)(\d+[+-]\d+)=", bytes(row.astype("uint8")).decode())
    }
    for name, data in (("rl", train), ("sft", sft), ("preference", preference), ("lm", lm)):
        assert data and not {arithmetic_canonical(q) for q in data} & set(evals), name
    assert {arithmetic_split(q) for q in set(problems(Path(cfg.sft.eval_files)))} == {"test"}
    assert cfg.rl.eval_size <= arithmetic_problem_count(cfg.data.synthetic_max_value, "test")


def test_stale_generated_file_with_held_out_problems_is_refused(tmp_path):
    path = tmp_path / "old.jsonl"
    test_problem = next(f"{a}+{b}" for a in range(50) for b in range(50) if arithmetic_split(f"{a}+{b}") == "test")
    path.write_text(
        json.dumps({"prompt": "What is 1+1?"}) + "\n" + json.dumps({"prompt": f"What is {test_problem}?"}) + "\n"
    )
    with pytest.raises(ValueError, match=f"old.jsonl:2: problem '{re.escape(test_problem)}' belongs to .*'test'"):
        ensure_arithmetic_file(str(path), "sft", 10, seed=0, split="train")


def test_gsm8k_train_drops_test_questions(tmp_path):
    (tmp_path / "gsm8k").mkdir()
    rows = lambda qs: "".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in qs)
    (tmp_path / "gsm8k" / "train.jsonl").write_text(rows(["A  question?", "Another one?"]))
    (tmp_path / "gsm8k" / "test.jsonl").write_text(rows(["a question?"]))
    assert [t.id for t in gsm8k_tasks(str(tmp_path), split="train")] == ["gsm8k/train:2"]
    assert [t.id for t in gsm8k_tasks(str(tmp_path), split="test")] == ["gsm8k/test:1"]


def test_gsm8k_and_humaneval_eval_sets_are_disjoint_from_training(tmp_path, monkeypatch):
    data = shared_data_dir()
    if not Path(data, "gsm8k", "test.jsonl").exists() or not Path(data, "humaneval", "HumanEval.jsonl.gz").exists():
        pytest.skip(f"shared data folder {data} is absent (set POSTTRAIN_DATA to it)")
    cfg = quickstart_config(tmp_path).replace({"rl.domains": "gsm8k,humaneval", "rl.eval_size": 10_000})
    domains, held_out = make_domains(cfg, ByteTokenizer(), None)
    norm = lambda t: " ".join(t.prompt[0]["content"].lower().split())
    gsm_eval = {norm(t) for d, t in held_out if d == "gsm8k"}
    assert len(gsm_eval) == 1319 and not gsm_eval & {norm(t) for t in domains["gsm8k"].tasks}
    he_eval = {t.id for d, t in held_out if d == "humaneval"}
    he_train = {t.id for t in domains["humaneval"].tasks}
    assert not he_eval & he_train and len(he_eval | he_train) == 164 and len(he_eval) == 40
    assert he_eval == {t.id for t in humaneval_tasks(split="test")}


def test_reasoning_gym_eval_sets_are_disjoint_from_training_by_meaning(tmp_path, caplog):
    """rg:<dataset> domains (issue 44 item 4): train and held-out draw from disjoint seed ranges, and
    a training task that means a held-out one ('4 + 3' is '3 + 4'; the same animals in another
    order) is left out. Small problem spaces (curriculum level 0) make such draws common."""
    pytest.importorskip("reasoning_gym")
    from posttrain.rl.tasks.rg_domain import meaning

    a = {"question": "", "answer": "7", "metadata": {"expression": "4 + 3"}}
    b = {"question": "", "answer": "7", "metadata": {"expression": "3+4"}}
    assert (
        meaning("chain_sum", a)
        == meaning("chain_sum", b)
        != meaning("chain_sum", {**b, "metadata": {"expression": "4-3"}})
    )
    legs = [{"metadata": {"animals": dict(pairs)}} for pairs in ([("cow", 2), ("duck", 1)], [("duck", 1), ("cow", 2)])]
    assert meaning("leg_counting", legs[0]) == meaning("leg_counting", legs[1])
    names = ("chain_sum", "leg_counting", "count_bits", "gcd")
    cfg = quickstart_config(tmp_path).replace(
        {"rl.domains": ",".join(f"rg:{n}" for n in names), "rl.arithmetic_size": 300, "rl.eval_size": 40}
    )
    cfg = cfg.replace({"rl.curriculum.rg_levels": "0"})
    domains, held_out = make_domains(cfg, ByteTokenizer(), None)
    for name in names:
        evals = [meaning(name, t.target.entry) for d, t in held_out if d == f"rg:{name}"]
        train = {meaning(name, t.target.entry) for t in domains[f"rg:{name}"].tasks}
        assert len(evals) == len(set(evals)) > 0, name  # distinct by meaning
        assert train and not train & set(evals), name
    assert re.search(r"rg:chain_sum train: left out \d+ tasks that mean a held-out task", caplog.text)


@pytest.mark.parametrize("rejected", ["answer", "working"])
def test_preference_pairs_reject_a_stated_answer_or_a_wrong_working(rejected, tmp_path):
    """data.synthetic_rejected: the rejected response keeps the right working and states another
    answer ("answer", a consistency preference), or works the sum out to that wrong answer
    ("working", an arithmetic one); the chosen response is right either way."""
    cfg = quickstart_config(tmp_path).replace({"data.synthetic_rejected": rejected})
    path = Path(resolve_data_files(cfg, "dpo", "preference").dpo.train_files)
    pairs = [json.loads(line) for line in path.read_text().splitlines()]
    worked = re.compile(r"(\d+)([+-])(\d+)=(-?\d+)\. The answer is (-?\d+)\.")
    for pair in pairs:
        a, op, b, work, answer = worked.fullmatch(pair["rejected"]).groups()
        right = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert int(answer) != right and pair["chosen"] == f"{a}{op}{b}={right}. The answer is {right}."
        assert int(work) == (right if rejected == "answer" else int(answer))
    with pytest.raises(ValueError, match="data.synthetic_rejected='working' cannot take effect"):
        cfg.replace({"data.synthetic": "", "data.synthetic_rejected": "working"})
    if rejected == "working":  # a run without a preference stage does not read it
        with pytest.raises(ValueError, match="cannot take effect: no stage of this run \\(sft\\)"):
            cfg.replace({"stage": "sft"}).check_stages()
