"""Continuous batching: a fixed number of decode slots; a finished sample's slot is refilled with
the next waiting sample inside the same device loop, so a few long completions do not idle the
batch.

Every request samples from its own RNG stream fold_in(key, sample id), so its completion does not
depend on which slot it ran in or when: with the same key it equals static `generate`'s (up to
float rounding of the different batch shapes).

`generate(..., slots=SlotConfig(...))` runs a call's prompts this way (the RL rollouts, with
`sampling.continuous_batching`): it prefills the prompts once, as a static batch does, and a free
slot takes a copy of its next sample's prompt cache row (`group_refill`). `ContinuousBatcher`
queues requests across calls and prefills each when a slot frees up (`slot_refill`), so a
long queue never holds every prompt's cache at once.

Images: a prompt may come with its image patches (`generate`'s `patches`), prefilled with its
tokens, wherever its prefill runs (once per prompt, or when its request takes a slot); decode steps
need none (generated tokens are text). A call with no images runs the text-only programs.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from posttrain.sampling import engine
from posttrain.sampling.continuous_programs import continuous_program
from posttrain.sampling.generate import (
    MIN_PROMPT_BUCKET,
    Samples,
    SlotConfig,
    bucket,
    check_request,
    host_outputs,
    host_samples,
    image_rows,
    new_token_limits,
    pad_patches,
    pad_prompts,
    prompt_rows,
    sharding_key,
)
from posttrain.sampling.rules import SamplingParams


def run_requests(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    rows: list[np.ndarray],
    limits: np.ndarray,
    sample_ids: np.ndarray,
    sampling: SamplingParams,
    key: jax.Array,
    slots: SlotConfig,
    pad_id: int,
    patches: list[np.ndarray | None] | None = None,
) -> engine.Outputs:
    """Run requests (prompt `rows`, new-token `limits` and RNG `sample_ids`, one each, in order)
    through `continuous_program`; host outputs of exactly len(rows) rows. `patches`: per request,
    its prompt's image patches or None."""
    check_request(sampling, slots=slots)
    n, c = len(rows), slots.refill_batch
    tokens, lengths = pad_prompts(rows, bucket(n) + c, bucket(max(map(len, rows)), MIN_PROMPT_BUCKET), pad_id)
    patches = image_rows(patches)
    padded_limits, ids = np.ones((len(tokens),), np.int32), np.zeros((len(tokens),), np.int32)
    padded_limits[:n], ids[:n] = limits, sample_ids
    out = continuous_program(
        graphdef,
        params,
        rest,
        tokens,
        lengths,
        padded_limits,
        ids,
        np.int32(n),
        key,
        None if patches is None else pad_patches(patches, rows, tokens.shape),
        sampling=sampling,
        pad_id=pad_id,
        num_slots=slots.num_slots,
        prefill_batch=c,
        rules=sharding_key(),
    )
    return jax.tree.map(lambda a: a[:n], host_outputs(out))


class ContinuousBatcher:
    """Queue prompts with `submit`, then `run` them through `num_slots` continuously refilled slots.

    Each prompt becomes `sampling.num_samples` requests (each prefilled on its own); request r's
    g-th sample draws from fold_in(key, r * G + g), like `generate`'s sample r * G + g. `run`
    returns every waiting request's samples exactly once and empties the queue.
    """

    def __init__(
        self,
        graphdef: nnx.GraphDef,
        sampling: SamplingParams,
        *,
        num_slots: int = 16,
        prefill_batch: int = 4,
        pad_id: int = 0,
    ):
        self.slots = SlotConfig(num_slots, prefill_batch)
        check_request(sampling, slots=self.slots)
        self.graphdef, self.sampling, self.pad_id = graphdef, sampling, pad_id
        self._next_id = 0
        self._waiting: list[tuple[int, np.ndarray, int, np.ndarray | None]] = []

    def submit(
        self, prompt: Sequence[int], max_new_tokens: int | None = None, patches: np.ndarray | None = None
    ) -> int:
        """Queue a prompt (token ids), optionally with its own new-token limit (<= the sampling
        params') and its image patches ([len, patch_dim], as `generate` takes them); returns its
        request id."""
        (row,) = prompt_rows([prompt])
        (limit,) = new_token_limits(None if max_new_tokens is None else [max_new_tokens], 1, 1, self.sampling)
        self.sampling.check_context([len(row)], [limit])
        if patches is not None and len(patches) != len(row):
            raise ValueError(f"patches: {len(patches)} rows for a prompt of {len(row)} tokens")
        rid, self._next_id = self._next_id, self._next_id + 1
        self._waiting.append((rid, row, limit, patches))
        return rid

    def run(self, params: nnx.State, rest: nnx.State, key: jax.Array) -> Samples:
        """Generate for every waiting request; `Samples.prompt_index` holds the request ids."""
        if not self._waiting:
            raise ValueError("ContinuousBatcher.run: no requests submitted")
        g = self.sampling.num_samples
        rids = np.repeat([rid for rid, *_ in self._waiting], g)
        out = run_requests(
            self.graphdef,
            params,
            rest,
            [row for _, row, _, _ in self._waiting for _ in range(g)],
            np.repeat([limit for _, _, limit, _ in self._waiting], g),
            rids * g + np.tile(np.arange(g), len(self._waiting)),
            self.sampling,
            key,
            self.slots,
            self.pad_id,
            [p for *_, p in self._waiting for _ in range(g)],
        )
        self._waiting = []
        return host_samples(out, rids)
