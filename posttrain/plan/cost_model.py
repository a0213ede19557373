"""Analytic per-chip cost of a run's programs on a TPU slice: model and executed FLOPs (remat and
attention recompute) and HBM bytes from the shapes, collective bytes from the mesh and the
sharding rules, and the roofline (`plan.roofline`: a floor on time, the bound that sets it,
MFU) — for every model × slice of the pod plan, where a compile of one large program takes 20-30
minutes on a CPU host (`tools/pod_plan.py`; checked against compiled programs, in and out of
sample, by tests/plan/test_compile_plan.py, tests/plan/test_cost_model.py and BENCHMARKS.md "Pod plan").

The schedule it counts (mesh axes data · fsdp · expert, the batch over all of them):
* ZeRO-3: every weight sharded over batch axes is all-gathered before use, once per forward
  pass, and again in the backward pass under remat (`model.remat` full or dots: the gathered copy
  is not a residual; see `WeightBytes.gathered_per_pass`); experts keep their `expert` sharding
  and gather only the embed dim. Each trained weight's gradient is reduced at its gathered size
  (see `WeightBytes` for which collective); LoRA adapters' gradients are all-reduced.
* Expert parallelism: per MoE layer and pass, each chip sends its T·k (token, expert) rows to the
  peers holding their experts and gets the outputs back; the backward pass does both again
  (transposed). Bytes are those the program's buffers hold, as `aot.collective_bytes` counts
  them: the ragged dispatch its T·k rows, the reply (and both directions of the padded
  exchange, with its int32 expert ids) the receive buffer, peers × min(T·k, capacity × local
  experts) rows.
Collectives are counted at the full size of the buffer moved (an all-gather's result), as the
compiled counts are; tensor and sequence parallelism are not modelled (an error says so).
"""

from __future__ import annotations

import dataclasses
import math

from flax import nnx
from jax.sharding import Mesh

from posttrain.core.state import abstract_model
from posttrain.models.decoder import Decoder, layer_kinds
from posttrain.models.flops import activated_matmul_params, train_flops_per_token
from posttrain.models.lora import BATCH_AXES, FAN_IN_DIMS, target_paths
from posttrain.models.moe.dispatch import auto_dispatch
from posttrain.models.moe.experts import expert_capacity
from posttrain.parallel import logical_spec
from posttrain.parallel.sharding import Rules
from posttrain.plan import aot
from posttrain.plan.roofline import phases, roofline
from posttrain.sampling.generate import bucket

# The programs a pod plan costs (analytic here, compiled by `compile_plan.plan`); `compile_plan` also
# reports "restore" (`restore_report`: not compiled) and "publish" (the learner → sampler reshard).
PROGRAMS = ("sft", "dpo", "rl_learner", "sampler")


@dataclasses.dataclass(frozen=True)
class WeightBytes:
    """Per-chip bytes of the weights as a step moves them (all layers together).

    gathered: weights sharded over batch axes, at their gathered size (this chip's experts,
      everything else whole); reduce_scattered / all_reduced: gradient bytes of the trained
      weights (all of them, or under LoRA the adapted ones, whose merged copy gets a weight-sized
      gradient) by the collective that reduces them: a reduce-scatter where the weight is sharded
      over one batch axis; an all-reduce where it is sharded over several (XLA reduces the
      gradient of a weight split over fsdp × expert with an all-reduce, seen in every compiled
      program) or over none, and for LoRA adapters (sharded only over layers and experts).
    stacked_dense / experts: the parts of `gathered` that are the layer stack's non-expert
      weights and the experts (the rest: embedding, head, final norm).
    read / experts_read: every weight as this chip reads it in one pass (at its gathered size,
      whether or not it was gathered), and the experts' part of that; local / local_trained: the
      bytes this chip holds (its shards), all weights and the trained ones (the optimizer's).
    """

    gathered: float
    reduce_scattered: float
    all_reduced: float
    stacked_dense: float = 0.0
    experts: float = 0.0
    read: float = 0.0
    experts_read: float = 0.0
    local: float = 0.0
    local_trained: float = 0.0

    def gathered_per_pass(self, trained: bool, remat: bool) -> float:
        """Bytes all-gathered by one pass over the model. A trained pass under remat gathers the
        experts twice (forward, recomputed forward: one explicit gather in the `shard_map` feeds
        the recompute and the transposed matmuls) and the other weights of the layer stack three
        times (XLA partitions the backward's transposed matmul with a gather of its own); weights
        outside the stack (embedding, head) once. Counted from the compiled programs' HLO."""
        if not (trained and remat):
            return self.gathered
        return self.gathered + self.experts + 2 * self.stacked_dense


