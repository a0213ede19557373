"""The Mixture-of-Experts feed-forward layer: router, dropless routed experts, shared experts.

Under an active `use_sharding(mesh, rules)` context on a multi-device mesh the routed part runs in
one `jax.shard_map` over the whole mesh (expert parallelism by all-to-all, ZeRO-3 gathers of the
embed dim, partial sums over the expert hidden dim); elsewhere it runs as plain jitted code. Both
give the same outputs and statistics.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from posttrain.config import ModelConfig, MoEConfig
from posttrain.models.layers import MLP, dtype_of, fan_in_init, param
from posttrain.models.moe.dispatch import ExpertLayout, expert_layout, gather_weight, routed_experts
from posttrain.models.moe.experts import expert_capacity
from posttrain.models.moe.router import (
    RouterBias,
    Routing,
    expert_counts,
    load_balancing_loss,
    route,
    router_z_loss,
    update_router_bias,
)
from posttrain.models.quant import is_quantized, quantized_spec, split_single_groups
from posttrain.parallel.sharding import Rules, current, logical_spec

TOKEN_NAMES = ("activation_batch", "activation_length", None)
ROUTER_NAMES = ("embed", None)
GATE_UP_NAMES = ("experts", "embed", "expert_mlp")
DOWN_NAMES = ("experts", "expert_mlp", "embed")
EMBED_DIMS = {"w_gate": 1, "w_up": 1, "w_down": 2}  # the embed dim of each expert weight


@dataclasses.dataclass(frozen=True)
class RoutingSpec:
    """The static routing hyper-parameters of `model.moe` that the per-device code needs."""

    num_experts: int
    top_k: int
    router: str
    norm_topk_prob: bool
    routed_scaling: float
    capacity_factor: float

    @classmethod
    def from_config(cls, moe: MoEConfig) -> RoutingSpec:
        """The spec of the `model.moe` section (which checked its values)."""
        if moe.num_experts < 1:
            raise ValueError(f"moe.num_experts={moe.num_experts}: an MoE layer needs at least 1 expert")
        return cls(
            int(moe.num_experts),
            int(moe.top_k),
            moe.router,
            bool(moe.norm_topk_prob),
            float(moe.routed_scaling),
            float(moe.capacity_factor),
        )


def moe_block(
    x: jax.Array,
    params: dict[str, jax.Array],
    *,
    spec: RoutingSpec,
    layout: ExpertLayout,
    mask: jax.Array | None = None,
    inference: bool = False,
    experts: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Routed experts on one device's tokens x [T, D] (compute dtype).

    params: router [D(/shards), E], w_gate/w_up [E_local, D(/shards), F_local],
    w_down [E_local, F_local, D(/shards)] and, for the sigmoid router, bias [E]. mask [T]: 1 for a
    real token, 0 for padding (None: all real); padding takes no expert capacity and is left out of
    the statistics. `experts` [T, k]: the experts to use instead of the router's top-k (routing
    replay, see `route`). Returns y [T, D] float32 and the layer statistics averaged over the real
    tokens of the whole mesh (see `MoE`), with "experts" [T, k] int32, the experts used.
    """
    num_tokens = x.shape[0]
    mask = jnp.ones((num_tokens,), jnp.float32) if mask is None else mask.astype(jnp.float32)
    router = gather_weight(params["router"], layout.router_axes, 0, layout)
    logits = x.astype(jnp.float32) @ router.astype(jnp.float32)
    routing = route(
        logits,
        top_k=spec.top_k,
        router=spec.router,
        norm_topk_prob=spec.norm_topk_prob,
        routed_scaling=spec.routed_scaling,
        bias=params.get("bias"),
        experts=None if experts is None else experts.astype(jnp.int32),
    )
    capacity = expert_capacity(num_tokens, spec.top_k, spec.num_experts, spec.capacity_factor)
    experts = routing.experts
    if capacity is not None:  # padding goes to no expert (id E): it takes no capacity rank
        experts = jnp.where(mask[:, None] > 0, experts, spec.num_experts)
    y, kept = routed_experts(
        x,
        experts,
        routing.weights,
        {name: gather_weight(params[name], layout.embed_axes, dim, layout) for name, dim in EMBED_DIMS.items()},
        num_experts=spec.num_experts,
        capacity=capacity,
        layout=layout,
        inference=inference,
    )
    if layout.psum_axes:
        y = jax.lax.psum(y, layout.psum_axes)
    stats = routing_stats(routing, logits, mask, kept if capacity is not None else None, spec, layout)
    return y, {**stats, "experts": routing.experts}


