"""Multi-process start (plain multi-controller JAX): one process per host, one global mesh.

Where the settings come from, first match wins:

1. `config.distributed.coordinator` ("host:port" of process 0) with `num_processes` and
   `process_id`: several CPU/GPU hosts, or several processes on one machine;
2. the environment: `JAX_COORDINATOR_ADDRESS` with `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID`;
3. a cluster jax detects itself: a multi-host TPU pod slice (`TPU_WORKER_HOSTNAMES`), SLURM, Open
   MPI — `jax.distributed.initialize()` with no addresses.

Otherwise the run is one process. On CPU the cross-process collectives are gloo's.

Failure: every process sends heartbeats to the coordination service; a process silent for
`distributed.heartbeat_timeout_s` is declared dead and jax terminates the others with an error
naming it ("The following tasks are unhealthy (stopped sending heartbeats): 1"; if process 0 — the
coordinator — died: "Failed to send RPC to coordination service ... the leader task ... died").
So no process hangs in a collective after a peer is gone; rerunning every process resumes from the
last checkpoint.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import logging
import os
from collections.abc import Mapping

import jax
import numpy as np

from posttrain.config import DistributedConfig
from posttrain.errors import UserError

_CLUSTER_ENV = ("SLURM_JOB_ID", "OMPI_COMM_WORLD_SIZE")  # clusters jax.distributed detects


@dataclasses.dataclass(frozen=True)
class DistributedSettings:
    """How this process joins the others; `coordinator=None` lets jax detect the cluster."""

    coordinator: str | None
    num_processes: int | None
    process_id: int | None
    heartbeat_timeout_s: int
    initialization_timeout_s: int


def _int_setting(value, key: str) -> int:
    try:
        return int(value)
    except (TypeError, ValueError):
        raise UserError(f"${key}={value!r}: expected an integer") from None


def distributed_settings(
    d: DistributedConfig | None = None, environ: Mapping[str, str] | None = None
) -> DistributedSettings | None:
    """The multi-process settings from the `distributed` section or the environment, or None for a
    single-process run. Raises UserError naming the key or variable when they are incomplete or
    out of range."""
    env = os.environ if environ is None else environ
    d = DistributedConfig() if d is None else d
    timeouts = dict(heartbeat_timeout_s=d.heartbeat_timeout_s, initialization_timeout_s=d.initialization_timeout_s)
    if not d.coordinator and (d.num_processes or d.process_id >= 0):
        raise UserError(
            f"distributed.num_processes={d.num_processes}, distributed.process_id={d.process_id} "
            "need distributed.coordinator (host:port of process 0)",
            key="distributed.coordinator",
        )
    if d.coordinator:
        where, key = "config.distributed", "distributed.process_id"
        coordinator, num, pid = d.coordinator, d.num_processes, d.process_id
    elif env.get("JAX_COORDINATOR_ADDRESS"):
        where, key = "$JAX_COORDINATOR_ADDRESS, $JAX_NUM_PROCESSES, $JAX_PROCESS_ID", None
        coordinator = env["JAX_COORDINATOR_ADDRESS"]
        if not env.get("JAX_NUM_PROCESSES") and not env.get("JAX_PROCESS_ID"):  # a cluster jax detects gives them
            return DistributedSettings(coordinator, None, None, **timeouts)
        num = _int_setting(env.get("JAX_NUM_PROCESSES", ""), "JAX_NUM_PROCESSES")
        pid = _int_setting(env.get("JAX_PROCESS_ID", ""), "JAX_PROCESS_ID")
    else:
        hosts = [h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
        if len(hosts) > 1 or any(k in env for k in _CLUSTER_ENV):
            return DistributedSettings(None, None, None, **timeouts)
        return None
    if ":" not in coordinator:
        raise UserError(
            f"{where}: coordinator {coordinator!r}: expected host:port of process 0",
            key=key and "distributed.coordinator",
        )
    if num < 1 or not 0 <= pid < num:
        raise UserError(
            f"{where}: process_id={pid} and num_processes={num}: expected num_processes >= 1 and "
            f"0 <= process_id < num_processes",
            key=key,
        )
    return DistributedSettings(coordinator, num, pid, **timeouts)


def maybe_initialize_distributed(d: DistributedConfig | None = None) -> bool:
    """Start `jax.distributed` when the `distributed` section or the environment describes several
    processes (see the module docstring); True when this is a multi-process run.

    Must run before anything touches a device. Single-process runs (laptop, Colab, one TPU host)
    skip it.
    """
    if jax.distributed.is_initialized():
        return True
    settings = distributed_settings(d)
    if settings is None:
        return False
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU hosts; other backends ignore it
    jax.distributed.initialize(
        settings.coordinator,
        settings.num_processes,
        settings.process_id,
        initialization_timeout=settings.initialization_timeout_s,
        heartbeat_timeout_seconds=settings.heartbeat_timeout_s,
    )
    logging.info(
        "jax.distributed: process %d of %d, %d local devices of %d",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def is_primary() -> bool:
    """Whether this process writes the run's shared outputs (metrics, config.json, plots, bars)."""
    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Wait until every process reaches the barrier `name` (no-op for one process)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def allgather_json(value) -> list:
    """Every process's JSON-serialisable `value`, in process order, on every process (e.g. the
    per-process data-iterator states a checkpoint keeps: orbax writes JSON items from process 0)."""
    if jax.process_count() == 1:
        return [value]
    from jax.experimental import multihost_utils

    data = np.frombuffer(json.dumps(value).encode(), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([data.size], np.int64))).reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: data.size] = data
    rows = np.asarray(multihost_utils.process_allgather(padded))
    return [json.loads(rows[i, :n].tobytes()) for i, n in enumerate(sizes)]


