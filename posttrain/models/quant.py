"""Weight-only quantisation for the sampler (w8a16, w4a16): the learner's float weights are
quantised on the fly into qwix `QArray`s (integer values + float scales), and every matmul that
reads a quantised weight runs with 16-bit (bfloat16) inputs and float32 accumulation.

- int8: one scale per output channel (absmax over the contracting axes). The matmul multiplies
  the int8 values (exactly representable in bfloat16) and applies the scales to its output, so
  no dequantised copy of the weight is ever written.
- int4: one scale per group of `INT4_GROUP` along the last contracting axis (per output channel
  too). The weight is dequantised to bfloat16 inside the jitted program (XLA fuses it into the
  matmul's operand on GPU/TPU), then multiplied.

Quantised: attention q/k/v/o, dense and shared-expert MLPs, the routed experts and an untied LM
head. Kept in float: the embedding table (also the head when tied), norms, biases and the MoE
router (routing decisions are discrete; small errors there flip experts).
Quantisation, scales and dequantisation are qwix's (`qwix.quantize`, `qwix.dequantize`); the
matmul form is ours (qwix's weight-only matmul dequantises into the scales' dtype before the dot).
Matmuls accumulate and return float32 on every path (decode, prefill, the grouped expert matmul of
the expert-parallel path), so that one model gives the same numbers on any mesh.
On a multi-device mesh the scales are sharded with their values (`quantized_spec`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx
from jax.sharding import PartitionSpec as P

from posttrain.config import QUANT_MODES

QArray = qwix.QArray
INT4_GROUP = 128
COMPUTE_DTYPE = jnp.bfloat16  # the "a16" of w8a16 / w4a16

# parameter name → its contracting axes (counted from the end: stacked layers add leading axes)
CONTRACTING_AXES = {
    "q": (-3,),
    "k": (-3,),
    "v": (-3,),
    "o": (-3, -2),
    "gate": (-2,),
    "up": (-2,),
    "down": (-2,),
    "w_gate": (-2,),
    "w_up": (-2,),
    "w_down": (-2,),
    "head": (-2,),
}
QTYPES = {"int8": jnp.int8, "int4": jnp.int4}


def check_mode(mode: str, key: str = "sampling.quantize") -> str:
    """`mode` if it is one of QUANT_MODES, else a ValueError naming `key`."""
    if mode not in QUANT_MODES:
        raise ValueError(f"{key}={mode!r}: expected one of {', '.join(QUANT_MODES)}")
    return mode


def quantize_weight(w: jax.Array, mode: str, contracting: tuple[int, ...]) -> QArray:
    """One weight as a QArray: int8 per output channel, or int4 per group of INT4_GROUP along the
    last contracting axis (axes negative, from the end; every other axis keeps its own scales)."""
    contracting = tuple(a % w.ndim for a in contracting)
    channels = [a for a in range(w.ndim) if a not in contracting]
    if mode == "int8":
        return qwix.quantize(w, jnp.int8, channelwise_axes=channels)
    last = contracting[-1]
    return qwix.quantize(
        w,
        jnp.int4,
        channelwise_axes=channels + list(contracting[:-1]),
        tiled_axes={last: math.gcd(w.shape[last], INT4_GROUP)},
    )


def quantize_params(params: nnx.State, mode: str) -> nnx.State:
    """The sampler's copy of a model's params with every matmul weight (CONTRACTING_AXES) as a
    QArray; `mode` "none" returns `params` as they are. Pure: jit it to quantise on device."""
    if check_mode(mode) == "none":
        return params

    def one(path, v):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]  # ... 'attn', 'q', then .value
        if names and names[-1] in CONTRACTING_AXES and jnp.issubdtype(v.dtype, jnp.floating):
            return quantize_weight(v, mode, CONTRACTING_AXES[names[-1]])
        return v

    return jax.tree.map_with_path(one, params)


def is_quantized(w) -> bool:
    """Whether a weight is a QArray."""
    return isinstance(w, QArray)


def dequantize(w, dtype) -> jax.Array:
    """A float weight as it is (cast to `dtype`), a QArray dequantised into `dtype`."""
    if isinstance(w, QArray):
        return qwix.dequantize(w).astype(dtype)
    return w.astype(dtype)


def is_channelwise(w: QArray, contracting: list[int] | tuple[int, ...]) -> bool:
    """Whether w has one scale per output channel (none along its `contracting` axes): then the
    matmul can run on the int values and scale its output."""
    return all(w.scale.shape[i] == 1 for i in contracting)


def weight_einsum(spec: str, x: jax.Array, w, dtype, *, preferred_element_type=None) -> jax.Array:
    """`jnp.einsum(spec, x, w)` for an activation x and a weight w, float or QArray.

    A float weight is cast to `dtype` (the model's compute dtype) exactly as the model always did.
    A QArray runs in bfloat16 with float32 accumulation (w8a16 / w4a16); per-channel scales are
    applied to the output, grouped ones by dequantising first. The result has `dtype` unless
    `preferred_element_type` says otherwise.
    """
    if not isinstance(w, QArray):
        return jnp.einsum(spec, x, w.astype(dtype), preferred_element_type=preferred_element_type)
    out_dtype = preferred_element_type or dtype
    inputs, out = spec.split("->")
    x_subs, w_subs = inputs.split(",")
    contracted = [i for i, c in enumerate(w_subs) if c not in out]
    x = x.astype(COMPUTE_DTYPE)
    if is_channelwise(w, contracted):
        y = jnp.einsum(spec, x, w.qvalue.astype(COMPUTE_DTYPE), preferred_element_type=jnp.float32)
        scale = w.scale.astype(jnp.float32).reshape([d for i, d in enumerate(w.scale.shape) if i not in contracted])
        # a broadcast multiply over the output (as an einsum it would become a batched dot); the
        # output's explicit axes, after a leading "...", align from the right
        explicit, kept = out.replace("...", ""), [c for c in w_subs if c in out]
        scale = scale.transpose(sorted(range(len(kept)), key=lambda i: explicit.index(kept[i])))
        ordered = sorted(kept, key=explicit.index)
        y = y * scale.reshape([scale.shape[ordered.index(c)] if c in kept else 1 for c in explicit])
    else:
        y = jnp.einsum(spec, x, dequantize(w, COMPUTE_DTYPE), preferred_element_type=jnp.float32)
    return y.astype(out_dtype)


def quantized_spec(
    w: QArray, spec: P, axis_sizes: dict[str, int], name: str = "weight", whole: tuple[int, ...] = ()
) -> QArray:
    """PartitionSpecs (in a QArray's shape) for a quantised weight whose float form is laid out as
    `spec`: the int values as the weight, the scales along with them, so that every shard holds the
    scales of its own values. Replicated: scales of a dim with one scale (per-channel weights'
    contracting dim, or a single group) and of the dims in `whole` (those the caller all-gathers
    before use; scales are small). A dim of group scales that stays sharded needs its groups to
    split evenly over its mesh axes, else a ValueError naming `name`. axis_sizes: axis → size.
    """
    scale_entries = []
    for i, k in enumerate(w.scale.shape):
        entry = spec[i] if i < len(spec) else None
        axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
        if k == 1 or i in whole:
            scale_entries.append(None)
            continue
        shards = math.prod(axis_sizes[a] for a in axes)
        if k % shards:
            raise ValueError(
                f"sampling.quantize: {name} {w.qvalue.shape} has {k} scale groups along dim {i}, "
                f"which do not split over its {shards} shards ({entry}); use int8 or another mesh"
            )
        scale_entries.append(entry)
    return dataclasses.replace(w, qvalue=spec, scale=P(*scale_entries))


def split_single_groups(w: QArray, spec: P, axis_sizes: dict[str, int], whole: tuple[int, ...] = ()) -> QArray:
    """w with its group scales repeated twice (groups of half the size: the same dequantised
    values) along every sharded dim where a shard would hold exactly one group. Inside a
    `shard_map` such a shard's scales would look per-channel (`is_channelwise`) and take the
    other arithmetic; with two groups per shard it takes the single-device one. `whole`: dims
    whose scales are not sharded (see `quantized_spec`)."""
    scale = w.scale
    for i, (n, k) in enumerate(zip(w.qvalue.shape, w.scale.shape)):
        entry = spec[i] if i < len(spec) else None
        if entry is None or k == 1 or i in whole:
            continue
        axes = (entry,) if isinstance(entry, str) else tuple(entry)
        if k == math.prod(axis_sizes[a] for a in axes):
            if (n // k) % 2:
                raise ValueError(
                    f"sampling.quantize: weight {w.qvalue.shape}: groups of {n // k} along dim {i}, "
                    "one per shard, cannot be halved; use int8 or another mesh"
                )
            scale = jnp.repeat(scale, 2, axis=i)
    return dataclasses.replace(w, scale=scale)
