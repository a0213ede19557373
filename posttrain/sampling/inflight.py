"""In-flight weight updates (PipelineRL): static-batch generation whose decode loop runs in chunks
of `every` steps; before each chunk the sampler asks `latest()` for the newest published weights
and, when they are newer, decodes on with them. Sequences in flight are not dropped: they keep
their slot, their KV cache (computed by the older weights) and their RNG stream.

Every generated token records the policy version whose logits it was drawn from (`Samples.
versions`): its behaviour log-prob is that distribution's, so the learner's importance weights and
its staleness bound (`rl.max_staleness`, per token) see exactly which policy produced it. The first
token a sequence samples after a switch still comes from logits the older weights computed (the
step before), so it carries the older version; the ones after carry the newer.

With weights that never change the samples are static `generate`'s for the same key (the same
programs, cut into chunks). Multi-process runs are refused upstream: a switch decided from one
process's view would change the weights of one collective's participants only.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np
from flax import nnx

from posttrain.sampling import engine
from posttrain.sampling.generate import PaddedPrompts, Samples, host_outputs, sharding_key, static_samples, static_slots
from posttrain.sampling.rules import SamplingParams

# () -> (version, params, rest): the newest published weights, called before the prefill and each chunk
Latest = Callable[[], tuple]


@engine.static_program()
def start_program(model: nnx.Module, prompts: engine.Prompts, *, sampling: SamplingParams, pad_id: int):
    """The prompts prefilled into `generate_program`'s slots, and empty outputs: (slots, outputs)."""
    slots, _ = static_slots(model, engine.decode_layers(model), prompts, sampling)
    return slots, engine.Outputs.empty(slots.row.shape[0], sampling.max_new_tokens, pad_id)


@functools.partial(jax.jit, static_argnames=("graphdef", "sampling", "pad_id", "rules"), donate_argnums=(3, 4))
def chunk_program(graphdef, params, rest, slots, out, max_steps, *, sampling, pad_id, rules=None):
    """At most `max_steps` decode steps of the slots with these weights: (outputs, slots)."""
    model = nnx.merge(graphdef, params, rest)
    layers = engine.decode_layers(model)
    return engine.decode_loop(
        model, slots, out, sampling, pad_id, layers=layers, return_slots=True, max_steps=max_steps
    )


def record_versions(
    versions: np.ndarray, logits_version: np.ndarray, before: np.ndarray, after: np.ndarray, version: int
) -> None:
    """Record, in place, the versions of the tokens a chunk run with policy `version` sampled: slot
    s drew tokens before[s] .. after[s]−1; the first from logits computed before the chunk
    (`logits_version[s]`), the others from this chunk's. A slot that decoded now holds logits of
    `version`. versions [S, M]; logits_version, before, after [S]."""
    m = np.arange(versions.shape[1])[None, :]
    moved = (after > before)[:, None]
    first = moved & (m == before[:, None])
    later = (m > before[:, None]) & (m < after[:, None])
    versions[first] = np.broadcast_to(logits_version[:, None], versions.shape)[first]
    versions[later] = version
    logits_version[after > before] = version


def generate_inflight(
    graphdef: nnx.GraphDef,
    latest: Latest,
    prompts: Sequence[Sequence[int]] | np.ndarray,
    sampling: SamplingParams,
    key: jax.Array,
    *,
    every: int,
    pad_id: int = 0,
    max_new_tokens: Sequence[int] | None = None,
) -> Samples:
    """`generate` with the weights `latest()` names, switched between chunks of `every` decode steps
    (module docstring). `Samples.versions` [N, M]: each generated token's policy version (−1 past
    the end)."""
    if every < 1:
        raise ValueError(f"generate_inflight: every={every}, expected >= 1 decode steps between weight checks")
    if sampling.speculative_k or sampling.record_routing:
        raise ValueError("in-flight weight updates: not with speculative decoding or recorded routing")
    batch = PaddedPrompts.of(prompts, sampling, pad_id, max_new_tokens=max_new_tokens)
    n, g = len(batch.rows), sampling.num_samples
    static = dict(sampling=sampling, pad_id=pad_id, rules=sharding_key())
    version, params, rest = latest()
    slots, out = batch.run(start_program, graphdef, params, rest, key)
    versions = np.full((len(batch.tokens) * g, sampling.max_new_tokens), -1, np.int32)
    logits_version = np.full((len(batch.tokens) * g,), version, np.int32)  # the prefill's
    before = np.zeros((len(batch.tokens) * g,), np.int32)
    while True:
        version, params, rest = latest()
        out, slots = chunk_program(graphdef, params, rest, slots, out, np.int32(every), **static)
        after, done = (np.asarray(a) for a in host_outputs((slots.step, slots.done)))
        record_versions(versions, logits_version, before, after, version)
        before = after
        if done.all():
            break
    return static_samples(host_outputs(out), n, g, versions=versions[: n * g])