def _spec_ways(spec, mesh: Mesh, names: tuple, batch_axes: set[str]) -> tuple[tuple[str, ...], int]:
    """(the batch axes splitting the non-expert dims: gathered before use, the ways every other
    axis splits the array: kept)."""
    gather, keep = (), 1
    for name, entry in zip(names, tuple(spec) + (None,) * (len(names) - len(spec))):
        for axis in () if entry is None else (entry,) if isinstance(entry, str) else entry:
            if axis in batch_axes and name != "experts":
                gather += (axis,)
            else:
                keep *= mesh.shape[axis]
    return gather, keep


def keep_experts(spec, names: tuple, mesh: Mesh) -> int:
    """Ways the `experts` dim of a weight is split (its LoRA adapters are split the same way)."""
    if "experts" not in names or names.index("experts") >= len(spec) or spec[names.index("experts")] is None:
        return 1
    entry = spec[names.index("experts")]
    return math.prod(mesh.shape[a] for a in ((entry,) if isinstance(entry, str) else entry))


def weight_bytes(cfg, mesh: Mesh, rules: Rules) -> WeightBytes:
    """`WeightBytes` of cfg.model's parameters laid out by `rules` on `mesh` (abstract, nothing allocated)."""
    params = nnx.state(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))), nnx.Param)
    lora = cfg.lora.rank > 0
    adapted = set(target_paths(params, cfg.lora.targets)) if lora else set()
    batch_axes = set(rules["batch"])
    gathered = reduce_scattered = all_reduced = stacked_dense = experts = read = experts_read = local = trained = 0.0
    for path, var in nnx.to_flat_state(params):
        key = "/".join(str(getattr(p, "key", p)) for p in path)
        names = tuple(var.get_metadata().get("out_sharding") or (None,) * len(var.shape))
        spec = logical_spec(names, mesh, rules, var.shape)
        gather_axes, keep = _spec_ways(spec, mesh, names, batch_axes)
        nbytes = math.prod(var.shape) * var.dtype.itemsize / keep  # this chip's part, gathered
        shard = nbytes / math.prod(mesh.shape[a] for a in gather_axes)
        read, local = read + nbytes, local + shard
        experts_read += nbytes if "experts" in names else 0.0
        trained += shard if (key in adapted or not lora) else 0.0
        if gather_axes:
            gathered += nbytes
            if "experts" in names:
                experts += nbytes
            elif key.startswith("stacks/"):
                stacked_dense += nbytes
        if key in adapted or not lora:
            if len(gather_axes) == 1:
                reduce_scattered += nbytes
            else:
                all_reduced += nbytes
        if key in adapted:  # A [*batch, fan_in, r], B [*batch, r, fan_out]; batch dims: layers, experts
            nb = sum(1 for n in names if n in BATCH_AXES)
            nin = FAN_IN_DIMS.get(key.rsplit("/", 1)[-1], 1)
            fans = math.prod(var.shape[nb : nb + nin]) + math.prod(var.shape[nb + nin :])
            ways = keep_experts(spec, names, mesh)
            all_reduced += math.prod(var.shape[:nb]) / ways * cfg.lora.rank * fans * var.dtype.itemsize
    return WeightBytes(
        gathered, reduce_scattered, all_reduced, stacked_dense, experts, read, experts_read, local, trained
    )


def activated_by_weight(m) -> dict[str, float]:
    """Weights one token multiplies through, by weight name (q, k, v, o, gate, up, down, w_gate,
    w_up, w_down, router, head): `activated_matmul_params` split up, for LoRA's targets."""
    kinds = layer_kinds(m)
    n_moe, n_dense = kinds.count("moe"), kinds.count("dense")
    d, moe = m.embed_dim, m.moe
    out = {
        "q": len(kinds) * d * m.num_heads * m.head_dim,
        "o": len(kinds) * d * m.num_heads * m.head_dim,
        "k": len(kinds) * d * m.num_kv_heads * m.head_dim,
        "v": len(kinds) * d * m.num_kv_heads * m.head_dim,
        "router": n_moe * d * moe.num_experts,
        "head": d * m.vocab_size,
    }
    for w in ("gate", "up", "down"):
        out[w] = n_dense * d * m.mlp_dim + n_moe * d * moe.shared_mlp_dim * moe.num_shared_experts
        out["w_" + w] = n_moe * d * moe.expert_mlp_dim * moe.top_k
    return out