_broadcasts = itertools.count()
KV_CHUNK = 1 << 20  # bytes per key-value entry (well under the coordination service's message limit)
KV_WAIT_MS = 60_000  # one blocking read; a read that times out is tried again (the lead may poll for long)


def broadcast_json(value):
    """Process 0's JSON-serialisable `value` on every process (the others' `value` is not read).

    It travels through the coordination service's key-value store, not a device collective: a
    process waiting here leaves its devices free (a learner process must keep serving its shards
    of the weights while it waits for its lead, who waits for the samplers those shards go to).
    Every process calls it at the same point; one process: `value` itself."""
    if jax.process_count() == 1:
        return value
    from jax._src import distributed

    client, key = distributed.global_state.client, f"posttrain/broadcast/{next(_broadcasts)}"
    if jax.process_index() == 0:
        data = json.dumps(value).encode()
        chunks = [data[i : i + KV_CHUNK] for i in range(0, len(data), KV_CHUNK)] or [b""]
        for n, chunk in enumerate(chunks):
            client.key_value_set_bytes(f"{key}/{n}", chunk)
        client.key_value_set(f"{key}/chunks", str(len(chunks)))
    else:
        chunks = int(_blocking_get(client, f"{key}/chunks"))
        value = json.loads(
            b"".join(client.blocking_key_value_get_bytes(f"{key}/{n}", KV_WAIT_MS) for n in range(chunks))
        )
    client.wait_at_barrier(key, 10 * KV_WAIT_MS)  # every process has read it: the lead frees it
    if jax.process_index() == 0:
        client.key_value_delete(f"{key}/")
    return value


def _blocking_get(client, key: str) -> str:
    while True:
        try:
            return client.blocking_key_value_get(key, KV_WAIT_MS)
        except jax.errors.JaxRuntimeError as e:
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a global array whose first axis is split across processes (the
    inverse of `make_array_from_process_local_data`), as numpy; the whole array on one process."""
    if getattr(x, "is_fully_addressable", True):
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.global_array_to_host_local_array(x, x.sharding.mesh, x.sharding.spec))
