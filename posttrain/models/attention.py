"""Grouped-query attention with RoPE (optionally scaled), optional QK-norm and q/k/v biases,
causal + segment masking."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.config import ATTENTION_KERNELS, RopeScalingConfig
from posttrain.models.layers import RMSNorm, dtype_of, fan_in_init, param
from posttrain.models.quant import weight_einsum
from posttrain.ops.blockwise import blockwise_attention
from posttrain.ops.context_parallel import check_mode, context_parallel_attention, live_layers, sequence_axes
from posttrain.ops.decode import K_TIME_AXIS, V_TIME_AXIS, decode_attention, sequence_sharded_decode, write_cache_rows  # noqa: F401 (re-exported)
from posttrain.ops.fused import KERNEL_PLATFORMS, check_platform, cudnn_attention, on_local_shards, splash_attention
from posttrain.parallel.sharding import constrain, current


def rope_frequencies(
    head_dim: int, theta: float, scaling: RopeScalingConfig | None = None, seq_len: jax.Array | None = None
) -> jax.Array:
    """Inverse frequencies theta^(-2i/d), i < d/2 (float32), stretched by `scaling`.

    seq_len (`RopeScalingConfig.dynamic_length()` in the model; any length as Hugging Face computes it)
    is used by dynamic scaling only.
    """
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim
    inv_freq = 1.0 / (theta**exponents)
    kind = scaling.type if scaling is not None else ""
    if kind == "linear":
        return inv_freq / scaling.factor
    if kind == "dynamic":
        length = jnp.maximum(jnp.asarray(seq_len, jnp.float32), scaling.original_max_position_embeddings)
        return 1.0 / (dynamic_theta(theta, head_dim, scaling, length) ** exponents)
    if kind == "yarn":
        return _yarn_frequencies(inv_freq, head_dim, theta, scaling)
    if kind == "llama3":
        return _llama3_frequencies(inv_freq, scaling)
    return inv_freq


def dynamic_theta(theta, head_dim: int, scaling: RopeScalingConfig, length=None):
    """The RoPE base dynamic NTK scaling uses at `length` (default: `scaling.dynamic_length()`, the
    model's): plain RoPE with this base is the same rotation, which is how a dynamic model exports."""
    length = scaling.dynamic_length() if length is None else length
    f, original = scaling.factor, scaling.original_max_position_embeddings
    return theta * ((f * length / original) - (f - 1)) ** (head_dim / (head_dim - 2))


def _yarn_frequencies(inv_freq: jax.Array, head_dim: int, theta: float, s: RopeScalingConfig) -> jax.Array:
    """YaRN (Peng et al. 2023): interpolate the low frequencies by `factor`, keep the high ones, with
    a linear ramp between the dimensions that make beta_fast and beta_slow rotations."""

    def dim_of(rotations):  # the dimension whose wavelength fits `rotations` times in the context
        wavelengths = s.original_max_position_embeddings / (rotations * 2 * math.pi)
        return head_dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dim_of(s.beta_fast), dim_of(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    high = high + 0.001 if low == high else high
    ramp = jnp.clip((jnp.arange(head_dim // 2, dtype=jnp.float32) - low) / (high - low), 0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep), 0: interpolate
    return (inv_freq / s.factor) * (1 - keep) + inv_freq * keep


def _llama3_frequencies(inv_freq: jax.Array, s: RopeScalingConfig) -> jax.Array:
    """Llama 3.1: wavelengths above original/low_freq_factor are divided by `factor`, those below
    original/high_freq_factor kept, and the band between interpolated smoothly."""
    original = s.original_max_position_embeddings
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > original / s.low_freq_factor, inv_freq / s.factor, inv_freq)
    smooth = (original / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= original / s.high_freq_factor) & (wavelen <= original / s.low_freq_factor)
    return jnp.where(medium, smoothed, scaled)


def apply_rope(x: jax.Array, positions: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotary embedding, 'rotate half' layout as in Llama/Qwen (HF).

    x: [batch, length, heads, head_dim]; positions: [batch, length] (int).
    """
    angles = positions[..., None].astype(jnp.float32) * inv_freq  # [B, S, Dh/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :]
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :]
    xf = x.astype(jnp.float32)
    x1, x2 = jnp.split(xf, 2, axis=-1)
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return (xf * cos + rotated * sin).astype(x.dtype)


def attention_mask(segment_ids: jax.Array, positions: jax.Array | None = None) -> jax.Array:
    """[batch, 1, q, k] boolean: causal within a segment; segment id 0 marks padding.

    Causality is by index, or by position when `positions` [batch, length] are given (tokens
    permuted for context parallelism; positions increase within a segment).
    """
    s = segment_ids.shape[1]
    if positions is None:
        causal = jnp.tril(jnp.ones((s, s), dtype=bool))[None]
    else:
        causal = positions[:, None, :] <= positions[:, :, None]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    return (causal & same & (segment_ids[:, None, :] != 0))[:, None]


def dot_product_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
    """Reference softmax attention with GQA, softmax in float32.

    q: [B, S, H, Dh]; k, v: [B, T, K, Dh] with H % K == 0; mask: [B, 1, S, T] bool.
    Rows with no visible key (padding) return zeros.
    """
    b, s, h, d = q.shape
    kv = k.shape[2]
    q = q.reshape(b, s, kv, h // kv, d)
    logits = jnp.einsum("bskgd,btkd->bkgst", q, k, preferred_element_type=jnp.float32) / jnp.sqrt(d)
    mask = mask[:, :, None]  # [B, 1, 1, S, T]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1) * mask.any(axis=-1, keepdims=True)
    out = jnp.einsum("bkgst,btkd->bskgd", probs.astype(v.dtype), v)
    return out.reshape(b, s, h, d)


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    """`model.attention`: how causal self-attention over a whole sequence is computed.

    xla (the reference: [B, K, G, S, T] scores in float32) | blockwise (`ops.blockwise`: memory
    linear in length; over a `sequence`-sharded mesh, context parallel as `model.context_parallel`
    says) | cudnn (GPU) | splash (TPU): the platform's fused kernel, on unpermuted rows with the
    `sequence` axis unsharded. `block` is `model.attention_block` (blockwise and splash tiles);
    `layers`: layers whose gathered K/V live at once under `model.remat` (`auto`'s estimate).
    """

    kind: str = "xla"
    block: int = 512
    context_parallel: str = "auto"
    layers: int = 1

    @classmethod
    def from_config(cls, cfg) -> AttentionKernel:
        """Validated from the model config; a fused kernel must exist on the devices in use."""
        kernel = cls(cfg.attention, cfg.attention_block, cfg.context_parallel, live_layers(cfg.remat, cfg.num_layers))
        if kernel.kind not in ATTENTION_KERNELS:
            raise ValueError(f"model.attention={kernel.kind!r}: expected one of {ATTENTION_KERNELS}")
        if kernel.block < 1:
            raise ValueError(f"model.attention_block={kernel.block}: must be positive")
        check_mode(kernel.context_parallel)
        if kernel.kind == "cudnn" and cfg.dtype not in ("bfloat16", "float16"):
            raise ValueError(f"model.attention='cudnn' computes in bfloat16 or float16; model.dtype={cfg.dtype!r}")
        if kernel.kind in KERNEL_PLATFORMS:
            ctx = current()
            check_platform(kernel.kind, ctx[0].devices.flat[0].platform if ctx else jax.default_backend())
        return kernel

    def __call__(
        self, q: jax.Array, k: jax.Array, v: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> jax.Array:
        """Causal self-attention within segments: q [B, S, H, Dh], k, v [B, S, K, Dh] → [B, S, H, Dh]."""
        axes, n = sequence_axes()
        if self.kind == "xla":
            return dot_product_attention(q, k, v, attention_mask(segment_ids, positions))
        if self.kind != "blockwise" and n > 1:
            raise ValueError(
                f"model.attention={self.kind!r} runs on an unsharded length; the mesh shards "
                f"it over {axes} ({n} devices): use model.attention='blockwise'"
            )
        if self.kind == "cudnn":
            return cudnn_attention(q, k, v, segment_ids)
        if self.kind == "splash":
            return on_local_shards(functools.partial(splash_attention, block_size=self.block), q, k, v, segment_ids)
        if n > 1:
            return context_parallel_attention(
                q, k, v, positions, segment_ids, mode=self.context_parallel, block_size=self.block, layers=self.layers
            )
        return blockwise_attention(q, k, v, positions, positions, segment_ids, segment_ids, block_size=self.block)


class Attention(nnx.Module):
    """Multi-head attention with grouped KV heads (GQA), RoPE (optionally scaled), optional QK-norm
    (Qwen3) and q/k/v biases (Qwen2)."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        pdt = dtype_of(cfg.param_dtype)
        self.dtype = dtype_of(cfg.dtype)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError(
                f"model.num_heads={cfg.num_heads} must be a multiple of model.num_kv_heads={cfg.num_kv_heads}"
            )
        if cfg.head_dim % 2:
            raise ValueError(f"model.head_dim={cfg.head_dim} must be even for RoPE")
        self.kernel = AttentionKernel.from_config(cfg)
        self.rope_theta = cfg.rope_theta
        self.rope_scaling = cfg.rope_scaling
        d, h, kv, hd = cfg.embed_dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        init = fan_in_init(in_axis=0, out_axis=(1, 2))
        self.q = param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"), pdt)
        self.k = param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pdt)
        self.v = param(rngs, init, (d, kv, hd), ("embed", "kv_heads", "head_dim"), pdt)
        if cfg.attention_bias:  # Qwen2: biases on the q, k and v projections (not on o)
            zeros = jax.nn.initializers.zeros
            self.q_bias = param(rngs, zeros, (h, hd), ("heads", "head_dim"), pdt)
            self.k_bias = param(rngs, zeros, (kv, hd), ("kv_heads", "head_dim"), pdt)
            self.v_bias = param(rngs, zeros, (kv, hd), ("kv_heads", "head_dim"), pdt)
        else:
            self.q_bias = self.k_bias = self.v_bias = None
        self.o = param(rngs, fan_in_init(in_axis=(0, 1), out_axis=2), (h, hd, d), ("heads", "head_dim", "embed"), pdt)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pdt, names=("head_dim",))
            self.k_norm = RMSNorm(hd, eps=cfg.norm_eps, param_dtype=pdt, names=("head_dim",))
        else:
            self.q_norm = self.k_norm = None

    def project_qkv(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        """x: [B, S, D] → q [B, S, H, Dh], k, v [B, S, K, Dh]: biases, QK-norm and (scaled) RoPE applied."""
        x = x.astype(self.dtype)
        q = weight_einsum("bsd,dhk->bshk", x, self.q[...], self.dtype)
        k = weight_einsum("bsd,dhk->bshk", x, self.k[...], self.dtype)
        v = weight_einsum("bsd,dhk->bshk", x, self.v[...], self.dtype)
        if self.q_bias is not None:
            q = q + self.q_bias[...].astype(self.dtype)
            k = k + self.k_bias[...].astype(self.dtype)
            v = v + self.v_bias[...].astype(self.dtype)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        scaling = self.rope_scaling
        seq_len = scaling.dynamic_length() if scaling.type == "dynamic" else None
        inv_freq = rope_frequencies(self.head_dim, self.rope_theta, scaling, seq_len)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        if scaling.attention_scale() != 1.0:
            q, k = q * scaling.attention_scale(), k * scaling.attention_scale()
        q = constrain(q, ("activation_batch", "activation_length", "activation_heads", "head_dim"))
        k = constrain(k, ("activation_batch", "activation_length", "activation_kv_heads", "head_dim"))
        v = constrain(v, ("activation_batch", "activation_length", "activation_kv_heads", "head_dim"))
        return q, k, v

    def output(self, attn: jax.Array) -> jax.Array:
        """[B, S, H, Dh] → [B, S, D]."""
        return weight_einsum("bshk,hkd->bsd", attn, self.o[...], self.dtype)

    def __call__(self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
        return self.prefill(x, positions, segment_ids)[0]

    def prefill(
        self, x: jax.Array, positions: jax.Array, segment_ids: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """Attention over the whole sequence that also returns its keys and values, laid out for
        the KV cache.

        x: [B, S, D] → (out [B, S, D], k [B, K, Dh, S], v [B, K, S, Dh]).
        """
        q, k, v = self.project_qkv(x, positions)
        out = self.output(self.kernel(q, k, v, positions, segment_ids))
        return out, k.transpose(0, 2, 3, 1), v.transpose(0, 2, 1, 3)

    def decode(
        self, x: jax.Array, positions: jax.Array, k_cache: jax.Array, v_cache: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """One new token per row against this layer's KV cache, whose index is the position.

        x: [B, 1, D]; positions: [B] (int), the new token's position and cache index;
        k_cache [B, K, Dh, T], v_cache [B, K, T, Dh]. Writes the token's key and value at cache
        index positions[b] of row b (in place), attends to cache entries 0..positions[b] and
        returns (out [B, 1, D], k_cache, v_cache).
        """
        q, k, v = self.project_qkv(x, positions[:, None])
        axes, n = sequence_axes()
        if n > 1 and k_cache.shape[K_TIME_AXIS] % n == 0:  # the cache's time axis is sharded
            out, k_cache, v_cache = sequence_sharded_decode(
                q[:, 0], k[:, 0], v[:, 0], k_cache, v_cache, positions, axes, n
            )
            return self.output(out[:, None]), k_cache, v_cache
        k_cache = write_cache_rows(k_cache, k[:, 0], positions, K_TIME_AXIS)
        v_cache = write_cache_rows(v_cache, v[:, 0], positions, V_TIME_AXIS)
        out = decode_attention(q[:, 0], k_cache, v_cache, positions)
        return self.output(out[:, None]), k_cache, v_cache
