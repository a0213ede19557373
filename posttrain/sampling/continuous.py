"""Continuous batching: a fixed number of decode slots; a finished sample's slot is refilled with
the next waiting request (prefilled into that slot) inside the same device loop, so a few long
completions do not idle the batch.

Every request samples from its own RNG stream fold_in(key, sample id), so its completion does not
depend on which slot it ran in or when: with the same key it equals static `generate`'s (up to
float rounding of the different batch shapes).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.sampling import engine, kv_cache
from posttrain.sampling.generate import (MIN_PROMPT_BUCKET, Samples, bucket, new_token_limits, pad_prompts,
                                         prompt_rows, sharding_key)
from posttrain.sampling.rules import SamplingParams


def slot_refill(model: nnx.Module, layers: list | None, tokens: jax.Array, lengths: jax.Array,
                limits: jax.Array, sample_ids: jax.Array, num_requests: jax.Array, prefill_batch: int,
                key: jax.Array, max_new: int):
    """`engine.decode_loop`'s refill for a request queue tokens [Q + C, P], lengths, new-token
    limits, sample_ids [Q + C] (C = prefill_batch; rows >= num_requests are padding); `layers`
    as `engine.decode_layers` gives them; RNG keys from `key` (see `engine.token_keys`).

    The queue state is the next request's index. While at least min(C, waiting) slots are free,
    the next C requests are prefilled together and moved into the first free slots; a prefill is
    never wasted on requests that find no slot.
    """
    def take(nxt):
        return jnp.minimum(prefill_batch, num_requests - nxt)

    def can_fill(carry):
        slots, nxt = carry
        return (take(nxt) > 0) & (jnp.sum(slots.done) >= take(nxt))

    def fill(carry):
        slots, nxt = carry
        n, num_slots = take(nxt), slots.done.shape[0]
        chunk = lambda a: jax.lax.dynamic_slice_in_dim(a, nxt, prefill_batch)
        logits, kv = engine.prefill(model, chunk(tokens), chunk(lengths), layers)
        free = jnp.nonzero(slots.done, size=prefill_batch, fill_value=num_slots)[0]
        dest = jnp.where(jnp.arange(prefill_batch) < n, free, num_slots)     # out of range: dropped
        put = lambda a, v: a.at[dest].set(v, mode="drop")
        slots = slots.replace(cache=kv_cache.insert_rows(slots.cache, kv, dest), logits=put(slots.logits, logits),
                              prompt_len=put(slots.prompt_len, chunk(lengths)), step=put(slots.step, 0),
                              limit=put(slots.limit, chunk(limits)),
                              done=put(slots.done, False),
                              keys=put(slots.keys, engine.token_keys(key, chunk(sample_ids), max_new)),
                              row=put(slots.row, nxt + jnp.arange(prefill_batch, dtype=jnp.int32)))
        return slots, nxt + n

    return lambda slots, nxt: jax.lax.while_loop(can_fill, fill, (slots, nxt))


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "pad_id", "num_slots", "prefill_batch", "rules"))
def continuous_program(graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, tokens: jax.Array,
                       lengths: jax.Array, limits: jax.Array, sample_ids: jax.Array, num_requests: jax.Array,
                       key: jax.Array, *, sampling: SamplingParams, pad_id: int, num_slots: int, prefill_batch: int,
                       rules: tuple | None = None) -> engine.Outputs:
    """The compiled continuous batcher: a queue tokens [Q + C, P] → Outputs of Q rows (row i is
    request i, drawing from fold_in(key, sample_ids[i])). `rules`: `generate.sharding_key()`."""
    model = nnx.merge(graphdef, params, rest)
    layers = engine.decode_layers(model)
    queue_rows, prompt_len = tokens.shape[0] - prefill_batch, tokens.shape[1]
    logits, kv = jax.eval_shape(lambda: engine.prefill(model, tokens[:prefill_batch], lengths[:prefill_batch], layers))
    zeros = jnp.zeros((num_slots,), jnp.int32)
    slots = engine.Slots(cache=kv_cache.empty_like(kv, num_slots, prompt_len + sampling.max_new_tokens),
                         logits=jnp.zeros((num_slots, logits.shape[1]), jnp.float32), prompt_len=zeros,
                         step=zeros, limit=zeros, done=jnp.ones((num_slots,), bool),
                         keys=engine.token_keys(key, zeros, sampling.max_new_tokens), row=zeros)
    out = engine.Outputs.empty(queue_rows, sampling.max_new_tokens, pad_id)
    refill = slot_refill(model, layers, tokens, lengths, limits, sample_ids, num_requests, prefill_batch, key,
                         sampling.max_new_tokens)
    return engine.decode_loop(model, slots, out, sampling, pad_id, layers=layers, refill=refill,
                              pending=lambda nxt: nxt < num_requests, queue=jnp.zeros((), jnp.int32))


class ContinuousBatcher:
    """Queue prompts with `submit`, then `run` them through `num_slots` continuously refilled slots.

    Each prompt becomes `sampling.num_samples` requests (each prefilled on its own); request r's
    g-th sample draws from fold_in(key, r * G + g), like `generate`'s sample r * G + g. `run`
    returns every waiting request's samples exactly once and empties the queue.
    """

    def __init__(self, graphdef: nnx.GraphDef, sampling: SamplingParams, *, num_slots: int = 16,
                 prefill_batch: int = 4, pad_id: int = 0):
        if sampling.speculative_k:
            raise ValueError("ContinuousBatcher: speculative decoding (speculative_k > 0) runs in `generate` only")
        if not 1 <= prefill_batch <= num_slots:
            raise ValueError(f"prefill_batch={prefill_batch}: expected 1..num_slots ({num_slots})")
        self.graphdef, self.sampling, self.pad_id = graphdef, sampling, pad_id
        self.num_slots, self.prefill_batch = num_slots, prefill_batch
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
        rows = [row for _, row, _ in self._waiting for _ in range(g)]
        n, c = len(rows), self.prefill_batch
        tokens, lengths = pad_prompts(rows, bucket(n) + c, bucket(max(map(len, rows)), MIN_PROMPT_BUCKET),
                                      self.pad_id)
        limits = np.ones((len(tokens),), np.int32)
        limits[:n] = np.repeat([limit for _, _, limit in self._waiting], g)
        ids = np.zeros((len(tokens),), np.int32)
        ids[:n] = rids * g + np.tile(np.arange(g), len(self._waiting))
        out = continuous_program(self.graphdef, params, rest, tokens, lengths, limits, ids, np.int32(n), key,
                                 sampling=self.sampling, pad_id=self.pad_id, num_slots=self.num_slots,
                                 prefill_batch=c, rules=sharding_key())
        out = jax.device_get(out)
        self._waiting = []
        return Samples(tokens=out.tokens[:n], logprobs=out.logprobs[:n], sampling_logprobs=out.sampling_logprobs[:n],
                       lengths=out.lengths[:n], stop_reason=out.stop_reason[:n], prompt_index=rids)
