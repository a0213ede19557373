"""A sampler process group's loop (stages/rlvr_sampler.py) against a learner that restarts, stalls
or dies: its leases, its weights and its heartbeat."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.rl.envs.base import Task
from posttrain.rl.rollout import transfer
from posttrain.rl.rollout.workqueue import WorkQueue
from posttrain.stages.rlvr_sampler import inflight_weights

TASKS = [("arithmetic", Task("t1", ({"role": "user", "content": "1+1"},), "2"))]


def weights_and_specs(mesh, value: float):
    """(params, rest) of one sharded array equal to `value`, and the specs a sampler pulls them in."""
    weights = ({"w": jax.device_put(jnp.full(16, value), NamedSharding(mesh, PartitionSpec("data")))}, {})
    shardings = transfer.weight_shardings(weights, mesh, {}, "learner")
    return weights, jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), weights, shardings)


def in_thread(fn, timeout: float = 10.0):
    """fn()'s result or exception, or an AssertionError when it is still waiting after `timeout`."""
    out = {}

    def run():
        try:
            out["value"] = fn()
        except Exception as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    assert not t.is_alive(), "still waiting (a deadlock)"
    return out


def test_an_inflight_sampler_drops_its_batch_and_resyncs_when_the_learner_restarts_older(tmp_path, monkeypatch):
    """A sampler holds version 10 in flight on batch 10; the learner restarts from the checkpoint of
    step 7 (new token, the queue forgotten): the sampler's wait for a version >= 10 ends with
    LeaseLost at once (in flight and before sampling), and its next lease pulls the restarted
    learner's version 7."""
    monkeypatch.setenv(transfer.HOST_ENV, "127.0.0.1")
    queue, mesh = WorkQueue(str(tmp_path)), jax.make_mesh((8,), ("data",))
    weights, specs = weights_and_specs(mesh, 10.0)
    first = transfer.WeightServer(queue, mesh, {}, "learner")
    first.publish(10, weights)
    queue.issue(10, TASKS, min_version=10, run="first")
    lease = queue.lease("s", bound=2)
    alive = lambda: queue.lease_token(lease["batch"]) == lease["lease"]  # noqa: E731
    client = transfer.WeightClient(queue, "s", specs, mesh)
    got = client.newest(lease["min_version"], alive)
    latest = inflight_weights(client, got, alive)
    assert latest()[0] == 10
    first.close()
    queue.reset()  # the learner restarted at step 7
    second = transfer.WeightServer(queue, mesh, {}, "learner")
    second.publish(7, weights_and_specs(mesh, 7.0)[0])
    queue.issue(7, TASKS, min_version=7, run="second")
    assert isinstance(in_thread(latest).get("error"), transfer.LeaseLost)
    assert isinstance(in_thread(lambda: client.newest(10, alive)).get("error"), transfer.LeaseLost)
    again = queue.lease("s", bound=2)
    (params, _), version = client.newest(again["min_version"])
    assert again["batch"] == 7 and version == 7 and client.restarts == 1
    np.testing.assert_array_equal(params["w"], np.full(16, 7.0))
    second.close()
