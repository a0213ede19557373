"""Static-batch generation: prefill the prompts once, share each prompt's cache with its group,
decode in one `lax.while_loop` that stops when every sample is done.

Prompt lengths and batch sizes are bucketed to powers of two, so a new batch of similar shape
reuses the compiled program. The model is the learner's own `(graphdef, params, rest)`. With
`slots` (`SlotConfig`) the same call decodes through continuously refilled slots (`continuous`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.parallel.mesh import accelerator_paths_forced
from posttrain.parallel.sharding import current, rules_key
from posttrain.sampling import engine, kv_cache
from posttrain.sampling.continuous_programs import grouped_continuous_program
from posttrain.sampling.rules import SamplingParams
from posttrain.sampling.speculative import speculative_program

MIN_PROMPT_BUCKET = 8


@dataclasses.dataclass
class Samples:
    """Completions on the host, one row per sample; a prompt's `num_samples` rows are contiguous.

    tokens [N, M] (pad after `lengths`, the stop token included), logprobs [N, M] (the policy's
    log-probs before temperature/top-k/top-p; 0 after the end), sampling_logprobs [N, M] (under
    the distribution sampled from: the behaviour log-probs an RL learner compares with its own,
    `rules.policy_logprobs`), lengths [N], stop_reason [N]
    (index into `STOP_REASONS`), prompt_index [N] (the prompt, or request, of each sample).
    With `SamplingParams.record_routing` (else None): routing [N, M, num_moe_layers, k], the
    experts each MoE layer chose for every generated token, and prompt_routing [N, P, ...] for the
    prompt's tokens (P the bucketed prompt length; entries past a prompt or completion: any expert).
    """

    tokens: np.ndarray
    logprobs: np.ndarray
    sampling_logprobs: np.ndarray
    lengths: np.ndarray
    stop_reason: np.ndarray
    prompt_index: np.ndarray
    speculative: dict | None = None  # speculative decoding: rounds, drafted and accepted tokens
    routing: np.ndarray | None = None
    prompt_routing: np.ndarray | None = None
    versions: np.ndarray | None = None  # in-flight updates (`sampling.inflight`): [N, M] int32, see there

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens of speculative decoding (nan without it)."""
        s = self.speculative or {}
        return s["accepted"] / s["drafted"] if s.get("drafted") else float("nan")

    def completion(self, i: int) -> list[int]:
        """Sample i's token ids."""
        return self.tokens[i, : self.lengths[i]].tolist()

    def stop_reason_name(self, i: int) -> str:
        """'stop' (a stop token) or 'length' (max_new_tokens) for sample i."""
        return engine.STOP_REASONS[self.stop_reason[i]]


def bucket(n: int, minimum: int = 1) -> int:
    """The smallest power of two >= max(n, minimum): a compile-cache-friendly size."""
    return 1 << (max(n, minimum) - 1).bit_length()


def prompt_rows(
    prompts: Sequence[Sequence[int]] | np.ndarray, prompt_mask: np.ndarray | None = None
) -> list[np.ndarray]:
    """Prompts as a list of token-id arrays.

    prompts: lists of ids, or an [N, L] array whose real tokens `prompt_mask` [N, L] marks (left- or
    right-padded alike; without a mask every entry is a token).
    """
    if prompt_mask is not None:
        prompts, prompt_mask = np.asarray(prompts), np.asarray(prompt_mask, bool)
        if prompts.shape != prompt_mask.shape:
            raise ValueError(f"prompt_mask shape {prompt_mask.shape} != prompts shape {prompts.shape}")
        rows = [p[m] for p, m in zip(prompts, prompt_mask)]
    else:
        rows = [np.asarray(p) for p in prompts]
    if not rows:
        raise ValueError("prompts: expected at least one prompt, got none")
    for i, r in enumerate(rows):
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"prompts[{i}]: expected a non-empty list of token ids, got shape {r.shape}")
    return [r.astype(np.int32) for r in rows]