def routing_stats(
    routing: Routing,
    logits: jax.Array,
    mask: jax.Array,
    kept: jax.Array | None,
    spec: RoutingSpec,
    layout: ExpertLayout,
) -> dict[str, jax.Array]:
    """Load, load-balancing and z losses, and the dropped fraction over the real tokens (mask [T])
    of all devices: sums over `layout.token_axes` divided by the global real-token count, so
    devices holding more padding weigh less. kept: kept real assignments (None: dropless)."""

    def token_sum(v):
        return jax.lax.psum(v, layout.token_axes) if layout.token_axes else v

    real = token_sum(jnp.sum(mask))
    tokens, assignments = jnp.maximum(real, 1.0), jnp.maximum(real * spec.top_k, 1.0)
    load = token_sum(expert_counts(routing.experts, spec.num_experts, mask)) / assignments
    mean_probs = token_sum(jnp.sum(routing.probs * mask[:, None], axis=0)) / tokens
    dropped = (
        jnp.float32(0.0) if kept is None else (real * spec.top_k - token_sum(kept.astype(jnp.float32))) / assignments
    )
    return {
        "aux_loss": load_balancing_loss(mean_probs, load, spec.top_k),
        "z_loss": token_sum(jnp.sum(router_z_loss(logits) * mask)) / tokens,
        "load": load,
        "dropped": dropped,
    }


