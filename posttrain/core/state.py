"""Train state (params, non-trainable model variables, optimizer state, step) and its sharded init."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh

from posttrain.models import lora
from posttrain.parallel.sharding import Rules, abstract_model, shardings_for  # noqa: F401 (re-exported)


@flax.struct.dataclass
class TrainState:
    """Everything a train step uses. `params` are what the optimizer trains (all weights, or only
    LoRA adapters); `rest` holds non-trainable model variables (router biases); `frozen` is the
    base weights under LoRA (None otherwise), never updated or checkpointed. `nonfinite` counts
    updates skipped for a non-finite loss or gradient (see `step.nonfinite_counts`); not
    checkpointed either: the counts are per run."""

    step: jax.Array
    params: Any
    rest: nnx.State
    opt_state: optax.OptState
    frozen: nnx.State | None = None
    nonfinite: dict | None = None


def lora_scale(lora_cfg) -> float | None:
    """alpha / rank when LoRA is on (rank > 0), else None."""
    if lora_cfg is None or lora_cfg.rank <= 0:
        return None
    if lora_cfg.dropout:
        raise ValueError(
            f"lora.dropout={lora_cfg.dropout}: not supported (adapters are merged into the "
            "weights, so there is no adapter activation to drop); set it to 0"
        )
    return lora_cfg.alpha / lora_cfg.rank


def model_params(state: TrainState, lora_cfg=None) -> nnx.State:
    """The weights the model runs with: params, or frozen base + merged LoRA adapters."""
    if state.frozen is None:
        return state.params
    return lora.merge(state.frozen, state.params, lora_scale(lora_cfg))


def train_state_init(
    make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation, lora_cfg=None, seed: int = 0
) -> Callable[[], TrainState]:
    """The function that builds a fresh TrainState (under LoRA: adapters on `lora_cfg.targets`
    trained, the initial weights kept as the frozen base); jit it, or `jax.eval_shape` it."""
    scale = lora_scale(lora_cfg)

    def init() -> TrainState:
        _, params, rest = nnx.split(make_model(), nnx.Param, ...)
        frozen = None
        if scale is not None:
            frozen, params = params, lora.init_adapters(params, lora_cfg.targets, lora_cfg.rank, jax.random.key(seed))
        nonfinite = {k: jnp.zeros((), jnp.int32) for k in ("skipped", "run", "longest")}
        return TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            rest=rest,
            opt_state=tx.init(params),
            frozen=frozen,
            nonfinite=nonfinite,
        )

    return init


def abstract_train_state(
    make_model: Callable[[], nnx.Module], tx: optax.GradientTransformation, mesh: Mesh, rules: Rules, lora_cfg=None
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """(graphdef, the TrainState as ShapeDtypeStructs carrying their shardings, the shardings):
    everything a compile needs, nothing allocated (ahead-of-time compilation for big meshes)."""
    shapes = jax.eval_shape(train_state_init(make_model, tx, lora_cfg))
    shardings = shardings_for(shapes, mesh, rules)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return nnx.graphdef(abstract_model(make_model)), abstract, shardings


def create_train_state(
    make_model: Callable[[], nnx.Module],
    tx: optax.GradientTransformation,
    mesh: Mesh,
    rules: Rules,
    lora_cfg=None,
    seed: int = 0,
) -> tuple[nnx.GraphDef, TrainState, TrainState]:
    """Initialise model and optimizer directly into their shardings (no host copy of the weights).

    With LoRA (`lora_cfg.rank > 0`) the optimizer trains adapters on `lora_cfg.targets` and the
    initial weights become the frozen base. Returns (graphdef, state, state_shardings).
    """
    init = train_state_init(make_model, tx, lora_cfg, seed)
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
