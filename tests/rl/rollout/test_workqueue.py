"""The workdir queue's results belong to a lease (rl/rollout/workqueue.py): late deliveries of a
batch that was re-issued, consumed or forgotten by a restarted learner are refused, never count
against back-pressure, and never reach the learner. Each test runs on a local folder and on gs://
(the GCS emulator, conftest.py: create-only writes honoured)."""

import concurrent.futures

import pytest

from posttrain.rl.envs.base import Task
from posttrain.rl.rollout.workqueue import LocalFiles, ObjectFiles, WorkQueue

TASKS = [("arithmetic", Task("t1", ({"role": "user", "content": "1+1"},), "2"))]


@pytest.fixture(params=["local", "gs"])
def workdir(request, tmp_path):
    """A fresh workdir: a local folder, or a fresh prefix in the emulator's bucket."""
    if request.param == "local":
        return str(tmp_path)
    return f"{request.getfixturevalue('gcs')}/{tmp_path.name}"


def result(lease: dict, version: int) -> dict:
    """A sampler's result for `lease` (what `encode_batch` writes, without groups)."""
    return {"version": version, "run": lease["run"], "groups": [], "lease": lease.get("lease")}


def test_late_results_for_an_earlier_learner_do_not_fill_the_queue(workdir):
    """The learner issues 10, 11 (max_staleness = 1: two slots), a sampler leases both; the learner
    crashes and resumes at 7; the late deliveries of 10 and 11 are refused and 7 is still leasable."""
    queue = WorkQueue(workdir)
    for p in (10, 11):
        queue.issue(p, TASKS, min_version=p - 1, run="first")
    late = [queue.lease("s", bound=2) for _ in range(2)]
    queue.reset()  # the learner restarted from its checkpoint at step 7
    for p in (7, 8):
        queue.issue(p, TASKS, min_version=p - 1, run="second")
    delivered = [queue.deliver(lease["batch"], result(lease, lease["batch"])) for lease in late]
    assert (queue.lease("s", bound=2) or {}).get("batch") == 7  # (before the fix: None, for ever)
    assert delivered == [False, False] and queue.pending() == [] and queue.result(10) is None


def test_a_stalled_samplers_late_result_of_a_consumed_batch_is_refused(workdir):
    """max_staleness = 0 (one slot): a stalled sampler's batch 0 is re-issued, sampled again and
    consumed; the stalled sampler then delivers it: refused, and batch 1 is leasable."""
    queue = WorkQueue(workdir)
    queue.issue(0, TASKS, min_version=0, run="r")
    stalled = queue.lease("a", bound=1)
    queue.reissue(0)  # (reissue_dead: a's heartbeat stopped)
    again = queue.lease("b", bound=1)
    queue.deliver(0, result(again, 0))
    assert queue.result(0) is not None
    queue.consume(0)  # the learner took it
    queue.issue(1, TASKS, min_version=1, run="r")
    late = queue.deliver(0, result(stalled, 0))
    assert (queue.lease("c", bound=1) or {}).get("batch") == 1  # (before the fix: None, for ever)
    assert late is False and again["lease"] != stalled["lease"]


def test_a_result_delivered_as_soon_as_the_batch_is_reissued_is_kept(workdir):
    """A fast sampler leases and delivers batch 0 the moment its old lease is released by
    `reissue`: its result is the current lease's and must survive the re-issue (the learner
    waited for a result the re-issue itself had deleted)."""
    queue = WorkQueue(workdir)
    queue.issue(0, TASKS, min_version=0, run="r")
    first = queue.lease("a", bound=1)
    assert queue.deliver(0, result(first, 0))
    remove, fresh = queue.remove, {}

    def remove_then_a_sampler_delivers(*parts):
        remove(*parts)
        if parts == ("leases", "0.json") and not fresh:
            fresh.update(queue.lease("b", bound=1))
            assert queue.deliver(0, result(fresh, 1))

    queue.remove = remove_then_a_sampler_delivers
    queue.reissue(0)
    assert fresh["lease"] != first["lease"] and queue.result(0)["version"] == 1 and queue.pending() == [0]


def test_a_result_that_slips_past_the_check_is_never_read_and_is_swept(workdir):
    """A re-issue between a sampler's check and its rename leaves a result no lease names: the
    learner reads the current lease's result only, back-pressure ignores the other, `sweep` removes it."""
    queue = WorkQueue(workdir)
    queue.issue(0, TASKS, min_version=0, run="r")
    first = queue.lease("a", bound=1)
    assert queue.deliver(0, result(first, 0))
    queue.remove("leases", "0.json")  # re-issued after the check: the lease only
    assert queue.result(0) is None and queue.pending() == []
    second = queue.lease("b", bound=1)
    assert second["batch"] == 0 and queue.result(0) is None
    assert queue.sweep() == 1 and queue.names("done") == []
    assert queue.deliver(0, result(second, 1)) and queue.result(0)["version"] == 1 and queue.pending() == [0]
    assert queue.reissue_dead(timeout_s=0.0, now=1e12) == []  # finished: not re-issued


def test_a_lease_that_outlives_the_restart_does_not_block_the_queue(workdir):
    """A sampler's exclusive create of batch 10's lease lands just after a restarted learner's reset
    (the race): its delivery is accepted, but batch 10 is not issued (the learner is at 7), so it is
    not a result the learner will read and does not hold the one slot (max_staleness = 0)."""
    queue = WorkQueue(workdir)
    queue.issue(10, TASKS, min_version=10, run="first")
    late = queue.lease("s", bound=1)
    lease_file = queue.read("leases", "10.json")
    queue.reset()
    queue.write(lease_file, "leases", "10.json")  # created after the reset's sweep
    queue.issue(7, TASKS, min_version=7, run="second")
    assert queue.deliver(10, result(late, 10))
    assert queue.pending() == [] and (queue.lease("s", bound=1) or {}).get("batch") == 7


def test_one_batch_leased_by_eight_samplers_at_once_goes_to_one(workdir):
    """The lease is an exclusive create (a hard link locally, a create-only write on gs://)."""
    queue = WorkQueue(workdir)
    assert isinstance(queue.files, LocalFiles if "://" not in workdir else ObjectFiles)
    queue.issue(0, TASKS, min_version=0, run="r")
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        leases = list(pool.map(lambda i: queue.lease(f"s{i}", bound=1), range(8)))
    won = [lease for lease in leases if lease is not None]
    assert len(won) == 1 and queue.lease_token(0) == won[0]["lease"]
