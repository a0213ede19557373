"""Records (parsed JSONL dicts) → token arrays for each stage, with errors that name the field.

Record kinds (a `fields` mapping renames: `{"prompt": "question"}` reads `prompt` from `question`):
- SFT: `{"messages": [{"role", "content"}, ...]}` or `{"prompt", "response"}`;
- preference: `{"prompt", "chosen", "rejected"}`;
- RL prompt: `{"prompt", "answer"?, "tests"?}`.
A prompt is a string (one user turn) or a list of messages; a response (`response`, `chosen`,
`rejected`) is a string (one assistant turn) or a list of messages that continue the prompt. All
go through the tokenizer's chat format, so every stage trains and samples the same layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from posttrain.data.images import NO_VISION, ImageSpec, image_parts
from posttrain.data.tokenizer import Tokenizer

Fields = Mapping[str, str] | None


class RecordError(ValueError):
    """A record that does not fit its kind; the message names the field and what was expected."""


def field_key(name: str, fields: Fields = None) -> str:
    """The record key that holds field `name` (renamed by `fields`, else itself)."""
    return (fields or {}).get(name, name)


def get_field(record: dict, name: str, fields: Fields = None, *, required: bool = True) -> Any:
    """`record[name]`, read from the key `fields[name]` when mapped; missing → `RecordError`."""
    key = field_key(name, fields)
    if key not in record:
        if not required:
            return None
        mapped = f" (read as {name!r})" if key != name else ""
        raise RecordError(f"missing field {key!r}{mapped}; the record has {sorted(record)}")
    return record[key]


def field_text(record: dict, name: str, *, joinable: bool = False) -> str:
    """Field `name` as text: a string (or a number); with `joinable` a list of strings joined by
    newlines; anything else is a RecordError naming the field."""
    value = get_field(record, name)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not joinable:
        return str(value)
    if joinable and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    if not isinstance(value, str):
        expected = "a string or a list of strings" if joinable else "a string or a number"
        raise RecordError(f"field {name!r}: expected {expected}, got {type(value).__name__}")
    return value


def field_labels(record: dict, name: str) -> tuple[str, ...]:
    """Field `name` as a non-empty list of labels (strings); a RecordError otherwise."""
    value = get_field(record, name)
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise RecordError(f"field {name!r}: expected a non-empty list of labels, got {value!r}")
    return tuple(value)


def _type_name(value: Any) -> str:
    return type(value).__name__


def check_messages(value: Any, field: str, *, parts: bool = False) -> list[dict]:
    """A list of `{"role": str, "content": str, ...}` dicts, or `RecordError` naming the element.
    `parts`: a content may also be a list of parts (text and images, checked by `with_images`,
    which the caller then runs)."""
    if not isinstance(value, list) or not value:
        raise RecordError(f"field {field!r}: expected a non-empty list of messages, got {_type_name(value)}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise RecordError(f"field {field!r}[{i}]: expected a message object, got {_type_name(m)}")
        for key in ("role", "content"):
            if not isinstance(m.get(key), str) and not (parts and key == "content" and isinstance(m.get(key), list)):
                got = "nothing" if key not in m else _type_name(m[key])
                raise RecordError(f"field {field!r}[{i}].{key}: expected a string, got {got}")
    return value


def with_images(
    messages: list[dict], field: str | Sequence[str], images: ImageSpec | None, path: str | None, why: str = NO_VISION
) -> tuple[list[dict], np.ndarray | None]:
    """Messages whose part-list contents are resolved for the tokenizer (image parts decoded and
    counted in patches), and the images' uint8 pixels [k, size, size, 3] in order (None when
    `images` is None: a text-only model, or a record kind without images (`why`), where an image
    part is an error). `field`: the record field all messages come from, or each message's place
    (`sft_locations`), which errors name."""
    places = [f"{field!r}[{i}]" for i in range(len(messages))] if isinstance(field, str) else list(field)
    out, pixels = [], []
    for m, place in zip(messages, places):
        try:
            content, found = image_parts(m["content"], f"field {place}.content", images, path, why)
        except ValueError as e:
            raise RecordError(str(e)) from None
        out.append({**m, "content": content})
        pixels += found
    if images is None:
        return out, None
    size = images.image_size
    return out, np.stack(pixels) if pixels else np.zeros((0, size, size, 3), np.uint8)


def as_messages(value: Any, field: str, role: str, *, parts: bool = False) -> list[dict]:
    """A string → one `role` message; a list → checked messages (`parts`: see `check_messages`)."""
    if isinstance(value, str):
        return [{"role": role, "content": value}]
    if isinstance(value, list):
        return check_messages(value, field, parts=parts)
    raise RecordError(f"field {field!r}: expected a string or a list of messages, got {_type_name(value)}")


def _encode_chat(tok: Tokenizer, messages: list[dict], field: str, **kw) -> tuple[list[int], list[bool]]:
    try:
        return tok.encode_chat(messages, **kw)
    except ValueError as e:  # unknown role, template's raise_exception, …
        raise RecordError(f"field {field!r}: {e}") from None


def sft_messages(record: dict, fields: Fields = None) -> tuple[list[dict], str]:
    """The conversation of an SFT record and the field it came from."""
    key = field_key("messages", fields)
    if key in record:
        return check_messages(record[key], key, parts=True), key
    if field_key("prompt", fields) not in record:
        raise RecordError(
            f"missing field {key!r} (or {field_key('prompt', fields)!r} and "
            f"{field_key('response', fields)!r}); the record has {sorted(record)}"
        )
    prompt = as_messages(get_field(record, "prompt", fields), field_key("prompt", fields), "user", parts=True)
    response = field_key("response", fields)
    return prompt + as_messages(get_field(record, "response", fields), response, "assistant", parts=True), response


def sft_locations(record: dict, count: int, fields: Fields = None) -> list[str]:
    """Where each of the `count` messages `sft_messages` made of `record` comes from, for errors:
    `'messages'[i]`, or `'prompt'[i]` for the prompt's and `'response'[j]` for the response's."""
    key = field_key("messages", fields)
    if key in record:
        return [f"{key!r}[{i}]" for i in range(count)]
    prompt = get_field(record, "prompt", fields)
    n = len(prompt) if isinstance(prompt, list) else 1
    p, r = field_key("prompt", fields), field_key("response", fields)
    return [f"{p!r}[{i}]" for i in range(n)] + [f"{r!r}[{j}]" for j in range(count - n)]


def sft_example(
    record: dict, tok: Tokenizer, *, fields: Fields = None, images: ImageSpec | None = None, path: str | None = None
) -> dict:
    """An SFT record → `{"tokens": int32[n], "loss_mask": bool[n]}` (+ `"pixels"`: uint8
    [images, size, size, 3] in token order when `images` is given; `path`: the record's JSONL file,
    which relative image paths are under).

    `loss_mask[i]` is True where token i is a target the model must predict: assistant content
    and its end-of-turn token (never an image placeholder). A record with nothing to train on is
    an error.
    """
    messages, field = sft_messages(record, fields)
    messages, pixels = with_images(messages, sft_locations(record, len(messages), fields), images, path)
    ids, trainable = _encode_chat(tok, messages, field)
    if not any(trainable):
        raise RecordError(f"field {field!r}: no assistant turn to train on")
    out = {"tokens": np.asarray(ids, np.int32), "loss_mask": np.asarray(trainable, bool)}
    return out if pixels is None else {**out, "pixels": pixels}


def _response(
    tok: Tokenizer, prompt: list[dict], prompt_ids: list[int], value: Any, field: str
) -> tuple[np.ndarray, np.ndarray]:
    """Response tokens after the prompt (up to the last trainable one) and their trainable flags."""
    ids, trainable = _encode_chat(tok, prompt + as_messages(value, field, "assistant"), field)
    p = len(prompt_ids)
    if ids[:p] != prompt_ids:
        raise RecordError(
            f"field {field!r}: the chat template renders the prompt differently when a "
            "response follows, so the response tokens cannot be separated"
        )
    trainable = np.asarray(trainable[p:], bool)
    if not trainable.any():
        raise RecordError(f"field {field!r}: no assistant turn")
    end = int(np.flatnonzero(trainable)[-1]) + 1
    return np.asarray(ids[p : p + end], np.int32), trainable[:end]


def preference_example(record: dict, tok: Tokenizer, *, fields: Fields = None) -> dict:
    """A preference record → `{"prompt", "chosen", "rejected"}` int32 ids (+ `chosen_mask`,
    `rejected_mask`: bool, True on assistant tokens — all of a single-turn response).

    `prompt` ends with the generation prompt; `chosen`/`rejected` are the response tokens that
    follow it, ending with the end-of-turn token.
    """
    prompt_key = field_key("prompt", fields)
    no = "preference records take no images yet"
    prompt, _ = with_images(
        as_messages(get_field(record, "prompt", fields), prompt_key, "user", parts=True), prompt_key, None, None, no
    )
    prompt_ids, _ = _encode_chat(tok, prompt, prompt_key, add_generation_prompt=True)
    out = {"prompt": np.asarray(prompt_ids, np.int32)}
    for name in ("chosen", "rejected"):
        response, _ = with_images(
            as_messages(get_field(record, name, fields), field_key(name, fields), "assistant", parts=True),
            name,
            None,
            None,
            no,
        )
        out[name], out[f"{name}_mask"] = _response(tok, prompt, prompt_ids, response, field_key(name, fields))
    return out


def _optional_text(record: dict, name: str, fields: Fields, *, joinable: bool = False) -> str | None:
    value = get_field(record, name, fields, required=False)
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not joinable:
        return str(value)
    if joinable and isinstance(value, list) and all(isinstance(v, str) for v in value):
        return "\n".join(value)
    expected = "a string or a list of strings" if joinable else "a string or a number"
    raise RecordError(f"field {field_key(name, fields)!r}: expected {expected}, got {_type_name(value)}")


def rl_prompt_example(
    record: dict, tok: Tokenizer, *, fields: Fields = None, images: ImageSpec | None = None, path: str | None = None
) -> dict:
    """An RL prompt record → `{"prompt": int32[p] (ending with the generation prompt),
    "answer": str | None, "tests": str | None, "record": the original dict}` (+ `"pixels"`, uint8
    [images, size, size, 3], when `images` is given; see `sft_example`).

    `answer` may be a number in the data (kept as its string); `tests` may be a list of strings
    (joined by newlines). The verifier gets `record` for anything else it needs.
    """
    prompt_key = field_key("prompt", fields)
    prompt = as_messages(get_field(record, "prompt", fields), prompt_key, "user", parts=True)
    prompt, pixels = with_images(prompt, prompt_key, images, path)
    ids, _ = _encode_chat(tok, prompt, prompt_key, add_generation_prompt=True)
    out = {
        "prompt": np.asarray(ids, np.int32),
        "answer": _optional_text(record, "answer", fields),
        "tests": _optional_text(record, "tests", fields, joinable=True),
        "record": record,
    }
    return out if pixels is None else {**out, "pixels": pixels}
