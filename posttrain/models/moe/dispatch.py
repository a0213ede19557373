"""Expert-parallel dispatch: send each (token, slot) assignment to the device holding its expert,
run the experts there, and bring the outputs back — all from inside one `jax.shard_map`.

Per device the steps are: sort the local assignments by expert (`sort_by_expert`), cut them into
one contiguous chunk per peer along the expert-parallel axes, exchange the chunks with an
all-to-all, run `grouped_ffn` on what arrived, and return the outputs by the inverse all-to-all.
Two exchanges do the same thing:

* padded (runs everywhere, XLA:CPU included): a fixed-size `all_to_all` of per-peer buffers of
  `bound` rows, where `bound` is the dropless worst case (every local assignment goes to one peer:
  T*k rows) or, with a capacity C, min(T*k, C * experts_per_device).
* ragged (GPU/TPU): `jax.lax.ragged_all_to_all` moves only the real rows; peers first all-gather
  how many rows each sends to whom so that every device can compute where its rows land.

`model.moe.dispatch='auto'` picks by the devices of the mesh (`auto_dispatch`): ragged on GPU and
TPU, padded on the CPU and on TPU generations whose compiler rejects the ragged collective (v5e).
The ragged exchange cannot run on the CPU, so `parallel.accelerator_paths`' test switch leaves this
choice to the platform; tests compile it for a TPU slice (tests/plan/test_compile_plan.py).

Without expert-parallel peers the same code runs with one chunk and no collective.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from posttrain.config import DISPATCHES
from posttrain.models.moe.experts import expert_ffn, expert_ranks, grouped_ffn, sort_by_expert
from posttrain.models.quant import QArray, is_quantized, weight_einsum
from posttrain.parallel.mesh import accelerator_paths, mesh_device_kind, mesh_platform

# tokens × experts up to which the CPU runs `dense_experts` rather than sorted rows (measured: 16-token
# decode 1.2× and 256-token prefill 1.7× faster dense; 512 tokens 1.5× slower)
DENSE_EXPERTS_MAX_TOKEN_EXPERTS = 2048

# device kinds for which 'auto' avoids `ragged_all_to_all`: libtpu 0.0.42.1 fails on the Qwen3-30B
# step for v5e-256 with "RET_CHECK failure ... ragged_all_to_all_emitter.cc:325" (BENCHMARKS "Pod
# plan"; a tiny step for v5e:2x2 does compile it), while every v5p slice compiles it
NO_RAGGED_ALL_TO_ALL = ("TPU v5 lite",)


def spec_axes(spec: P, dim: int) -> tuple[str, ...]:
    """The mesh axes that shard dimension `dim` of a PartitionSpec, in major-to-minor order."""
    entry = spec[dim] if dim < len(spec) else None
    if entry is None:
        return ()
    return (entry,) if isinstance(entry, str) else tuple(entry)


@dataclasses.dataclass(frozen=True)
class ExpertLayout:
    """Where tokens and expert weights live, as seen by one device inside the `shard_map`.

    token_axes: mesh axes the tokens are sharded over (statistics are averaged over them).
    expert_axes / expert_sizes: axes sharding the experts dimension of the expert weights.
    embed_axes / router_axes: axes sharding the embed dimension of the expert / router weights
      (all-gathered before use, ZeRO-3).
    mlp_axes: axes sharding the expert hidden dimension; the down-projection partials are summed.
    dispatch: 'padded' | 'ragged' all-to-all flavour.
    """

    token_axes: tuple[str, ...] = ()
    expert_axes: tuple[str, ...] = ()
    expert_sizes: tuple[int, ...] = ()
    embed_axes: tuple[str, ...] = ()
    router_axes: tuple[str, ...] = ()
    mlp_axes: tuple[str, ...] = ()
    dispatch: str = "padded"

    @property
    def a2a_axes(self) -> tuple[str, ...]:
        """Expert axes that tokens travel over: those the tokens are sharded over."""
        return tuple(a for a in self.expert_axes if a in self.token_axes)

    @property
    def num_peers(self) -> int:
        """Devices exchanging tokens in one all-to-all group."""
        return math.prod(s for a, s in zip(self.expert_axes, self.expert_sizes) if a in self.token_axes)

    @property
    def psum_axes(self) -> tuple[str, ...]:
        """Axes over which each device holds a partial output: the expert hidden dimension, and
        expert axes the tokens are replicated over (each such device runs its own experts only)."""
        return self.mlp_axes + tuple(a for a in self.expert_axes if a not in self.token_axes)


def auto_dispatch(mesh: Mesh) -> str:
    """The all-to-all flavour `dispatch='auto'` takes on `mesh`: 'padded' where the compiler has no
    `ragged_all_to_all` (XLA:CPU; TPU kinds in `NO_RAGGED_ALL_TO_ALL`), else 'ragged'. Read from
    the mesh's devices, so a program compiled ahead of time for a TPU slice gets that slice's path."""
    if mesh_platform(mesh) == "cpu" or mesh_device_kind(mesh) in NO_RAGGED_ALL_TO_ALL:
        return "padded"
    return "ragged"


def expert_layout(mesh: Mesh, token_spec: P, router_spec: P, gate_spec: P, down_spec: P, dispatch: str) -> ExpertLayout:
    """ExpertLayout from the PartitionSpecs of the tokens [B, S, D], router kernel [D, E], gate/up
    weights [E, D, F] and down weights [E, F, D]; dispatch 'auto' resolves by `auto_dispatch`,
    'ragged' and 'padded' (`model.moe.dispatch`) force a flavour."""
    if dispatch not in DISPATCHES:
        raise ValueError(f"moe.dispatch={dispatch!r}: expected one of {DISPATCHES}")
    if dispatch == "auto":
        dispatch = auto_dispatch(mesh)
    token_axes = spec_axes(token_spec, 0) + spec_axes(token_spec, 1)
    expert_axes, mlp_axes = spec_axes(gate_spec, 0), spec_axes(gate_spec, 2)
    if (spec_axes(down_spec, 0), spec_axes(down_spec, 1)) != (expert_axes, mlp_axes):
        raise ValueError(
            f"expert weights sharded inconsistently: w_gate {gate_spec} vs w_down "
            f"{down_spec}; the experts and expert_mlp dims must use the same mesh axes"
        )
    if set(mlp_axes) & set(token_axes):
        raise ValueError(
            f"sharding rules put tokens ({token_spec}) and the expert_mlp dim "
            f"({gate_spec}) on the same mesh axes {sorted(set(mlp_axes) & set(token_axes))}"
        )
    return ExpertLayout(
        token_axes=token_axes,
        expert_axes=expert_axes,
        expert_sizes=tuple(mesh.shape[a] for a in expert_axes),
        embed_axes=spec_axes(gate_spec, 1),
        router_axes=spec_axes(router_spec, 0),
        mlp_axes=mlp_axes,
        dispatch=dispatch,
    )


def gather_weight(w: jax.Array | QArray, axes: tuple[str, ...], axis: int, layout: ExpertLayout) -> jax.Array:
    """All-gather dimension `axis` of a weight shard over `axes` (innermost axis first).

    Over an axis the tokens are sharded on, the gathered copy is typed varying, so the backward
    pass reduce-scatters its gradient; over one they are replicated on it is typed invariant, so
    the outputs computed from it stay invariant there.
    """
    if is_quantized(w):  # the values; the scales come whole along `axis` (`quantized_spec`)
        return dataclasses.replace(w, qvalue=gather_weight(w.qvalue, axes, axis, layout))
    for a in reversed(axes):
        to = "varying" if a in layout.token_axes else "invarying"
        w = jax.lax.all_gather(w, a, axis=axis, tiled=True, to=to)
    return w


def peer_first_experts(layout: ExpertLayout, experts_per_device: int) -> jax.Array:
    """[num_peers] int32: the first global expert held by each all-to-all peer, in peer order.

    The experts dim is split over `expert_axes` major-to-minor; a peer shares this device's
    coordinates on the expert axes the tokens are replicated over.
    """
    peer = jnp.arange(layout.num_peers, dtype=jnp.int32)
    block = jnp.zeros_like(peer)
    stride = 1
    for axis, size in reversed(list(zip(layout.expert_axes, layout.expert_sizes))):
        if axis in layout.token_axes:
            coord = peer % size
            peer = peer // size
        else:
            coord = jax.lax.axis_index(axis)
        block = block + coord * stride
        stride *= size
    return block * experts_per_device


class Sends(NamedTuple):
    """What this device sends each all-to-all peer: its assignments sorted by expert, in chunks."""

    group_sizes: jax.Array  # [E] sorted rows per global expert
    first: jax.Array  # [num_peers] each peer's first global expert (`peer_first_experts`)
    start: jax.Array  # [num_peers] where each peer's chunk starts among the sorted rows
    size: jax.Array  # [num_peers] its number of rows
    bound: int  # rows of a per-peer buffer (module docstring)


def routed_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    ffn: dict[str, jax.Array],
    *,
    num_experts: int,
    capacity: int | None,
    layout: ExpertLayout,
    inference: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Weighted sum of each token's expert outputs, for this device's tokens.

    x: [T, D] compute dtype; experts, weights: [T, k] from the router; ffn: this device's experts
    `w_gate`, `w_up` [E_local, D, F_local] and `w_down` [E_local, F_local, D], the embed dim gathered. Returns y [T, D]
    float32, partial over `layout.psum_axes`, and the number of kept assignments (scalar int32).
    `inference`: the call is not differentiated (the sampler), see below.
    """
    num_tokens, top_k = experts.shape
    args = (x, experts, weights, ffn)
    if accelerator_paths() or not (
        ffn["w_gate"].shape[0] == num_experts and layout.num_peers == 1 and capacity is None
    ):
        return exchanged_experts(*args, capacity=capacity, layout=layout)
    # The CPU (unless `parallel.accelerator_paths`' test switch is on), every expert on this device,
    # dropless: every expert on every token for few tokens, else sorted rows. When not
    # differentiated, padded batched matmuls first, whenever no expert is over a generous capacity
    # (a lax.cond on the actual load; under autodiff the cond would carry both paths' residuals,
    # which costs more than it saves: measured in a training step).
    if num_tokens * num_experts <= DENSE_EXPERTS_MAX_TOKEN_EXPERTS:
        fallback = lambda: dense_experts(*args)
    else:
        fallback = lambda: exchanged_experts(*args, capacity=None, layout=layout)[0]
    kept = jnp.int32(num_tokens * top_k)
    if not inference:
        return fallback(), kept
    room = spare_capacity(num_tokens * top_k, num_experts)
    load = jnp.bincount(experts.reshape(-1), length=num_experts)
    return jax.lax.cond(jnp.max(load) <= room, lambda: padded_experts(*args, capacity=room), fallback), kept


