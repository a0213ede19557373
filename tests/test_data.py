"""Data layer: tokenizers, chat masks, packing, JSONL sources, grain pipelines and their state."""

import json
import logging
import re
import uuid
from pathlib import Path

import fsspec
import numpy as np
import pytest

from posttrain.data.examples import RecordError, preference_example, rl_prompt_example, sft_example
from posttrain.data.packing import pack_examples, pad_example
from posttrain.data.pipeline import preference_batches, read_jsonl, rl_prompt_batches, sft_batches
from posttrain.data.sources import DataError, SkipLog
from posttrain.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from tests.support.hf import CHATML, make_hf_folder

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared/data"
BYTE = ByteTokenizer()
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4, naïvely"},
    {"role": "user", "content": "and 3+3?"},
    {"role": "assistant", "content": "6"},
]


def write_jsonl(lines, name="data.jsonl") -> str:
    """Write lines (dicts are JSON-encoded, strings written as they are) to a fresh memory:// file."""
    path = f"memory://{uuid.uuid4().hex}/{name}"
    with fsspec.open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def trainable_runs(ids, mask) -> list[list[int]]:
    """The maximal runs of consecutive trainable tokens."""
    runs, current = [], []
    for i, m in zip(ids, mask):
        if m:
            current.append(int(i))
        elif current:
            runs, current = runs + [current], []
    return runs + [current] if current else runs


# --- tokenizers -------------------------------------------------------------------------------


def test_byte_tokenizer_round_trip_and_chat_mask():
    text = "héllo, wörld ✓\n"
    assert BYTE.decode(BYTE.encode(text)) == text
    assert BYTE.vocab_size <= 272 and BYTE.pad_id == 0
    assert max(BYTE.encode("\xff")) < BYTE.vocab_size
    ids, mask = BYTE.encode_chat(CHAT)
    assert ids[0] == BYTE.bos_id and len(ids) == len(mask)
    eos = BYTE.eos_id
    assert trainable_runs(ids, mask) == [BYTE.encode("4, naïvely") + [eos], BYTE.encode("6") + [eos]]
    prompt, prompt_mask = BYTE.encode_chat(CHAT[:2], add_generation_prompt=True)
    assert ids[: len(prompt)] == prompt and not any(prompt_mask)
    with pytest.raises(ValueError, match="role='robot'"):
        BYTE.encode_chat([{"role": "robot", "content": "x"}])


@pytest.fixture(scope="module")
def hf_tok() -> HFTokenizer:
    root = make_hf_folder(
        f"memory://{uuid.uuid4().hex}/tok",
        {
            "eos_token": {"content": "<|im_end|>", "special": True},
            "pad_token": "<|endoftext|>",
            "chat_template": CHATML,
        },
    )
    return load_tokenizer(root)


def test_hf_tokenizer_applies_chat_template(hf_tok):
    assert hf_tok.decode(hf_tok.encode("What is 2+2? naïvely")) == "What is 2+2? naïvely"
    assert hf_tok.eos_id == hf_tok.encode("<|im_end|>")[0] and hf_tok.bos_id is None
    assert hf_tok.pad_id == hf_tok.encode("<|endoftext|>")[0]
    ids, mask = hf_tok.encode_chat(CHAT)
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT)
    assert ids == hf_tok.encode(rendered)
    eos = hf_tok.eos_id
    assert trainable_runs(ids, mask) == [hf_tok.encode("4, naïvely") + [eos], hf_tok.encode("6") + [eos]]
    prompt, _ = hf_tok.encode_chat(CHAT[:2], add_generation_prompt=True)
    assert prompt == ids[: len(prompt)]
    assert prompt[-len(hf_tok.encode("<|im_start|>assistant\n")) :] == hf_tok.encode("<|im_start|>assistant\n")


