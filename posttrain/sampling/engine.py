"""The device side of the sampler: prefill, one sampling step, one decode step, the decode loop.

Everything here is traced inside one jitted program per (model, sampling params, bucketed shape).
Decoding works on *slots*: rows of the KV cache, each holding one sample in flight. A slot knows
its prompt length, how many tokens it has generated, whether it is done, the RNG id of its sample
and the output row it writes to, so the same loop serves static batches (slot = sample) and
continuous batching (slots refilled from a queue).
"""

from __future__ import annotations

from typing import NamedTuple

import flax
import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.ops.decode import K_TIME_AXIS, V_TIME_AXIS, extend_attention, write_cache_span
from posttrain.parallel.mesh import accelerator_paths
from posttrain.parallel.sharding import constrain
from posttrain.sampling import kv_cache
from posttrain.sampling.rules import SamplingParams, sample_token

STOP_REASONS = ("stop", "length")  # stop token sampled | new-token limit reached


@flax.struct.dataclass
class Slots:
    """Decode slots (S rows). `logits` are each slot's next-token logits."""

    cache: tuple  # see kv_cache: (k [S, K, Dh, T], v [S, K, T, Dh]) per layer
    logits: jax.Array  # [S, V] float32
    prompt_len: jax.Array  # [S] int32
    step: jax.Array  # [S] int32: tokens generated so far
    limit: jax.Array  # [S] int32: max new tokens of the sample (<= max_new_tokens)
    done: jax.Array  # [S] bool: finished or empty
    keys: jax.Array  # [S, M] PRNG keys: the key of each of the sample's tokens (`token_keys`)
    row: jax.Array  # [S] int32: output row of the sample


@flax.struct.dataclass
class Outputs:
    """Per-sample results, R rows of up to M = max_new_tokens tokens."""

    tokens: jax.Array  # [R, M] int32, pad after the end
    logprobs: jax.Array  # [R, M] float32: policy log-probs (before temperature/filters), 0 after the end
    sampling_logprobs: jax.Array  # [R, M] float32: under the distribution sampled from
    lengths: jax.Array  # [R] int32
    stop_reason: jax.Array  # [R] int32: index into STOP_REASONS
    # with `SamplingParams.record_routing`, the experts each MoE layer chose (`routing_dtype`):
    routing: jax.Array | None = None  # [R, M, num_moe_layers, k]: for generated token m (any after the end)
    prompt_routing: jax.Array | None = None  # [R, P, num_moe_layers, k]: for the prompt (any on padding)

    @classmethod
    def empty(cls, rows: int, max_new: int, pad_id: int) -> Outputs:
        """Buffers for `rows` samples before any token: pad tokens, zero log-probs and lengths."""
        zeros = jnp.zeros((rows, max_new), jnp.float32)
        return cls(
            jnp.full((rows, max_new), pad_id, jnp.int32),
            zeros,
            zeros,
            jnp.zeros((rows,), jnp.int32),
            jnp.zeros((rows,), jnp.int32),
        )


class Prompts(NamedTuple):
    """A static batch inside a sampler program: tokens [B, P], lengths and new-token limits [B] (rows
    >= num_prompts are padding), the RNG key, and the prompts' images patches [B, P, patch_dim] or None."""

    tokens: jax.Array
    lengths: jax.Array
    limits: jax.Array
    num_prompts: jax.Array
    key: jax.Array
    patches: jax.Array | None = None


def static_program(*static_argnames: str):
    """Jit `body(model, prompts, *, sampling, pad_id, **static)` as a sampler program of a static
    batch: program(graphdef, params, rest, tokens, lengths, limits, num_prompts, key, patches=None,
    *, sampling, pad_id, rules=None, **static), the model merge(graphdef, params, rest) and the
    arrays `Prompts`. Static (the compile key): graphdef, sampling, pad_id, the body's own
    `static_argnames` and `rules`, `generate.sharding_key()`: the rules it is traced under, which the
    body never reads."""

    def jit(body):
        def program(
            graphdef, params, rest, tokens, lengths, limits, num_prompts, key, patches=None, *, rules=None, **static
        ):
            del rules
            prompts = Prompts(tokens, lengths, limits, num_prompts, key, patches)
            return body(nnx.merge(graphdef, params, rest), prompts, **static)

        program.__name__, program.__qualname__, program.__doc__ = body.__name__, body.__qualname__, body.__doc__
        return jax.jit(program, static_argnames=("graphdef", "sampling", "pad_id", "rules", *static_argnames))

    return jit


