"""Bounded run-ahead (`core/step.dispatched`): the training loops never have more than
`MAX_STEPS_AHEAD` steps in flight. Unbounded, XLA:CPU with 8 devices deadlocks a collective
(jaxlib 0.10: a later program can take a device's last in-flight slot first) and aborts."""

import subprocess
import sys
import textwrap

import jax

from posttrain.config import base_config
from posttrain.core.step import MAX_STEPS_AHEAD, dispatched
from posttrain.stages import lm
from tests.support.typed_configs import typed


class Result:
    """A stand-in for a step's device result that records when something waits for it."""

    def __init__(self, i, waits):
        self.i, self.waits = i, waits

    def block_until_ready(self):
        self.waits.append(self.i)
        return self


def test_dispatched_waits_for_the_step_max_steps_ahead_back():
    waits, results = [], []
    for i in range(MAX_STEPS_AHEAD + 3):
        dispatched(results, Result(i, waits))
    assert waits == [0, 1, 2]  # after step K, step K - MAX_STEPS_AHEAD; nothing before that


# One jitted step with an all-reduce over 8 CPU devices, dispatched 3000 times: without waiting it
# deadlocked and aborted in 3 of 3 runs here (XLA's "Termination timeout ... only 7 of them
# arrived"), as did a wait every 64 steps; every 32 or fewer never did.
HAMMER = textwrap.dedent(
    """
    import os, sys
    os.environ["XLA_FLAGS"] = ("--xla_force_host_platform_device_count=8 "
                               "--xla_cpu_collective_call_terminate_timeout_seconds=20")
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from posttrain.core.step import dispatched
    mesh = Mesh(np.array(jax.devices()), ("d",))
    step = jax.jit(lambda w, x: (w - 0.1 * jax.grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w),) * 2)
    w = jax.device_put(jnp.ones((64, 64)), NamedSharding(mesh, P()))
    x = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, P("d")))
    results = []
    for _ in range(3000):
        w, m = step(w, x)
        dispatched(results, m)
    print("finished", float(w.sum()))
    """
)


def test_thousands_of_collective_steps_on_8_cpu_devices_finish_when_dispatched():
    out = subprocess.run([sys.executable, "-c", HAMMER], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and "finished" in out.stdout, out.stderr[-2000:]


def test_the_training_loop_bounds_its_steps_in_flight(tmp_path, monkeypatch):
    """Every step goes through `dispatched`: with log_every beyond the run nothing is fetched, yet
    no more than MAX_STEPS_AHEAD steps are ever unfinished when the next is dispatched."""
    unfinished = []

    def spy(results, result):
        dispatched(results, result)
        unfinished.append(sum(not all(x.is_ready() for x in jax.tree.leaves(r)) for r in results))

    monkeypatch.setattr("posttrain.core.loop.dispatched", spy)
    cfg = base_config()
    cfg.workdir = str(tmp_path)
    cfg.mesh.data = 8
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 12, 8, 16, 1000
    cfg.train.progress = False
    lm.run(typed(cfg))
    assert len(unfinished) == 12 and max(unfinished) <= MAX_STEPS_AHEAD
