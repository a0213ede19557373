"""Compile one split of the RL split plan (`tools/pod_plan.py --rl-split --compile`): the
`rl_learner` program on the learner's chips and the `sampler` program on the sampler mesh, with
libtpu's compiler over abstract TPU devices (`plan.aot`), nothing allocated.

The devices are divided as `rl.placement=split` divides them (`rl.rollout.placement`): the last
N chips of the slice form the sampler mesh (the learner's fsdp / expert / tensor degrees, the rest
on data: `sampler_mesh_sizes`), the others the learner mesh (data × the model-parallel group, as
`rl_split.mesh` lays it out). The learner compiles on one minibatch of the rows
`rl_split` charges it (padded to a multiple of lcm(learner chips, rl.group_size)); the
sampler on the whole step's prompts, which its data replicas split. Each report is
`compile_plan.program_report`'s (compiled per-chip memory, FLOPs, collectives, roofline), beside
the analytic floors of the same split, with the weight bytes one publish moves.
"""

from __future__ import annotations

import dataclasses
import math

import jax
from flax import nnx

from posttrain.models.decoder import Decoder
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.plan import aot, compile_plan, rl_split
from posttrain.rl.rollout.placement import sampler_mesh_sizes
from posttrain.sampling.layout import sampler_rules


@dataclasses.dataclass
class CompiledSplit:
    """One split compiled: the analytic `Split`, the two programs' reports (`program_report`'s,
    plus mesh and compile seconds) and the publish's bytes (whole model; per sampler chip)."""

    split: rl_split.Split
    learner: dict
    sampler: dict
    model_bytes: int  # every weight once, in the dtype the sampler takes it (one publish moves it)
    publish_bytes_per_chip: int  # what lands on each sampler chip per publish (its shard of the copy)

    @property
    def learner_total(self) -> float | None:
        """The learner's compiled bytes per chip (arguments + outputs - aliased + temporaries +
        code); None when it did not compile (over HBM: `learner["error"]`)."""
        return self.learner.get("total")

    @property
    def sampler_total(self) -> float | None:
        """The sampler's compiled bytes per chip, plus the next weights landing while it samples
        (the publish's second copy, which the analytic sampler floor also counts); None when it
        did not compile."""
        return None if "error" in self.sampler else self.sampler["total"] + self.publish_bytes_per_chip


def split_meshes(topology: str, sampler_chips: int, group: int, expert: int) -> tuple:
    """(learner mesh, sampler mesh) over the abstract chips of one slice: the first chips the
    learner's (data × fsdp × expert, fsdp × expert = `group`), the last `sampler_chips` the
    sampler's (`sampler_mesh_sizes`), as `rl.placement=split` places them."""
    devices = aot.tpu_devices(topology)
    learners = len(devices) - sampler_chips
    if not 0 < sampler_chips < len(devices) or sampler_chips % group or learners % group:
        raise ValueError(
            f"sampler_chips={sampler_chips}: expected a multiple of the model-parallel group {group} "
            f"below the slice's {len(devices)} chips"
        )
    sizes = dict(data=learners // group, fsdp=group // expert, expert=expert, tensor=1, sequence=1)
    learner = make_mesh(sizes, devices[:learners])
    return learner, make_mesh(sampler_mesh_sizes(learner, sampler_chips), devices[learners:])


def learner_config(cfg, learner_chips: int):
    """cfg with the prompts per step the learner compiles for: each minibatch's rows padded up to
    a multiple of lcm(learner chips, group size), as `rl_split` charges (and
    `rl.algo.learner.batch_rows` pads) them; minibatches and updates kept."""
    r = cfg.rl
    rows = r.prompts_per_step * r.group_size // r.minibatches
    unit = math.lcm(learner_chips, r.group_size)
    return cfg.replace({"rl.prompts_per_step": -(-rows // unit) * unit // r.group_size * r.minibatches})


def _compile(cfg, mesh, rules, name: str, prompt_len: int, chip: aot.Chip, log) -> dict:
    """`program_report` of program `name` on `mesh`, or, when the TPU compiler refuses it for
    HBM (RESOURCE_EXHAUSTED), {"program", "mesh", "error": its message, "fits": False}."""
    with use_sharding(mesh, rules):
        (program,) = compile_plan.build_programs(cfg, mesh, rules, (name,), prompt_len)
    where = {"mesh": dict(mesh.shape)}
    try:
        compiled, seconds = compile_plan.compile_program(program, mesh, rules)
    except jax.errors.JaxRuntimeError as e:
        if "RESOURCE_EXHAUSTED" not in str(e):
            raise
        log(f"{name} on {mesh.size} chips: does not fit ({str(e).splitlines()[0]})")
        return {"program": name, **where, "error": str(e).splitlines()[0], "fits": False}
    log(f"{name} on {mesh.size} chips: compiled in {seconds:.1f} s")
    report = compile_plan.program_report(program, compiled, chip, mesh.size)
    return {**report, **where, "compile_s": seconds}


def publish_bytes(cfg, sampler, rules) -> tuple[int, int]:
    """(the model's weight bytes, the bytes of them each sampler chip holds) in the layout the
    sampler takes them (`sampling.layout`): what one publish moves, in all and per sampler chip."""
    srules = sampler_rules(rules, cfg.sampling.layout)
    with use_sharding(sampler, srules):
        params, _ = compile_plan.abstract_weights(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), sampler, srules)
    whole = sum(math.prod(x.shape) * jax.numpy.dtype(x.dtype).itemsize for x in jax.tree.leaves(params))
    return whole, aot.shard_bytes(params)


def compile_split(
    cfg, topology: str, split: rl_split.Split, group: int, prompt_len: int = 1024, log=print
) -> CompiledSplit:
    """Compile `split` (a `plan_split` candidate of one slice `topology`, e.g. 'v5p-128') for cfg:
    the learner and sampler programs on their meshes (`split_meshes`), and the publish's bytes."""
    gen, _ = aot.parse_topology(topology)
    cfg = rl_split.with_dispatch(cfg, gen)
    chip, rules = aot.CHIPS[gen], parse_rules(cfg.sharding.rules)
    expert = max(1, min(cfg.mesh.expert, group))
    learner, sampler = split_meshes(topology, split.sampler_chips, group, expert)
    learn = _compile(learner_config(cfg, learner.size), learner, rules, "rl_learner", prompt_len, chip, log)
    sample = _compile(cfg, sampler, rules, "sampler", prompt_len, chip, log)
    return CompiledSplit(split, learn, sample, *publish_bytes(cfg, sampler, rules))
