"""The device programs of continuous batching: decode slots refilled inside one jitted loop, from a
queue of prompts (`slot_refill`) or from a prefilled group's cache rows (`group_refill`).
`continuous.py` drives them from the host."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.sampling import engine, kv_cache
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
    patches: jax.Array | None = None,
):
    """`engine.decode_loop`'s refill for a request queue tokens [Q + C, P], lengths, new-token
    limits, sample_ids [Q + C] (C = prefill_batch; rows >= num_requests are padding); `layers`
    as `engine.decode_layers` gives them; RNG keys from `key` (see `engine.token_keys`); patches
    [Q + C, P, patch_dim]: the requests' images, prefilled with their tokens (or None).

    While at least min(C, waiting) slots are free, the next C requests are prefilled together and
    moved into the first free slots; a prefill is never wasted on requests that find no slot.
    """

    def fill(slots, nxt, n):
        chunk = lambda a: jax.lax.dynamic_slice_in_dim(a, nxt, prefill_batch)
        images = None if patches is None else chunk(patches)
        logits, kv = engine.prefill(model, chunk(tokens), chunk(lengths), layers, patches=images)
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
    patches: jax.Array | None = None,
    *,
    sampling: SamplingParams,
    pad_id: int,
    num_slots: int,
    prefill_batch: int,
    rules: tuple | None = None,
) -> engine.Outputs:
    """The compiled continuous batcher: a queue tokens [Q + C, P] → Outputs of Q rows (row i is
    request i, drawing from fold_in(key, sample_ids[i])); patches [Q + C, P, patch_dim]: the
    requests' images (or None). `rules`: `generate.sharding_key()`."""
    model = nnx.merge(graphdef, params, rest)
    layers = engine.decode_layers(model)
    queue_rows, prompt_len = tokens.shape[0] - prefill_batch, tokens.shape[1]
    logits, kv = jax.eval_shape(lambda: engine.prefill(model, tokens[:prefill_batch], lengths[:prefill_batch], layers))
    slots = _empty_slots(kv, logits, num_slots, prompt_len + sampling.max_new_tokens, key, sampling.max_new_tokens)
    out = engine.Outputs.empty(queue_rows, sampling.max_new_tokens, pad_id)
    refill = slot_refill(
        model,
        layers,
        tokens,
        lengths,
        limits,
        sample_ids,
        num_requests,
        prefill_batch,
        key,
        sampling.max_new_tokens,
        patches,
    )
    return _decode_queue(model, layers, slots, out, sampling, pad_id, refill, num_requests)


@engine.static_program("num_slots", "refill_batch")
def grouped_continuous_program(
    model: nnx.Module,
    prompts: engine.Prompts,
    *,
    sampling: SamplingParams,
    pad_id: int,
    num_slots: int,
    refill_batch: int,
) -> engine.Outputs:
    """`generate_program`'s contract (arguments: `engine.static_program`; prompts tokens [B, P] and
    their images patches [B, P, patch_dim] or None, prefilled once; B * G output rows, sample i*G+g
    from fold_in(key, i*G+g)) decoded in `num_slots` continuously refilled slots."""
    tokens, lengths, limits, num_prompts, key, patches = prompts
    layers = engine.decode_layers(model)
    logits, kv = engine.prefill(model, tokens, lengths, layers, patches=patches)
    g, max_new = sampling.num_samples, sampling.max_new_tokens
    slots = _empty_slots(kv, logits, num_slots, tokens.shape[1] + max_new, key, max_new)
    out = engine.Outputs.empty(tokens.shape[0] * g, max_new, pad_id)
    num_requests = num_prompts * g
    refill = group_refill(logits, kv, lengths, limits, g, num_requests, refill_batch, key, max_new)
    return _decode_queue(model, layers, slots, out, sampling, pad_id, refill, num_requests)


def _decode_queue(model, layers, slots, out, sampling, pad_id, refill, num_requests: jax.Array) -> engine.Outputs:
    """`engine.decode_loop` of slots refilled by `refill` from a queue of `num_requests` requests,
    its state the next request's index."""
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
