"""A sampler process group of a disaggregated RLVR run (`rl.placement = disaggregated`, `rl.role = sampler`).

    python -m posttrain.main --config CONFIG --config.rl.placement=disaggregated --config.rl.role=sampler

Same config and workdir as the learner's command (either may start first: the sampler waits for
`<workdir>/rl/learner.json`). Loop: lease the oldest issued batch (`rl/rollout/workqueue.py`; none
while `rl.max_staleness + 1` finished batches wait for the learner), pull the newest weights when the
learner has published newer ones (at least the batch's `min_version`, `rl/rollout/transfer.py`),
sample it with the key the in-process loop would use (`batch_key`), verify, deliver. A lease lost
meanwhile (re-issued, or forgotten by a learner that restarted from an older checkpoint, whose
versions go backwards) drops its batch, whether waiting for weights or in flight (`LeaseLost`); the
next lease re-syncs to the restarted learner's weights. A thread beats the heartbeat while the work
on a lease progresses (`rl/rollout/liveness.py`), so the learner re-issues this sampler's leases
once it has stopped or hung. Exits (status 0) when the learner writes `rl/finished.json`. It holds
no workdir lock (the learner does) and writes nothing but the queue's files.

A group may be several processes (`config.distributed`, as any multi-process run; as many as the
learner's): one JAX program over their devices whose lead process alone talks to the queue, the
others following its every decision (`rl/rollout/group.py`); each verifies its share of the groups.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable
from functools import partial

import jax
from flax import nnx

from posttrain.config import RLConfig
from posttrain.core.state import abstract_model
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules, use_sharding
from posttrain.rl.algo.critic import ValueDecoder
from posttrain.rl.checks import check_rlvr_stage
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.group import from_lead, gather_payload, is_lead
from posttrain.rl.rollout.hosts import combine_info
from posttrain.rl.rollout.liveness import Heartbeat, Progress
from posttrain.rl.rollout.transfer import LeaseLost, WeightClient, weight_shardings
from posttrain.rl.rollout.worker import SUMMED_INFO, RolloutWorker
from posttrain.rl.rollout.workqueue import WorkQueue, encode_batch
from posttrain.rl.tasks.registry import make_domains, make_reward_fn
from posttrain.sampling.continuous import SlotConfig
from posttrain.sampling.layout import sampler_rules
from posttrain.stages.rlvr_parts import rollout_prefix_cache, rollout_sampling


def pull_specs(make, mesh, rules, layout: str) -> tuple:
    """(graphdef, (params, rest) as ShapeDtypeStructs in the shardings the learner publishes in)."""
    shapes = jax.eval_shape(lambda: tuple(nnx.split(make(), nnx.Param, ...)[1:]))
    shardings = weight_shardings(shapes, mesh, rules, layout)
    specs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    return nnx.graphdef(abstract_model(make)), specs


def batch_key(base_key, batch: int, max_staleness: int):
    """Batch `batch`'s sampling key as the in-process loop makes it: `collect_batch`'s first round
    on-policy (max_staleness = 0), the overlapped producer's otherwise; so a disaggregated run
    samples what the colocated run would with the same weights."""
    key = jax.random.fold_in(base_key, batch)
    return jax.random.split(key)[1] if max_staleness == 0 else key


def inflight_weights(
    client: WeightClient, got: tuple, alive: Callable[[], bool] = lambda: True, moved: Callable[[], None] = lambda: None
):
    """`latest` of in-flight updates on a sampler group (`rl.inflight_update_every`): between decode
    steps, the newest weights the learner has published (pulled when newer than the held ones,
    `got` = ((params, rest), version) at first), the held ones once it has finished. LeaseLost
    (the batch abandoned) once `alive()` says the lease is gone: a restarted learner forgot it and
    its versions went backwards; the sampler then re-syncs with the next lease. `moved()` is called
    at each check (decode steps went by: the sampler's progress)."""
    held = [got]

    def latest() -> tuple:
        moved()
        if not from_lead(alive):
            raise LeaseLost(f"in flight at version {held[0][1]}: the lease is no longer this sampler's")
        newer = client.newest(held[0][1], alive)
        if newer is not None:
            held[0] = newer
        (params, rest), version = held[0]
        return version, params, rest

    return latest


@dataclasses.dataclass(frozen=True)
class SamplerLoop:
    """What a sampler group's loop works with: its queue, weight client, worker (which bumps
    `progress`), the tasks by id, the base key and the `rl` section."""

    queue: WorkQueue
    client: WeightClient
    worker: RolloutWorker
    progress: Progress
    tasks_by_id: dict
    base_key: jax.Array
    rl: RLConfig
    name: str


def sample_lease(loop: SamplerLoop, lease: dict) -> bool | None:
    """Pull the weights `lease` needs, sample and verify its batch, deliver it: True when
    delivered, False when the lease was lost first (re-issued, or the learner restarted: the batch
    is dropped and the next lease re-syncs), None when the learner finished meanwhile."""
    queue, client, r, name = loop.queue, loop.client, loop.rl, loop.name
    alive = lambda: queue.lease_token(lease["batch"]) == lease["lease"]  # noqa: E731
    try:
        got = client.newest(lease["min_version"], alive)
        if got is None:
            return None
        (params, rest), version = got
        tasks = [(d, loop.tasks_by_id[(d, i)]) for d, i in lease["tasks"]]
        latest = inflight_weights(client, got, alive, loop.progress.bump) if r.inflight_update_every else None
        key = batch_key(loop.base_key, lease["batch"], r.max_staleness)
        with loop.progress.working():  # a hung generation or verifier stops the heartbeat
            batch = loop.worker.rollout(params, rest, tasks, key, latest=latest)
    except LeaseLost as e:
        logging.warning("rl sampler %s: batch %d dropped: %s", name, lease["batch"], e)
        return False
    version = min((ro.version for ro in batch.rollouts(version)), default=version)  # the oldest token's
    info = combine_info(batch.info, SUMMED_INFO)  # every process's share
    parts = (batch.groups, batch.behav, info, version, name, lease["run"], batch.routing)
    payload = gather_payload(encode_batch(*parts, batch.versions, lease=lease["lease"]))
    if from_lead(lambda: queue.deliver(lease["batch"], payload)):
        return True
    why = "its lease is no longer ours (re-issued, or the learner restarted)"
    logging.warning("rl sampler %s: batch %d dropped: %s", name, lease["batch"], why)
    return False


def run_sampler(cfg, *, poll_s: float = 0.05) -> dict:
    """Sample issued batches until the learner finishes; {"batches": delivered, "pulled_bytes": …}."""
    cfg = cfg.for_stage("rlvr")
    check_rlvr_stage(cfg)  # also what disaggregated cannot do yet
    r = cfg.rl
    queue = WorkQueue(cfg.workdir)
    name = from_lead(lambda: f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(3)}")
    tok = load_tokenizer(cfg.data.tokenizer)
    domains, _ = make_domains(cfg, tok, make_reward_fn(r))
    tasks_by_id = {(d, t.id): t for d, dom in domains.items() for t in dom.tasks}
    mesh, rules = mesh_and_rules(cfg)
    model = ValueDecoder if r.advantage == "gae" else Decoder
    graphdef, specs = pull_specs(lambda: model(cfg.model, rngs=nnx.Rngs(cfg.seed)), mesh, rules, cfg.sampling.layout)
    pool = concurrent.futures.ThreadPoolExecutor(r.verifier_workers)
    worker = RolloutWorker(
        graphdef,
        domains,
        rollout_sampling(cfg, tok.stop_ids),
        tok.pad_id,
        pool,
        r.verifier_delay,
        episodes=partial(rollout_episodes, cohorts=r.episode_cohorts) if r.env != "single" else None,
        prefix_cache=rollout_prefix_cache(cfg),
        continuous=SlotConfig.of(cfg.sampling),
        rules=sampler_rules(rules, cfg.sampling.layout),
        inflight_every=r.inflight_update_every,
        progress=(progress := Progress()).bump,
    )
    delivered, bound = 0, r.max_staleness + 1
    beat = Heartbeat(queue, name, r.lease_timeout_s / 4, progress, r.progress_deadline_s)
    if is_lead():
        beat.start()
    logging.info("rl sampler %s: waiting for the learner in %s", name, queue.path())
    client = WeightClient(queue, name, specs, mesh, reconnect_s=r.reconnect_timeout_s)
    loop = SamplerLoop(queue, client, worker, progress, tasks_by_id, jax.random.key(cfg.seed), r, name)
    try:
        with use_sharding(mesh, rules):
            next_lease = lambda: "finished" if queue.finished() else queue.lease(name, bound)  # noqa: E731
            while (lease := from_lead(next_lease)) != "finished":
                if lease is None:
                    time.sleep(poll_s)
                    continue
                done = sample_lease(loop, lease)
                if done is None:  # the learner finished while this sampler waited for weights
                    break
                delivered += done
    finally:
        beat.stop()
        pool.shutdown(wait=False, cancel_futures=True)
    rate = client.pulled_bytes / client.pull_s / 2**20 if client.pull_s else 0.0
    logging.info(
        "rl sampler %s: the learner finished; %d batches delivered; pulled %.1f MiB in %.2f s (%.1f MiB/s)",
        *(name, delivered, client.pulled_bytes / 2**20, client.pull_s, rate),
    )
    return {"batches": delivered, "pulled_bytes": client.pulled_bytes, "pull_s": client.pull_s}