def exchanged_experts(
    x: jax.Array,
    experts: jax.Array,
    weights: jax.Array,
    ffn: dict[str, jax.Array],
    *,
    capacity: int | None,
    layout: ExpertLayout,
) -> tuple[jax.Array, jax.Array]:
    """`routed_experts` by sorting the assignments by expert and exchanging them with the peers
    that hold their experts (see the module docstring); the general path. The number of experts is
    this device's (`ffn`) times the devices the experts dim is split over."""
    num_tokens, top_k = experts.shape
    local = ffn["w_gate"].shape[0]
    order, group_sizes = sort_by_expert(experts.reshape(-1), local * math.prod(layout.expert_sizes), capacity)
    first = peer_first_experts(layout, local)
    bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(group_sizes)])
    bound = num_tokens * top_k if capacity is None else min(num_tokens * top_k, capacity * local)
    sends = Sends(group_sizes, first, bounds[first], bounds[first + local] - bounds[first], bound)
    tokens = order // top_k  # token of each sorted row
    if layout.dispatch == "ragged" and layout.num_peers > 1:
        out = ragged_exchange(x[tokens], sends, layout, ffn)
    else:
        out = padded_exchange(x, tokens, experts.reshape(-1)[order], sends, layout, ffn)
    out = jnp.zeros_like(out).at[order].add(out, unique_indices=True)
    y = jnp.einsum("tk,tkd->td", weights, out.reshape(num_tokens, top_k, -1).astype(jnp.float32))
    return y, jnp.sum(group_sizes)


