"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023) with a self-drafting policy: the
draft is the policy's own first `draft_layers` layers followed by its final norm and LM head
(layer-skip drafting: no second model, and the draft's KV entries for layers < draft_layers are
exactly the policy's).

Each round, per row: the draft proposes k tokens d_1..d_k from its sampling distribution q; the
policy scores [last, d_1..d_k] in one forward pass against the KV cache (`extend`), giving its
sampling distributions p_1..p_{k+1}; d_i is accepted with probability min(1, p_i(d_i) / q_i(d_i))
until the first rejection, where a token is drawn from norm(max(0, p_i − q_i)); when all k are
accepted a bonus token is drawn from p_{k+1}. The emitted tokens are distributed exactly as
sampling from p token by token (temperature, top-k and top-p included: p and q are both
`sampling_logprobs`); greedy decoding is unchanged; the log-probs returned are the policy's.

The KV cache is indexed by position: a round writes positions L..L+k (L: tokens in the cache), and
entries past the accepted ones are overwritten before anything can attend to them. Its layout is
the plain sampler's (`engine.decode_layers`): per layer, the layers unrolled, on the CPU; stacked
per scanned stack on GPU/TPU, where prefill, the draft's and the policy's `extend` all loop over
each stack's repeats, so the compiled round stays one unit of layers deep at any depth (unrolling
a pod-sized model's layers would compile for minutes per depth doubling and hold a second,
sliced copy of the weights).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.logprobs import token_logprobs
from posttrain.sampling import engine, kv_cache
from posttrain.sampling.engine import extend
from posttrain.sampling.rules import SamplingParams, sample_token, sampling_logprobs


def draw(key: jax.Array, logp: jax.Array, greedy: bool) -> jax.Array:
    """A token per row from log-probs [B, V] (argmax when greedy)."""
    if greedy:
        return jnp.argmax(logp, axis=-1).astype(jnp.int32)
    return jax.vmap(jax.random.categorical)(jax.random.split(key, logp.shape[0]), logp).astype(jnp.int32)


