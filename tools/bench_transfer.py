"""Weights from the learner to a sampler group over `jax.experimental.transfer`, as a disaggregated
run publishes them (rl/rollout/transfer.py: want → offer through the work queue → pull), between
processes on this machine: MiB/s per pull, for groups of 1 and of 2 processes a side.

    python tools/bench_transfer.py --mib 256 --rounds 5 --processes 1,2 [--devices 8]

Each configuration starts a learner group and a sampler group (`--devices` CPU devices split over a
group's processes, the weights sharded over them as the learner shards a model's), publishes
`--rounds` versions and times each on the sampler's lead: `ask+pull` (from asking to holding the
version: the queue round trip, the offer and the pull) and `pull` (the transfer alone). Prints the
median and range of MiB/s over rounds (the first, which connects, is left out).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def weights(mib: int, mesh, value: float):
    """(params, rest): four float32 matrices of `mib` MiB in all (the learner publishes them in the
    layout `transfer.weight_shardings` gives arrays without logical axes)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    rows = mib * 2**20 // 4 // 4 // 1024
    sharding = NamedSharding(mesh, PartitionSpec("data"))
    make = jax.jit(
        lambda: {f"w{i}": jnp.full((rows, 1024), value + i, jnp.float32) for i in range(4)}, out_shardings=sharding
    )
    return make(), {}


def serve(args) -> None:
    """One process of the learner group: publish versions 0..rounds-1, each once the last was pulled."""
    import jax

    from posttrain.rl.rollout.transfer import WeightServer
    from posttrain.rl.rollout.workqueue import WorkQueue

    queue, mesh = WorkQueue(args.workdir), jax.make_mesh((jax.device_count(),), ("data",))
    server = WeightServer(queue, mesh, {}, "learner", host="127.0.0.1")
    for version in range(args.rounds):
        server.publish(version, weights(args.mib, mesh, float(version)))
        while not queue.finished() and (queue.read("pulled.json") or {}).get("version", -1) < version:
            time.sleep(0.01)
    while not queue.finished():
        time.sleep(0.05)
    server.close()


def pull(args) -> None:
    """One process of the sampler group: take each version as it is published, timing it."""
    import jax

    from posttrain.rl.rollout.group import is_lead
    from posttrain.rl.rollout.transfer import WeightClient, weight_shardings
    from posttrain.rl.rollout.workqueue import WorkQueue

    queue, mesh = WorkQueue(args.workdir), jax.make_mesh((jax.device_count(),), ("data",))
    shapes = jax.eval_shape(lambda: weights(args.mib, mesh, 0.0))
    shardings = weight_shardings(shapes, mesh, {}, "learner")  # as a sampler group computes them
    specs = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings)
    client, rows = WeightClient(queue, "bench", specs, mesh, poll_s=0.005), []
    for version in range(args.rounds):
        t0, pulled = time.perf_counter(), client.pull_s
        (params, _), got = client.newest(version)
        assert got == version and float(params["w0"].addressable_data(0)[0, 0]) == version
        rows.append({"ask_pull_s": time.perf_counter() - t0, "pull_s": client.pull_s - pulled})
        if is_lead():
            queue.write({"version": version}, "pulled.json")
    if is_lead():
        queue.finish()
        print(json.dumps(rows))


def group(role: str, args, processes: int, port: int) -> list[subprocess.Popen]:
    env = {
        **os.environ,
        "PYTHONPATH": ROOT,
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": f"--xla_force_host_platform_device_count={args.devices // processes}",
        "POSTTRAIN_RL_HOST": "127.0.0.1",
    }
    procs = []
    for i in range(processes):
        argv = [sys.executable, __file__, "--role", role, "--workdir", args.workdir, "--mib", str(args.mib)]
        argv += ["--rounds", str(args.rounds), "--process", str(i), "--processes", str(processes), "--port", str(port)]
        procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True))
    return procs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args, processes: int) -> dict:
    with tempfile.TemporaryDirectory() as workdir:
        args.workdir = workdir
        learners = group("learner", args, processes, free_port())
        samplers = group("sampler", args, processes, free_port())
        out = samplers[0].communicate(timeout=1800)[0]
        for p in learners + samplers:
            if p.wait(timeout=120):
                raise SystemExit(f"a {processes}-process group exited with {p.returncode}")
    rows = json.loads(out.strip().splitlines()[-1])[1:]  # the first round connects
    rate = lambda key: sorted(args.mib / r[key] for r in rows)  # noqa: E731
    return {"processes": processes, **{k: rate(k) for k in ("ask_pull_s", "pull_s")}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--processes", default="1,2")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--role", choices=("learner", "sampler"), help=argparse.SUPPRESS)
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--process", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role:
        if int(args.processes) > 1:
            import jax

            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            jax.distributed.initialize(f"127.0.0.1:{args.port}", int(args.processes), args.process)
        (serve if args.role == "learner" else pull)(args)
        return
    print(f"{args.mib} MiB of float32 weights over {args.devices} CPU devices a group, {args.rounds - 1} timed rounds")
    print("| processes a group | ask+pull MiB/s (median, range) | pull MiB/s (median, range) |\n|---:|---|---|")
    for n in (int(x) for x in args.processes.split(",")):
        m = measure(args, n)
        cell = lambda xs: f"{xs[len(xs) // 2]:.0f} ({xs[0]:.0f}-{xs[-1]:.0f})"  # noqa: E731
        print(f"| {n} | {cell(m['ask_pull_s'])} | {cell(m['pull_s'])} |", flush=True)


if __name__ == "__main__":
    main()
