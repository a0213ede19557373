"""Tokenizers: one interface, a Hugging Face `tokenizer.json` implementation and a byte fallback.

`encode_chat` is the piece post-training needs beyond plain encoding: the token ids of a
conversation *and* which of them are trainable (assistant content and its end-of-turn token), so
SFT loss, preference log-probs and RL prompts all see the same chat format.
"""

from __future__ import annotations

import itertools
import json
import logging
from collections.abc import Sequence
from typing import Protocol

import fsspec
import numpy as np

from posttrain.data import chat_template

log = logging.getLogger(__name__)


class Tokenizer(Protocol):
    """What the data pipelines, sampler and verifiers need from a tokenizer."""

    vocab_size: int
    pad_id: int
    eos_id: int
    bos_id: int | None
    stop_ids: tuple[int, ...]  # tokens that end generation (eos and any end-of-turn ids)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]: ...

    def token_text(self, i: int) -> str | None: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def encode_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[bool]]: ...


class ByteTokenizer:
    """UTF-8 bytes plus a few specials — no files, for the CPU quickstart and tests.

    Ids: `<pad>`=0, `<bos>`=1, `<eos>`=2, role markers 3-6 (system, user, assistant, tool), then
    byte `b` → `b + 7`; vocab_size 263. `<|image|>`=263, an image's patch placeholder, lies past the
    text vocabulary (so the vocabulary, and every data state that records it, is what it was before
    images): a model that reads images has `model.vocab_size >= 264` (`model.vision`). A chat
    is `<bos>` then, per message, its role marker, its content and `<eos>` (the end-of-turn token,
    so generation stops at the end of a reply). A content may be a list of parts: text
    (`{"type": "text", "text"}`) and images already cut into patches (`{"type": "image",
    "num_patches": n}`, from `data.images`), an image being n `<|image|>` tokens, never trainable.
    """

    SPECIALS = ("<pad>", "<bos>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>", "<|tool|>")
    ROLES = {"system": 3, "user": 4, "assistant": 5, "tool": 6}
    OFFSET = len(SPECIALS)
    vocab_size = OFFSET + 256
    image_id = vocab_size  # <|image|>: one per image patch (model.vision.image_token_id)
    pad_id, bos_id, eos_id = 0, 1, 2
    stop_ids = (2,)

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Text → byte ids (no specials; with them: `<bos>` first, as a chat starts)."""
        ids = (np.frombuffer(text.encode(), np.uint8).astype(np.int64) + self.OFFSET).tolist()
        return [self.bos_id, *ids] if add_special_tokens else ids

    def token_text(self, i: int) -> str | None:
        """The text of id `i`: a special token's name, a byte's character (None: no such id)."""
        if 0 <= i < self.OFFSET:
            return self.SPECIALS[i]
        return bytes([i - self.OFFSET]).decode(errors="replace") if self.OFFSET <= i < self.image_id else None

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text; special tokens are dropped, invalid UTF-8 becomes U+FFFD."""
        data = bytes(int(i) - self.OFFSET for i in ids if self.OFFSET <= int(i) < self.image_id)
        return data.decode(errors="replace")

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """A conversation → (ids, trainable): trainable on assistant content and its `<eos>`."""
        ids, trainable = [self.bos_id], [False]
        for i, m in enumerate(messages):
            if m["role"] not in self.ROLES:
                raise ValueError(f"messages[{i}].role={m['role']!r}: expected one of {sorted(self.ROLES)}")
            body, images = self._content(m["content"]), []
            if not isinstance(body, list):
                body, images = body
            body += [self.eos_id]
            ids += [self.ROLES[m["role"]]] + body
            trainable += [False] + [m["role"] == "assistant" and i not in images for i in range(len(body))]
        if add_generation_prompt:
            ids.append(self.ROLES["assistant"])
            trainable.append(False)
        return ids, trainable

    def _content(self, content) -> list[int] | tuple[list[int], set[int]]:
        """A message's ids: a string's bytes, or a part list's ids and the indices of image tokens."""
        if isinstance(content, str):
            return self.encode(content)
        ids, images = [], set()
        for part in content:
            if part.get("type") == "image":
                images.update(range(len(ids), len(ids) + part["num_patches"]))
                ids += [self.image_id] * part["num_patches"]
            else:
                ids += self.encode(part["text"])
        return ids, images


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value