def accept(key: jax.Array, drafts: jax.Array, q: jax.Array, p: jax.Array, greedy: bool) -> tuple[jax.Array, jax.Array]:
    """The acceptance rule: drafts [B, k] with the draft's and the policy's sampling log-probs
    q [B, k, V], p [B, k + 1, V] → (accepted count a [B], the token after them [B]: drawn from
    norm(max(0, p_a − q_a)) after a rejection, from p_k when all are accepted)."""
    b, k = drafts.shape
    u_key, t_key = jax.random.split(key)
    p_d = jnp.take_along_axis(p[:, :k], drafts[..., None], axis=-1)[..., 0]
    q_d = jnp.take_along_axis(q, drafts[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(u_key, (b, k))
    ok = (p_d == 0) if greedy else (jnp.log(u) < p_d - q_d)  # greedy: the policy's argmax
    a = jnp.sum(jnp.cumprod(ok, axis=1), axis=1)
    p_a = jnp.take_along_axis(p, a[:, None, None], axis=1)[:, 0]  # [B, V]
    q_pad = jnp.concatenate([q, jnp.full_like(q[:, :1], -jnp.inf)], axis=1)  # q_k: no mass
    q_a = jnp.take_along_axis(q_pad, a[:, None, None], axis=1)[:, 0]
    residual = jnp.maximum(jnp.exp(p_a) - jnp.exp(q_a), 0.0)
    residual = jnp.where(jnp.sum(residual, -1, keepdims=True) > 0, residual, jnp.exp(p_a))
    return a, draw(t_key, jnp.log(residual), greedy)


def emit(
    out: engine.Outputs,
    rows: jax.Array,
    step: jax.Array,
    limit: jax.Array,
    live: jax.Array,
    tokens: jax.Array,
    count: jax.Array,
    logits: jax.Array,
    sampled: jax.Array,
    stop_ids: tuple,
) -> tuple[engine.Outputs, jax.Array, jax.Array]:
    """Record the first `count` [B] of tokens [B, S] (logits [B, S, V] and sampling log-probs
    [B, S, V] they were drawn from) at each live row's next output places, up to its limit and its
    first stop token; returns (out, new step, finished)."""
    s = tokens.shape[1]
    idx = jnp.arange(s)[None]
    valid = live[:, None] & (idx < count[:, None]) & (step[:, None] + idx < limit[:, None])
    is_stop = jnp.isin(tokens, jnp.asarray(stop_ids, jnp.int32)) & valid
    valid &= jnp.cumsum(is_stop, axis=1) - is_stop == 0  # nothing after a stop
    n = jnp.sum(valid, axis=1)
    stopped, new_step = jnp.any(is_stop & valid, axis=1), step + n
    finished = live & (stopped | (new_step >= limit))
    r = jnp.where(valid, rows[:, None], out.tokens.shape[0])
    cols = step[:, None] + idx
    policy = token_logprobs(logits, tokens)
    sampling = jnp.take_along_axis(sampled, tokens[..., None], axis=-1)[..., 0]
    end = jnp.where(finished, rows, out.tokens.shape[0])
    out = engine.Outputs(
        tokens=out.tokens.at[r, cols].set(tokens, mode="drop"),
        logprobs=out.logprobs.at[r, cols].set(policy, mode="drop"),
        sampling_logprobs=out.sampling_logprobs.at[r, cols].set(sampling, mode="drop"),
        lengths=out.lengths.at[end].set(new_step, mode="drop"),
        stop_reason=out.stop_reason.at[end].set(jnp.where(stopped, 0, 1), mode="drop"),
    )
    return out, new_step, finished


@engine.static_program()
def speculative_program(
    model: nnx.Module, prompts: engine.Prompts, *, sampling: SamplingParams, pad_id: int
) -> tuple[engine.Outputs, jax.Array]:
    """`generate_program` by speculative rounds (see the module doc): → (Outputs, [rounds, drafted,
    accepted] summed over rows). Text only: its draft takes no images."""
    if prompts.patches is not None:
        raise ValueError("speculative_program: images are sampled without speculative decoding")
    tokens, lengths, limits, num_prompts, key, _ = prompts
    g, b, k, n = sampling.num_samples, tokens.shape[0], sampling.speculative_k, sampling.draft_layers
    layers, depth = engine.decode_layers(model), engine.depth(model)
    if not 1 <= n <= depth:
        raise ValueError(f"draft_layers={n}: expected 1..the model's {depth} layers")
    logits, kv = engine.prefill(model, tokens, lengths, layers)
    cache = kv_cache.allocate(kv, tokens.shape[1] + sampling.max_new_tokens + k + 1)
    cache, logits = kv_cache.repeat_rows(cache, g), jnp.repeat(logits, g, axis=0)
    rows = jnp.arange(b * g, dtype=jnp.int32)
    live, limit = rows < num_prompts * g, jnp.repeat(limits, g)
    first_keys = engine.token_keys(key, rows, 1)[:, 0]  # generate's keys for the first token
    first = jax.vmap(sample_token, in_axes=(0, 0, None))(first_keys, logits, sampling)[0].astype(jnp.int32)
    round_key = jax.random.fold_in(key, 2**31 - 1)  # apart from the sample ids
    out = engine.Outputs.empty(b * g, sampling.max_new_tokens, pad_id)
    first_logprobs = sampling_logprobs(logits, sampling)[:, None]
    out, step, finished = emit(
        out,
        rows,
        jnp.zeros_like(rows),
        limit,
        live,
        first[:, None],
        jnp.ones_like(rows),
        logits[:, None],
        first_logprobs,
        sampling.stop_ids,
    )

    def body(carry):
        cache, last, length, step, done, out, stats, r = carry
        draft_key, accept_key = jax.random.split(jax.random.fold_in(round_key, r))
        c, tok, drafts, q = cache, last, [], []
        for i in range(k):
            h, c = extend(model, layers, tok[:, None], (length + i)[:, None], c, n)
            q.append(sampling_logprobs(model.logits(h)[:, 0], sampling))
            tok = draw(jax.random.fold_in(draft_key, i), q[-1], sampling.greedy)
            drafts.append(tok)
        drafts, q = jnp.stack(drafts, 1), jnp.stack(q, 1)
        seq = jnp.concatenate([last[:, None], drafts], axis=1)
        h, cache = extend(model, layers, seq, length[:, None] + jnp.arange(k + 1), c)
        p_logits = model.logits(h)
        p = sampling_logprobs(p_logits, sampling)
        a, t = accept(accept_key, drafts, q, p, sampling.greedy)
        emitted = jnp.where(jnp.arange(k + 1)[None] < a[:, None], jnp.pad(drafts, ((0, 0), (0, 1))), t[:, None])
        live = ~done
        out, step, finished = emit(out, rows, step, limit, live, emitted, a + 1, p_logits, p, sampling.stop_ids)
        stats = stats + jnp.stack([jnp.sum(live), k * jnp.sum(live), jnp.sum(jnp.where(live, a, 0))])
        length = jnp.where(live, length + a + 1, length)
        return cache, jnp.where(live, t, last), length, step, done | finished, out, stats, r + 1

    carry = (
        cache,
        first,
        jnp.repeat(lengths, g),
        step,
        ~live | finished,
        out,
        jnp.zeros((3,), jnp.int32),
        jnp.int32(0),
    )
    carry = jax.lax.while_loop(lambda c: jnp.any(~c[4]), body, carry)
    return carry[5], carry[6]
