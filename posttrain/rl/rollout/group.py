"""Sampler groups and learners of several processes (`rl.placement = disaggregated`).

A sampler group, or the learner, may be one multi-controller JAX program over several hosts (a TPU
slice of several hosts is several processes). Its processes run the same loop in lock-step and
only the lead (process 0) talks to the work queue: it leases, reads learner.json and the pull
offers, delivers and beats the heartbeat. What it read reaches the others through `from_lead`, a
broadcast every process makes at the same point of its loop, so all of them take the same lease,
pull the same version, switch weights at the same decode step and drop a lost lease together.

Weights travel between peers: process i of a sampler group pulls its own shards from process i of
the learner (both run the learner's mesh over as many processes, so they hold the same shards;
`transfer.WeightClient` checks it). Each process of a sampler group verifies its share of the
groups (`hosts.group_share`) and the lead delivers them as one batch (`gather_payload`); each
learner process keeps its share of a taken batch (`local_share`), as a colocated run of several
processes does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from posttrain.parallel import allgather_json, broadcast_json
from posttrain.rl.rollout.hosts import group_share


def is_lead() -> bool:
    """Whether this process talks to the work queue for its group (process 0)."""
    return jax.process_index() == 0


def from_lead(read: Callable[[], Any]) -> Any:
    """`read()` evaluated on the lead process only, its (JSON) value on every process. Every
    process calls it at the same point; one process: `read()`, no collective."""
    if jax.process_count() == 1:
        return read()
    return broadcast_json(read() if is_lead() else None)


def gather_payload(payload: dict) -> dict | None:
    """Every process's share of a sampled batch (`workqueue.encode_batch`) as one payload on the
    lead, its groups in process order (the tasks' order) and its version the oldest; None elsewhere."""
    if jax.process_count() == 1:
        return payload
    parts = allgather_json(payload)
    if not is_lead():
        return None
    return {**parts[0], "groups": [g for p in parts for g in p["groups"]], "version": min(p["version"] for p in parts)}


def local_share(*per_group: list | None) -> tuple:
    """This process's contiguous share of each list of per-group values (None stays None): the
    groups of a taken batch that this learner process trains on."""
    if jax.process_count() == 1:
        return per_group
    share = group_share(len(next(v for v in per_group if v is not None)), exact=True)
    return tuple(None if v is None else v[share] for v in per_group)