class HFTokenizer:
    """A Hugging Face fast tokenizer (`tokenizer.json`) with its chat template.

    Plain `encode` adds no special tokens; chats are rendered with the template from
    `tokenizer_config.json` (or `chat_template.jinja`) exactly as transformers renders them and
    tokenized without added specials (the template writes them). A tokenizer without a template
    renders chats as plain text (contents back to back, eos after assistant turns), with a warning.
    Without a `pad_token` in the config, padding uses the eos id (padding is masked anyway).
    Images, as a LLaVA processor writes them: each image part of a message becomes the image
    token's text (config `image_token`, else `<image>` or `<|image|>` when in the vocabulary) before
    the template renders the chat, and its one id is then expanded to the image's `num_patches`
    placeholders (`image_id`, `model.vision.image_token_id`), never trainable.
    """

    IMAGE_TOKENS = ("<image>", "<|image|>")

    def __init__(
        self,
        tokenizer,
        config: dict | None = None,
        *,
        chat_template_source: str | None = None,
        stop_ids: Sequence[int] = (),
        name: str = "tokenizer",
    ):
        """`tokenizer`: a `tokenizers.Tokenizer`; `config`: tokenizer_config.json's contents."""
        self._tok = tokenizer
        self.name = name
        config = config or {}
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self._specials = {
            k: t
            for k in ("bos_token", "eos_token", "pad_token", "unk_token")
            if (t := _token_text(config.get(k))) is not None
        }
        self.eos_id = self._special_id("eos_token", ("</s>", "<|endoftext|>", "<eos>", "<|end_of_text|>"))
        self.bos_id = self._special_id("bos_token", ()) if "bos_token" in self._specials else None
        self.pad_id = self._special_id("pad_token", ()) if "pad_token" in self._specials else self.eos_id
        self.stop_ids = tuple(sorted({self.eos_id, *stop_ids}))
        image = [t] if (t := _token_text(config.get("image_token"))) else self.IMAGE_TOKENS
        found = [(t, i) for t in image if (i := tokenizer.token_to_id(t)) is not None]
        self.image_text, self.image_id = found[0] if found else (None, None)
        source = chat_template_source or config.get("chat_template")
        if isinstance(source, list):  # [{"name": ..., "template": ...}, ...]
            source = {t["name"]: t["template"] for t in source}.get("default")
        if not source:
            log.warning(
                "%s has no chat template: chats render as plain text "
                "(contents back to back, eos after assistant turns)",
                name,
            )
            source = chat_template.PLAIN_TEMPLATE
        self.chat_template_source = source
        self._template = chat_template.compile_template(source)

    def _special_id(self, key: str, fallbacks: Sequence[str]) -> int:
        """The id of special token `key` from the config, else of the first fallback in the vocab."""
        if key in self._specials:
            if (i := self._tok.token_to_id(self._specials[key])) is None:
                raise ValueError(
                    f"{self.name}: tokenizer_config.json {key}={self._specials[key]!r} is not in the vocabulary"
                )
            return i
        for text in fallbacks:
            if (i := self._tok.token_to_id(text)) is not None:
                self._specials[key] = text
                return i
        raise ValueError(
            f"{self.name}: no {key} in tokenizer_config.json and none of {list(fallbacks)} in the vocabulary"
        )

    @classmethod
    def from_dir(cls, path: str) -> HFTokenizer:
        """Load `tokenizer.json` [+ `tokenizer_config.json`, `chat_template.jinja`,
        `generation_config.json` (its eos ids are stop ids)] from a folder (local or fsspec URL)."""
        from tokenizers import Tokenizer as _Tokenizer

        def read(name: str) -> str | None:
            url = f"{path.rstrip('/')}/{name}"
            fs, fs_path = fsspec.core.url_to_fs(url)
            if not fs.exists(fs_path):
                return None
            with fsspec.open(url, "r", encoding="utf-8") as f:
                return f.read()

        spec = read("tokenizer.json")
        if spec is None:
            raise FileNotFoundError(f"{path}: no tokenizer.json")
        config = json.loads(read("tokenizer_config.json") or "{}")
        gen = json.loads(read("generation_config.json") or "{}").get("eos_token_id", [])
        return cls(
            _Tokenizer.from_str(spec),
            config,
            chat_template_source=read("chat_template.jinja"),
            stop_ids=[gen] if isinstance(gen, int) else gen,
            name=path,
        )

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        """Text → ids, without added special tokens (with them: what the tokenizer's post-processor
        adds, e.g. a BOS, as transformers' `encode` does by default; lm-eval scores that way)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        """Ids → text, special tokens dropped."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)

    def token_text(self, i: int) -> str | None:
        """The vocabulary entry of id `i` (a special token's text, e.g. "<s>"; None: no such id)."""
        return self._tok.id_to_token(int(i))

    def render_chat(
        self, messages: list[dict], *, add_generation_prompt: bool = False, continue_final_message: bool = False
    ) -> str:
        """A text-only conversation as the chat template renders it (transformers' `apply_chat_template(
        tokenize=False)`); `continue_final_message`: cut after the last message's content."""
        text = chat_template.render(
            self._template, messages, add_generation_prompt=add_generation_prompt, special_tokens=self._specials
        )
        return chat_template.continue_final(text, messages) if continue_final_message else text

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = False) -> tuple[list[int], list[bool]]:
        """A conversation through the chat template → (ids, trainable).

        A token is trainable when its characters overlap an assistant turn's span (content and
        end-of-turn token, not the role header the generation prompt writes).
        """
        messages, patches = self._flatten_images(messages)
        text, spans = chat_template.render_with_spans(
            self._template, messages, add_generation_prompt=add_generation_prompt, special_tokens=self._specials
        )
        enc = self._tok.encode(text, add_special_tokens=False)
        offsets = np.fromiter(itertools.chain.from_iterable(enc.offsets), np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
        trainable = np.zeros(len(enc.ids), bool)
        for s, e in spans:
            trainable |= (starts < e) & (ends > s)
        ids = np.asarray(enc.ids, np.int64)
        if not patches:
            return ids.tolist(), trainable.tolist()
        at = np.flatnonzero(ids == self.image_id)
        if len(at) != len(patches):
            raise ValueError(
                f"{self.name}: {len(patches)} image parts but {len(at)} {self.image_text!r} tokens after the chat "
                "template (a text part writes the image token itself, or the template drops it)"
            )
        repeats = np.ones(len(ids), np.int64)
        repeats[at] = patches
        trainable[at] = False
        return np.repeat(ids, repeats).tolist(), np.repeat(trainable, repeats).tolist()

    def _flatten_images(self, messages: list[dict]) -> tuple[list[dict], list[int]]:
        """Messages with string contents (an image part → the image token's text) and each image's
        `num_patches`, in order."""
        if all(isinstance(m.get("content"), str) for m in messages):
            return messages, []
        if self.image_id is None:
            raise ValueError(
                f"{self.name}: messages with image parts, but the tokenizer has no image token "
                f"(tokenizer_config.json image_token, or one of {list(self.IMAGE_TOKENS)} in the vocabulary)"
            )
        flat, patches = [], []
        for m in messages:
            content = m.get("content")
            if not isinstance(content, str):
                parts = []
                for part in content:
                    if part.get("type") == "image":
                        parts.append(self.image_text)
                        patches.append(part["num_patches"])
                    else:
                        parts.append(part["text"])
                content = "".join(parts)
            flat.append({**m, "content": content})
        return flat, patches


def load_tokenizer(spec: str) -> Tokenizer:
    """`"byte"` → `ByteTokenizer`; anything else is a folder (path or URL) with tokenizer.json."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer.from_dir(spec)
