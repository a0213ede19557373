"""LoRA (Hu et al. 2021) on chosen projection weights, applied to the parameter state.

An adapted weight is W + (alpha / rank) · A @ B, with A [*batch, fan_in, r] and B [*batch, r,
fan_out] (B starts at zero, so training starts from the base model). Leading `layers` / `experts`
dimensions are batch dimensions: stacked layers and every expert get their own adapters.

Adapters live beside the model, not in it: `merge` builds the adapted weights from the frozen base
and the adapters inside the jitted step, so every model path (learner, sampler, MoE experts) sees
ordinary weights and gradients flow only to A and B. Only adapters are trained, held in the
optimizer and checkpointed. The cost is one transient weight-sized buffer per adapted weight.

A target names weights by their parameter name (the last key of the path). Decoder targets
(`TEXT_TARGETS`) adapt only the decoder; the image weights (`model.vision`) have their own names
(`VISION_TARGETS`) and are adapted only when named: `proj` (the linear patch embedding, encoder
`linear`); for encoder `vit` `patch` (the tower's patch embedding), `wq wk wv wo` (its attention),
`fc1 fc2` (its MLP) and `proj1 proj2` (the projector into the decoder). So `q` never reaches the
tower's `wq`: the default targets tune the language model with the image tower frozen (LLaVA's
practice), and a vision target that matches no weight of the model is an error.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

BATCH_AXES = ("layers", "experts")
TEXT_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "w_gate", "w_up", "w_down")
VISION_TARGETS = ("proj", "patch", "wq", "wk", "wv", "wo", "fc1", "fc2", "proj1", "proj2")
TARGETS = TEXT_TARGETS + VISION_TARGETS
VISION_ROOT = "vision"  # the decoder's attribute holding the image weights (models/vision.py, models/vit.py)
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


def _targeted(path, targets) -> str | None:
    """The target naming weight `path`, or None: a decoder target outside the image weights, a
    vision target inside them (module docstring)."""
    name = str(getattr(path[-1], "key", path[-1]))
    in_vision = str(getattr(path[0], "key", path[0])) == VISION_ROOT
    ok = name in targets and (name in VISION_TARGETS) == in_vision
    return name if ok else None


def target_paths(params: nnx.State, targets) -> list[str]:
    """Paths ('stacks/0/blocks/0/attn/q', 'vision/layers/0/wq', ...) of the weights named in `targets`."""
    bad = sorted(set(targets) - set(TARGETS))
    if bad:
        raise ValueError(f"lora.targets: unknown {bad}; valid: {TARGETS}")
    flat = nnx.to_flat_state(params)
    hit = {_targeted(p, targets) for p, _ in flat}
    if missing := [t for t in targets if t in VISION_TARGETS and t not in hit]:
        raise ValueError(
            f"lora.targets: vision targets {missing} match no weight of this model (proj: "
            "model.vision.encoder='linear'; patch wq wk wv wo fc1 fc2 proj1 proj2: encoder='vit')"
        )
    return [_key(p) for p, _ in flat if _targeted(p, targets)]


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