def attention_forward(m, length: int) -> float:
    """Executed attention forward FLOPs per token: QKᵀ and PV, 2·L·H·Dh per (query, key) pair
    each; for the tiled kernels the tiles on and below the diagonal, (S + block) / 2 pairs per
    query (they skip those above), all S for the xla reference (a masked S×S matmul). Its
    backward costs twice this."""
    pairs = length if m.attention == "xla" else min(length, (length + m.attention_block) / 2)
    return 4 * m.num_layers * m.num_heads * m.head_dim * pairs


def recompute_per_token(m, length: int) -> float:
    """FLOPs per token that `model.remat` and the attention kernel compute again in the backward.

    remat full (`nothing_saveable` on each layer): the layer stack's forward, 2·(N − head) + the
    attention forward (the LM head is outside the scan: not recomputed); remat dots
    (`dots_with_no_batch_dims_saveable`): the weight matmuls are kept, but the attention einsums
    and the experts (batched over experts, or `ragged_dot`) are recomputed; flash-style kernels
    (every `model.attention` but the xla reference) recompute the scores QKᵀ in their backward.
    """
    n, f = activated_matmul_params(m), attention_forward(m, length)
    experts = 3 * m.embed_dim * m.moe.expert_mlp_dim * m.moe.top_k * layer_kinds(m).count("moe")
    remat = {"none": 0.0, "full": 2 * (n - m.embed_dim * m.vocab_size) + f, "dots": 2 * experts + f}[m.remat]
    return remat + (f / 2 if m.attention != "xla" else 0.0)


def train_flops(cfg, rows: int, length: int) -> tuple[float, float]:
    """(model, executed) FLOPs of one train step on rows × length tokens (all chips together).

    Model: 6·N_activated + causal attention per token; under LoRA 4·N (frozen weights need no
    weight gradient), the count MFU is quoted in. Executed: what the chips compute: forward 2·N,
    input gradients 2·N, weight gradients 2·N (under LoRA only on the adapted weights, merged
    W + s·A·B before use, so their gradient is weight-sized), attention forward and backward
    (3 × `attention_forward`), plus `recompute_per_token`. model ≤ executed always.
    """
    m = cfg.model
    n, tokens = activated_matmul_params(m), rows * length
    full = train_flops_per_token(m, length) * tokens
    weight_grads = 2 * n
    if cfg.lora.rank > 0:
        weight_grads = 2 * sum(v for k, v in activated_by_weight(m).items() if k in tuple(cfg.lora.targets))
    executed = (4 * n + weight_grads + 3 * attention_forward(m, length) + recompute_per_token(m, length)) * tokens
    model = full * 4 / 6 if cfg.lora.rank > 0 else full
    return model, executed


def reference_flops(m, rows: int, length: int) -> float:
    """Executed FLOPs of a frozen reference's forward on rows × length tokens."""
    return (2 * activated_matmul_params(m) + attention_forward(m, length)) * rows * length


def sampler_flops(m, prompts: int, prompt_len: int, samples: int, new_tokens: int) -> tuple[float, float]:
    """(model, executed) FLOPs of prefilling `prompts` prompts and decoding `samples` × `new_tokens`
    tokens for each. Model: 2·N_activated per token plus attention over the context each token
    sees (4·L·H·Dh per context position; causal in the prefill). Executed: a decode step attends
    over the whole cache (prompt + new tokens, masked), as `ops.decode.decode_attention` does."""
    n, attn = activated_matmul_params(m), 4 * m.num_layers * m.num_heads * m.head_dim
    prefill = prompts * (2 * n * prompt_len + attn * prompt_len**2 / 2)
    decode = prompts * samples * (2 * n * new_tokens + attn * (new_tokens * prompt_len + new_tokens**2 / 2))
    executed = prompts * samples * new_tokens * (2 * n + attn * (prompt_len + new_tokens))
    return prefill + decode, prefill + executed


