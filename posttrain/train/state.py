"""Train state (params, non-trainable model variables, optimizer state, step) and its sharded init."""

from __future__ import annotations

from typing import Any, Callable

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from posttrain.parallel.sharding import Rules, logical_spec


@flax.struct.dataclass
class TrainState:
    """Everything a train step updates. `rest` holds non-trainable model variables (router biases)."""
    step: jax.Array
    params: nnx.State
    rest: nnx.State
    opt_state: optax.OptState


def shardings_for(tree: Any, mesh: Mesh, rules: Rules) -> Any:
    """NamedShardings for a pytree of nnx Variables (from their logical `out_sharding` names) and
    plain arrays (replicated): works for params, optimizer state and whole train states."""
    def one(x):
        if isinstance(x, nnx.Variable):
            names = x.get_metadata().get("out_sharding") or (None,) * len(x.shape)
            return x.replace(NamedSharding(mesh, logical_spec(names, mesh, rules, x.shape)))
        return NamedSharding(mesh, P())
    return jax.tree.map(one, tree, is_leaf=lambda x: isinstance(x, nnx.Variable))


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


def create_train_state(make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation,
                       mesh: Mesh, rules: Rules) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Initialise model and optimizer directly into their shardings (no host copy of the weights).

    Returns (graphdef, state, state_shardings).
    """
    def init() -> TrainState:
        _, params, rest = nnx.split(make_model(), nnx.Param, ...)
        return TrainState(step=jnp.zeros((), jnp.int32), params=params, rest=rest,
                          opt_state=tx.init(params))

    graphdef = nnx.graphdef(abstract_model(make_model))
    shardings = shardings_for(jax.eval_shape(init), mesh, rules)
    state = jax.jit(init, out_shardings=shardings)()
    return graphdef, state, shardings


def init_model_state(make_model: Callable[[], nnx.Module], mesh: Mesh, rules: Rules) -> tuple[nnx.State, nnx.State]:
    """(params, rest) of a freshly initialised model, created directly in their shardings."""
    def init():
        _, params, rest = nnx.split(make_model(), nnx.Param, ...)
        return params, rest
    return jax.jit(init, out_shardings=shardings_for(jax.eval_shape(init), mesh, rules))()