def sharded_moe_block(
    x: jax.Array,
    mask: jax.Array,
    params: dict[str, jax.Array],
    *,
    spec: RoutingSpec,
    mesh: Mesh,
    rules: Rules,
    dispatch: str,
    inference: bool = False,
    experts: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """`moe_block` in a `jax.shard_map` over the whole mesh; x: [B, S, D], mask [B, S] (and the
    replayed experts [B, S, k], or None) → y [B, S, D] float32 and the statistics, "experts" [B, S, k].

    Tokens are split as the `batch` and `length` rules say, weights as their logical names say;
    the specs come from `logical_spec`, so rule changes carry through.
    """

    def spec_of(names, shape):
        return logical_spec(names, mesh, rules, shape)

    token_spec = spec_of(TOKEN_NAMES, x.shape)
    param_specs = {
        "router": spec_of(ROUTER_NAMES, params["router"].shape),
        "w_gate": spec_of(GATE_UP_NAMES, params["w_gate"].shape),
        "w_up": spec_of(GATE_UP_NAMES, params["w_up"].shape),
        "w_down": spec_of(DOWN_NAMES, params["w_down"].shape),
    }
    if "bias" in params:
        param_specs["bias"] = P()
    layout = expert_layout(
        mesh, token_spec, param_specs["router"], param_specs["w_gate"], param_specs["w_down"], dispatch
    )
    for name, embed_dim in EMBED_DIMS.items():  # the sampler's quantised experts
        if is_quantized(params[name]):  # scales go with their values, whole along the gathered embed dim
            params = {
                **params,
                name: split_single_groups(params[name], param_specs[name], dict(mesh.shape), whole=(embed_dim,)),
            }
            param_specs[name] = quantized_spec(
                params[name], param_specs[name], dict(mesh.shape), f"moe.{name}", whole=(embed_dim,)
            )

    def body(x, mask, params, experts):
        b, s, d = x.shape
        y, aux = moe_block(
            x.reshape(b * s, d),
            params,
            spec=spec,
            layout=layout,
            mask=mask.reshape(b * s),
            inference=inference,
            experts=None if experts is None else experts.reshape(b * s, -1),
        )
        return y.reshape(b, s, d), {**aux, "experts": aux["experts"].reshape(b, s, -1)}

    mask_spec = P(*token_spec[:2])
    aux_specs = {"aux_loss": P(), "z_loss": P(), "load": P(), "dropped": P(), "experts": mask_spec}
    # check_vma stays on: the varying/invariant types make autodiff insert the psums that the
    # gradients of replicated weights need; `gather_weight` picks the type per mesh axis so that
    # outputs are invariant exactly where out_specs replicate them.
    return jax.shard_map(
        body,
        mesh=mesh,
        in_specs=(token_spec, mask_spec, param_specs, None if experts is None else mask_spec),
        out_specs=(token_spec, aux_specs),
        check_vma=True,
    )(x, mask, params, experts)


class MoE(nnx.Module):
    """Mixture-of-Experts SwiGLU layer (Mixtral, Qwen3-MoE, DeepSeek-V3 routing), dropless by
    default.

    `__call__(x [B, S, D], mask [B, S] | None) -> (y [B, S, D], aux)`, y in the compute dtype;
    mask marks real tokens (1) and padding (0). aux holds float32, over the real tokens only,
    `aux_loss` (unweighted load-balancing loss, HF normalisation), `z_loss` (unweighted router
    z-loss), `load` [E] (fraction of the real tokens' routed assignments per expert, before any
    capacity drop; sums to 1) and `dropped` (fraction of them over capacity; 0 when dropless).

    Capacity mode (`capacity_factor > 0`): each expert keeps, per group of tokens, the first
    ceil(capacity_factor * tokens * k / E) real assignments in token order and drops the rest
    (their combine weight becomes 0; the shared experts and the residual still carry the token);
    padding is routed to no expert. The group is the tokens of one call, or of one device when
    expert-parallel.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        moe = cfg.moe
        self.spec = RoutingSpec.from_config(moe)
        if moe.dispatch not in ("auto", "ragged", "padded"):
            raise ValueError(f"moe.dispatch={moe.dispatch!r}: expected 'auto', 'ragged' or 'padded'")
        self.dispatch = moe.dispatch
        self.bias_update_rate = float(moe.bias_update_rate)
        self.dtype = dtype_of(cfg.dtype)
        param_dtype = dtype_of(cfg.param_dtype)
        dim, experts, hidden = cfg.embed_dim, moe.num_experts, moe.expert_mlp_dim
        self.router = param(rngs, fan_in_init(), (dim, experts), ROUTER_NAMES, param_dtype)
        expert_init = fan_in_init(in_axis=-2, out_axis=-1, batch_axis=(0,))
        self.w_gate = param(rngs, expert_init, (experts, dim, hidden), GATE_UP_NAMES, param_dtype)
        self.w_up = param(rngs, expert_init, (experts, dim, hidden), GATE_UP_NAMES, param_dtype)
        self.w_down = param(rngs, expert_init, (experts, hidden, dim), DOWN_NAMES, param_dtype)
        self.router_bias = (
            RouterBias(jnp.zeros((experts,), jnp.float32), out_sharding=(None,), eager_sharding=False)
            if moe.router == "sigmoid"
            else None
        )
        self.shared = (
            MLP(dim, moe.num_shared_experts * moe.shared_mlp_dim, param_dtype=param_dtype, dtype=self.dtype, rngs=rngs)
            if moe.num_shared_experts > 0
            else None
        )

    def __call__(
        self,
        x: jax.Array,
        mask: jax.Array | None = None,
        *,
        update_bias: bool = False,
        inference: bool = False,
        experts: jax.Array | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """Routed + shared experts on x [B, S, D] (mask [B, S]: 1 real token, 0 padding; None: all
        real); with `update_bias` (sigmoid router, rate > 0) also steps `router_bias` towards
        balanced load of the real tokens, in place. `inference`: the call will not be
        differentiated (the sampler), which lets the CPU pick its expert path at run time.
        `experts` [B, S, k]: replay these experts instead of the router's choice (`route`); aux
        also holds "experts" [B, S, k] int32, the experts each token used."""
        x = x.astype(self.dtype)
        mask = jnp.ones(x.shape[:2], jnp.float32) if mask is None else mask.astype(jnp.float32)
        params = {
            "router": self.router[...],
            "w_gate": self.w_gate[...],
            "w_up": self.w_up[...],
            "w_down": self.w_down[...],
        }
        if self.router_bias is not None:
            params["bias"] = self.router_bias[...]
        ctx = current()
        if ctx is not None and ctx[0].size > 1:
            mesh, rules = ctx
            y, aux = sharded_moe_block(
                x,
                mask,
                params,
                spec=self.spec,
                mesh=mesh,
                rules=rules,
                dispatch=self.dispatch,
                inference=inference,
                experts=experts,
            )
        else:
            b, s, d = x.shape
            y, aux = moe_block(
                x.reshape(b * s, d),
                params,
                spec=self.spec,
                layout=ExpertLayout(),
                mask=mask.reshape(b * s),
                inference=inference,
                experts=None if experts is None else experts.reshape(b * s, -1),
            )
            y, aux = y.reshape(b, s, d), {**aux, "experts": aux["experts"].reshape(b, s, -1)}
        y = y.astype(self.dtype)
        if self.shared is not None:
            y = y + self.shared(x)
        if update_bias and self.router_bias is not None and self.bias_update_rate > 0:
            self.router_bias[...] = update_router_bias(params["bias"], aux["load"], self.bias_update_rate)
        return y, aux
