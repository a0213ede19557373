"""Compile a run's programs for a TPU topology without a TPU, and say what each costs per chip.

The programs are the run's own — the SFT and DPO train steps, the RL learner step with its KL
reference, the sampler (prefill + decode loop) — built from abstract shapes (nothing is
allocated) on the mesh the config asks for over abstract TPU devices (`plan.aot`). For each:
per-device bytes of arguments (by part: params, optimizer state, reference, batch), outputs,
temporaries and code (`memory_analysis`), FLOPs (`cost_analysis` and the model's own count),
bytes moved per kind of collective (from the optimized HLO), and whether it fits the chip's HBM.
CLI: `tools/compile_plan.py`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import Mesh, NamedSharding

from posttrain.core.harness import restore_target
from posttrain.core.optim import lr_schedule, make_optimizer
from posttrain.core.state import abstract_model, abstract_train_state
from posttrain.core.step import lm_loss, make_train_step
from posttrain.models.decoder import Decoder
from posttrain.models.flops import activated_matmul_params, train_flops_per_token
from posttrain.ops import context_parallel
from posttrain.parallel import logical_spec, make_mesh, parse_rules, rules_key, shardings_for, use_sharding
from posttrain.plan import aot, cost_model
from posttrain.plan.cost_model import PROGRAMS
from posttrain.plan.roofline import roofline
from posttrain.rl.algo.learner import rl_loss
from posttrain.sampling.generate import bucket, generate_program
from posttrain.sampling.layout import sampler_rules
from posttrain.sampling.rules import SamplingParams
from posttrain.stages.dpo import dpo_stage_loss

LM_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


@dataclasses.dataclass
class Program:
    """A jitted function with abstract (sharded) arguments, ready to lower and compile.

    parts: named argument subtrees whose per-device bytes the report lists; model_flops: the
    model's own FLOP count for one call (all devices together), for MFU; executed_flops: what the
    chips compute (`cost_model.train_flops`; 0: model_flops); decode_steps / kv_bytes: a
    sampler's decode steps and the KV cache bytes (all devices) each reads, for its HBM floor.
    """

    name: str
    fn: Callable
    args: tuple
    parts: dict[str, Any]
    model_flops: float
    rules: Any = None  # the logical-axis rules it runs under, when not the run's (the sampler's layout)
    executed_flops: float = 0.0
    decode_steps: int = 0
    kv_bytes: float = 0.0


def abstract(shape: tuple[int, ...], dtype, names: tuple, mesh: Mesh, rules) -> jax.ShapeDtypeStruct:
    """A ShapeDtypeStruct laid out by logical names, as `put_batch` would place the array."""
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, logical_spec(names, mesh, rules, shape)))


def lm_batch(rows: int, length: int, mesh: Mesh, rules, prefix: str = "") -> dict:
    """An abstract token batch (inputs, targets, loss_mask, positions, segment_ids) [rows, length]."""
    return {prefix + k: abstract((rows, length), jnp.int32, ("batch", "length"), mesh, rules) for k in LM_KEYS}


def abstract_weights(make: Callable[[], nnx.Module], mesh: Mesh, rules) -> tuple[nnx.State, nnx.State]:
    """(params, rest) of the model as sharded ShapeDtypeStructs: a reference policy or sampler weights."""
    _, params, rest = nnx.split(abstract_model(make), nnx.Param, ...)
    place = lambda tree: jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings_for(tree, mesh, rules)
    )
    return place(params), place(rest)


def train_program(name: str, cfg, mesh: Mesh, rules, loss_fn, batch: dict, extra: tuple, tokens: int) -> Program:
    """A train step (`make_train_step`, donated state, as `train.loop` jits it) over abstract state."""
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    graphdef, state, shardings = abstract_train_state(make, tx, mesh, rules, cfg.lora)
    loss = loss_fn(graphdef)
    step = jax.jit(
        make_train_step(graphdef, tx, loss, lr_schedule(cfg.optim, cfg.train.steps), cfg.lora),
        out_shardings=(shardings, None),
        donate_argnums=0,
    )
    parts = {
        "params": state.params,
        "optimizer": state.opt_state,
        "frozen base": state.frozen,
        "model variables": state.rest,
        "reference": extra,
        "batch": batch,
    }
    length = batch[next(iter(batch))].shape[1]
    flops = train_flops_per_token(cfg.model, length) * tokens
    if cfg.lora.rank > 0:  # frozen weights get no weight gradient: forward + input gradient only
        flops *= 4 / 6
    rows = sum(v.shape[0] for k, v in batch.items() if k.endswith("inputs"))  # the policy's (the reference's too)
    executed = cost_model.train_flops(cfg, rows, length)[1] + (
        cost_model.reference_flops(cfg.model, rows, length) if extra else 0
    )
    return Program(name, step, (state, batch, *extra), parts, flops, executed_flops=executed)


def sft_program(cfg, mesh: Mesh, rules) -> Program:
    """The SFT step on [train.batch_size, train.seq_len] packed rows."""
    b, s = cfg.train.batch_size, cfg.train.seq_len
    return train_program(
        "sft",
        cfg,
        mesh,
        rules,
        lambda g: functools.partial(lm_loss, moe_cfg=cfg.model.moe),
        lm_batch(b, s, mesh, rules),
        (),
        b * s,
    )


def dpo_program(cfg, mesh: Mesh, rules) -> Program:
    """The DPO step: train.batch_size pairs of train.seq_len, the frozen reference's forward inside."""
    b, s = cfg.train.batch_size, cfg.train.seq_len
    batch = {**lm_batch(b, s, mesh, rules, "chosen_"), **lm_batch(b, s, mesh, rules, "rejected_")}
    ref = abstract_weights(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), mesh, rules)
    loss = lambda g: functools.partial(dpo_stage_loss, graphdef=g, dpo_cfg=cfg.dpo, moe_cfg=cfg.model.moe)
    # the reference's forward is a third of a policy step's FLOPs on the same tokens
    return train_program("dpo", cfg, mesh, rules, loss, batch, ref, 2 * b * s * 4 / 3)