def spare_capacity(assignments: int, num_experts: int) -> int:
    """Rows per expert for `padded_experts`: a uniform router's mean load plus three standard
    deviations, rounded up to a multiple of 4 (at most all assignments)."""
    mean = assignments / num_experts
    return min(assignments, 4 * math.ceil((mean + 3 * math.sqrt(mean)) / 4))


def batched_swiglu(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array) -> jax.Array:
    """silu(rows[e] @ w_gate[e]) * (rows[e] @ w_up[e]) for every expert e: rows [E, R, D] →
    [E, R, F] float32. Batched over experts, the layout the weights lie in (no transposed copy)."""
    mm = functools.partial(weight_einsum, "erd,edf->erf", dtype=rows.dtype, preferred_element_type=jnp.float32)
    return jax.nn.silu(mm(rows, w_gate)) * mm(rows, w_up)


def padded_experts(
    x: jax.Array, experts: jax.Array, weights: jax.Array, ffn: dict[str, jax.Array], *, capacity: int
) -> jax.Array:
    """Each expert on its first `capacity` assignments (in token order), as batched matmuls over an
    [E, capacity, D] buffer: no per-group slices of the weights, no tiles. Assignments beyond an
    expert's capacity contribute nothing: callers use it when none is (`routed_experts`).

    x [T, D]; experts, weights [T, k]; ffn's w_* [E, D, F] / [E, F, D]. Returns y [T, D] float32.
    """
    num_tokens, top_k = experts.shape
    num_experts, dim = ffn["w_gate"].shape[0], x.shape[1]
    flat = experts.reshape(-1)
    rank = expert_ranks(flat, *sort_by_expert(flat, num_experts))
    slot = jnp.where(rank < capacity, flat * capacity + rank, num_experts * capacity)  # out of range: dropped
    rows = jnp.zeros((num_experts * capacity, dim), x.dtype).at[slot].set(jnp.repeat(x, top_k, axis=0), mode="drop")
    h = batched_swiglu(rows.reshape(num_experts, capacity, dim), ffn["w_gate"], ffn["w_up"]).astype(x.dtype)
    out = weight_einsum("erf,efd->erd", h, ffn["w_down"], x.dtype, preferred_element_type=jnp.float32)
    out = out.reshape(-1, dim).at[slot].get(mode="fill", fill_value=0)
    return jnp.einsum("tk,tkd->td", weights.astype(jnp.float32), out.reshape(num_tokens, top_k, dim))


