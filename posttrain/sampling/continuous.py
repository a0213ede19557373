"""Continuous batching: a fixed number of decode slots; a finished sample's slot is refilled with
the next waiting sample inside the same device loop, so a few long completions do not idle the
batch.

Every request samples from its own RNG stream fold_in(key, sample id), so its completion does not
depend on which slot it ran in or when: with the same key it equals static `generate`'s (up to
float rounding of the different batch shapes).

`generate_continuous` has `generate`'s contract (the RL rollouts call either, `sampling.
continuous_batching`): it prefills the prompts once, as `generate` does, and a free slot takes a
copy of its next sample's prompt cache row (`group_refill`). `ContinuousBatcher` queues requests
across calls and prefills each when a slot frees up (`slot_refill`), so a long queue never holds
every prompt's cache at once.

Images: a prompt may come with its image patches (`generate`'s `patches`), prefilled with its
tokens, wherever its prefill runs (once per prompt, or when its request takes a slot); decode steps
need none (generated tokens are text). A call with no images runs the text-only programs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from posttrain.sampling import engine
from posttrain.sampling.continuous_programs import continuous_program, grouped_continuous_program
from posttrain.sampling.generate import (
    MIN_PROMPT_BUCKET,
    PaddedPrompts,
    Samples,
    bucket,
    host_outputs,
    host_samples,
    image_rows,
    new_token_limits,
    pad_patches,
    pad_prompts,
    prompt_rows,
    sharding_key,
    static_samples,
)
from posttrain.sampling.rules import SamplingParams


@dataclasses.dataclass(frozen=True)
class SlotConfig:
    """Continuous batching's shape: `num_slots` decode slots (rows of the KV cache), free slots
    refilled `refill_batch` samples at a time (`ContinuousBatcher`: requests prefilled together)."""

    num_slots: int = 16
    refill_batch: int = 4

    def __post_init__(self):
        if not 1 <= self.refill_batch <= self.num_slots:
            raise ValueError(f"refill_batch={self.refill_batch}: expected 1..num_slots ({self.num_slots})")

    def fitted(self, num_requests: int) -> SlotConfig:
        """No more slots than the (bucketed) requests of one call can fill: a call with fewer
        samples than slots runs them all at once, like a static batch."""
        slots = min(self.num_slots, bucket(num_requests))
        return SlotConfig(slots, min(self.refill_batch, slots))

    @classmethod
    def of(cls, sampling) -> SlotConfig | None:
        """`sampling.continuous_batching`'s slots (from the `sampling` section), or None: static batches."""
        return cls(sampling.num_slots, sampling.refill_batch) if sampling.continuous_batching else None


def static_only(sampling: SamplingParams) -> None:
    """Refuse what only the static sampler (`generate`) does: speculative decoding, recording routing."""
    if sampling.speculative_k:
        raise ValueError("continuous batching: speculative decoding (speculative_k > 0) runs in `generate` only")
    if sampling.record_routing:
        raise ValueError("continuous batching: routing is recorded by the static sampler (`generate`) only")


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
    static_only(sampling)
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


def generate_continuous(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    sampling: SamplingParams,
    key: jax.Array,
    *,
    slots: SlotConfig = SlotConfig(),
    pad_id: int = 0,
    prompt_mask: np.ndarray | None = None,
    max_new_tokens: Sequence[int] | None = None,
    patches: Sequence[np.ndarray | None] | None = None,
) -> Samples:
    """`generate` through continuously refilled slots: the same contract and the same samples.

    The prompts are prefilled once, as in `generate`; their `num_samples` samples each are the
    queue. Sample i*G+g is prompt i's g-th and draws from fold_in(key, i*G+g), so with the same
    key every sample's tokens are the same and its log-probs equal to float rounding, whatever
    slot ran it. A few long samples then hold a few slots while the rest of the queue flows
    through the others, instead of holding every row of a static batch until they end.
    `patches`: per prompt, its image patches or None, as `generate` takes them.
    """
    static_only(sampling)
    batch = PaddedPrompts.of(
        prompts, sampling, pad_id, prompt_mask=prompt_mask, max_new_tokens=max_new_tokens, patches=patches
    )
    n, g = len(batch.rows), sampling.num_samples
    fitted = slots.fitted(n * g)
    out = batch.run(
        grouped_continuous_program,
        graphdef,
        params,
        rest,
        key,
        batch.image_patches(),
        num_slots=fitted.num_slots,
        refill_batch=fitted.refill_batch,
    )
    return static_samples(host_outputs(out), n, g)


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
        if sampling.speculative_k:
            raise ValueError("ContinuousBatcher: speculative decoding (speculative_k > 0) runs in `generate` only")
        self.slots = SlotConfig(num_slots, prefill_batch)
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