def token_keys(key: jax.Array, sample_ids: jax.Array, max_new: int) -> jax.Array:
    """The RNG key of every token of each sample: fold_in(fold_in(key, id), n) for n < max_new;
    sample_ids [N] → keys [N, max_new]. A sample's draws depend on nothing else (not its slot,
    its batch or when it started). Drawn for all tokens at once: on the CPU every threefry call
    is a loop of its own, too dear for each token."""
    streams = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, sample_ids)
    return jax.vmap(lambda k: jax.vmap(jax.random.fold_in, in_axes=(None, 0))(k, jnp.arange(max_new)))(streams)


def routing_dtype(model: nnx.Module):
    """The smallest integer type that holds the model's expert ids: the recorded routing of every
    token and MoE layer is kept on the device until the batch ends (uint8 up to 256 experts)."""
    experts = max(b.mlp.spec.num_experts for stack in model.stacks for b in stack.blocks if b.is_moe)
    return jnp.uint8 if experts <= 256 else jnp.int16 if experts < 2**15 else jnp.int32


def decode_layers(model: nnx.Module) -> list | None:
    """The model's layers as the sampler should get them (see `Decoder.layers`).

    On the CPU they are sliced out of the stacked weights once, before the loop: XLA:CPU copies
    a weight slice that feeds a matmul, so slicing inside the loop would copy every weight at
    every token. Elsewhere (`parallel.accelerator_paths`: GPU/TPU, or the CPU under the test
    switch `POSTTRAIN_ACCELERATOR_PATHS=1`) this returns None: prefill, extend and decode run each
    stack of layers under `lax.scan` (`Decoder.decode_stacked`, the KV cache stacked to match,
    `sampling.kv_cache`), so the compiled program stays one layer deep whatever the depth, GPU/TPU
    compilers fuse the per-layer weight slices into the matmuls, and no second copy of the
    weights takes memory.
    """
    return None if stacked_cache() else model.layers()


def stacked_cache() -> bool:
    """Whether the sampler traced now keeps its KV cache stacked (`decode_layers` is None)."""
    return accelerator_paths()


def prefill(
    model: nnx.Module,
    tokens: jax.Array,
    lengths: jax.Array,
    layers: list | None = None,
    *,
    routing: bool = False,
    patches: jax.Array | None = None,
) -> tuple:
    """Right-padded prompts tokens [B, P] with lengths [B] (>= 1) → (next-token logits [B, V], kv),
    and with `routing` the experts [B, P, num_moe_layers, k] each MoE layer chose (`Decoder.prefill`).
    patches [B, P, patch_dim]: the prompts' image patches at their placeholders (`models.vision`).

    Positions are 0..P-1 and padding has segment id 0, exactly as the learner lays out a row.
    `layers`: `decode_layers(model)`; None gives the stacked cache `decode_step` then takes.
    """
    tokens = constrain(tokens, ("activation_batch", "activation_length"))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)
    hidden, kv, *experts = model.prefill(
        tokens, positions, segment_ids, layers, stacked=layers is None, routing=routing, patches=patches
    )
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    return (model.logits(last)[:, 0], kv, *experts)


def stack_segments(model: nnx.Module) -> tuple[tuple[int, int], ...]:
    """(blocks per unit, repeats) of each scanned stack of the model, in layer order: how a
    stacked KV cache maps to layers (`kv_cache.to_layers`)."""
    return tuple((len(stack.blocks), jax.tree.leaves(nnx.state(stack))[0].shape[0]) for stack in model.stacks)


def depth(model: nnx.Module) -> int:
    """The model's number of layers."""
    return sum(width * repeats for width, repeats in stack_segments(model))


