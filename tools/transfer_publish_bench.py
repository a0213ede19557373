"""The publish of `rl.placement = disaggregated` measured: weights through `jax.experimental.transfer`
(`rl.rollout.transfer`) on simulated CPU devices, learner and sampler servers in one process on
127.0.0.1. Overhead measurements: both ends share the host's cores and memory, so this is the cost
of the protocol and the copies, not a bandwidth any DCN link has.

    PYTHONPATH=. python tools/transfer_publish_bench.py [--devices 8] [--repeats 10]

For `configs/rlvr_tiny.py`'s model and a wider one (embed 512, 4 layers, MLP 2048), in the learner's
layout over `--devices` devices: the model's bytes and the bytes pulled (every shard of every
device); `publish ms`, the learner's `WeightServer.publish` until its fresh copy is ready;
`pull ms`, a sampler's `WeightClient` from asking (want file) to the weights ready on its devices
(the file handshake and the serving thread's poll included); `raw MB/s`, one `await_pull` + `pull`
with no files; medians over `--repeats`.
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--repeats", type=int, default=10)
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    os.environ.setdefault("POSTTRAIN_RL_HOST", "127.0.0.1")
    sys.path.insert(0, str(ROOT))
    import jax
    from flax import nnx

    from posttrain.config import run_config
    from posttrain.core.state import init_model_state
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import mesh_and_rules
    from posttrain.rl.rollout.transfer import WeightClient, WeightServer, start_server
    from posttrain.rl.rollout.workqueue import WorkQueue
    from posttrain.stages.rlvr_sampler import pull_specs

    print("| model | model MB | MB pulled | publish ms | pull ms | MB/s (pull) | raw MB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, model in (("rlvr_tiny", {}), ("wide", dict(embed_dim=512, num_layers=4, mlp_dim=2048, head_dim=64))):
        cfg = runpy.run_path(str(ROOT / "configs" / "rlvr_tiny.py"))["get_config"]()
        cfg.model.update(model)
        cfg = run_config(cfg)
        mesh, rules = mesh_and_rules(cfg)
        make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))  # noqa: E731
        weights = init_model_state(make, mesh, rules)
        _, specs = pull_specs(make, mesh, rules, "learner")
        queue = WorkQueue(tempfile.mkdtemp(prefix="transfer-bench-"))
        server, client = WeightServer(queue, mesh, rules, "learner"), None
        publish, pull, raw = [], [], []
        for i in range(args.repeats + 1):  # the first: programs compiled, connections made, not timed
            t0 = time.perf_counter()
            server.publish(i, weights)
            jax.block_until_ready(server._current[1])
            t1 = time.perf_counter()
            client = client or WeightClient(queue, "bench", specs, mesh, poll_s=0.001)
            t2 = time.perf_counter()
            client.newest(min_version=i)
            t3 = time.perf_counter()
            if i:
                publish.append(t1 - t0)
                pull.append(t3 - t2)
        pulled = sum(s.data.nbytes for x in jax.tree.leaves(client.weights) for s in x.addressable_shards) / 2**20
        model_mb = sum(x.nbytes for x in jax.tree.leaves(weights)) / 2**20
        other = start_server("127.0.0.1")
        conn = other.connect(server.server.address())
        leaves, flat_specs = jax.tree.leaves(weights), jax.tree.leaves(specs)
        for i in range(args.repeats + 1):
            t0 = time.perf_counter()
            server.server.await_pull(10_000 + i, leaves)
            jax.block_until_ready(conn.pull(10_000 + i, flat_specs))
            if i:
                raw.append(time.perf_counter() - t0)
        server.close()
        pm, lm, rm = (statistics.median(x) * 1e3 for x in (publish, pull, raw))
        print(
            f"| {name} | {model_mb:.2f} | {pulled:.2f} | {pm:.2f} | {lm:.2f} | {pulled / lm * 1e3:.0f} | "
            f"{pulled / rm * 1e3:.0f} |"
        )


if __name__ == "__main__":
    main()