def test_hf_template_errors_and_plain_fallback(tmp_path):
    strict = CHATML.replace(
        "{% for",
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversations must start with a user turn') }}{% endif %}{% for",
        1,
    )
    tok = load_tokenizer(make_hf_folder(str(tmp_path / "strict"), {"eos_token": "<|im_end|>", "chat_template": strict}))
    with pytest.raises(RecordError, match="'messages': chat template: Conversations must start"):
        sft_example({"messages": CHAT}, tok)
    tagged = (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
        "{% endgeneration %}{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    tok = load_tokenizer(make_hf_folder(str(tmp_path / "tagged"), {"eos_token": "<|im_end|>", "chat_template": tagged}))
    ids, mask = tok.encode_chat(CHAT)
    assert ids == tok.encode("".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CHAT))
    assert trainable_runs(ids, mask) == [tok.encode("4, naïvely<|im_end|>"), tok.encode("6<|im_end|>")]
    plain = load_tokenizer(make_hf_folder(str(tmp_path / "plain"), {"eos_token": "<|endoftext|>"}))
    ids, mask = plain.encode_chat(CHAT[1:3])
    assert ids == plain.encode("2+2?4, naïvely<|endoftext|>")
    assert trainable_runs(ids, mask) == [plain.encode("4, naïvely<|endoftext|>")]


# --- examples and packing -----------------------------------------------------------------------


def check_rows(rows, seq_len):
    """Invariants of packed rows: segment layout, positions, targets within segments."""
    for row in rows:
        assert all(v.shape == (seq_len,) and v.dtype == np.int32 for v in row.values())
        seg = row["segment_ids"]
        used = seg > 0
        assert (np.diff(used.astype(int)) <= 0).all()  # padding only at the end
        ids = seg[used]
        assert (np.diff(ids) >= 0).all() and set(ids) == set(range(1, ids.max() + 1))  # contiguous, distinct
        for s in set(ids):
            idx = np.flatnonzero(seg == s)
            assert (row["positions"][idx] == np.arange(len(idx))).all()
            assert (row["targets"][idx[:-1]] == row["inputs"][idx[1:]]).all()
            assert row["loss_mask"][idx[-1]] == 0 and row["targets"][idx[-1]] == 0
        assert not row["loss_mask"][~used].any()


def test_packing_segments_and_response_mask():
    chats = [
        CHAT,
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello!"}],
        CHAT[1:3],
        [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "y"}],
    ]
    examples = [sft_example({"messages": c}, BYTE) for c in chats]
    seq_len = 64
    rows = list(pack_examples(examples, seq_len))
    check_rows(rows, seq_len)
    # Every conversation appears as one segment whose loss covers exactly its assistant replies.
    expected = {tuple(sft_example({"messages": c}, BYTE)["tokens"]): c for c in chats}
    found = 0
    for row in rows:
        for s in set(row["segment_ids"][row["segment_ids"] > 0]):
            idx = np.flatnonzero(row["segment_ids"] == s)
            chat = expected[tuple(row["inputs"][idx])]
            want = [t for m in chat if m["role"] == "assistant" for t in BYTE.encode(m["content"]) + [BYTE.eos_id]]
            assert row["targets"][idx][row["loss_mask"][idx] == 1].tolist() == want
            found += 1
    assert found == len(chats) and len(rows) < len(chats)  # several per row
    row = pad_example(examples[1], seq_len)
    check_rows([row], seq_len)
    assert row["loss_mask"].sum() == len("hello!") + 1


def test_packing_rejects_or_truncates_long_examples():
    ex = sft_example({"prompt": "a" * 30, "response": "b" * 10}, BYTE)
    with pytest.raises(ValueError, match="does not fit seq_len=16"):
        list(pack_examples([ex], 16))
    (row,) = pack_examples([ex], 16, truncate=True)
    assert (row["segment_ids"] == 1).all() and row["inputs"].tolist() == ex["tokens"][:16].tolist()


