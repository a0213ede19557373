"""The tokenizer a GGUF file describes in its metadata, as the Hugging Face files `data.tokenizer` reads.

A GGUF carries no `tokenizer.json`: llama.cpp stores the vocabulary, the BPE merges, each token's
type, the special token ids and the chat template as metadata (`tokenizer.ggml.*`,
`tokenizer.chat_template`). `tokenizer_files` rebuilds from them the byte-level BPE tokenizer
llama.cpp runs — the split rules `tokenizer.ggml.pre` names, control tokens matched whole as
specials — and returns the files of a model folder: `tokenizer.json`, `tokenizer_config.json`
(special tokens, chat template) and `generation_config.json` (the ids that end a reply).
"""

from __future__ import annotations

import functools
import json

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors

# tokenizer.ggml.token_type values (llama.cpp's llama_token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
# llama.cpp's split regexes for byte-level BPE, by `tokenizer.ggml.pre`; applied in order, each to
# the pieces the one before cut (llama-vocab.cpp). "gpt2" is the one ByteLevel(use_regex=True) runs.
_DIGITS = r"\p{N}"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
PRE_TOKENIZER_SPLITS = {
    "default": ("gpt2",),
    "gpt2": ("gpt2",),
    "smollm": (_DIGITS, "gpt2"),
    "starcoder": (_DIGITS, "gpt2"),
    "refact": (_DIGITS, "gpt2"),
    "llama-bpe": (_LLAMA3,),
    "llama3": (_LLAMA3,),
    "qwen2": (_QWEN2,),
}


@functools.cache
def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte → printable character table, in which byte-level BPE vocabularies are spelled."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _byte_spelling(token: str) -> str:
    """`token` in the byte alphabet: as stored when it already is, else its UTF-8 bytes respelled
    (a few files store added tokens with real spaces or other characters)."""
    alphabet = set(byte_alphabet().values())
    if set(token) <= alphabet:
        return token
    return "".join(byte_alphabet()[b] for b in token.encode("utf-8"))


def _pre_tokenizer(pre: str, where: str) -> pre_tokenizers.PreTokenizer:
    """llama.cpp's splitting for `tokenizer.ggml.pre` = `pre`, then the byte alphabet."""
    if pre not in PRE_TOKENIZER_SPLITS:
        supported = ", ".join(sorted(PRE_TOKENIZER_SPLITS))
        raise ValueError(f"{where}: tokenizer.ggml.pre={pre!r} is not supported; supported: {supported}")
    *splits, last = PRE_TOKENIZER_SPLITS[pre]
    steps = [pre_tokenizers.Split(Regex(s), behavior="isolated") for s in splits]
    if last == "gpt2":
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [
            pre_tokenizers.Split(Regex(last), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    return steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(steps)


def _merges(merges: list[str], where: str) -> list[tuple[str, str]]:
    """'left right' strings → pairs; anything else is an error naming the merge."""
    pairs = []
    for i, m in enumerate(merges):
        parts = m.split(" ")
        if len(parts) != 2:
            raise ValueError(f"{where}: tokenizer.ggml.merges[{i}]={m!r} is not 'left right'")
        pairs.append((parts[0], parts[1]))
    return pairs


def build_tokenizer(meta: dict, where: str = "GGUF") -> Tokenizer:
    """The byte-level BPE `tokenizers.Tokenizer` of GGUF metadata `meta` (key → value), with its
    control tokens as specials and user-defined tokens matched whole."""
    model = meta.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(
            f"{where}: tokenizer.ggml.model={model!r} is not supported; supported: 'gpt2' (byte-level BPE)"
        )
    tokens = list(meta["tokenizer.ggml.tokens"])
    types = list(meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    vocab = {_byte_spelling(t): i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise ValueError(f"{where}: tokenizer.ggml.tokens spells {len(tokens) - len(vocab)} tokens twice")
    tok = Tokenizer(models.BPE(vocab, _merges(meta.get("tokenizer.ggml.merges", []), where), fuse_unk=False))
    tok.pre_tokenizer = _pre_tokenizer(meta.get("tokenizer.ggml.pre", "default"), where)
    tok.decoder = decoders.ByteLevel()
    alphabet = set(byte_alphabet().values())
    # A control token spelled outside the byte alphabet is a mislabelled byte sequence, not a special.
    specials = [t for t, k in zip(tokens, types) if k == CONTROL and set(t) <= alphabet]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED])
    _add_post_processor(tok, meta, tokens)
    return tok


def _add_post_processor(tok: Tokenizer, meta: dict, tokens: list[str]) -> None:
    """bos/eos around encoded text where the file asks for them (`add_bos_token`, `add_eos_token`)."""
    ends = {}
    for k in ("bos", "eos"):
        i = meta.get(f"tokenizer.ggml.{k}_token_id")
        if meta.get(f"tokenizer.ggml.add_{k}_token") and i is not None:
            ends[k] = (tokens[i], i)
    if not ends:
        return
    bos = [ends["bos"][0]] if "bos" in ends else []
    eos = [ends["eos"][0]] if "eos" in ends else []
    tok.post_processor = processors.TemplateProcessing(
        single=[*bos, "$A", *eos], pair=[*bos, "$A", *eos, *bos, "$B", *eos], special_tokens=sorted(set(ends.values()))
    )


def special_tokens(meta: dict, where: str = "GGUF") -> dict[str, str]:
    """{bos_token, eos_token, pad_token, unk_token} → token text, for the ids the file sets."""
    tokens = meta["tokenizer.ggml.tokens"]
    out = {}
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding"), ("unk", "unknown")):
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            continue
        if not 0 <= i < len(tokens):
            raise ValueError(f"{where}: tokenizer.ggml.{key}_token_id={i} is outside the vocabulary ({len(tokens)})")
        out[f"{name}_token"] = tokens[i]
    return out


def stop_ids(meta: dict) -> list[int]:
    """The ids that end a reply: eos, end-of-turn and end-of-message where the file sets them."""
    keys = ("eos", "eot", "eom")
    return sorted({meta[f"tokenizer.ggml.{k}_token_id"] for k in keys if f"tokenizer.ggml.{k}_token_id" in meta})


def tokenizer_files(meta: dict, where: str = "GGUF") -> dict[str, str]:
    """Filename → contents of the tokenizer files of a model folder for GGUF metadata `meta`:
    tokenizer.json, tokenizer_config.json (special tokens, chat template) and
    generation_config.json (bos/eos/pad ids; its eos ids are the stop ids of `data.tokenizer`)."""
    tok = build_tokenizer(meta, where)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special_tokens(meta, where),
        "add_bos_token": bool(meta.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "clean_up_tokenization_spaces": False,
    }
    if meta.get("tokenizer.chat_template"):
        config["chat_template"] = meta["tokenizer.chat_template"]
    generation = {
        k: meta[f"tokenizer.ggml.{g}_token_id"]
        for k, g in (("bos_token_id", "bos"), ("pad_token_id", "padding"))
        if f"tokenizer.ggml.{g}_token_id" in meta
    }
    if ids := stop_ids(meta):
        generation["eos_token_id"] = ids[0] if len(ids) == 1 else ids
    return {
        "tokenizer.json": tok.to_str(),
        "tokenizer_config.json": json.dumps(config, indent=2, ensure_ascii=False),
        "generation_config.json": json.dumps(generation, indent=2),
    }