def exchange_bytes(cfg, mesh: Mesh, rules: Rules, tokens: int) -> tuple[float, float]:
    """(rows, ids) bytes per chip of one pass's expert exchange, over all MoE layers, for `tokens`
    tokens on this chip: the dispatch and the reply as the program's buffers hold them (see the
    module docstring); ids: the padded exchange's int32 expert ids (forward only)."""
    m, moe = cfg.model, cfg.model.moe
    n_moe = layer_kinds(m).count("moe")
    expert_axes = [a for a in rules["experts"] if mesh.shape[a] > 1]
    peers = math.prod(mesh.shape[a] for a in expert_axes if a in rules["batch"])
    if not n_moe or peers == 1:
        return 0.0, 0.0
    assignments = tokens * moe.top_k
    local = moe.num_experts // math.prod(mesh.shape[a] for a in expert_axes)
    capacity = expert_capacity(tokens, moe.top_k, moe.num_experts, moe.capacity_factor)
    receive = peers * (assignments if capacity is None else min(assignments, capacity * local))
    dispatch = auto_dispatch(mesh) if moe.dispatch == "auto" else moe.dispatch
    rows = assignments + receive if dispatch == "ragged" else 2 * receive
    width = m.embed_dim * (2 if m.dtype == "bfloat16" else 4)
    return n_moe * rows * width, n_moe * (0 if dispatch == "ragged" else 4 * receive)


def tokens_per_chip(rows: int, length: int, mesh: Mesh, rules: Rules) -> int:
    """Tokens of a [rows, length] batch on one chip, laid out as `put_batch` lays it out."""
    spec = logical_spec(("batch", "length"), mesh, rules, (rows, length))
    ways = math.prod(
        mesh.shape[a] for entry in spec if entry is not None for a in ((entry,) if isinstance(entry, str) else entry)
    )
    return rows * length // ways


def program_work(cfg, program: str, prompt_len: int) -> dict:
    """The shapes a program runs on: policy rows × length per step and the reference's rows
    (train programs), or prompts, prompt length, samples and new tokens (the sampler); the same
    shapes `compile_plan` builds its programs with."""
    b, s, r = cfg.train.batch_size, cfg.train.seq_len, cfg.rl
    if program == "sft":
        return dict(rows=b, length=s, ref_rows=0)
    if program == "dpo":
        return dict(rows=2 * b, length=s, ref_rows=2 * b)
    if program == "rl_learner":
        rows = r.prompts_per_step * r.group_size // r.minibatches
        return dict(rows=rows, length=bucket(prompt_len + r.max_new_tokens - 1, 8), ref_rows=rows if r.kl_coef else 0)
    if program == "sampler":
        return dict(
            prompts=bucket(r.prompts_per_step),
            prompt_len=bucket(prompt_len, 8),
            samples=r.group_size,
            new_tokens=r.max_new_tokens,
        )
    raise ValueError(f"program {program!r}: expected one of {PROGRAMS}")


def kv_bytes_per_position(m) -> float:
    """Bytes of one row's K and V cache at one position, all layers (the cache is in model.dtype)."""
    return 2 * m.num_layers * m.num_kv_heads * m.head_dim * (2 if m.dtype == "bfloat16" else 4)


def train_hbm_bytes(cfg, w: WeightBytes, tokens: int, reads: int) -> float:
    """A floor on the HBM bytes per chip of one train step on `tokens` tokens of this chip: every
    weight read `reads` times at its gathered size (forward, backward, and the recompute under
    remat), each trained weight's gradient written once at that size, the optimizer reading and
    writing this chip's trained shards (params, and AdamW's two moments) and its gradient shard,
    the residual stream kept per layer (written, read back) and the float32 logits (written, read)."""
    m = cfg.model
    act = 2 if m.dtype == "bfloat16" else 4
    moments = 2 if cfg.optim.name == "adamw" else 0
    optimizer = (3 + 2 * moments) * w.local_trained
    activations = tokens * (2 * m.num_layers * m.embed_dim * act + 2 * m.vocab_size * 4)
    return reads * w.read + w.reduce_scattered + w.all_reduced + optimizer + activations


def decode_weight_bytes(cfg, w: WeightBytes, mesh: Mesh, rules: Rules, rows: float) -> float:
    """Weight bytes one decode step reads on a chip with `rows` rows: every non-expert weight
    once, and of its local experts only those the step's tokens can reach (at most the
    assignments arriving here under an even router: rows × peers × top_k / expert ways)."""
    moe = cfg.model.moe
    if not w.experts_read:
        return w.read
    axes = [a for a in rules["experts"] if mesh.shape[a] > 1]
    ways = math.prod(mesh.shape[a] for a in axes)
    peers = math.prod(mesh.shape[a] for a in axes if a in rules["batch"])
    local = moe.num_experts / ways
    arriving = rows * peers * moe.top_k / ways
    return w.read - w.experts_read + w.experts_read * min(1.0, arriving / local)


