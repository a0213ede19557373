"""rl/rollout/transfer.py without a transfer server: who may read the address file, and what a learner
process other than the lead serves."""

import os

from posttrain.rl.rollout import workqueue
from posttrain.rl.rollout.workqueue import WorkQueue


def test_the_address_file_is_this_users_only_from_its_creation(tmp_path, monkeypatch):
    """learner.json carries the run token: its temporary file is created 0600 (under any umask),
    not made so after it was written. The mode is read wherever the file is touched after its
    creation: at a chmod (before it acts) and at the rename."""
    queue, modes = WorkQueue(str(tmp_path)), []
    chmod, replace = os.chmod, os.replace

    def seen(src) -> None:
        modes.append(os.stat(src).st_mode & 0o777)

    monkeypatch.setattr(workqueue.os, "chmod", lambda src, mode: (seen(src), chmod(src, mode)))
    monkeypatch.setattr(workqueue.os, "replace", lambda src, dst: (seen(src), replace(src, dst)))
    old = os.umask(0o022)
    try:
        workqueue.write_json(queue.path("learner.json"), {"token": "secret"}, mode=0o600)
    finally:
        os.umask(old)
    assert modes and set(modes) == {0o600} and os.stat(queue.path("learner.json")).st_mode & 0o777 == 0o600


def test_a_learner_process_other_than_the_lead_serves_the_leads_offers(tmp_path, monkeypatch):
    """Process 1 of a learner (is_lead False) reads the offers process 0 wrote and serves its own
    shards under each: a version it holds at once, a newer one once it has published it too;
    another learner's offer never; each offer once."""
    from types import SimpleNamespace

    import jax
    import jax.numpy as jnp

    from posttrain.rl.rollout import transfer

    monkeypatch.setenv(transfer.HOST_ENV, "127.0.0.1")
    monkeypatch.setattr(transfer, "is_lead", lambda: False)
    queue, mesh = WorkQueue(str(tmp_path)), jax.make_mesh((8,), ("data",))
    server, served = transfer.WeightServer(queue, mesh, {}, "learner"), []
    server.server = SimpleNamespace(await_pull=lambda uuid, arrays: served.append((uuid, float(arrays[0][0]))))
    server._ticker.start, server.keep = (lambda: None), 2  # ticks by hand here; keeps 2 as with 2 processes
    server.publish(3, ({"w": jnp.full(16, 3.0)}, {}))
    offer = lambda nonce, version, learner=server.learner: {"nonce": nonce, "version": version, "learner": learner}  # noqa: E731
    queue.write(offer("a", 3), "pulls", "s1.offer.json")
    queue.write(offer("b", 4), "pulls", "s2.offer.json")  # the lead is one version ahead
    queue.write(offer("c", 3, learner="an earlier learner"), "pulls", "s3.offer.json")
    assert server.serve_pending() == 1 and served == [(transfer.offer_uuid(server.token, "s1", "a", 3), 3.0)]
    server.publish(4, ({"w": jnp.full(16, 4.0)}, {}))
    assert server.serve_pending() == 1 and served[-1] == (transfer.offer_uuid(server.token, "s2", "b", 4), 4.0)
    assert server.serve_pending() == 0 and sorted(server._copies) == [3, 4]  # (the last two versions)