def rl_learner_program(cfg, mesh: Mesh, rules, prompt_len: int) -> Program:
    """The RL learner step: `rl.learner.rl_loss` in `make_train_step`, as `rl.learner.Learner`
    jits it, on one minibatch (prompts_per_step × group_size / rl.minibatches rows) of the bucketed
    prompt + response length; with the proximal log-probs when there are several optimizer steps per
    batch, and the KL reference as extra arguments when rl.kl_coef > 0 (under LoRA the run passes
    the frozen base, which the report then counts twice)."""
    r = cfg.rl
    rows, length = r.prompts_per_step * r.group_size // r.minibatches, bucket(prompt_len + r.max_new_tokens - 1, 8)
    batch = lm_batch(rows, length, mesh, rules)
    per_token = ["behav_logp"] + (["old_logp"] if r.updates_per_batch * r.minibatches > 1 else [])
    per_token += ["old_values", "returns"] if r.advantage == "gae" else []
    for key in per_token:
        batch[key] = abstract((rows, length), jnp.float32, ("batch", "length"), mesh, rules)
    shape, names = ((rows, length), ("batch", "length")) if r.advantage == "gae" else ((rows,), ("batch",))
    batch["advantages"] = abstract(shape, jnp.float32, names, mesh, rules)
    ref = abstract_weights(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), mesh, rules) if r.kl_coef else ()
    sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens)
    loss = lambda g: functools.partial(rl_loss, graphdef=g, rl_cfg=r, moe_cfg=cfg.model.moe, sampling=sampling)
    tokens = rows * length * (4 / 3 if r.kl_coef else 1)
    return train_program("rl_learner", cfg, mesh, rules, loss, batch, ref, tokens)


