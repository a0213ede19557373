"""The platform's fused attention kernels as jax ships them: cuDNN flash attention on GPU
(`jax.nn.dot_product_attention(implementation="cudnn")`) and Pallas splash attention on TPU
(`jax.experimental.pallas.ops.tpu.splash_attention`).

Both mask causally by index within a row (positions are not consulted), so they serve
unpermuted rows on one `sequence` shard; packed segments go in as segment ids (splash) or a
boolean mask (cuDNN). Queries that see no key (padding, segment 0) return zeros, as the
reference does.
"""

from __future__ import annotations

import functools
import math

import jax
from jax.sharding import PartitionSpec as P

from posttrain.parallel.sharding import current, logical_spec

KERNEL_PLATFORMS = {"cudnn": "gpu", "splash": "tpu"}


def check_platform(kind: str, platform: str) -> None:
    """Raise naming `model.attention` when the fused kernel `kind` does not exist on `platform`."""
    want = KERNEL_PLATFORMS[kind]
    if platform != want:
        raise ValueError(
            f"model.attention={kind!r} needs a {want.upper()} (jax ships that kernel only there), "
            f"but the devices are {platform!r}; use 'blockwise' (any platform) or 'xla'"
        )


def _real_rows(segment_ids: jax.Array) -> jax.Array:
    """[B, S, 1, 1] bool: the query is a token, not padding (which the reference answers with 0)."""
    return (segment_ids != 0)[:, :, None, None]


def cudnn_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """cuDNN flash attention, causal within segments: q [B, S, H, Dh], k, v [B, S, K, Dh] in
    bfloat16 or float16 (cuDNN's types: `model.dtype`)."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) & (segment_ids[:, None, :] != 0)
    out = jax.nn.dot_product_attention(q, k, v, mask=same[:, None], is_causal=True, implementation="cudnn")
    return out * _real_rows(segment_ids).astype(out.dtype)


@functools.lru_cache(maxsize=16)
def _splash_kernel(groups: int, length: int, block: int, interpret: bool):
    """A causal multi-query splash kernel for `groups` query heads sharing one kv head."""
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    mask = splash.MultiHeadMask([splash.CausalMask((length, length)) for _ in range(groups)])
    b = min(block, length)
    # every block of the forward and the two backward kernels (the compute blocks default to the kv ones)
    sizes = splash.BlockSizes(block_q=b, block_kv=b, block_q_dkv=b, block_kv_dkv=b, block_q_dq=b, block_kv_dq=b)
    return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret)


def splash_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *, block_size: int = 512, interpret: bool = False
) -> jax.Array:
    """Pallas splash attention (TPU), causal within segments: q [B, S, H, Dh], k, v [B, S, K, Dh].

    GQA runs as one multi-query kernel per kv head (vmapped over batch and kv heads). `interpret`
    runs the Pallas kernel in interpret mode (tests on a CPU).
    """
    from jax.experimental.pallas.ops.tpu import splash_attention as splash

    b, s, h, d = q.shape
    kv = k.shape[2]
    if s % min(block_size, s):
        raise ValueError(
            f"model.attention='splash': length {s} must be a multiple of model.attention_block={block_size}"
        )
    kernel = _splash_kernel(h // kv, s, block_size, interpret)
    qg = (q / math.sqrt(d)).astype(q.dtype).reshape(b, s, kv, h // kv, d).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, Dh]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, Dh]

    def one(qg, kt, vt, seg):
        return kernel(qg, kt, vt, segment_ids=splash.SegmentIds(q=seg, kv=seg))

    out = jax.vmap(jax.vmap(one, in_axes=(0, 0, 0, None)), in_axes=(0, 0, 0, 0))(qg, kt, vt, segment_ids)
    out = out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, d)
    return out * _real_rows(segment_ids).astype(out.dtype)


def on_local_shards(kernel, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`kernel(q, k, v, segment_ids)` per device under `use_sharding`: a Pallas (Mosaic) kernel
    cannot be partitioned by the compiler, so it runs inside `shard_map` on each device's rows and
    whole GQA groups (heads split as the kv heads are), the length whole."""
    ctx = current()
    if ctx is None or ctx[0].size == 1:
        return kernel(q, k, v, segment_ids)
    mesh, rules = ctx
    batch, _, heads, _ = (
        tuple(logical_spec(("batch", "length", "kv_heads", "head_dim"), mesh, rules, k.shape)) + (None,) * 4
    )[:4]
    spec = P(batch, None, heads, None)
    return jax.shard_map(
        kernel, mesh=mesh, in_specs=(spec, spec, spec, P(batch, None)), out_specs=spec, check_vma=False
    )(q, k, v, segment_ids)