def extend(
    model: nnx.Module,
    layers: list | None,
    tokens: jax.Array,
    positions: jax.Array,
    cache: tuple,
    num_layers: int | None = None,
    patches: jax.Array | None = None,
) -> tuple[jax.Array, tuple]:
    """Several new tokens per row through the first `num_layers` (default: all) layers against the
    KV cache: tokens, positions [B, S] → (hidden [B, S, D] after the final norm, cache). Each
    token's key and value are written at its position (one scatter per layer) and it attends to the
    row's cache entries 0..its position. Speculative decoding scores its drafts with it; the prefix
    cache prefills a prompt's uncached suffix with it.

    `layers`: `decode_layers(model)`. Given, the layers run unrolled on the per-layer cache; None
    (GPU/TPU) takes the stacked cache (`prefill(stacked=True)`'s layout) and runs each stack's
    repeats in a loop whose body is one unit of blocks, reading its weights and cache slice by the
    repeat index and writing the slice back in place, so the program stays one unit deep whatever
    the depth or `num_layers` (a draft of the first n layers stops inside a stack: its whole
    repeats loop, then the blocks of the next unit it needs run once). patches [B, S, patch_dim]:
    the new tokens' images (whole images only: a ViT tower encodes each from its patches here)."""
    x = model._embed(tokens, patches, positions)
    if layers is None:
        x, new_cache = _extend_stacked(model, x, positions, cache, num_layers)
    else:
        new_cache = list(cache)
        for i, block in enumerate(layers[:num_layers]):
            x, *new_cache[i] = _extend_block(block, x, positions, *cache[i])
    return model.final_norm(x), kv_cache.shard(tuple(tuple(kv) for kv in new_cache))


def _extend_block(block, x: jax.Array, positions: jax.Array, k_cache: jax.Array, v_cache: jax.Array):
    """One block of `extend`: x [B, S, D] → (x, k_cache, v_cache) with the S tokens' keys and values written."""
    q, k, v = block.attn.project_qkv(block.attn_norm(x), positions)
    k_cache = write_cache_span(k_cache, k, positions, K_TIME_AXIS)
    v_cache = write_cache_span(v_cache, v, positions, V_TIME_AXIS)
    attn = extend_attention(q, k_cache, v_cache, positions)
    return block.feed_forward(x + block.attn.output(attn), inference=True)[0], k_cache, v_cache