def sampler_program(cfg, mesh: Mesh, rules, prompt_len: int) -> Program:
    """The sampler (`generate_program`: prefill, then the decode loop) for one RL step's prompts,
    with the weights the learner publishes (LoRA merged: a full set), in the layout
    `sampling.layout` says (the learner's, or the decode layout's copy). The other samplers
    (quantised, speculative, continuous, prefix-cached) are different programs: refused, not
    costed as this one."""
    r, s = cfg.rl, cfg.sampling
    for key, static in (
        ("quantize", "none"),
        ("speculative_k", 0),
        ("continuous_batching", False),
        ("prefix_cache", 0),
    ):
        if getattr(s, key) != static:
            raise ValueError(
                f"sampling.{key}={getattr(s, key)!r}: the compile plan's sampler is the static bf16 "
                f"`generate_program`; set sampling.{key}={static!r} to plan it"
            )
    rules = sampler_rules(rules, cfg.sampling.layout)
    params, rest = abstract_weights(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), mesh, rules)
    graphdef = nnx.graphdef(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))))
    b, p = bucket(r.prompts_per_step), bucket(prompt_len, 8)
    sampling = SamplingParams(
        temperature=r.temperature,
        top_k=r.top_k,
        top_p=r.top_p,
        max_new_tokens=r.max_new_tokens,
        stop_ids=(0,),
        num_samples=r.group_size,
    )
    replicated = lambda shape, dtype: abstract(shape, dtype, (None,) * len(shape), mesh, rules)
    key = jax.eval_shape(lambda: jax.random.key(0))
    args = (
        params,
        rest,
        replicated((b, p), jnp.int32),
        replicated((b,), jnp.int32),
        replicated((b,), jnp.int32),
        replicated((), jnp.int32),
        jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=NamedSharding(mesh, jax.sharding.PartitionSpec())),
    )
    fn = jax.jit(lambda *a: generate_program(graphdef, *a, sampling=sampling, pad_id=0, rules=rules_key(rules)))
    n = activated_matmul_params(cfg.model)
    flops = 2 * n * (b * p + b * r.group_size * r.max_new_tokens)
    parts = {"params": params, "model variables": rest}
    executed = cost_model.sampler_flops(cfg.model, b, p, r.group_size, r.max_new_tokens)[1]
    kv = b * r.group_size * (p + r.max_new_tokens) * cost_model.kv_bytes_per_position(cfg.model)
    return Program("sampler", fn, args, parts, flops, rules, max(executed, flops), r.max_new_tokens, kv)


def publish_program(cfg, mesh: Mesh, rules) -> Program:
    """The RL publish's reshard of the learner's weights into the sampler's layout
    (`sampling.layout.publish_weights`: a new copy; with sampling.layout = 'learner' a plain copy)."""
    params, _ = abstract_weights(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), mesh, rules)
    target, _ = abstract_weights(
        lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), mesh, sampler_rules(rules, cfg.sampling.layout)
    )
    fn = jax.jit(lambda p: p, out_shardings=jax.tree.map(lambda x: x.sharding, target))
    return Program("publish", fn, (params,), {"params": params}, 0.0)


def build_programs(cfg, mesh: Mesh, rules, names: tuple[str, ...], prompt_len: int) -> list[Program]:
    """The named programs of `PROGRAMS` for `cfg` on `mesh`."""
    builders = {
        "sft": lambda: sft_program(cfg, mesh, rules),
        "dpo": lambda: dpo_program(cfg, mesh, rules),
        "rl_learner": lambda: rl_learner_program(cfg, mesh, rules, prompt_len),
        "sampler": lambda: sampler_program(cfg, mesh, rules, prompt_len),
        "publish": lambda: publish_program(cfg, mesh, rules),
    }
    unknown = [n for n in names if n not in builders]
    if unknown:
        raise ValueError(f"programs {unknown}: expected some of {tuple(builders)}")
    return [builders[n]() for n in names]