def pad_prompts(rows: list[np.ndarray], num_rows: int, length: int, pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-pad prompts into tokens [num_rows, length] and lengths [num_rows]; extra rows hold one
    pad token (they are marked done and dropped)."""
    tokens = np.full((num_rows, length), pad_id, np.int32)
    lengths = np.ones((num_rows,), np.int32)
    for i, r in enumerate(rows):
        tokens[i, : len(r)], lengths[i] = r, len(r)
    return tokens, lengths


def pad_patches(patches: Sequence[np.ndarray | None], rows: list[np.ndarray], shape: tuple[int, int]) -> np.ndarray:
    """Per-prompt patches ([len, patch_dim] or None) → float32 [B, P, patch_dim] like `pad_prompts`."""
    if len(patches) != len(rows):
        raise ValueError(f"patches for {len(patches)} prompts, {len(rows)} prompts given")
    dim = next((np.shape(p)[-1] for p in patches if p is not None), 0)
    out = np.zeros((*shape, dim), np.float32)
    for i, (p, r) in enumerate(zip(patches, rows)):
        if p is not None:
            if len(p) != len(r):
                raise ValueError(f"patches[{i}]: {len(p)} rows for a prompt of {len(r)} tokens")
            out[i, : len(r)] = p
    return out


def image_rows(patches: Sequence[np.ndarray | None] | None) -> list[np.ndarray | None] | None:
    """Per-prompt patches as given, or None when no prompt has any (a text-only call compiles and
    runs exactly as without images)."""
    if patches is None or all(p is None for p in patches):
        return None
    return list(patches)


def new_token_limits(
    limits: Sequence[int] | None, num_rows: int, num_prompts: int, sampling: SamplingParams
) -> np.ndarray:
    """Per-prompt caps on new tokens [num_rows] (default and maximum: sampling.max_new_tokens)."""
    out = np.full((num_rows,), sampling.max_new_tokens, np.int32)
    if limits is not None:
        limits = np.asarray(limits, np.int32).reshape(-1)
        if len(limits) != num_prompts:
            raise ValueError(f"max_new_tokens: {len(limits)} limits for {num_prompts} prompts")
        if not np.all((limits >= 1) & (limits <= sampling.max_new_tokens)):
            raise ValueError(
                f"max_new_tokens={limits.tolist()}: each must be in 1..sampling.max_new_tokens "
                f"({sampling.max_new_tokens})"
            )
        out[:num_prompts] = limits
    return out


def static_slots(
    model: nnx.Module, layers: list | None, prompts: engine.Prompts, sampling: SamplingParams
) -> tuple[engine.Slots, list]:
    """The prompts tokens [B, P] (and their images, if any) prefilled once, each prompt's cache row
    repeated for its G samples: (B * G slots, sample i*G+g in slot and output row i*G+g with RNG id
    i*G+g; rows >= num_prompts done), and [the prompt's experts] with `sampling.record_routing`
    (else [None] or [])."""
    g, (b, p) = sampling.num_samples, prompts.tokens.shape
    logits, kv, *prompt_experts = engine.prefill(
        model, prompts.tokens, prompts.lengths, layers, routing=sampling.record_routing, patches=prompts.patches
    )
    cache = kv_cache.repeat_rows(kv_cache.allocate(kv, p + sampling.max_new_tokens), g)
    ids = jnp.arange(b * g, dtype=jnp.int32)
    slots = engine.Slots(
        cache=cache,
        logits=jnp.repeat(logits, g, axis=0),
        prompt_len=jnp.repeat(prompts.lengths, g),
        step=jnp.zeros((b * g,), jnp.int32),
        limit=jnp.repeat(prompts.limits, g),
        done=ids >= prompts.num_prompts * g,
        keys=engine.token_keys(prompts.key, ids, sampling.max_new_tokens),
        row=ids,
    )
    return slots, prompt_experts


@engine.static_program()
def generate_program(
    model: nnx.Module, prompts: engine.Prompts, *, sampling: SamplingParams, pad_id: int
) -> engine.Outputs:
    """The compiled sampler (arguments: `engine.static_program`): prompts tokens [B, P], lengths and
    new-token limits [B] (rows >= num_prompts are padding) → Outputs of B * num_samples rows, sample
    i*G+g being prompt i's g-th (its RNG id too). patches [B, P, patch_dim]: the prompts' images
    (prefilled; none are generated)."""
    g, b = sampling.num_samples, prompts.tokens.shape[0]
    layers = engine.decode_layers(model)
    slots, prompt_experts = static_slots(model, layers, prompts, sampling)
    out = engine.Outputs.empty(b * g, sampling.max_new_tokens, pad_id)
    if sampling.record_routing:  # the prompt's experts, shared by its samples; the generated ones in the loop
        if prompt_experts[0] is None:
            raise ValueError("SamplingParams.record_routing: the model has no MoE layer, no routing to record")
        dtype = engine.routing_dtype(model)
        out = out.replace(
            prompt_routing=jnp.repeat(prompt_experts[0], g, axis=0).astype(dtype),
            routing=jnp.zeros((b * g, sampling.max_new_tokens, *prompt_experts[0].shape[2:]), dtype),
        )
    return engine.decode_loop(model, slots, out, sampling, pad_id, layers=layers)


def sharding_key() -> tuple:
    """What a sampler trace depends on beyond its arguments, hashable: the logical-axis rules in
    force (`parallel.rules_key`; None outside `use_sharding`) and the accelerator-path test switch
    (`parallel.accelerator_paths`). The sampler programs take it as a static argument, so that one
    mesh under two rule sets (`sampling.layout`), or with the switch flipped, never reuses a
    program traced for the other."""
    ctx = current()
    return (None if ctx is None else rules_key(ctx[1]), accelerator_paths_forced())


def host_outputs(out):
    """Device outputs → numpy on this host; with several processes, every process gets all rows
    (the sampler's output is a global array no single process can read alone)."""
    if all(getattr(x, "is_fully_addressable", True) for x in jax.tree.leaves(out)):
        return jax.device_get(out)
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(out, tiled=True)


@dataclasses.dataclass
class PaddedPrompts:
    """A call's prompts padded for a static-batch program (`engine.static_program`): `rows`, their
    token ids (`prompt_rows`); tokens [B, P] and lengths [B] (`pad_prompts`, B and P bucketed);
    new-token `limits` [B]; `patches`, per prompt its images or None (`image_rows`); and the call's
    sampling params and pad id."""

    rows: list[np.ndarray]
    tokens: np.ndarray
    lengths: np.ndarray
    limits: np.ndarray
    patches: list[np.ndarray | None] | None
    sampling: SamplingParams
    pad_id: int

    @classmethod
    def of(
        cls,
        prompts: Sequence[Sequence[int]] | np.ndarray,
        sampling: SamplingParams,
        pad_id: int,
        *,
        prompt_mask: np.ndarray | None = None,
        max_new_tokens: Sequence[int] | None = None,
        patches: Sequence[np.ndarray | None] | None = None,
    ) -> PaddedPrompts:
        """`generate`'s prompts, per-prompt new-token limits and images, checked and padded."""
        rows = prompt_rows(prompts, prompt_mask)
        n = len(rows)
        tokens, lengths = pad_prompts(rows, bucket(n), bucket(max(map(len, rows)), MIN_PROMPT_BUCKET), pad_id)
        limits = new_token_limits(max_new_tokens, len(tokens), n, sampling)
        sampling.check_context([len(r) for r in rows], limits[:n])
        return cls(rows, tokens, lengths, limits, image_rows(patches), sampling, pad_id)

    def image_patches(self) -> np.ndarray | None:
        """The prompts' images padded like their tokens (`pad_patches`), or None without any."""
        return None if self.patches is None else pad_patches(self.patches, self.rows, self.tokens.shape)

    def run(self, program, graphdef: nnx.GraphDef, params: nnx.State, rest: nnx.State, key: jax.Array, *args, **static):
        """`program` (an `engine.static_program`) on these prompts, traced under the rules in force
        (`sharding_key`); `args`: what follows the key (the images), `static`: the program's own."""
        num_prompts = np.int32(len(self.rows))
        return program(
            graphdef,
            params,
            rest,
            self.tokens,
            self.lengths,
            self.limits,
            num_prompts,
            key,
            *args,
            sampling=self.sampling,
            pad_id=self.pad_id,
            rules=sharding_key(),
            **static,
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

    @classmethod
    def of(cls, sampling) -> SlotConfig | None:
        """`sampling.continuous_batching`'s slots (from the `sampling` section), or None: static batches."""
        return cls(sampling.num_slots, sampling.refill_batch) if sampling.continuous_batching else None


def check_request(sampling: SamplingParams, patches=None, prefix_cache=None, slots: SlotConfig | None = None) -> None:
    """Refuse the combinations the sampler paths do not serve: images or routing records with
    speculative decoding or the prefix cache; continuous batching (`slots`) with any of those."""
    if slots is not None:
        if sampling.speculative_k:
            raise ValueError("continuous batching: speculative decoding (speculative_k > 0) runs in `generate` only")
        if sampling.record_routing:
            raise ValueError("continuous batching: routing is recorded by the static sampler (`generate`) only")
        if prefix_cache is not None:
            raise ValueError("continuous batching: the prefix cache serves static batches (`generate`) only")
    if patches is not None and sampling.speculative_k:
        raise ValueError("generate(patches=...): images are sampled without speculative decoding (speculative_k > 0)")
    if sampling.record_routing and (prefix_cache is not None or sampling.speculative_k):
        raise ValueError(
            "SamplingParams.record_routing: the static sampler records routing, not the prefix cache "
            "or speculative decoding (model.moe.routing_replay=sampler needs both off)"
        )


def generate(
    graphdef: nnx.GraphDef,
    params: nnx.State,
    rest: nnx.State,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    sampling: SamplingParams,
    key: jax.Array,
    *,
    pad_id: int = 0,
    prompt_mask: np.ndarray | None = None,
    max_new_tokens: Sequence[int] | None = None,
    prefix_cache=None,
    patches: Sequence[np.ndarray | None] | None = None,
    slots: SlotConfig | None = None,
) -> Samples:
    """Sample `sampling.num_samples` completions for each prompt with the learner's weights.

    prompts: see `prompt_rows`; max_new_tokens: optional per-prompt limits (<= the sampling
    params'). Runs one compiled program, cached per bucketed batch size and prompt length; call it
    under `use_sharding(mesh, rules)` to shard the cache and activations. Sample i*G+g is prompt
    i's g-th and draws from fold_in(key, i*G+g). `prefix_cache`: a `prefix_cache.PrefixCache`
    that serves cached prompt prefixes' KV and keeps this call's (same outputs, less prefill).
    `patches`: per prompt, its image patches aligned with its tokens ([len, patch_dim], zeros off
    the placeholders; `data.packing.place_patches`) or None (text only); the prefix cache keys
    cached prefixes by these images too. Speculative decoding takes none (its draft has no images).
    `slots`: continuous batching (`sampling.continuous_batching`): the samples are a queue flowing through
    that many refilled slots, the same tokens (log-probs to float rounding) whatever slot ran one.
    """
    check_request(sampling, image_rows(patches), prefix_cache, slots)
    batch = PaddedPrompts.of(
        prompts, sampling, pad_id, prompt_mask=prompt_mask, max_new_tokens=max_new_tokens, patches=patches
    )
    stats = None
    if prefix_cache is not None:
        out = prefix_cache.sample(
            graphdef,
            params,
            rest,
            batch.rows,
            *batch.tokens.shape,
            batch.limits,
            key,
            sampling=sampling,
            pad_id=pad_id,
            patches=batch.patches,
        )
    elif slots is not None:
        fitted = slots.fitted(len(batch.rows) * sampling.num_samples)
        static = {"num_slots": fitted.num_slots, "refill_batch": fitted.refill_batch}
        out = batch.run(grouped_continuous_program, graphdef, params, rest, key, batch.image_patches(), **static)
    elif sampling.speculative_k:
        out, stats = batch.run(speculative_program, graphdef, params, rest, key)
        stats = dict(zip(("rounds", "drafted", "accepted"), np.asarray(stats).tolist()))
    else:
        out = batch.run(generate_program, graphdef, params, rest, key, batch.image_patches())
    return static_samples(host_outputs(out), len(batch.rows), sampling.num_samples, speculative=stats)


def static_samples(out: engine.Outputs, n: int, g: int, **extra) -> Samples:
    """The host outputs of a static batch → Samples of its n real prompts × g samples (padding rows
    dropped); `extra` fields (speculative stats, token versions) as given."""
    return host_samples(out, np.repeat(np.arange(n), g), **extra)


def host_samples(out: engine.Outputs, prompt_index: np.ndarray, **extra) -> Samples:
    """Host outputs → Samples of their first len(prompt_index) rows (the rest: padding), row i
    sampled for prompt (or request) prompt_index[i]; `extra` fields as given."""
    cut = lambda a: None if a is None else a[: len(prompt_index)]  # noqa: E731
    return Samples(
        tokens=cut(out.tokens),
        logprobs=cut(out.logprobs),
        sampling_logprobs=cut(out.sampling_logprobs),
        lengths=cut(out.lengths),
        stop_reason=cut(out.stop_reason),
        prompt_index=prompt_index,
        routing=cut(out.routing),
        prompt_routing=cut(out.prompt_routing),
        **extra,
    )