def program_cost(cfg, mesh: Mesh, rules: Rules, program: str, prompt_len: int, chip: aot.Chip) -> dict:
    """Per-chip FLOPs (model and executed), HBM bytes, collective bytes by kind and the roofline
    (`roofline`: time, the bound that sets it, MFU) of one call of `program`, from the shapes alone.
    The sampler is two phases: the prefill, then `new_tokens` decode steps, each its own roofline."""
    unmodelled = {
        a: mesh.shape[a] for a in mesh.axis_names if a not in ("data", "fsdp", "expert") and mesh.shape[a] > 1
    }
    if unmodelled:
        raise ValueError(
            f"mesh {dict(mesh.shape)}: the analytic cost model covers data · fsdp · expert "
            f"meshes; {unmodelled} (tensor / sequence parallelism) is not modelled"
        )
    if program == "sampler" and cfg.sampling.layout != "learner":
        raise ValueError(
            f"sampling.layout={cfg.sampling.layout!r}: the analytic cost model covers the sampler in "
            "the learner layout (weights gathered at every decode step); the decode layout's "
            "tensor-parallel activations are not modelled (compile it: tools/pod_plan.py --compile)"
        )
    w, work, m = weight_bytes(cfg, mesh, rules), program_work(cfg, program, prompt_len), cfg.model
    coll = dict.fromkeys(aot.COLLECTIVES, 0.0)
    if program == "sampler":
        b, p, g, n = work["prompts"], work["prompt_len"], work["samples"], work["new_tokens"]
        model, executed = sampler_flops(m, b, p, g, n)
        prefill_flops = sampler_flops(m, b, p, g, 0)[0]
        prompt_tokens, rows = tokens_per_chip(b, p, mesh, rules), tokens_per_chip(b * g, 1, mesh, rules)
        pre = dict.fromkeys(aot.COLLECTIVES, 0.0) | {"all-gather": w.gathered}
        pre["all-to-all"] = sum(exchange_bytes(cfg, mesh, rules, prompt_tokens))
        step = dict.fromkeys(aot.COLLECTIVES, 0.0) | {"all-gather": w.gathered}
        step["all-to-all"] = sum(exchange_bytes(cfg, mesh, rules, rows))
        kv = kv_bytes_per_position(m)
        pre_hbm = w.read + prompt_tokens * kv
        step_hbm = decode_weight_bytes(cfg, w, mesh, rules, rows) + rows * (p + n + 1) * kv
        coll = {k: pre[k] + n * step[k] for k in coll}
        hbm = pre_hbm + n * step_hbm
        devices = mesh.size
        times = phases(
            [
                (1, roofline(prefill_flops / devices, prefill_flops / devices, pre_hbm, pre, chip)),
                (n, roofline(0.0, (executed - prefill_flops) / devices / max(n, 1), step_hbm, step, chip)),
            ],
            model / devices,
            executed / devices,
            chip,
        )
    else:
        rows, length, ref_rows = work["rows"], work["length"], work["ref_rows"]
        model, executed = train_flops(cfg, rows, length)
        if ref_rows:  # the reference's forward: a third of a step's model FLOPs on its tokens
            model += train_flops_per_token(m, length) * ref_rows * length / 3
            executed += reference_flops(m, ref_rows, length)
        forward = 2 if m.remat != "none" else 1  # under remat the backward gathers and exchanges again
        tokens = tokens_per_chip(rows, length, mesh, rules)
        rows_b, ids_b = exchange_bytes(cfg, mesh, rules, tokens)
        coll["all-gather"] = w.gathered_per_pass(True, forward == 2) + (w.gathered if ref_rows else 0.0)
        coll["reduce-scatter"], coll["all-reduce"] = w.reduce_scattered, w.all_reduced
        coll["all-to-all"] = forward * (rows_b + ids_b) + rows_b
        hbm = train_hbm_bytes(cfg, w, tokens, 1 + forward)
        if ref_rows:
            ref_tokens = tokens_per_chip(ref_rows, length, mesh, rules)
            coll["all-to-all"] += sum(exchange_bytes(cfg, mesh, rules, ref_tokens))
            hbm += w.read + ref_tokens * 2 * m.vocab_size * 4
        times = roofline(model / mesh.size, executed / mesh.size, hbm, coll, chip)
    return {
        "program": program,
        "model_flops_per_device": model / mesh.size,
        "executed_flops_per_device": executed / mesh.size,
        "hbm_bytes": hbm,
        "collectives": coll,
        **times,
    }
