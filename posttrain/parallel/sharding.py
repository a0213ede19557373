"""Logical axis names → mesh shardings.

Model code names array dimensions logically: weights by `embed`, `heads`, `mlp`, `experts`, ...,
activations by `activation_batch`, `activation_embed`, ... One table of rules maps each logical
name to zero or more mesh axes; changing parallelism is a change of that table.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from posttrain.config import DEFAULT_RULES

# Tensor-parallel dims (Megatron): attention heads, MLP and expert hidden, vocab; weights and activations.
TENSOR_PARALLEL_NAMES = (
    "heads",
    "kv_heads",
    "mlp",
    "expert_mlp",
    "vocab",
    "vocab_lookup",
    "activation_heads",
    "activation_kv_heads",
    "activation_mlp",
    "activation_vocab",
)

Rules = Mapping[str, tuple[str, ...]]


def parse_rules(table: Mapping[str, Any]) -> dict[str, tuple[str, ...]]:
    """Rules from a config table whose values are comma-separated mesh axes ('' = replicated)."""
    rules = dict(DEFAULT_RULES)
    for name, axes in table.items():
        if isinstance(axes, str):
            axes = tuple(a.strip() for a in axes.split(",") if a.strip())
        rules[name] = tuple(axes)
    return rules


def decode_rules(rules: Rules) -> dict[str, tuple[str, ...]]:
    """The sampler's decode layout derived from the learner's `rules` (as MaxText decodes with
    ici_tensor_parallelism): no ZeRO-3. The mesh axes that shard the weights' `embed` dim, except
    those holding experts, join each tensor-parallel name (heads, MLP / expert hidden, vocab) after
    its own axes; `embed` is whole; batch, and so the KV cache's rows, keeps only the axes left.

    A decode step then moves activations (an all-reduce of [B, D] per projection that sums over
    heads or hidden) instead of all-gathering every weight shard again for each token. Weights
    are replicated over the batch axes (data, and expert outside the experts).
    """
    zero3 = tuple(a for a in rules["embed"] if a not in rules["experts"])
    out = dict(rules)
    out["embed"] = ()
    for name in TENSOR_PARALLEL_NAMES:
        out[name] = tuple(rules[name]) + tuple(a for a in zero3 if a not in rules[name])
    out["vocab_lookup"] = out["vocab"]  # look tokens up in the table's own shards
    tensor = {a for name in TENSOR_PARALLEL_NAMES for a in out[name]}
    for name in ("batch", "activation_batch"):
        out[name] = tuple(a for a in rules[name] if a not in tensor)
    return out


def rules_key(rules: Rules) -> tuple:
    """`rules` as a hashable value: a jit static argument for programs whose traced sharding
    constraints depend on the rules in force (two rule sets on one mesh must not share a trace)."""
    return tuple(sorted((k, tuple(v)) for k, v in rules.items()))


def logical_spec(names: Sequence[str | None], mesh: Mesh, rules: Rules, shape: Sequence[int] | None = None) -> P:
    """PartitionSpec for a dimension list of logical names.

    Mesh axes of size 1 are dropped; a mesh axis is used at most once per array (first dimension
    wins); with `shape` given, trailing mesh axes that do not divide a dimension are dropped, so
    small dims (e.g. 2 KV heads on a 4-way tensor axis) stay replicated instead of failing.
    """
    used: set[str] = set()
    out = []
    for i, name in enumerate(names):
        if name is None:
            out.append(None)
            continue
        if name not in rules:
            raise KeyError(f"logical axis {name!r} has no sharding rule; known: {sorted(rules)}")
        axes = [a for a in rules[name] if mesh.shape[a] > 1 and a not in used]
        if shape is not None:
            while axes and shape[i] % math.prod(mesh.shape[a] for a in axes):
                axes.pop()
        used.update(axes)
        out.append(None if not axes else axes[0] if len(axes) == 1 else tuple(axes))
    while out and out[-1] is None:
        out.pop()
    return P(*out)


def shardings_for(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree of nnx Variables (from their logical `out_sharding` names) and
    plain arrays (replicated): params, optimizer state and whole train states alike."""

    def one(x):
        if isinstance(x, nnx.Variable):
            names = x.get_metadata().get("out_sharding") or (None,) * len(x.shape)
            return x.replace(NamedSharding(mesh, logical_spec(names, mesh, rules, x.shape)))
        return NamedSharding(mesh, P())

    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


# The mesh and rules in force while a jitted function is traced; model code reads them to place
# sharding constraints on activations and to build `shard_map`s.
_CONTEXT: contextvars.ContextVar[tuple[Mesh, Rules] | None] = contextvars.ContextVar("posttrain_sharding", default=None)


@contextlib.contextmanager
def use_sharding(mesh: Mesh, rules: Rules):
    """Make `mesh` and `rules` current (also `jax.set_mesh`) for tracing model code."""
    token = _CONTEXT.set((mesh, dict(rules)))
    try:
        with jax.set_mesh(mesh):
            yield
    finally:
        _CONTEXT.reset(token)


def current() -> tuple[Mesh, Rules] | None:
    """The (mesh, rules) set by `use_sharding`, or None outside it."""
    return _CONTEXT.get()


def constrain(x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """`with_sharding_constraint` by logical names; a no-op outside `use_sharding`."""
    ctx = current()
    if ctx is None:
        return x
    mesh, rules = ctx
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_spec(names, mesh, rules, x.shape)))


def named_sharding(names: Sequence[str | None], shape: Sequence[int] | None = None) -> NamedSharding:
    """NamedSharding by logical names under the current `use_sharding` context."""
    ctx = current()
    if ctx is None:
        raise RuntimeError("named_sharding() needs an active use_sharding(mesh, rules) context")
    mesh, rules = ctx
    return NamedSharding(mesh, logical_spec(names, mesh, rules, shape))


def abstract_model(make_model: Callable[[], nnx.Module]) -> nnx.Module:
    """The model's structure and shapes without allocating (for shardings and restores).

    Plain `jax.eval_shape` rather than `nnx.eval_shape`, which would resolve the logical axis
    names against the current mesh itself; `shardings_for` applies our rules instead.
    """
    graphdef = None

    def shapes():
        nonlocal graphdef
        graphdef, state = nnx.split(make_model())
        return state

    state = jax.eval_shape(shapes)
    return nnx.merge(graphdef, state)
