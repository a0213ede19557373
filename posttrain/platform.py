"""Which platform JAX uses: on a machine with neither a TPU nor a GPU, and `JAX_PLATFORMS` unset,
the CPU, chosen before jax is imported (`quiet_platform`), so that an installed libtpu (the `tpu`
extra) is never initialised there: it would print `INVALID_ARGUMENT: unexpected worker hostname`
lines at every start. Imports no jax (`platform_line` imports it when called). Used by the command
lines (`posttrain.main`, `posttrain.eval.lm_eval_cli`).
"""

from __future__ import annotations

import contextlib
import glob
import os

TPU_DEVICE_FILES = ("/dev/accel*", "/dev/vfio")  # a TPU VM's chips (jax also reads the PCI bus: TPU_VENDOR)
TPU_VENDOR = "0x1ae0"  # Google's PCI vendor id, whose devices jax counts as TPU chips (jax._src.hardware_utils)
GPU_DEVICE_FILES = ("/dev/nvidia0", "/dev/nvidiactl", "/dev/dxg", "/dev/kfd")  # NVIDIA (jax's list) and AMD
PLATFORM_NOTE = ""  # why `quiet_platform` chose the platform, for the platform line


def accelerator_present(patterns: tuple[str, ...], vendor: str | None = None) -> bool:
    """Whether any of the device files `patterns` (globs) exists, or a PCI device of `vendor`."""
    if any(glob.glob(p) for p in patterns):
        return True
    if vendor is None:
        return False
    for path in glob.glob("/sys/bus/pci/devices/*/vendor"):
        with contextlib.suppress(OSError), open(path) as f:
            if f.read().strip() == vendor:
                return True
    return False


def quiet_platform(environ=os.environ, *, tpu: bool | None = None, gpu: bool | None = None) -> str | None:
    """Make JAX pick the CPU quietly on a machine with neither a TPU nor a GPU when the user named
    no platform: `JAX_PLATFORMS=cpu`, so that an installed libtpu (the `tpu` extra) is never
    initialised there and prints no `INVALID_ARGUMENT: unexpected worker hostname` lines. Runs
    before jax is imported; returns the value set (None: `JAX_PLATFORMS` was set, even empty, or
    an accelerator is present, and jax chooses as it always does)."""
    global PLATFORM_NOTE
    if "JAX_PLATFORMS" in environ:
        return None
    tpu = accelerator_present(TPU_DEVICE_FILES, TPU_VENDOR) if tpu is None else tpu
    gpu = accelerator_present(GPU_DEVICE_FILES) if gpu is None else gpu
    if tpu or gpu:
        return None
    environ["JAX_PLATFORMS"] = "cpu"
    PLATFORM_NOTE = " (no TPU or GPU here: JAX_PLATFORMS=cpu; set JAX_PLATFORMS to choose)"
    return "cpu"


def platform_line() -> str:
    """One line naming the platform JAX uses and its device count (and why, when chosen here)."""
    import jax

    return f"platform: {jax.default_backend()}, {jax.device_count()} device(s){PLATFORM_NOTE}"