def dense_experts(x: jax.Array, experts: jax.Array, weights: jax.Array, ffn: dict[str, jax.Array]) -> jax.Array:
    """Σ_e combine[t, e] · FFN_e(x_t) with every expert on every token (one-hot combine weights).

    x [T, D]; experts, weights [T, k]; ffn's w_* [E, D, F] / [E, F, D]. Returns y [T, D] float32.
    The combine weights scale the hidden activations, so that the down projection and the sum
    over experts are one matmul.
    """
    w_gate, w_up, w_down = ffn["w_gate"], ffn["w_up"], ffn["w_down"]
    num_tokens, num_experts = x.shape[0], w_gate.shape[0]
    combine = (
        jnp.zeros((num_tokens, num_experts), jnp.float32)
        .at[jnp.arange(num_tokens)[:, None], experts]
        .add(weights.astype(jnp.float32))
    )
    h = batched_swiglu(jnp.broadcast_to(x, (num_experts,) + x.shape), w_gate, w_up)
    if is_quantized(w_down):  # bfloat16 inputs: round h before the combine weights, as the other paths do
        out = weight_einsum("etf,efd->etd", h.astype(x.dtype), w_down, x.dtype, preferred_element_type=jnp.float32)
        return jnp.einsum("te,etd->td", combine, out)
    h = h * combine.T[:, :, None]
    return weight_einsum("etf,efd->td", h.astype(x.dtype), w_down, x.dtype, preferred_element_type=jnp.float32)


