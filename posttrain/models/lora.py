"""LoRA (Hu et al. 2021) on chosen projection weights, applied to the parameter state.

An adapted weight is W + (alpha / rank) · A @ B, with A [*batch, fan_in, r] and B [*batch, r,
fan_out] (B starts at zero, so training starts from the base model). Leading `layers` / `experts`
dimensions are batch dimensions: stacked layers and every expert get their own adapters.

Adapters live beside the model, not in it: `merge` builds the adapted weights from the frozen base
and the adapters inside the jitted step, so every model path (learner, sampler, MoE experts) sees
ordinary weights and gradients flow only to A and B. Only adapters are trained, held in the
optimizer and checkpointed. The cost is one transient weight-sized buffer per adapted weight.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

BATCH_AXES = ("layers", "experts")
TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "w_gate", "w_up", "w_down")
# Input (fan-in) dimensions after the batch dims; the rest are output dims.
FAN_IN_DIMS = {"o": 2}


def _key(path) -> str:
    return "/".join(str(getattr(p, "key", p)) for p in path)


def _split_dims(name: str, var: nnx.Variable) -> tuple[int, int, int]:
    """(batch dims, fan_in, fan_out) of weight `name`."""
    names = var.get_metadata().get("out_sharding") or ()
    nb = 0
    while nb < len(names) and names[nb] in BATCH_AXES:
        nb += 1
    nin = FAN_IN_DIMS.get(name, 1)
    shape = var.shape
    return nb, math.prod(shape[nb : nb + nin]), math.prod(shape[nb + nin :])


def target_paths(params: nnx.State, targets) -> list[str]:
    """Paths ('stacks/0/blocks/0/attn/q', ...) of the weights named in `targets`."""
    bad = sorted(set(targets) - set(TARGETS))
    if bad:
        raise ValueError(f"lora.targets: unknown {bad}; valid: {TARGETS}")
    return [_key(p) for p, _ in nnx.to_flat_state(params) if str(getattr(p[-1], "key", p[-1])) in targets]


def init_adapters(params: nnx.State, targets, rank: int, key: jax.Array) -> dict:
    """{weight path: {"a", "b"}} LoRAParams for every targeted weight; A ~ N(0, 1/fan_in), B = 0."""
    if rank <= 0:
        raise ValueError(f"lora.rank={rank}: must be positive")
    paths = set(target_paths(params, targets))
    if not paths:
        raise ValueError(f"lora.targets={tuple(targets)} match no weight of the model")
    adapters = {}
    for i, (path, var) in enumerate(nnx.to_flat_state(params)):
        k = _key(path)
        if k not in paths:
            continue
        name = str(getattr(path[-1], "key", path[-1]))
        nb, fan_in, fan_out = _split_dims(name, var)
        batch, names = var.shape[:nb], tuple((var.get_metadata().get("out_sharding") or ())[:nb])
        a = jax.random.normal(jax.random.fold_in(key, i), (*batch, fan_in, rank), jnp.float32) / math.sqrt(fan_in)
        adapters[k] = {
            "a": nnx.LoRAParam(a.astype(var.dtype), out_sharding=(*names, None, None), eager_sharding=False),
            "b": nnx.LoRAParam(
                jnp.zeros((*batch, rank, fan_out), var.dtype), out_sharding=(*names, None, None), eager_sharding=False
            ),
        }
    return adapters


def merge(params: nnx.State, adapters: dict, scale: float) -> nnx.State:
    """Base params with every adapted weight replaced by W + scale · A @ B (differentiable)."""

    def one(path, var):
        ad = adapters.get(_key(path))
        if ad is None:
            return var
        a, b = ad["a"][...], ad["b"][...]
        delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32)).reshape(var.shape)
        return var.replace(var[...] + (scale * delta).astype(var.dtype))

    return nnx.from_flat_state([(p, one(p, v)) for p, v in nnx.to_flat_state(params)])
