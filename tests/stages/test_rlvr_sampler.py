"""A sampler process group's loop (stages/rlvr_sampler.py) against a learner that restarts, stalls
or dies: its leases, its weights and its heartbeat."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.config import RLConfig
from posttrain.errors import UserError
from posttrain.rl.envs.base import Task
from posttrain.rl.rollout import transfer
from posttrain.rl.rollout.workqueue import WorkQueue
from posttrain.stages.rlvr_sampler import inflight_weights
from tests.support.typed_configs import run_cfg

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


class FakeTransfer:
    """`transfer.start_server` for every process of a test: servers by address; a pull from a
    server that `dies` raises what a killed learner's does."""

    CLOSED = "INTERNAL: SocketServer: Connection closed"

    def __init__(self):
        self.servers, self.pulls = {}, []

    def start_server(self, host):
        server = FakeServer(self, f"{host}:{len(self.servers) + 1}")
        self.servers[server.addr] = server
        return server


class FakeServer:
    def __init__(self, net: FakeTransfer, addr: str):
        self.net, self.addr, self.offers, self.dies = net, addr, {}, None

    def address(self):
        return self.addr

    def await_pull(self, uuid, arrays):
        self.offers[uuid] = arrays

    def connect(self, addr):
        return FakeConn(self.net.servers[addr])


class FakeConn:
    def __init__(self, server: FakeServer):
        self.server = server

    def pull(self, uuid, specs):
        self.server.net.pulls.append(self.server.addr)
        if self.server.dies is not None:
            self.server.dies()
            raise jax.errors.JaxRuntimeError(FakeTransfer.CLOSED)
        return self.server.offers.pop(uuid)


def test_a_sampler_outlives_a_learner_killed_mid_pull_and_pulls_from_its_restart(tmp_path, monkeypatch):
    """The learner is SIGKILLed while the sampler pulls version 6 (the pull raises `Connection
    closed`); a restarted learner publishes version 4: the sampler tries again, re-reads
    learner.json, connects to the new learner and pulls its weights instead of exiting."""
    net = FakeTransfer()
    monkeypatch.setattr(transfer, "start_server", net.start_server)
    queue, mesh = WorkQueue(str(tmp_path)), jax.make_mesh((8,), ("data",))
    weights, specs = weights_and_specs(mesh, 5.0)
    first = transfer.WeightServer(queue, mesh, {}, "learner", host="learner")
    first.publish(5, weights)
    client = transfer.WeightClient(queue, "s", specs, mesh, poll_s=0.01)
    assert client.newest(5)[1] == 5
    first.publish(6, weights)
    restarted = []

    def killed():  # the learner dies mid-pull and is started again (from its step-4 checkpoint)
        first.server.dies, restarted[:] = None, [transfer.WeightServer(queue, mesh, {}, "learner", host="learner")]
        first.close()
        restarted[0].publish(4, weights_and_specs(mesh, 4.0)[0])

    first.server.dies = killed
    (params, _), version = in_thread(lambda: client.newest(0))["value"]
    assert version == 4 and client.restarts == 1 and net.pulls == ["learner:1", "learner:1", "learner:3"]
    np.testing.assert_array_equal(params["w"], np.full(16, 4.0))
    restarted[0].close()


def test_a_sampler_gives_up_after_rl_reconnect_timeout_s_of_failed_pulls(tmp_path, monkeypatch):
    """A learner whose pulls keep failing: the sampler tries again with backoff, and after
    reconnect_s seconds of failures (`rl.reconnect_timeout_s`, a fake clock here) raises
    LearnerUnreachable naming the key and the last error; a longer timeout keeps it trying."""
    net, now = FakeTransfer(), [0.0]
    monkeypatch.setattr(transfer, "start_server", net.start_server)
    queue, mesh = WorkQueue(str(tmp_path)), jax.make_mesh((8,), ("data",))
    weights, specs = weights_and_specs(mesh, 5.0)
    learner = transfer.WeightServer(queue, mesh, {}, "learner", host="learner")
    learner.publish(5, weights)
    learner.server.dies = lambda: None  # every pull fails
    fake = {"clock": lambda: now[0], "sleep": lambda s: now.__setitem__(0, now[0] + s)}
    # waits 0.01, 0.02, … doubling, up to 5 s: 1.27 s after 8 tries, 30.11 s after 15
    for reconnect_s, tries in ((1.0, 8), (30.0, 15)):
        client = transfer.WeightClient(queue, "s", specs, mesh, poll_s=0.01, reconnect_s=reconnect_s, **fake)
        net.pulls.clear()
        with pytest.raises(transfer.LearnerUnreachable, match=rf"rl.reconnect_timeout_s={reconnect_s:g}\).*closed"):
            client.newest(5)
        assert len(net.pulls) == tries
    learner.close()


@pytest.mark.parametrize("key", ["rl.reconnect_timeout_s", "rl.progress_deadline_s"])
def test_the_samplers_time_limits_are_checked_and_read_under_disaggregated_only(key):
    """A limit is positive; a value other than the default is refused where no sampler reads it."""
    with pytest.raises(UserError) as e:
        run_cfg({key: 0.0})
    assert e.value.key == key
    run_cfg({key: 5.0, "rl.placement": "disaggregated", "rl.role": "sampler"}, stage="rlvr").check_stages()
    with pytest.raises(UserError, match=rf"config\.{key}=5\.0 cannot take effect: only rl.placement='disaggregated'"):
        run_cfg({key: 5.0}, stage="rlvr").check_stages()


@pytest.mark.slow
def test_a_sampler_outlives_a_sigkilled_learner_and_finishes_with_its_restart(tmp_path):
    """rl.max_staleness = 1 with in-flight updates: the learner is SIGKILLed after step 2 (no
    checkpoint: its restart begins again at step 0, so the versions go backwards). The sampler
    neither exits with the learner's dead connection nor waits for a version the restart will not
    reach: it re-syncs to the restarted learner, which completes the run, and exits 0."""
    from tests.support.rl_processes import spawn, wait

    no_eval = {"rl.eval_every": 0, **{f"rl.{k}": getattr(RLConfig(), k) for k in ("eval_size", "eval_samples")}}
    run, flags = tmp_path / "run", {"rl.max_staleness": 1, "rl.inflight_update_every": 2, **no_eval}
    sampler = spawn(run, "sampler", tmp_path / "sampler.log", **flags)
    first = spawn(run, "learner", tmp_path / "first.log", **flags)
    deadline = time.time() + 240
    while not (run / "metrics.jsonl").exists() or '"step": 2' not in (run / "metrics.jsonl").read_text():
        assert time.time() < deadline and first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        time.sleep(0.1)
    first.kill()
    first.wait()
    time.sleep(1.0)  # the sampler meets the dead learner (a pull, an in-flight check or a lease)
    assert sampler.poll() is None, (tmp_path / "sampler.log").read_text()[-3000:]
    second = spawn(run, "learner", tmp_path / "second.log", **flags)
    wait(second, tmp_path / "second.log")
    wait(sampler, tmp_path / "sampler.log", timeout=60)
    assert "the learner restarted" in (tmp_path / "sampler.log").read_text()