def padded_exchange(
    x: jax.Array,
    tokens: jax.Array,
    sorted_ids: jax.Array,
    sends: Sends,
    layout: ExpertLayout,
    ffn: dict[str, jax.Array],
) -> jax.Array:
    """Expert outputs [A, D] of the assignments sorted by expert, exchanged as fixed-size
    [num_peers, bound] buffers; zero for assignments that no peer of this device computes
    (dropped, or held by a device that has other tokens).

    x: [T, D] tokens; tokens, sorted_ids: [A] token and global expert of each sorted assignment.
    """
    group_sizes, first, send_start, send_size, bound = sends
    slot = jnp.arange(bound, dtype=jnp.int32)
    valid = slot < send_size[:, None]
    src = jnp.where(valid, send_start[:, None] + slot, tokens.shape[0])  # [peers, bound]
    token = tokens.at[src].get(mode="fill", fill_value=x.shape[0])
    send = x.at[token].get(mode="fill", fill_value=0)  # [peers, bound, D]
    local = ffn["w_gate"].shape[0]
    if layout.num_peers == 1:
        sizes = jax.lax.dynamic_slice_in_dim(group_sizes, first[0], local)
        back = expert_ffn(send[0], sizes, **ffn).astype(x.dtype)[None]
    else:
        ids = jnp.where(valid, sorted_ids.at[src].get(mode="fill", fill_value=0) - first[:, None], local)
        recv = jax.lax.all_to_all(send, layout.a2a_axes, 0, 0, tiled=True)
        recv_ids = jax.lax.all_to_all(ids, layout.a2a_axes, 0, 0, tiled=True)
        out = grouped_ffn(recv.reshape(-1, x.shape[1]), recv_ids.reshape(-1), **ffn)
        back = jax.lax.all_to_all(out.astype(x.dtype).reshape(send.shape), layout.a2a_axes, 0, 0, tiled=True)
    return jnp.zeros_like(x, shape=(tokens.shape[0], x.shape[1])).at[src].add(back, mode="drop")


def ragged_exchange(rows: jax.Array, sends: Sends, layout: ExpertLayout, ffn: dict[str, jax.Array]) -> jax.Array:
    """Like `padded_exchange`, but only real rows travel (`jax.lax.ragged_all_to_all`).

    rows: [A, D] assignments sorted by expert; returns their expert outputs [A, D]. Received rows
    are laid out source-major, each source's rows sorted by expert; the reply writes every output
    back at the sender's sorted position of its row.
    """
    group_sizes, first, send_start, send_size, bound = sends
    axes, peers, local = layout.a2a_axes, layout.num_peers, ffn["w_gate"].shape[0]
    me = jax.lax.axis_index(axes)
    counts = jax.lax.all_gather(group_sizes, axes)  # [peers (source), E]
    bounds = jnp.concatenate([jnp.zeros((peers, 1), jnp.int32), jnp.cumsum(counts, axis=1)], axis=1)
    sizes = bounds[:, first + local] - bounds[:, first]  # [source, dest]
    recv_size = sizes[:, me]
    recv_start = jnp.cumsum(recv_size) - recv_size
    land = (jnp.cumsum(sizes, axis=0) - sizes)[me]  # my rows' offset at each dest
    buffer = jnp.zeros_like(rows, shape=(peers * bound, rows.shape[1]))
    recv = jax.lax.ragged_all_to_all(rows, buffer, send_start, send_size, land, recv_size, axis_name=axes)
    per_expert = jax.lax.dynamic_slice_in_dim(counts, first[me], local, axis=1).reshape(-1)
    segment = jnp.searchsorted(jnp.cumsum(per_expert), jnp.arange(peers * bound), side="right")
    ids = jnp.where(segment < peers * local, segment % local, local)
    out = grouped_ffn(recv, ids, **ffn).astype(rows.dtype)
    reply_land = bounds[:, first[me]]  # where each source sent from
    return jax.lax.ragged_all_to_all(
        out, jnp.zeros_like(rows), recv_start, recv_size, reply_land, send_size, axis_name=axes
    )
