"""The workdir queue between a learner and its sampler process groups (`rl.placement = disaggregated`).

Everything lives under `<workdir>/rl/`, each file written whole (a temporary file renamed over it),
so a reader never sees half a file:

    tasks/<p>.json     batch p's tasks, issued by the learner (it owns the TaskScheduler, so the
                       task sequence is the seed's, however many samplers run): [[domain, task id]…]
                       and `min_version`, the oldest policy version that may sample it
    leases/<p>.json    which sampler took batch p, under a fresh random lease token (created whole
                       and exclusively, a hard link: one sampler per batch)
    samplers/<id>.json a sampler's heartbeat; a lease whose sampler has not beaten for
                       `rl.lease_timeout_s` (and no result) is re-issued: its lease file is removed
    done/<p>.<lease>.json  batch p's verified groups, the policy version that sampled them and the
                       behaviour log-probs (`encode_batch`), delivered under lease token <lease>,
                       read by the learner in order of issue
    finished.json      the learner is done: samplers exit 0

A result belongs to a lease: a sampler delivers only while its lease is batch p's current one (a
batch re-issued, consumed or forgotten by a restarted learner has another lease or none, and the
late result is refused), and the learner reads only the result named by the current lease, so a
stale file that slipped past the check (a re-issue between check and rename) is never read; it
is swept. Back-pressure: a sampler takes no lease while `bound` results the learner will read
(`pending`) wait unconsumed.

The files live in a local folder (`LocalFiles`: writes renamed into place, exclusive creation by a
hard link) or under an fsspec URL (`ObjectFiles`, e.g. gs://: an object is written whole, and
exclusive creation is a create-only write, GCS's `ifGenerationMatch=0` precondition), so learner
and samplers need no shared disk: a gs:// workdir holds the queue, learner.json, checkpoints and
metrics (tested end to end on the GCS emulator). Every poll lists or reads objects: on real GCS
each is a request, tens a second per waiting process at the 50 ms poll interval.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
import time

import fsspec
import numpy as np

from posttrain import storage
from posttrain.rl.envs.base import Trajectory
from posttrain.rl.reward import Reward
from posttrain.rl.tasks.scheduler import Group

DIRS = ("tasks", "leases", "samplers", "done", "pulls")


def write_json(path: str, obj, mode: int = 0o666) -> None:
    """Write `obj` as JSON to `path` atomically (a temporary file in the same folder, renamed);
    `mode`: its permissions under the umask (0o600: readable by this user only), from the file's
    creation on (never briefly wider)."""
    tmp = f"{path}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    with os.fdopen(os.open(tmp, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode), "w") as f:
        json.dump(obj, f, default=_plain)
    os.replace(tmp, path)


def read_json(path: str):
    """The JSON at `path`, or None when there is none (yet, or any more, or a lease being written)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (FileNotFoundError, ValueError):
        return None


def _plain(o):
    return o.item() if hasattr(o, "item") else str(o)


class LocalFiles:
    """The queue's files in a local (or shared) folder: JSON written to a temporary file and renamed
    into place, exclusive creation by a hard link of a written file."""

    def __init__(self, root: str) -> None:
        self.root = storage.local(root)
        for d in DIRS:
            os.makedirs(os.path.join(self.root, d), exist_ok=True)

    def path(self, *parts: str) -> str:
        return os.path.join(self.root, *parts)

    def names(self, folder: str) -> list[str]:
        return os.listdir(self.path(folder))

    def read(self, path: str):
        return read_json(path)

    def write(self, path: str, obj, mode: int = 0o666) -> None:
        write_json(path, obj, mode)

    def create(self, path: str, obj) -> bool:
        tmp = f"{os.path.dirname(path)}/.{os.path.basename(path)}.{secrets.token_hex(4)}.tmp"
        write_json(tmp, obj)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            os.remove(tmp)

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(path)

    def exists(self, path: str) -> bool:
        return os.path.exists(path)


