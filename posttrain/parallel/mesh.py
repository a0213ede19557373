"""Device mesh construction."""

from __future__ import annotations

import math
import os

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from posttrain.parallel.sharding import Rules, current, parse_rules

MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")
ACCELERATOR_PATHS_ENV = "POSTTRAIN_ACCELERATOR_PATHS"


def resolve_mesh_shape(sizes: dict[str, int], num_devices: int) -> tuple[int, ...]:
    """Axis sizes in `MESH_AXES` order, with at most one -1 filled by the remaining devices.

    Raises ValueError naming the axes when the sizes do not multiply to `num_devices`.
    """
    unknown = set(sizes) - set(MESH_AXES)
    if unknown:
        raise ValueError(f"config.mesh: unknown axes {sorted(unknown)}; valid axes are {MESH_AXES}")
    shape = [int(sizes.get(a, 1)) for a in MESH_AXES]
    free = [a for a, s in zip(MESH_AXES, shape) if s == -1]
    if len(free) > 1:
        raise ValueError(f"config.mesh: at most one axis may be -1, got {free}")
    if any(s == 0 or s < -1 for s in shape):
        raise ValueError(f"config.mesh: axis sizes must be positive or -1, got {dict(zip(MESH_AXES, shape))}")
    fixed = math.prod(s for s in shape if s != -1)
    if free:
        if num_devices % fixed:
            raise ValueError(
                f"config.mesh: {dict(zip(MESH_AXES, shape))} — the fixed axes use {fixed} devices, "
                f"which does not divide the {num_devices} available"
            )
        shape[shape.index(-1)] = num_devices // fixed
    elif fixed != num_devices:
        raise ValueError(
            f"config.mesh: {dict(zip(MESH_AXES, shape))} needs {fixed} devices but {num_devices} are "
            f"available; set one axis to -1 to use the rest"
        )
    return tuple(shape)


def make_mesh(sizes: dict[str, int], devices=None) -> Mesh:
    """A mesh over all (or the given) devices with axes `MESH_AXES`, in Auto (GSPMD) mode."""
    devices = jax.devices() if devices is None else list(devices)
    shape = resolve_mesh_shape(dict(sizes), len(devices))
    if devices == jax.devices():
        return jax.make_mesh(shape, MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=(AxisType.Auto,) * len(MESH_AXES))


def mesh_and_rules(cfg) -> tuple[Mesh, Rules]:
    """A run's mesh (`cfg.mesh`) and logical-axis rules (`cfg.sharding.rules`): the setup every
    stage and tool starts with."""
    return make_mesh(cfg.mesh.to_dict()), parse_rules(cfg.sharding.rules)


def mesh_device(mesh: Mesh | None = None):
    """A device (or jax's `AbstractDevice` under jit) of the mesh a program is being built for:
    `mesh`, else the mesh made current by `use_sharding` / `jax.set_mesh`; None when there is none."""
    if mesh is None:
        ctx = current()
        mesh = ctx[0] if ctx is not None else jax.sharding.get_abstract_mesh()  # works under jit
    if mesh.empty:
        return None
    if isinstance(mesh, Mesh):
        return mesh.devices.flat[0]
    return getattr(mesh, "abstract_device", None)


def mesh_platform(mesh: Mesh | None = None) -> str:
    """The platform ('cpu', 'gpu', 'tpu') of the devices a program is being built for.

    The devices of `mesh`, else of the mesh made current by `use_sharding` / `jax.set_mesh`, else
    the default backend. Code choosing an accelerator path asks this rather than
    `jax.default_backend()`, which says `cpu` on a CPU host even while a program is compiled
    ahead of time for an (abstract) TPU mesh.
    """
    device = mesh_device(mesh)
    return device.platform if device is not None else jax.default_backend()


def mesh_device_kind(mesh: Mesh | None = None) -> str:
    """The device kind ('TPU v5 lite', 'TPU v5', 'cpu', ...) of the devices a program is being
    built for (see `mesh_platform`): some code paths compile for one TPU generation, not another."""
    device = mesh_device(mesh)
    return device.device_kind if device is not None else jax.devices()[0].device_kind


def accelerator_paths_forced() -> bool:
    """Whether `$POSTTRAIN_ACCELERATOR_PATHS` asks for the accelerator branches on any platform:
    1/true/on yes, 0/false/off or unset no; anything else is an error naming the variable."""
    value = os.environ.get(ACCELERATOR_PATHS_ENV, "").strip().lower()
    if value in ("", "0", "false", "off", "no"):
        return False
    if value in ("1", "true", "on", "yes"):
        return True
    raise ValueError(f"${ACCELERATOR_PATHS_ENV}={value!r}: expected 1 (take the GPU/TPU code paths) or 0")


def accelerator_paths(mesh: Mesh | None = None) -> bool:
    """Whether code that picks a path by platform takes the accelerator (GPU/TPU) one: True on the
    devices of a GPU or TPU mesh (`mesh_platform`), and on the CPU when the test switch
    `POSTTRAIN_ACCELERATOR_PATHS=1` is set, so the CPU suite runs the branches pods run.

    Every branch that can run on the CPU asks this, and only this: the sampler's stacked KV cache
    under `lax.scan` (`sampling.engine.decode_layers`), experts on `ragged_dot`
    (`models.moe.experts.grouped_matmul`) and the general expert exchange instead of the CPU's
    dense fast path (`models.moe.dispatch.routed_experts`). Branches that cannot run on the CPU
    (the ragged all-to-all, Pallas/cuDNN attention kernels) follow `mesh_platform` /
    `mesh_device_kind` and are compiled for a TPU topology in tests (tests/parallel/test_mesh_platform_paths.py,
    tests/plan/test_compile_plan.py). Read at trace time: the sampler's compile key carries it
    (`sampling.generate.sharding_key`); other jitted functions are traced again only when new.
    """
    return mesh_platform(mesh) != "cpu" or accelerator_paths_forced()