def _extend_stacked(model: nnx.Module, x: jax.Array, positions: jax.Array, cache: tuple, depth: int | None):
    """`extend`'s stacked form: the first `depth` layers (None: all) over each stack's repeats."""
    segments = stack_segments(model)
    leading = [r for w, r in segments for _ in range(w)]  # each pair's repeats
    if [k.shape[0] if k.ndim == 5 else None for k, _ in cache] != leading:
        raise ValueError(f"KV cache of {len(cache)} (k, v) pairs is not stacked as the model's stacks {segments}")
    remaining = sum(w * r for w, r in segments) if depth is None else depth
    new_cache, first = list(cache), 0
    for stack, (width, repeats) in zip(model.stacks, segments):
        if remaining <= 0:
            break
        graphdef, state = nnx.split(stack)
        whole = min(repeats, remaining // width)  # repeats run with every block
        part = min(width, remaining - whole * width) if whole < repeats else 0  # blocks of the next
        remaining -= whole * width + part

        def unit(r, x, kvs, blocks, graphdef=graphdef, state=state):
            take = lambda a: jax.lax.dynamic_index_in_dim(a, r, keepdims=False)
            put = lambda a, new: jax.lax.dynamic_update_index_in_dim(a, new, r, 0)
            out = list(kvs)
            for j, block in enumerate(nnx.merge(graphdef, jax.tree.map(take, state)).blocks[:blocks]):
                x, k, v = _extend_block(block, x, positions, take(kvs[j][0]), take(kvs[j][1]))
                out[j] = (put(kvs[j][0], k), put(kvs[j][1], v))
            return x, tuple(out)

        kvs = tuple(cache[first : first + width])
        if whole:
            x, kvs = jax.lax.fori_loop(0, whole, lambda r, c, unit=unit: unit(r, *c, width), (x, kvs))
        if part:
            x, kvs = unit(whole, x, kvs, part)
        new_cache[first : first + width] = kvs
        first += width
    return x, new_cache


def sample_step(slots: Slots, out: Outputs, sampling: SamplingParams, pad_id: int) -> tuple[Slots, Outputs, jax.Array]:
    """Sample every live slot's next token from its logits and record it; returns the tokens [S]
    to decode next (pad for done slots). A token draws from its key in `slots.keys`.
    """
    index = jnp.minimum(slots.step, slots.keys.shape[1] - 1)[:, None]  # done slots: any key
    keys = jnp.take_along_axis(slots.keys, index, axis=1)[:, 0]
    tokens, logprobs, sampling_lps = jax.vmap(sample_token, in_axes=(0, 0, None))(keys, slots.logits, sampling)
    live = ~slots.done
    rows = jnp.where(live, slots.row, out.tokens.shape[0])  # out of range: dropped
    step = slots.step + live
    stopped = live & jnp.isin(tokens, jnp.asarray(sampling.stop_ids, jnp.int32))
    finished = stopped | (live & (step >= slots.limit))
    end_rows = jnp.where(finished, slots.row, out.tokens.shape[0])
    out = out.replace(
        tokens=out.tokens.at[rows, slots.step].set(tokens.astype(jnp.int32), mode="drop"),
        logprobs=out.logprobs.at[rows, slots.step].set(logprobs, mode="drop"),
        sampling_logprobs=out.sampling_logprobs.at[rows, slots.step].set(sampling_lps, mode="drop"),
        lengths=out.lengths.at[end_rows].set(step, mode="drop"),
        stop_reason=out.stop_reason.at[end_rows].set(jnp.where(stopped, 0, 1), mode="drop"),
    )
    slots = slots.replace(step=step, done=slots.done | finished)
    return slots, out, jnp.where(live, tokens, pad_id).astype(jnp.int32)


def decode_step(
    model: nnx.Module, slots: Slots, tokens: jax.Array, layers: list | None = None, *, routing: bool = False
) -> Slots | tuple[Slots, jax.Array]:
    """Feed each slot's last sampled token (tokens [S]) and store the next-token logits; with
    `routing` also return the experts [S, num_moe_layers, k] each MoE layer chose for that token."""
    capacity = kv_cache.capacity(slots.cache)
    positions = jnp.clip(slots.prompt_len + slots.step - 1, 0, capacity - 1)
    if layers is None:
        hidden, cache, *experts = model.decode_stacked(tokens[:, None], positions, slots.cache, routing=routing)
    else:
        hidden, cache, *experts = model.decode(tokens[:, None], positions, slots.cache, layers, routing=routing)
    logits = constrain(model.logits(hidden)[:, 0], ("activation_batch", "activation_vocab"))
    slots = slots.replace(cache=kv_cache.shard(cache), logits=logits)
    return (slots, experts[0][:, 0]) if routing else slots


def decode_loop(
    model: nnx.Module,
    slots: Slots,
    out: Outputs,
    sampling: SamplingParams,
    pad_id: int,
    *,
    layers: list | None = None,
    refill=None,
    pending=None,
    queue=(),
    return_slots: bool = False,
    max_steps: jax.Array | None = None,
) -> Outputs | tuple[Outputs, Slots]:
    """Sample and decode until every slot is done and nothing is pending, in one `lax.while_loop`.

    `layers`: `decode_layers(model)`, computed once outside the loop. Continuous batching passes
    `refill(slots, queue) -> (slots, queue)`, run at the start of every step to fill free slots,
    and `pending(queue) -> bool`, whether requests still wait; `queue` is their state.
    `return_slots`: also return the final slots (the prefix cache keeps their KV). `max_steps`:
    stop after that many steps even with slots live (in-flight weight updates resume the returned
    slots with other weights, `sampling.inflight`). With
    `out.routing` allocated (`SamplingParams.record_routing`) each fed token's experts are recorded
    at its place in the output (a sample's last token is fed too, so every generated token has them).
    """

    def cond(carry):
        slots, _, queue = carry
        live = jnp.any(~slots.done)
        return live if pending is None else live | pending(queue)

    def body(carry):
        slots, out, queue = carry
        if refill is not None:
            slots, queue = refill(slots, queue)
        live = ~slots.done
        slots, out, tokens = sample_step(slots, out, sampling, pad_id)
        if out.routing is None:
            return decode_step(model, slots, tokens, layers), out, queue
        slots, experts = decode_step(model, slots, tokens, layers, routing=True)
        rows = jnp.where(live, slots.row, out.routing.shape[0])  # the token sampled now, at step - 1
        routing = out.routing.at[rows, slots.step - 1].set(experts.astype(out.routing.dtype), mode="drop")
        return slots, out.replace(routing=routing), queue

    if max_steps is None:
        slots, out, _ = jax.lax.while_loop(cond, body, (slots, out, queue))
    else:
        slots, out, _, _ = jax.lax.while_loop(
            lambda c: cond(c[:3]) & (c[3] < max_steps),
            lambda c: (*body(c[:3]), c[3] + 1),
            (slots, out, queue, jnp.int32(0)),
        )
    return (out, slots) if return_slots else out
