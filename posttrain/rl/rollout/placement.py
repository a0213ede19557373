"""Where the RL sampler runs (`rl.placement`): on the learner's devices, or on devices of its own.

- colocated: one mesh over every device (`mesh.*`); the sampler reads the learner's weights
  (`sampling.layout`).
- split: one process group whose devices are divided. The last `rl.sampler_devices` devices form
  the sampler mesh, the others the learner mesh (its shape from `mesh.*` over those devices). Each
  publish copies the learner's weights onto the sampler mesh (`publish_weights`, a `device_put`
  across device sets; with `rl.max_staleness >= 1` the producer's thread makes it, beside the
  learner's next update, `stages.rlvr.publish_step`); the sampler's programs compile for the
  sampler mesh, and its tokens and behaviour log-probs come back to the host, where the learner's
  batch is built on the learner mesh.
- disaggregated: separate process groups (`rl.role` = learner | sampler), each on a mesh of its own
  devices as colocated (`mesh.*`); weights travel over the transfer server (rl/rollout/remote.py).

The sampler mesh keeps the learner's model-parallel degrees (`fsdp`, `expert`, `tensor`), so the
sampling layout's rules split each weight as they do on the learner, and puts the rest of its
devices on `data` (replicas that split the rollout rows); `sequence` is 1 (decode does not split
the sequence). `rl.sampler_devices` must therefore be a multiple of fsdp × expert × tensor.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax.sharding import Mesh

from posttrain.config import PLACEMENTS
from posttrain.errors import UserError
from posttrain.models.quant import quantize_params
from posttrain.parallel import make_mesh, mesh_and_rules, parse_rules, resolve_mesh_shape, shardings_for
from posttrain.parallel.sharding import Rules
from posttrain.sampling.layout import publish_weights, sampler_rules

MODEL_AXES = ("fsdp", "expert", "tensor")  # the axes that split a weight: the sampler keeps their sizes
quantize_sampler_params = jax.jit(quantize_params, static_argnums=1)


class Placement(NamedTuple):
    """The learner's mesh and rules, and the sampler's mesh (None: the learner's, colocated)."""

    learner: Mesh
    rules: Rules
    sampler: Mesh | None = None


def sampler_mesh_sizes(learner: Mesh, sampler_devices: int) -> dict[str, int]:
    """The sampler mesh's axis sizes: the learner's fsdp / expert / tensor, the rest on data;
    a UserError naming rl.sampler_devices when they do not divide it."""
    kept = {a: learner.shape[a] for a in MODEL_AXES}
    group = math.prod(kept.values())
    if sampler_devices % group:
        raise UserError(
            f"rl.sampler_devices={sampler_devices} is not a multiple of the learner's model-parallel group "
            f"({' × '.join(f'mesh.{a}={s}' for a, s in kept.items())} = {group}): the sampler keeps these "
            "degrees so that sampling.layout splits each weight as on the learner, and adds data replicas",
            key="rl.sampler_devices",
        )
    return {**kept, "data": sampler_devices // group, "sequence": 1}


def place_devices(cfg, devices=None) -> Placement:
    """The meshes of an RLVR run (`rl.placement`, `rl.sampler_devices`) over `devices` (default:
    every device), refusing with errors naming the key what cannot work."""
    r = cfg.rl
    if r.placement in ("colocated", "disaggregated"):  # disaggregated: this process group's devices
        mesh, rules = mesh_and_rules(cfg)
        return Placement(mesh, rules)
    if r.placement != "split":  # config.rl.check_placement refuses the rest before a run starts
        raise UserError(f"rl.placement={r.placement!r}: expected one of {PLACEMENTS}", key="rl.placement")
    if jax.process_count() > 1:
        raise UserError(
            f"rl.placement='split' runs in one process for now ({jax.process_count()} processes started): "
            "the learner and sampler meshes would span hosts; use rl.placement='colocated'",
            key="rl.placement",
        )
    devices = list(jax.devices() if devices is None else devices)
    n = r.sampler_devices
    if not 1 <= n < len(devices):
        raise UserError(
            f"rl.sampler_devices={n} with {len(devices)} devices: split needs 1 … {len(devices) - 1} "
            "sampler devices and leaves the others to the learner",
            key="rl.sampler_devices",
        )
    sizes = cfg.mesh.to_dict()
    try:
        resolve_mesh_shape(sizes, len(devices) - n)
    except ValueError as e:
        raise UserError(
            f"rl.sampler_devices={n} leaves {len(devices) - n} devices for the learner, which mesh.* does not "
            f"fit ({e}); set one mesh axis to -1 or change rl.sampler_devices",
            key="rl.sampler_devices",
        ) from e
    learner = make_mesh(sizes, devices[: len(devices) - n])
    sampler = make_mesh(sampler_mesh_sizes(learner, n), devices[len(devices) - n :])
    return Placement(learner, parse_rules(cfg.sharding.rules), sampler)


def sampler_weights(params, rest, sampling_cfg, sharding: tuple | None) -> tuple:
    """(params, rest) as the sampler takes them. `sharding`: (learner mesh, rules[, sampler mesh]):
    the params in `sampling.layout` on the learner mesh, or with a sampler mesh (split) params and
    rest copied onto it in the layout's rules (one `device_put` across device sets, dispatched
    without waiting) — or None: as they are. Then quantised when `sampling.quantize` says so."""
    if sharding is not None:
        mesh, rules, to = (*sharding, None)[:3]
        params = publish_weights(params, mesh, rules, sampling_cfg.layout, to=to)
        if to is not None:
            rest = jax.device_put(rest, shardings_for(rest, to, sampler_rules(rules, sampling_cfg.layout)))
    if sampling_cfg.quantize != "none":
        params = quantize_sampler_params(params, sampling_cfg.quantize)
    return params, rest
