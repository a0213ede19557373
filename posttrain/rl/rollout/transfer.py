"""Weights from the learner to sampler process groups (`rl.placement = disaggregated`) over
`jax.experimental.transfer` (experimental: used with the jax range setup.py pins).

The learner starts a transfer server and writes `<workdir>/rl/learner.json` atomically: its
address, a random run token, its mesh shape and the newest published version. A sampler that wants
newer weights writes `rl/pulls/<sampler>.want.json` with a fresh nonce; the learner's serving thread
offers the newest published weights for one pull under `offer_uuid(token, sampler, nonce, version)`
and answers with the version in `rl/pulls/<sampler>.offer.json`; the sampler pulls under that uuid.

Who may pull: the transfer API has no authentication hook, so the token is part of the pull's name.
An offer's uuid is a keyed hash (HMAC-SHA256, 63 bits) of the token: a peer that has not read the
token from the workdir cannot name any offer, and each offer is served once. learner.json is
readable by the learner's user only (mode 0600): samplers run as that user on a shared filesystem,
which is the trust boundary, as for checkpoints.

A pull needs the same shard layout on both sides, so a sampler group runs the learner's mesh shape
over as many processes (`WeightClient` checks both) with the weights in the sampler's layout
(`weight_shardings`). With several processes (`rl/rollout/group.py`) every learner process serves
its own shards: learner.json lists each process's address, the lead process of each side makes and
answers the wants, the other learner processes serve each offer the lead made (they keep the last
two versions: the lead may offer one they have just replaced), and process i of a sampler group
pulls from learner process i. An offer whose sampler died before pulling keeps one copy of that
version alive in the learner (bounded by the number of dead samplers).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp

from posttrain.errors import UserError
from posttrain.parallel import agree, allgather_json, broadcast_json, shardings_for
from posttrain.rl.rollout.group import from_lead, is_lead
from posttrain.rl.rollout.ticker import Ticker
from posttrain.rl.rollout.workqueue import WorkQueue
from posttrain.sampling.layout import sampler_rules

HOST_ENV = "POSTTRAIN_RL_HOST"  # the address the learner's transfer server binds (default: this host's)


def transfer_module():
    """`jax.experimental.transfer`, or a UserError naming rl.placement when this jax lacks it."""
    try:
        from jax.experimental import transfer
    except ImportError as e:
        raise UserError(
            f"rl.placement='disaggregated' needs jax.experimental.transfer (jax >= 0.7, tested with 0.10.2); "
            f"this jax {jax.__version__} has none ({e}): install a jax in the range setup.py pins",
            key="rl.placement",
        ) from e
    return transfer


def offer_uuid(token: str, sampler: str, nonce: str, version: int) -> int:
    """The name of one offer: a 63-bit HMAC of (sampler, nonce, version) keyed by the run's token."""
    digest = hmac.new(token.encode(), f"{sampler}/{nonce}/{version}".encode(), hashlib.sha256).digest()
    return int.from_bytes(digest[:8], "big") >> 1


def bind_host() -> str:
    """The learner's address: $POSTTRAIN_RL_HOST, else this host's IP (127.0.0.1 if it has none)."""
    if os.environ.get(HOST_ENV):
        return os.environ[HOST_ENV]
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def start_server(host: str):
    """A transfer server of this process's devices on `host` (any free port)."""
    transfer = transfer_module()
    return transfer.start_transfer_server(jax.devices()[0].client, f"{host}:0", [f"{host}:0"])


def weight_shardings(weights: tuple, mesh, rules, layout: str) -> tuple:
    """The shardings (params, rest) travel in: params in the sampler's layout, rest in the rules."""
    params, rest = weights
    return shardings_for(params, mesh, sampler_rules(rules, layout)), shardings_for(rest, mesh, rules)


