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
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import qwix
from flax import nnx

from posttrain.parallel.mesh import mesh_platform

QArray = qwix.QArray
QUANT_MODES = ("none", "int8", "int4")
INT4_GROUP = 128
COMPUTE_DTYPE = jnp.bfloat16            # the "a16" of w8a16 / w4a16
CPU_F32_BATCHED_ROWS = 16               # see `weight_einsum`

# parameter name → its contracting axes (counted from the end: stacked layers add leading axes)
CONTRACTING_AXES = {"q": (-3,), "k": (-3,), "v": (-3,), "o": (-3, -2), "gate": (-2,), "up": (-2,),
                    "down": (-2,), "w_gate": (-2,), "w_up": (-2,), "w_down": (-2,), "head": (-2,)}
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
    return qwix.quantize(w, jnp.int4, channelwise_axes=channels + list(contracting[:-1]),
                         tiled_axes={last: math.gcd(w.shape[last], INT4_GROUP)})


def quantize_params(params: nnx.State, mode: str) -> nnx.State:
    """The sampler's copy of a model's params with every matmul weight (CONTRACTING_AXES) as a
    QArray; `mode` "none" returns `params` as they are. Pure: jit it to quantise on device."""
    if check_mode(mode) == "none":
        return params

    def one(path, v):
        names = [k.key for k in path if isinstance(k, jax.tree_util.DictKey)]   # ... 'attn', 'q', then .value
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
    acc = jnp.float32
    batched = any(c in x_subs and c in out for c in w_subs if c != ".")
    rows = math.prod(d for c, d in zip(x_subs, x.shape) if c in out and c not in w_subs)
    if mesh_platform() == "cpu" and batched and rows > CPU_F32_BATCHED_ROWS:
        # XLA:CPU's dot thunk lacks bf16 x bf16 -> f32 for the layout it picks for batched matmuls
        # of many rows (MoE prefill): a bf16 result there (accumulated in f32 inside the kernel,
        # rounded once). Decode-sized ones keep f32, which is also the fast kernel (2.5x, measured).
        acc = COMPUTE_DTYPE
    if all(w.scale.shape[i] == 1 for i in contracted):
        y = jnp.einsum(spec, x, w.qvalue.astype(COMPUTE_DTYPE), preferred_element_type=acc).astype(jnp.float32)
        scale = w.scale.astype(jnp.float32).reshape([d for i, d in enumerate(w.scale.shape) if i not in contracted])
        # a broadcast multiply over the output (as an einsum it would become a batched dot); the
        # output's explicit axes, after a leading "...", align from the right
        explicit, kept = out.replace("...", ""), [c for c in w_subs if c in out]
        scale = scale.transpose(sorted(range(len(kept)), key=lambda i: explicit.index(kept[i])))
        ordered = sorted(kept, key=explicit.index)
        y = y * scale.reshape([scale.shape[ordered.index(c)] if c in kept else 1 for c in explicit])
    else:
        y = jnp.einsum(spec, x, qwix.dequantize(w).astype(COMPUTE_DTYPE), preferred_element_type=acc)
    return y.astype(out_dtype)
