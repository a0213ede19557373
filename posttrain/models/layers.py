"""Basic decoder layers: RMSNorm, SwiGLU MLP, embedding, with logical-axis annotations."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.quant import weight_einsum
from posttrain.parallel.sharding import constrain


def dtype_of(name: str) -> jnp.dtype:
    """'float32' | 'bfloat16' | 'float16' → jnp dtype, with a clear error for anything else."""
    try:
        return {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: expected float32, bfloat16 or float16") from None


def fan_in_init(in_axis: int | Sequence[int] = -2, out_axis: int | Sequence[int] = -1, batch_axis: Sequence[int] = ()):
    """Truncated-normal init with variance 1/fan_in (LeCun), for stacked/batched kernels too."""
    return jax.nn.initializers.variance_scaling(
        1.0, "fan_in", "truncated_normal", in_axis=in_axis, out_axis=out_axis, batch_axis=batch_axis
    )


def param(rngs: nnx.Rngs, init, shape: Sequence[int], names: Sequence[str | None], dtype) -> nnx.Param:
    """A parameter initialised by `init`, annotated with logical axis `names`.

    Eager sharding is off: `train.state.shardings_for` maps the names through our rules table
    (with divisibility checks) and the init is jitted straight into those shardings.
    """
    if len(names) != len(shape):
        raise ValueError(f"names {names} do not match shape {shape}")
    return nnx.Param(init(rngs.params(), tuple(shape), dtype), out_sharding=tuple(names), eager_sharding=False)


class RMSNorm(nnx.Module):
    """Root-mean-square layer norm (Zhang & Sennrich 2019), computed in float32."""

    def __init__(self, dim: int, *, eps: float, param_dtype, names: Sequence[str | None] = ("embed",)):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype), out_sharding=tuple(names), eager_sharding=False)

    def __call__(self, x: jax.Array) -> jax.Array:
        xf = x.astype(jnp.float32)
        y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


class MLP(nnx.Module):
    """SwiGLU feed-forward: down(silu(x @ gate) * (x @ up))."""

    def __init__(self, embed_dim: int, mlp_dim: int, *, param_dtype, dtype, rngs: nnx.Rngs):
        self.dtype = dtype
        init = fan_in_init()
        self.gate = param(rngs, init, (embed_dim, mlp_dim), ("embed", "mlp"), param_dtype)
        self.up = param(rngs, init, (embed_dim, mlp_dim), ("embed", "mlp"), param_dtype)
        self.down = param(rngs, init, (mlp_dim, embed_dim), ("mlp", "embed"), param_dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        x = x.astype(self.dtype)
        mm = lambda a, w: weight_einsum("...d,df->...f", a, w, self.dtype)  # a float or quantised weight
        h = jax.nn.silu(mm(x, self.gate[...])) * mm(x, self.up[...])
        h = constrain(h, ("activation_batch", "activation_length", "activation_mlp"))
        return mm(h, self.down[...])