class WeightServer:
    """The learner's side: `publish` keeps a fresh copy of each version; a thread serves pulls."""

    def __init__(self, queue: WorkQueue, mesh, rules, layout: str, *, host: str | None = None, poll_s=0.02):
        self.queue, self.mesh, self.rules, self.layout = queue, mesh, rules, layout
        self.server = start_server(host or bind_host())
        self.token = broadcast_json(secrets.token_hex(16))  # every learner process names offers alike
        self.addresses = allgather_json(self.server.address())  # sampler process i pulls from process i
        self.learner = hashlib.sha256(self.token.encode()).hexdigest()[:16]  # names this learner, not its token
        self.offers, self.keep = 0, 1 if jax.process_count() == 1 else 2
        self._lock, self._copies, self._served, self._copy = threading.Lock(), {}, {}, None
        self._ticker = Ticker(self.serve_pending, poll_s, "weights")

    def publish(self, version: int, weights: tuple) -> None:
        """Offer `weights` ((params, rest)) as `version`: copied into fresh buffers (the learner's
        are donated to its next update), then announced in learner.json (by the lead process)."""
        if self._copy is None:
            self._copy = jax.jit(
                lambda t: jax.tree.map(jnp.copy, t), out_shardings=weight_shardings(weights, *self._layout())
            )
        copy = self._copy(weights)
        with self._lock:
            self._copies = {**{v: c for v, c in self._copies.items() if v < version}, version: copy}
            self._copies = dict(sorted(self._copies.items())[-self.keep :])
        if is_lead():
            info = {"address": self.addresses[0], "addresses": self.addresses, "token": self.token, "version": version}
            self.queue.write({**info, "pid": os.getpid(), "mesh": dict(self.mesh.shape)}, "learner.json", mode=0o600)
        self._ticker.start()

    def _layout(self) -> tuple:
        return self.mesh, self.rules, self.layout

    def serve_pending(self) -> int:
        """Offer the newest weights to every sampler with an unanswered want (the lead process), or
        serve this process's shards under each offer the lead made (the others); how many."""
        offered = self._offer_wanted() if is_lead() else self._serve_offered()
        self.offers += offered
        return offered

    def _unanswered(self, kind: str):
        """(sampler, record) of each `pulls/<sampler>.<kind>.json` whose nonce this process has not
        served yet."""
        suffix = f".{kind}.json"
        for name in sorted(self.queue.names("pulls")):
            record = self.queue.read("pulls", name) if name.endswith(suffix) else None
            if record is not None and self._served.get(name[: -len(suffix)]) != record["nonce"]:
                yield name[: -len(suffix)], record

    def _offer_wanted(self) -> int:
        offered = 0
        for sampler, want in self._unanswered("want"):
            with self._lock:
                version, arrays = max(self._copies.items())
            self.server.await_pull(offer_uuid(self.token, sampler, want["nonce"], version), jax.tree.leaves(arrays))
            self._served[sampler] = want["nonce"]
            offer = {"nonce": want["nonce"], "version": version, "learner": self.learner}
            self.queue.write(offer, "pulls", f"{sampler}.offer.json")
            offered += 1
        return offered

    def _serve_offered(self) -> int:
        served = 0
        for sampler, offer in self._unanswered("offer"):
            if offer.get("learner") != self.learner:
                continue  # an earlier learner's
            with self._lock:
                arrays, newest = self._copies.get(offer["version"]), max(self._copies)
            if arrays is None and offer["version"] > newest:
                continue  # the lead published it first: so will this process, shortly
            if arrays is None:
                logging.error("rl learner: version %d offered to %s is no longer held here", offer["version"], sampler)
            else:
                uuid = offer_uuid(self.token, sampler, offer["nonce"], offer["version"])
                self.server.await_pull(uuid, jax.tree.leaves(arrays))
                served += 1
            self._served[sampler] = offer["nonce"]
        return served

    def close(self) -> None:
        """Stop serving (offers already made stay pullable while the process lives)."""
        self._ticker.stop(join_s=5)


class LeaseLost(Exception):
    """The batch a sampler works on is no longer its own (re-issued, or the learner restarted and
    forgot it): waiting for or sampling with weights for it is pointless."""


class LearnerUnreachable(RuntimeError):
    """Pulls from the learner failed for longer than `rl.reconnect_timeout_s`."""


BACKOFF_MAX_S = 5.0  # the longest wait between two tries of a failed pull


