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
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.sampling import engine, kv_cache
from posttrain.sampling.generate import (
    MIN_PROMPT_BUCKET,
    Samples,
    bucket,
    host_outputs,
    new_token_limits,
    pad_prompts,
    prompt_rows,
    sharding_key,
)
from posttrain.sampling.rules import SamplingParams


def _place(
    slots: engine.Slots,
    n: jax.Array,
    logits: jax.Array,
    kv,
    prompt_len: jax.Array,
    limits: jax.Array,
    keys: jax.Array,
    rows: jax.Array,
) -> engine.Slots:
    """The first n of C new samples (their next-token logits [C, V], prompt kv, prompt lengths,
    new-token limits, token keys and output rows) moved into the first n free slots."""
    c, num_slots = logits.shape[0], slots.done.shape[0]
    free = jnp.nonzero(slots.done, size=c, fill_value=num_slots)[0]
    dest = jnp.where(jnp.arange(c) < n, free, num_slots)  # out of range: dropped
    put = lambda a, v: a.at[dest].set(v, mode="drop")
    return slots.replace(
        cache=kv_cache.insert_rows(slots.cache, kv, dest),
        logits=put(slots.logits, logits),
        prompt_len=put(slots.prompt_len, prompt_len),
        step=put(slots.step, 0),
        limit=put(slots.limit, limits),
        done=put(slots.done, False),
        keys=put(slots.keys, keys),
        row=put(slots.row, rows),
    )


def _refill_loop(fill_batch: int, num_requests: jax.Array, fill):
    """Refill while at least min(fill_batch, waiting) slots are free: `fill(slots, nxt, n)` places
    requests nxt .. nxt+n-1. The queue state is the next request's index."""

    def take(nxt):
        return jnp.minimum(fill_batch, num_requests - nxt)

    def can_fill(carry):
        slots, nxt = carry
        return (take(nxt) > 0) & (jnp.sum(slots.done) >= take(nxt))

    def body(carry):
        slots, nxt = carry
        return fill(slots, nxt, take(nxt)), nxt + take(nxt)

    return lambda slots, nxt: jax.lax.while_loop(can_fill, body, (slots, nxt))


def slot_refill(
    model: nnx.Module,
    layers: list | None,
    tokens: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    sample_ids: jax.Array,
    num_requests: jax.Array,
    prefill_batch: int,
    key: jax.Array,
    max_new: int,
):
    """`engine.decode_loop`'s refill for a request queue tokens [Q + C, P], lengths, new-token
    limits, sample_ids [Q + C] (C = prefill_batch; rows >= num_requests are padding); `layers`
    as `engine.decode_layers` gives them; RNG keys from `key` (see `engine.token_keys`).

    While at least min(C, waiting) slots are free, the next C requests are prefilled together and
    moved into the first free slots; a prefill is never wasted on requests that find no slot.
    """

    def fill(slots, nxt, n):
        chunk = lambda a: jax.lax.dynamic_slice_in_dim(a, nxt, prefill_batch)
        logits, kv = engine.prefill(model, chunk(tokens), chunk(lengths), layers)
        return _place(
            slots,
            n,
            logits,
            kv,
            chunk(lengths),
            chunk(limits),
            engine.token_keys(key, chunk(sample_ids), max_new),
            nxt + jnp.arange(prefill_batch, dtype=jnp.int32),
        )

    return _refill_loop(prefill_batch, num_requests, fill)