def test_preference_and_rl_examples():
    rec = {"prompt": [{"role": "user", "content": "2+2?"}], "chosen": "4", "rejected": "five"}
    ex = preference_example(rec, BYTE)
    assert ex["prompt"].tolist() == BYTE.encode_chat(rec["prompt"], add_generation_prompt=True)[0]
    assert ex["chosen"].tolist() == BYTE.encode("4") + [BYTE.eos_id] and ex["rejected_mask"].all()
    rl = rl_prompt_example({"q": "2+2?", "a": 4}, BYTE, fields={"prompt": "q", "answer": "a"})
    assert rl["answer"] == "4" and rl["tests"] is None and rl["record"] == {"q": "2+2?", "a": 4}
    assert BYTE.decode(rl["prompt"]) == "2+2?" and rl["prompt"][-1] == BYTE.ROLES["assistant"]
    with pytest.raises(RecordError, match="missing field 'q' \\(read as 'prompt'\\)"):
        rl_prompt_example({"question": "x"}, BYTE, fields={"prompt": "q"})
    with pytest.raises(RecordError, match=r"'messages'\[1\].content: expected a string, got int"):
        sft_example({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": 3}]}, BYTE)
    with pytest.raises(RecordError, match="no assistant turn"):
        sft_example({"messages": [{"role": "user", "content": "x"}]}, BYTE)


# --- JSONL sources and pipelines ----------------------------------------------------------------

GOOD = {"prompt": "1+1=", "response": "2"}
BAD_LINES = {  # line → the reason the error must give
    "{not json": "not valid JSON",
    json.dumps({"prompt": "1+1="}): "missing field 'response'",
    json.dumps({"prompt": "1+1=", "response": 2}): "'response': expected a string or a list of messages, got int",
    json.dumps({"prompt": "x" * 100, "response": "2"}): "too long: 106 tokens > seq_len=64",
}


@pytest.mark.parametrize("line", list(BAD_LINES))
def test_bad_record_names_file_and_line(line):
    path = write_jsonl([GOOD, "", line])  # the bad record is on line 3 (line 2 is empty)
    it = sft_batches(path, BYTE, batch_size=2, seq_len=64, seed=0, epochs=1, shuffle=False)
    with pytest.raises(DataError, match=f"^{re.escape(path)}:3: .*{re.escape(BAD_LINES[line])}"):
        list(it)


def test_bad_records_skipped_are_counted_and_logged(caplog):
    path = write_jsonl([GOOD] * 3 + list(BAD_LINES) + [GOOD])
    it = sft_batches(path, BYTE, batch_size=2, seq_len=64, seed=0, epochs=1, on_error="skip")
    with caplog.at_level(logging.WARNING):
        batches = list(it)
    assert it.skipped == len(BAD_LINES)
    assert sum(len(set(b["segment_ids"][r][b["segment_ids"][r] > 0])) for b in batches for r in range(2)) == 4
    assert f"{path}:4" in caplog.text and "too long" in caplog.text
    with pytest.raises(DataError, match="an epoch's worth"):
        next(sft_batches(write_jsonl(list(BAD_LINES)), BYTE, batch_size=2, seq_len=64, seed=0, on_error="skip"))
    skips = SkipLog("skip")
    assert len(list(read_jsonl(path, skips=skips))) == 7 and skips.skipped == 1
    with pytest.raises(DataError, match=f"{path}:4: not valid JSON"):
        list(read_jsonl(path))


def test_truncate_option_counts_cut_examples():
    path = write_jsonl([GOOD, {"prompt": "x" * 100, "response": "2"}])
    it = sft_batches(path, BYTE, batch_size=2, seq_len=64, seed=0, epochs=1, truncate=True)
    (batch,) = list(it)
    assert it.truncated == 1 and it.skipped == 0 and (batch["segment_ids"] > 0).sum() == 64 + 10


def record_ids(batches) -> list[int]:
    return [ex["record"]["id"] for batch in batches for ex in batch]


def test_shuffle_is_seeded_and_differs_per_epoch():
    path = write_jsonl([{"id": i, "prompt": f"q{i}"} for i in range(20)])

    def order(seed, n=40):
        it = rl_prompt_batches(path, BYTE, batch_size=4, seed=seed)
        ids = record_ids(next(it) for _ in range(n // 4))
        assert it.epoch == n // 20
        return ids

    a = order(0)
    assert a == order(0) and a != order(1)
    assert sorted(a[:20]) == sorted(a[20:]) == list(range(20)) and a[:20] != a[20:]
    assert record_ids(rl_prompt_batches(path, BYTE, batch_size=4, seed=0, shuffle=False, epochs=1)) == list(range(20))


def test_process_shards_are_disjoint_and_equal():
    path = write_jsonl([{"id": i, "prompt": f"q{i}"} for i in range(21)])
    shards = [
        record_ids(rl_prompt_batches(path, BYTE, batch_size=4, seed=3, epochs=1, process_index=p, process_count=2))
        for p in range(2)
    ]
    assert len(shards[0]) == len(shards[1]) == 10 and not set(shards[0]) & set(shards[1])
    with pytest.raises(ValueError, match="multiple of process_count=2"):
        rl_prompt_batches(path, BYTE, batch_size=3, seed=0, process_index=0, process_count=2)


def sft_records(n=40):
    rng = np.random.default_rng(0)
    return [
        {
            "messages": [
                {"role": "user", "content": "q" * int(rng.integers(1, 30))},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(n)
    ]


@pytest.mark.parametrize(
    "make",
    [
        lambda p: sft_batches(p, BYTE, batch_size=3, seq_len=96, seed=7, on_error="skip"),
        lambda p: sft_batches(p, BYTE, batch_size=3, seq_len=96, seed=7, packing=False, on_error="skip"),
        lambda p: preference_batches(
            p,
            BYTE,
            batch_size=2,
            max_len=96,
            seed=7,
            on_error="skip",
            fields={"prompt": "messages", "chosen": "c", "rejected": "r"},
        ),
    ],
    ids=["packed", "padded", "preference"],
)
def test_get_state_set_state_resumes_exactly(make):
    records = [dict(r, c="yes", r="no") for r in sft_records()]
    path = write_jsonl(records[:10] + ["oops"] + records[10:])  # a skipped record in the stream
    it = make(path)
    for _ in range(5):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = [next(it) for _ in range(3)]
    fresh = make(path)
    fresh.set_state(state)
    got = [next(fresh) for _ in range(3)]
    for e, g in zip(expected, got):
        assert e.keys() == g.keys() and all(np.array_equal(e[k], g[k]) for k in e)
    assert fresh.skipped == it.skipped
    other = sft_batches(path, BYTE, batch_size=3, seq_len=128, seed=7, on_error="skip")
    with pytest.raises(ValueError, match="saved with"):
        other.set_state(state)


def test_resuming_reads_a_data_file_named_from_another_directory_as_the_same_file(tmp_path, monkeypatch):
    """A run started with a relative workdir (`runs/x`) and resumed with it written absolutely, or
    from another directory, reads the same file: resuming is not refused. Another file still is."""
    path = tmp_path / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sft_records()))
    monkeypatch.chdir(tmp_path)
    it = sft_batches("data.jsonl", BYTE, batch_size=3, seq_len=96, seed=7)
    next(it)
    state = json.loads(json.dumps(it.get_state()))
    expected = next(it)
    monkeypatch.chdir(tmp_path.parent)
    fresh = sft_batches(str(path), BYTE, batch_size=3, seq_len=96, seed=7)
    fresh.set_state(state)
    assert all(np.array_equal(expected[k], value) for k, value in next(fresh).items())
    other = tmp_path / "other.jsonl"
    other.write_text(path.read_text())
    with pytest.raises(ValueError, match="saved with files="):
        sft_batches(str(other), BYTE, batch_size=3, seq_len=96, seed=7).set_state(state)


def test_preference_batches_mask_only_the_response():
    path = write_jsonl([{"prompt": "2+2=", "chosen": "4", "rejected": "22"}])
    batch = next(preference_batches(path, BYTE, batch_size=2, max_len=16, seed=0, epochs=1))
    for side, text in (("chosen", "4"), ("rejected", "22")):
        mask = batch[f"{side}_loss_mask"][0] == 1
        assert batch[f"{side}_targets"][0][mask].tolist() == BYTE.encode(text) + [BYTE.eos_id]
        assert (batch[f"{side}_segment_ids"][1] == 0).all()  # end of data: a padding row


def test_gsm8k_as_rl_prompts():
    path = SHARED_DATA / "gsm8k/train.jsonl"
    if not path.exists():
        pytest.skip(f"{path} not found (shared data folder absent)")
    it = rl_prompt_batches(str(path), BYTE, batch_size=8, seed=0, fields={"prompt": "question", "answer": "answer"})
    batch = next(it)
    assert len(batch) == 8 and it.skipped == 0
    for ex in batch:
        assert BYTE.decode(ex["prompt"]) == ex["record"]["question"] and "#### " in ex["answer"]


def test_humaneval_gz_as_code_prompts():
    path = SHARED_DATA / "humaneval/HumanEval.jsonl.gz"
    if not path.exists():
        pytest.skip(f"{path} not found (shared data folder absent)")
    it = rl_prompt_batches(str(path), BYTE, batch_size=4, seed=0, fields={"tests": "test"})
    for ex in next(it):
        assert ex["tests"].startswith(ex["record"]["test"][:20]) and "def check(" in ex["tests"]
        assert BYTE.decode(ex["prompt"]) == ex["record"]["prompt"]