def compile_program(program: Program, mesh: Mesh, rules) -> tuple[Any, float]:
    """(compiled, seconds) of a program, lowered under the mesh and rules it was built for."""
    t = time.perf_counter()
    with use_sharding(mesh, rules if program.rules is None else program.rules):
        compiled = program.fn.lower(*program.args).compile()
    return compiled, time.perf_counter() - t


def program_report(program: Program, compiled, chip: aot.Chip, num_devices: int) -> dict:
    """Per-device memory by category, FLOPs, collective bytes (a decode loop's for every step), fit,
    an HBM floor (arguments read, outputs written, and per decode step the weights and KV cache
    it reads) and the roofline (`estimate_step`) of a compiled program."""
    mem = compiled.memory_analysis()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    hlo = compiled.as_text()
    collectives, unknown_trips = aot.collective_bytes(hlo)
    total = (
        mem.argument_size_in_bytes
        + mem.output_size_in_bytes
        - mem.alias_size_in_bytes
        + mem.temp_size_in_bytes
        + mem.generated_code_size_in_bytes
    )
    report = {
        "program": program.name,
        "arguments": mem.argument_size_in_bytes,
        "outputs": mem.output_size_in_bytes,
        "aliased": mem.alias_size_in_bytes,
        "temporaries": mem.temp_size_in_bytes,
        "code": mem.generated_code_size_in_bytes,
        "total": total,
        "parts": {k: aot.shard_bytes(v) for k, v in program.parts.items() if jax.tree.leaves(v)},
        "hbm": chip.hbm_bytes,
        "fits": total <= chip.hbm_bytes,
        "xla_flops": float(cost.get("flops", 0.0)) if cost else 0.0,
        "xla_bytes": float(cost.get("bytes accessed", 0.0)) if cost else 0.0,
        "model_flops_per_device": program.model_flops / num_devices,
        "executed_flops_per_device": (program.executed_flops or program.model_flops) / num_devices,
        "collectives": collectives,
        "loop_trip_unknown": unknown_trips,
        "loop_iteration_collectives": aot.loop_iteration_bytes(hlo),  # the decode loop's: per token
    }
    weights = max(report["parts"].get("params", 0), report["loop_iteration_collectives"].get("all-gather", 0))
    decode = program.decode_steps * (weights + program.kv_bytes / num_devices)
    report["hbm_bytes"] = max(report["xla_bytes"], mem.argument_size_in_bytes + mem.output_size_in_bytes + decode)
    if unknown_trips and program.decode_steps > 1:  # the decode loop counted once: count every step
        loop = report["loop_iteration_collectives"]
        report["collectives"] = {k: v + (program.decode_steps - 1) * loop.get(k, 0) for k, v in collectives.items()}
    report.update(estimate_step(report, chip))
    return report


def estimate_step(report: dict, chip: aot.Chip) -> dict:
    """The roofline (`plan.roofline.roofline`) of a compiled program: executed FLOPs the larger
    of XLA's count (a loop body counted once) and the program's own; bytes as `program_report` counts."""
    model, hbm = report["model_flops_per_device"], report.get("hbm_bytes", 0.0)
    executed = max(report["xla_flops"], report.get("executed_flops_per_device", 0.0), model)
    return roofline(model, executed, hbm, report["collectives"], chip)


def argument_report(program: Program, chip: aot.Chip, num_devices: int) -> dict:
    """What is known without compiling: per-device argument bytes by part (exact: the shards of
    the abstract arguments) and the model's FLOPs; compute-bound time at peak."""
    parts = {k: aot.shard_bytes(v) for k, v in program.parts.items() if jax.tree.leaves(v)}
    flops = program.model_flops / num_devices
    return {
        "program": program.name,
        "parts": parts,
        "arguments": sum(parts.values()),
        "model_flops_per_device": flops,
        "hbm": chip.hbm_bytes,
        "compute_s": flops / chip.peak_flops,
    }