def group_refill(
    logits: jax.Array,
    kv,
    lengths: jax.Array,
    limits: jax.Array,
    num_samples: int,
    num_requests: jax.Array,
    refill_batch: int,
    key: jax.Array,
    max_new: int,
):
    """`engine.decode_loop`'s refill from prompts prefilled once (next-token logits [B, V], kv,
    lengths and new-token limits [B]): request r is prompt r // G's sample r % G, with RNG id and
    output row r, as static `generate`'s sample r. A free slot gets a copy of its prompt's cache
    row and logits (no prefill inside the loop), `refill_batch` slots at a time.
    """

    def fill(slots, nxt, n):
        request = nxt + jnp.arange(refill_batch, dtype=jnp.int32)
        prompt = jnp.minimum(request // num_samples, lengths.shape[0] - 1)
        rows_kv = jax.tree.map(lambda a: jnp.take(a, prompt, axis=a.ndim - 4), kv)  # [.., B, ..] → [.., C, ..]
        return _place(
            slots,
            n,
            logits[prompt],
            rows_kv,
            lengths[prompt],
            limits[prompt],
            engine.token_keys(key, request, max_new),
            request,
        )

    return _refill_loop(refill_batch, num_requests, fill)


def _empty_slots(kv, logits: jax.Array, num_slots: int, capacity: int, key: jax.Array, max_new: int) -> engine.Slots:
    """`num_slots` free slots with caches of `capacity` entries, shaped like a prefill's kv and logits."""
    zeros = jnp.zeros((num_slots,), jnp.int32)
    return engine.Slots(
        cache=kv_cache.empty_like(kv, num_slots, capacity),
        logits=jnp.zeros((num_slots, logits.shape[1]), jnp.float32),
        prompt_len=zeros,
        step=zeros,
        limit=zeros,
        done=jnp.ones((num_slots,), bool),
        keys=engine.token_keys(key, zeros, max_new),
        row=zeros,
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "pad_id", "num_slots", "prefill_batch", "rules"))
def continuous_program(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    tokens: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    sample_ids: jax.Array,
    num_requests: jax.Array,
    key: jax.Array,
    *,
    sampling: SamplingParams,
    pad_id: int,
    num_slots: int,
    prefill_batch: int,
    rules: tuple | None = None,
) -> engine.Outputs:
    """The compiled continuous batcher: a queue tokens [Q + C, P] → Outputs of Q rows (row i is
    request i, drawing from fold_in(key, sample_ids[i])). `rules`: `generate.sharding_key()`."""
    model = nnx.merge(graphdef, params, rest)
    layers = engine.decode_layers(model)
    queue_rows, prompt_len = tokens.shape[0] - prefill_batch, tokens.shape[1]
    logits, kv = jax.eval_shape(lambda: engine.prefill(model, tokens[:prefill_batch], lengths[:prefill_batch], layers))
    slots = _empty_slots(kv, logits, num_slots, prompt_len + sampling.max_new_tokens, key, sampling.max_new_tokens)
    out = engine.Outputs.empty(queue_rows, sampling.max_new_tokens, pad_id)
    refill = slot_refill(
        model, layers, tokens, lengths, limits, sample_ids, num_requests, prefill_batch, key, sampling.max_new_tokens
    )
    return engine.decode_loop(
        model,
        slots,
        out,
        sampling,
        pad_id,
        layers=layers,
        refill=refill,
        pending=lambda nxt: nxt < num_requests,
        queue=jnp.zeros((), jnp.int32),
    )


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "pad_id", "num_slots", "refill_batch", "rules"))
def grouped_continuous_program(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    tokens: jax.Array,
    lengths: jax.Array,
    limits: jax.Array,
    num_prompts: jax.Array,
    key: jax.Array,
    *,
    sampling: SamplingParams,
    pad_id: int,
    num_slots: int,
    refill_batch: int,
    rules: tuple | None = None,
) -> engine.Outputs:
    """`generate_program`'s contract (prompts tokens [B, P] prefilled once, B * G output rows,
    sample i*G+g from fold_in(key, i*G+g)) decoded in `num_slots` continuously refilled slots.
    `rules`: `generate.sharding_key()`, the rules it is traced under (part of the compile key)."""
    model = nnx.merge(graphdef, params, rest)
    layers = engine.decode_layers(model)
    logits, kv = engine.prefill(model, tokens, lengths, layers)
    g, max_new = sampling.num_samples, sampling.max_new_tokens
    slots = _empty_slots(kv, logits, num_slots, tokens.shape[1] + max_new, key, max_new)
    out = engine.Outputs.empty(tokens.shape[0] * g, max_new, pad_id)
    num_requests = num_prompts * g
    refill = group_refill(logits, kv, lengths, limits, g, num_requests, refill_batch, key, max_new)
    return engine.decode_loop(
        model,
        slots,
        out,
        sampling,
        pad_id,
        layers=layers,
        refill=refill,
        pending=lambda nxt: nxt < num_requests,
        queue=jnp.zeros((), jnp.int32),
    )


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
) -> engine.Outputs:
    """Run requests (prompt `rows`, new-token `limits` and RNG `sample_ids`, one each, in order)
    through `continuous_program`; host outputs of exactly len(rows) rows."""
    if sampling.speculative_k:
        raise ValueError("continuous batching: speculative decoding (speculative_k > 0) runs in `generate` only")
    n, c = len(rows), slots.refill_batch
    tokens, lengths = pad_prompts(rows, bucket(n) + c, bucket(max(map(len, rows)), MIN_PROMPT_BUCKET), pad_id)
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
) -> Samples:
    """`generate` through continuously refilled slots: the same contract and the same samples.

    The prompts are prefilled once, as in `generate`; their `num_samples` samples each are the
    queue. Sample i*G+g is prompt i's g-th and draws from fold_in(key, i*G+g), so with the same
    key every sample's tokens are the same and its log-probs equal to float rounding, whatever
    slot ran it. A few long samples then hold a few slots while the rest of the queue flows
    through the others, instead of holding every row of a static batch until they end.
    """
    if sampling.speculative_k:
        raise ValueError("continuous batching: speculative decoding (speculative_k > 0) runs in `generate` only")
    rows = prompt_rows(prompts, prompt_mask)
    n, g = len(rows), sampling.num_samples
    tokens, lengths = pad_prompts(rows, bucket(n), bucket(max(map(len, rows)), MIN_PROMPT_BUCKET), pad_id)
    limits = new_token_limits(max_new_tokens, len(tokens), n, sampling)
    fitted = slots.fitted(n * g)
    out = grouped_continuous_program(
        graphdef,
        params,
        rest,
        tokens,
        lengths,
        limits,
        np.int32(n),
        key,
        sampling=sampling,
        pad_id=pad_id,
        num_slots=fitted.num_slots,
        refill_batch=fitted.refill_batch,
        rules=sharding_key(),
    )
    out = jax.tree.map(lambda a: a[: n * g], host_outputs(out))
    return Samples(
        tokens=out.tokens,
        logprobs=out.logprobs,
        sampling_logprobs=out.sampling_logprobs,
        lengths=out.lengths,
        stop_reason=out.stop_reason,
        prompt_index=np.repeat(np.arange(n), g),
    )


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
        self._waiting: list[tuple[int, np.ndarray, int]] = []

    def submit(self, prompt: Sequence[int], max_new_tokens: int | None = None) -> int:
        """Queue a prompt (token ids), optionally with its own new-token limit (<= the sampling
        params'); returns its request id."""
        (row,) = prompt_rows([prompt])
        (limit,) = new_token_limits(None if max_new_tokens is None else [max_new_tokens], 1, 1, self.sampling)
        rid, self._next_id = self._next_id, self._next_id + 1
        self._waiting.append((rid, row, limit))
        return rid

    def run(self, params: nnx.State, rest: nnx.State, key: jax.Array) -> Samples:
        """Generate for every waiting request; `Samples.prompt_index` holds the request ids."""
        if not self._waiting:
            raise ValueError("ContinuousBatcher.run: no requests submitted")
        g = self.sampling.num_samples
        rids = np.repeat([rid for rid, _, _ in self._waiting], g)
        out = run_requests(
            self.graphdef,
            params,
            rest,
            [row for _, row, _ in self._waiting for _ in range(g)],
            np.repeat([limit for _, _, limit in self._waiting], g),
            rids * g + np.tile(np.arange(g), len(self._waiting)),
            self.sampling,
            key,
            self.slots,
            self.pad_id,
        )
        self._waiting = []
        return Samples(
            tokens=out.tokens,
            logprobs=out.logprobs,
            sampling_logprobs=out.sampling_logprobs,
            lengths=out.lengths,
            stop_reason=out.stop_reason,
            prompt_index=rids,
        )