class ObjectFiles:
    """The queue's files under an fsspec URL (gs://bucket/run/rl): an object is written whole, so
    readers never see half of one; exclusive creation is a create-only write (`mode="create"`:
    GCS's `ifGenerationMatch=0` precondition, refused with FileExistsError when the object exists).
    Object stores have no permissions per object: the bucket's access decides who reads learner.json."""

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/")
        # no listing cache: every poll must see the other processes' writes
        self.fs, _ = fsspec.core.url_to_fs(self.root, use_listings_cache=False, skip_instance_cache=True)

    def path(self, *parts: str) -> str:
        return storage.join(self.root, *parts)

    def names(self, folder: str) -> list[str]:
        try:
            return [p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.path(folder), detail=False, refresh=True)]
        except FileNotFoundError:
            return []

    def read(self, path: str):
        try:
            return json.loads(self.fs.cat_file(path))
        except (FileNotFoundError, ValueError):
            return None

    def write(self, path: str, obj, mode: int = 0o666) -> None:
        self.fs.pipe_file(path, json.dumps(obj, default=_plain).encode())

    def create(self, path: str, obj) -> bool:
        try:
            self.fs.pipe_file(path, json.dumps(obj, default=_plain).encode(), mode="create")
            return True
        except FileExistsError:
            return False

    def remove(self, path: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.fs.rm_file(path)

    def exists(self, path: str) -> bool:
        return self.fs.exists(path)


def queue_files(root: str) -> LocalFiles | ObjectFiles:
    """The backend for the queue's root folder: `ObjectFiles` for a URL (gs://), else `LocalFiles`."""
    return ObjectFiles(root) if storage.is_url(root) else LocalFiles(root)


def _batches(names: list[str]) -> list[int]:
    return sorted(int(n[:-5]) for n in names if n.endswith(".json") and n[:-5].isdigit())


def _results(names: list[str]) -> list[tuple[int, str]]:
    """(batch, lease token) of every delivered result file `<p>.<lease>.json` among `names`."""
    parts = (n.split(".") for n in names)
    return sorted((int(n[0]), n[1]) for n in parts if len(n) == 3 and n[0].isdigit() and n[2] == "json")


class WorkQueue:
    """The queue's files under `<workdir>/rl` (module docstring); learner and sampler methods."""

    def __init__(self, workdir: str) -> None:
        self.files = queue_files(storage.join(workdir, "rl"))

    def path(self, *parts: str) -> str:
        """A path (or URL) under `<workdir>/rl`."""
        return self.files.path(*parts)

    def read(self, *parts: str):
        """The JSON of `<workdir>/rl/<parts>`, or None when there is none (yet, or any more)."""
        return self.files.read(self.path(*parts))

    def write(self, obj, *parts: str, mode: int = 0o666) -> None:
        """Write `obj` as `<workdir>/rl/<parts>`, whole (`mode`: a local file's permissions from creation)."""
        self.files.write(self.path(*parts), obj, mode)

    def names(self, folder: str) -> list[str]:
        """The file names in `<workdir>/rl/<folder>`."""
        return self.files.names(folder)

    def remove(self, *parts: str) -> None:
        """Remove `<workdir>/rl/<parts>` if it is there."""
        self.files.remove(self.path(*parts))

    # --- learner ------------------------------------------------------------------------------

    def reset(self) -> None:
        """Forget an earlier learner's queue (a restarted learner re-issues from its checkpoint)."""
        for d in DIRS:
            for name in self.names(d):
                self.remove(d, name)
        self.remove("finished.json")

    def issue(self, batch: int, tasks: list[tuple[str, object]], min_version: int, run: str = "") -> None:
        """Offer batch `batch` (its (domain, task) pairs) to the samplers; `run` names the learner's
        incarnation (a result carries it back: one sampled for an earlier learner is refused)."""
        task = {"batch": batch, "min_version": min_version, "run": run, "tasks": [[d, t.id] for d, t in tasks]}
        self.write(task, "tasks", f"{batch}.json")

    def lease_token(self, batch: int) -> str | None:
        """The token of batch `batch`'s current lease, None when no sampler holds it."""
        return (self.read("leases", f"{batch}.json") or {}).get("lease")

    def result(self, batch: int) -> dict | None:
        """Batch `batch`'s result under its current lease, or None while there is none."""
        lease = self.lease_token(batch)
        return None if lease is None else self.read("done", f"{batch}.{lease}.json")

    def pending(self) -> list[int]:
        """The batches whose result the learner will read: issued, and delivered under the current lease."""
        issued = set(_batches(self.names("tasks")))
        return sorted({p for p, lease in _results(self.names("done")) if p in issued and lease == self.lease_token(p)})

    def sweep(self) -> int:
        """Remove the results no current lease names (late, re-issued, of an earlier learner)."""
        stale = [(p, lease) for p, lease in _results(self.names("done")) if lease != self.lease_token(p)]
        for p, lease in stale:
            self.remove("done", f"{p}.{lease}.json")
        return len(stale)

    def _drop_results(self, batch: int) -> None:
        for p, lease in _results(self.names("done")):
            if p == batch:
                self.remove("done", f"{p}.{lease}.json")

    def consume(self, batch: int) -> None:
        """Remove batch `batch`'s task, lease and results (it has been taken or dropped)."""
        for d in ("tasks", "leases"):
            self.remove(d, f"{batch}.json")
        self._drop_results(batch)

    def reissue(self, batch: int) -> None:
        """Make batch `batch` leasable again (its results, if any, dropped). The results go first:
        once the lease is gone a sampler may lease the batch again and deliver, and that result
        stays (one delivered under the old lease in between is swept)."""
        self._drop_results(batch)
        self.remove("leases", f"{batch}.json")

    def reissue_dead(self, timeout_s: float, now: float | None = None) -> list[int]:
        """Re-issue every unfinished batch leased by a sampler with no heartbeat for `timeout_s`."""
        now, again, finished = time.time() if now is None else now, [], set(self.pending())
        for p in _batches(self.names("leases")):
            lease = self.read("leases", f"{p}.json")
            if lease is None or p in finished:
                continue
            beat = self.read("samplers", f"{lease['sampler']}.json") or {"t": lease["t"]}
            if now - beat["t"] > timeout_s:
                self.reissue(p)
                again.append(p)
        return again

    def finish(self, ok: bool = True) -> None:
        """Tell the samplers the learner is done (they exit 0)."""
        self.write({"ok": ok, "t": time.time()}, "finished.json")

    # --- sampler ------------------------------------------------------------------------------

    def finished(self) -> bool:
        """Whether the learner has finished."""
        return self.files.exists(self.path("finished.json"))

    def heartbeat(self, sampler: str) -> None:
        """Record that `sampler` is alive (its leases stay its own)."""
        self.write({"t": time.time(), "pid": os.getpid()}, "samplers", f"{sampler}.json")

    def lease(self, sampler: str, bound: int) -> dict | None:
        """The oldest issued batch no sampler holds, now leased to `sampler` (its task with the
        lease token, `lease`, that its result must carry); None when there is none, or when
        `bound` results the learner will read already wait (back-pressure)."""
        if len(self.pending()) >= bound:
            return None
        for p in _batches(self.names("tasks")):
            token = secrets.token_hex(8)
            lease = {"sampler": sampler, "t": time.time(), "lease": token}
            if not self.files.create(self.path("leases", f"{p}.json"), lease):  # whole and exclusive
                continue
            task = self.read("tasks", f"{p}.json")
            if task is not None:
                return {**task, "lease": token}
            self.remove("leases", f"{p}.json")  # consumed meanwhile (a learner that restarted)
        return None

    def deliver(self, batch: int, payload: dict) -> bool:
        """Hand batch `batch`'s result (`encode_batch`, carrying its lease token) to the learner;
        False (nothing delivered) when that lease is no longer the batch's current one."""
        lease = payload.get("lease")
        if lease is None or self.lease_token(batch) != lease:
            return False
        self.write(payload, "done", f"{batch}.{lease}.json")
        return True


def encode_batch(
    groups: list[Group],
    behav: list,
    info: dict,
    version: int,
    sampler: str,
    run: str = "",
    routing=None,
    versions=None,
    lease: str | None = None,
) -> dict:
    """A verified batch as JSON: its groups (task ids, rewards, trajectories), the behaviour
    log-probs (float32 values, exact through JSON), the experts the sampler chose per token when it
    records them (`routing[j][g]`, `rl.rollout.routing`), the policy version that sampled it (its
    oldest token's), each token's version with in-flight updates (`versions[j][g]`,
    `rl.rollout.inflight`), the learner run (`issue`) it was leased from and the lease's token."""
    payload = {
        "version": version,
        "sampler": sampler,
        "run": run,
        "lease": lease,
        "info": info,
        "groups": [
            {
                "domain": g.domain,
                "task": g.task.id,
                "rewards": [float(x) for x in g.rewards],
                "correct": [float(x) for x in g.correct],
                "behav": [np.asarray(b, np.float32).tolist() for b in lp],
                "trajectories": [
                    {**dataclasses.asdict(t), "reward": None if t.reward is None else dataclasses.asdict(t.reward)}
                    for t in g.trajectories
                ],
            }
            for g, lp in zip(groups, behav)
        ],
    }
    if routing is not None:
        for g, r in zip(payload["groups"], routing):
            g["routing"], g["routing_dtype"] = [np.asarray(x).tolist() for x in r], str(np.asarray(r[0]).dtype)
    for g, v in zip(payload["groups"], versions or ()):
        g["versions"] = [np.asarray(x, np.int32).tolist() for x in v]
    return payload


def decode_versions(payload: dict) -> list[list[np.ndarray]] | None:
    """`encode_batch`'s token versions (`versions[j][g]`), or None when the sampler recorded none."""
    return [[np.asarray(v, np.int32) for v in g["versions"]] for g in payload["groups"] if "versions" in g] or None


def decode_batch(payload: dict, tasks_by_id: dict) -> tuple[list[Group], list[list[np.ndarray]], list | None]:
    """`encode_batch`'s groups, behaviour log-probs and routing (None when the sampler recorded none);
    `tasks_by_id[(domain, id)]` is the Task."""
    groups, behav = [], []
    routing = [
        [np.asarray(r, g["routing_dtype"]) for r in g["routing"]] for g in payload["groups"] if "routing" in g
    ] or None
    for g in payload["groups"]:
        trajs = [
            Trajectory(**{**t, "reward": None if t["reward"] is None else Reward(**t["reward"])})
            for t in g["trajectories"]
        ]
        groups.append(Group(g["domain"], tasks_by_id[(g["domain"], g["task"])], g["rewards"], trajs, g["correct"]))
        behav.append([np.asarray(b, np.float32) for b in g["behav"]])
    return groups, behav, routing