def restore_plan(cfg, mesh: Mesh, rules) -> tuple[dict, Any]:
    """(target, orbax restore args) of a resume of the run's train state on `mesh`: the same
    `train.loop.restore_target` a run restores into, from abstract shapes (nothing read)."""
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))
    _, state, shardings = abstract_train_state(make, make_optimizer(cfg.optim, cfg.train.steps), mesh, rules, cfg.lora)
    target = restore_target(state, shardings)
    return target, ocp.checkpoint_utils.construct_restore_args(target)


def restore_report(target: dict, restore_args: Any, mesh: Mesh, chip: aot.Chip) -> dict:
    """Per-device bytes each restored item lands in, and the checks that make a restore at this
    scale possible: every array gets a sharding on `mesh` with its global shape (orbax reads only
    the device's shards), shards split the array evenly, and the total fits the chip's HBM.
    `problems` names each array that fails; `replicated` counts the bytes held whole on every chip."""
    problems, replicated = [], 0
    leaves = jax.tree_util.tree_leaves_with_path(target)
    for (path, x), args in zip(leaves, jax.tree.leaves(restore_args)):
        name = jax.tree_util.keystr(path)
        sharding = getattr(args, "sharding", None)
        if not isinstance(sharding, NamedSharding) or sharding.mesh != mesh:
            problems.append(f"{name}: no sharding on the plan's mesh ({sharding})")
            continue
        if tuple(args.global_shape) != tuple(x.shape):
            problems.append(f"{name}: global shape {args.global_shape} != {x.shape}")
        spec = sharding.spec
        for dim, axes in zip(x.shape, spec):
            axes = () if axes is None else axes if isinstance(axes, tuple) else (axes,)
            ways = math.prod(mesh.shape[a] for a in axes)
            if dim % ways:
                problems.append(f"{name}: dim {dim} not divisible into {ways} shards ({spec})")
        if sharding.is_fully_replicated:
            replicated += aot.shard_bytes(x)
    parts = {k: aot.shard_bytes(v) for k, v in target.items()}
    total = sum(parts.values())
    return {
        "program": "restore",
        "parts": parts,
        "arguments": total,
        "total": total,
        "arrays": len(leaves),
        "replicated": replicated,
        "problems": problems,
        "hbm": chip.hbm_bytes,
        "fits": total <= chip.hbm_bytes and not problems,
    }


def plan(
    cfg,
    topology: str,
    names: tuple[str, ...] = PROGRAMS,
    prompt_len: int = 256,
    log: Callable[[str], None] = print,
    compile: bool = True,
) -> list[dict]:
    """Compile `names` for `cfg` on `topology` (e.g. 'v5p:2x2x1', 'v5p-128'); one report each.
    `compile=False`: only `argument_report` (seconds instead of minutes for a large model).
    "restore" in `names` adds the checkpoint restore's report (`restore_report`, nothing compiled)."""
    gen, _ = aot.parse_topology(topology)
    devices = aot.tpu_devices(topology)
    mesh, rules = make_mesh(cfg.mesh.to_dict(), devices), parse_rules(cfg.sharding.rules)
    reports, where = [], {"topology": topology, "mesh": dict(mesh.shape)}
    if "restore" in names:
        target, restore_args = restore_plan(cfg, mesh, rules)
        reports.append({**restore_report(target, restore_args, mesh, aot.CHIPS[gen]), **where})
        names = tuple(n for n in names if n != "restore")
    with use_sharding(mesh, rules):
        programs = build_programs(cfg, mesh, rules, names, prompt_len)
    for program in programs:
        if not compile:
            reports.append({**argument_report(program, aot.CHIPS[gen], len(devices)), **where})
            continue
        with context_parallel.recorded() as cp_choices:  # what `auto` resolves to, as a real run would
            compiled, seconds = compile_program(program, mesh, rules)
        report = program_report(program, compiled, aot.CHIPS[gen], len(devices))
        report.update(where, compile_s=seconds, context_parallel=cp_choices)
        log(f"{topology} {program.name}: compiled in {seconds:.1f} s")
        reports.append(report)
    return reports