class WeightClient:
    """A sampler group's side: finds the learner through learner.json and pulls newer versions. A
    pull that fails (the learner died mid-pull: `JaxRuntimeError: … Connection closed`) is tried
    again with backoff after re-reading learner.json (a restarted learner is connected to), for up to
    `reconnect_s` seconds of failures in a row; then LearnerUnreachable. With several processes the
    lead decides each step from the queue (`_plan`) and every process acts on it (`rl/rollout/group.py`)."""

    def __init__(
        self,
        queue: WorkQueue,
        sampler: str,
        specs: tuple,
        mesh,
        *,
        poll_s: float = 0.05,
        reconnect_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.queue, self.sampler, self.specs, self.mesh, self.poll_s = queue, sampler, specs, mesh, poll_s
        self.reconnect_s, self.clock, self.sleep = reconnect_s, clock, sleep  # (clock and backoff waits)
        self.server = start_server(bind_host())
        self.token = self.conn = self.weights = None
        self.version = -1
        self.pulled_bytes = self.restarts = 0
        self.pull_s = 0.0

    def newest(self, min_version: int, alive: Callable[[], bool] | None = None) -> tuple | None:
        """((params, rest), version) of the newest published version, pulled when newer than the
        one held, waiting until it is at least `min_version` (a sampler started before the learner
        waits for learner.json); None once the learner has finished. `alive` (read on the lead
        process): whether the lease this is for is still the sampler's; LeaseLost once it is not (a
        restarted learner, resumed from an older checkpoint, may never reach `min_version`: its
        leases are new ones)."""
        failing = None  # (since, tries) while pulls fail
        while True:
            plan = from_lead(lambda: self._plan(min_version, alive))
            if plan["kind"] == "lost":
                raise LeaseLost(f"waiting for version {min_version}: the lease is no longer this sampler's")
            if plan["kind"] == "finished":
                return None
            if plan["kind"] == "ready":
                return self.weights, self.version
            info, error = plan.get("info"), None
            try:
                if info is not None and (info["token"] != self.token or self.conn is None):
                    self._connect(info)
                if plan["kind"] == "pull":
                    self._pull(plan["offer"])
            except jax.errors.JaxRuntimeError as e:
                error = e
            if not agree(error is None, name="a weight pull's success", reduce="all"):
                failing = self._failed(error, info, failing)
                continue
            failing = None
            if plan["kind"] == "wait":
                time.sleep(self.poll_s)

    def _plan(self, min_version: int, alive: Callable[[], bool] | None) -> dict:
        """The lead's next step from the queue: lost (the lease), finished (the learner), pull (an
        offer of newer weights, after asking for it), ready (held weights are new enough), wait."""
        if alive is not None and not alive():
            return {"kind": "lost"}
        info = self.queue.read("learner.json")
        if info is not None and (info["token"] != self.token or info["version"] > self.version):
            offer = self._ask(info)
            if offer is not None:
                return {"kind": "pull", "info": info, "offer": offer}
            return {"kind": "finished"} if self.queue.finished() else {"kind": "again"}  # (replaced: read it again)
        if self.version >= min_version:
            return {"kind": "ready"}
        return {"kind": "finished"} if self.queue.finished() else {"kind": "wait", "info": info}

    def _failed(self, error: Exception | None, info: dict, failing: tuple | None) -> tuple[float, int]:
        """A connection or pull failed (on some process): wait (doubling from poll_s up to
        BACKOFF_MAX_S) and drop the connection, so the next try re-reads learner.json and
        reconnects; (since, tries), or LearnerUnreachable once failures have lasted `reconnect_s`
        (by the lead's clock)."""
        now = self.clock()
        since, tries = failing or (now, 0)
        error = error or RuntimeError("another process of this sampler group failed to pull")
        if from_lead(lambda: now - since >= self.reconnect_s):
            raise LearnerUnreachable(
                f"rl sampler {self.sampler}: no pull from the learner at {info['address']} succeeded for "
                f"{now - since:.0f} s (rl.reconnect_timeout_s={self.reconnect_s:g}); last error: {error}"
            ) from error
        wait = min(self.poll_s * 2**tries, BACKOFF_MAX_S)
        logging.warning("rl sampler %s: pull failed (%s); trying again in %.2f s", self.sampler, error, wait)
        self.sleep(wait)
        self.conn = None
        return since, tries + 1

    def _connect(self, info: dict) -> None:
        if info["mesh"] != dict(self.mesh.shape):
            raise UserError(
                f"this sampler's mesh {dict(self.mesh.shape)} differs from the learner's {info['mesh']}: "
                "under rl.placement='disaggregated' a sampler group runs the learner's mesh.* for now",
                key="rl.placement",
            )
        addresses = info.get("addresses", [info["address"]])
        if len(addresses) != jax.process_count():
            raise UserError(
                f"this sampler group runs {jax.process_count()} process(es), the learner {len(addresses)}: under "
                "rl.placement='disaggregated' each sampler process pulls its shards from the learner process of "
                "its index, so a group runs as many processes as the learner",
                key="rl.placement",
            )
        if self.token not in (None, info["token"]):  # another learner (restarted: versions may go backwards)
            self.restarts += 1
            logging.warning(
                "rl sampler %s: the learner restarted at version %d; re-syncing", self.sampler, info["version"]
            )
        self.conn = self.server.connect(addresses[jax.process_index()])
        if info["token"] != self.token:
            self.token, self.version = info["token"], -1

    def _ask(self, info: dict) -> dict | None:
        """Ask the learner of `info` for its newest weights (the lead process): its offer, or None
        when the learner finished or another learner replaced it meanwhile."""
        nonce = secrets.token_hex(8)
        self.queue.write({"nonce": nonce}, "pulls", f"{self.sampler}.want.json")
        while (offer := self.queue.read("pulls", f"{self.sampler}.offer.json")) is None or offer["nonce"] != nonce:
            if self.queue.finished() or (self.queue.read("learner.json") or {}).get("token") != info["token"]:
                return None
            time.sleep(self.poll_s)
        return offer

    def _pull(self, offer: dict) -> None:
        """Pull this process's shards of the weights `offer` names (every process of the group)."""
        leaves, tree = jax.tree.flatten(self.specs)
        t0 = time.perf_counter()
        flat = self.conn.pull(offer_uuid(self.token, self.sampler, offer["nonce"], offer["version"]), leaves)
        self.weights = jax.block_until_ready(jax.tree.unflatten(tree, flat))
        self.version = offer["version"]
        self.pulled_bytes += sum(x.size * x.dtype.itemsize for x in leaves)
        self.pull_s += time.perf_counter() - t0
