"""Grain pipelines from JSONL to train batches, with a checkpointable iterator state.

    JsonlSource ─▶ shuffle(seed; reshuffled each epoch) ─▶ this process's slice ─▶ repeat(epochs)
       ─▶ map(parse + tokenize + length check) ─▶ [pack] ─▶ batch

Grain does the indexed part (shuffle, shard, repeat, threaded map) and owns the read position;
packing and batching are a small deterministic Python step after it, whose carried-over rows go
into `get_state` next to grain's position, so a restored iterator yields exactly the batches an
uninterrupted one would.

Multi-host: every process reads the file index, but parses and tokenizes only its own records:
the shuffled epoch is cut into `process_count` interleaved slices of equal length (the last
`len % process_count` records of each shuffled epoch are left out — different ones each epoch),
and process `i` packs its slice into its `batch_size // process_count` rows of each global batch
(`jax.make_array_from_process_local_data` assembles them). The data order therefore depends on
`process_count`. The iterator state is per process and records both; a checkpoint holds every
process's, and a resume on another process count recomputes each slice from the global read
position (the rule is in `data/reshard.py`). With finite `epochs` processes may run out of packed
rows at different steps: train for a step count.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import Unpack

import numpy as np

from posttrain.data.examples import preference_example, rl_prompt_example, sft_example
from posttrain.data.images import ImageSpec
from posttrain.data.packing import Packer, build_row, fit_length, stack_rows
from posttrain.data.sources import DataError, read_jsonl
from posttrain.data.tokenizer import Tokenizer

__all__ = ["BatchIterator", "DataError", "preference_batches", "read_jsonl", "rl_prompt_batches", "sft_batches"]
from posttrain.data.iterator import Batcher, BatchIterator, Reading, pipeline_iterator


def sft_batches(
    paths: str | Sequence[str],
    tok: Tokenizer,
    *,
    seq_len: int,
    packing: bool = True,
    truncate: bool = False,
    fields: Mapping[str, str] | None = None,
    open_rows: int = 8,
    final_seq_len: int | None = None,
    images: ImageSpec | None = None,
    **reading: Unpack[Reading],
) -> BatchIterator:
    """SFT batches in the train step's format (`inputs, targets, loss_mask, positions,
    segment_ids`, each `[batch_size // process_count, seq_len]` int32; with `images`, also
    `patches` float32 [rows, seq_len, patch_dim] aligned with `inputs`, see `data.packing`).

    `packing` puts several conversations in a row (first-fit over `open_rows` open rows);
    otherwise one per row. An example longer than `seq_len` is a bad record ("too long") unless
    `truncate`, which keeps its first `seq_len` tokens and counts it in `truncated`. `reading`:
    epochs, shuffle, process slice, ... (`data.iterator.Reading`); `epochs=None` repeats forever;
    the last batch of finite data is filled with padding rows.

    `final_seq_len` (> seq_len) makes this an early stage of a staged-context run: "too long" and
    `truncate` apply at `final_seq_len`, and an example that fits it but not `seq_len` is deferred
    (counted in `deferred`, trained in a later epoch) — short examples first, re-packed at each
    stage (`continue_from`).

    Images in records (`{"type": "image", "image": path}` parts, `data.images`) need `images`; a
    missing or undecodable image is a bad record, and so is an example whose truncation would
    cut an image.
    """
    final = max(final_seq_len or seq_len, seq_len)
    row = lambda examples: build_row(examples, seq_len, pad_id=tok.pad_id, images=images)
    empty = row([])

    def batcher(rows: int) -> Batcher:
        collate = lambda batch_rows: stack_rows([row(r) for r in batch_rows], rows, empty)
        return Batcher(rows, collate, Packer(seq_len, open_rows=open_rows) if packing else None)

    make = lambda r, path: sft_example(r, tok, fields=fields, images=images, path=path)
    fit = functools.partial(fit_example, seq_len=seq_len, final=final, truncate=truncate, images=images)
    shape = dict(seq_len=seq_len, packing=packing, open_rows=open_rows, truncate=truncate)
    shape |= {"final_seq_len": final} if final != seq_len else {}
    shape |= {"images": list(images)} if images is not None else {}
    return pipeline_iterator("sft", paths, tok, make, fit, batcher, fields=fields, **shape, **reading)


def fit_example(
    example: dict, *, seq_len: int, final: int, truncate: bool, images: ImageSpec | None
) -> tuple[dict | None, str | None, bool]:
    """(the example as trained now, or None; why it is a bad record, or None; whether it was cut):
    over `final` tokens it is bad unless `truncate` cuts it (never through an image); over
    `seq_len` (an early stage of a staged context) it waits for a later, longer stage."""
    n = len(example["tokens"])
    cut = n > final and truncate
    if n > final and not truncate:
        return None, f"too long: {n} tokens > seq_len={final} (truncate=True would cut it)", False
    if cut:
        try:
            example = fit_length(example, final, truncate=True, images=images)
        except ValueError:
            return None, f"too long: {n} tokens > seq_len={final}, and truncating would cut an image", False
    if len(example["tokens"]) > seq_len:
        return None, None, cut  # deferred to a later, longer stage
    return example, None, cut


def preference_row(example: dict | None, max_len: int, pad_id: int = 0) -> dict[str, np.ndarray]:
    """A preference pair → `chosen_*` and `rejected_*` rows (prompt + response, loss on the
    response's assistant tokens); `None` → padding rows."""
    row = {}
    for side in ("chosen", "rejected"):
        examples = []
        if example is not None:
            p = len(example["prompt"])
            examples = [
                {
                    "tokens": np.concatenate([example["prompt"], example[side]]),
                    "loss_mask": np.concatenate([np.zeros(p, bool), example[f"{side}_mask"]]),
                }
            ]
        row.update({f"{side}_{k}": v for k, v in build_row(examples, max_len, pad_id=pad_id).items()})
    return row


def preference_batches(
    paths: str | Sequence[str],
    tok: Tokenizer,
    *,
    max_len: int,
    fields: Mapping[str, str] | None = None,
    **reading: Unpack[Reading],
) -> BatchIterator:
    """Preference batches, one pair per row: `chosen_{inputs,targets,loss_mask,positions,
    segment_ids}` and `rejected_*`, each `[batch_size // process_count, max_len]` int32.

    A pair whose prompt + longer response exceeds `max_len` is a bad record ("too long").
    `reading`: batch_size, seed, epochs, ... (`data.iterator.Reading`).
    """

    def fit(example: dict) -> tuple[dict | None, str | None, bool]:
        n = len(example["prompt"]) + max(len(example["chosen"]), len(example["rejected"]))
        if n > max_len:
            return None, f"too long: prompt + response = {n} tokens > max_len={max_len}", False
        return example, None, False

    empty = preference_row(None, max_len, tok.pad_id)

    def batcher(rows: int) -> Batcher:
        return Batcher(
            rows, lambda rs: stack_rows([preference_row(r[0], max_len, tok.pad_id) for r in rs], rows, empty)
        )

    make = lambda r, path: preference_example(r, tok, fields=fields)
    return pipeline_iterator("preference", paths, tok, make, fit, batcher, fields=fields, max_len=max_len, **reading)


def rl_prompt_batches(
    paths: str | Sequence[str],
    tok: Tokenizer,
    *,
    fields: Mapping[str, str] | None = None,
    max_prompt_len: int | None = None,
    images: ImageSpec | None = None,
    **reading: Unpack[Reading],
) -> BatchIterator:
    """RL prompt batches: lists of `rl_prompt_example` dicts, `batch_size // process_count` each
    (the last batch of finite data may be shorter). A prompt over `max_prompt_len` tokens is a
    bad record ("too long"). With `images`, image parts are read (each dict's `pixels`).
    `reading`: batch_size, seed, epochs, ... (`data.iterator.Reading`)."""

    def fit(example: dict) -> tuple[dict | None, str | None, bool]:
        n = len(example["prompt"])
        if max_prompt_len is not None and n > max_prompt_len:
            return None, f"too long: prompt of {n} tokens > max_prompt_len={max_prompt_len}", False
        return example, None, False

    make = lambda r, path: rl_prompt_example(r, tok, fields=fields, images=images, path=path)
    batcher = lambda rows: Batcher(rows, lambda batch_rows: [r[0] for r in batch_rows])
    shape = {"max_prompt_len": max_prompt_len} | ({"images": list(images)} if images is not None else {})
    return pipeline_iterator("rl_prompts", paths, tok, make, fit, batcher, fields=fields, **shape, **reading)
