"""The publish of `rl.placement = split` measured: the bytes the learner → sampler copy lands on the
sampler's devices and its latency (`rl.rollout.placement.sampler_weights`), on simulated CPU
devices. Overhead measurements: the simulated devices share the host's cores and memory, so this
is the cost of the copy, not a bandwidth any accelerator link has.

    PYTHONPATH=. python tools/split_publish_bench.py [--devices 8] [--sampler-devices 4] [--repeats 20]

For `configs/rlvr_tiny.py`'s model and a wider one (`--wide`: embed 512, 4 layers, MLP 2048),
sampling.layout learner and tensor: the model's bytes, the bytes landing on the sampler devices
(every shard of every sampler device), the dispatch time (what the learner's thread waits before
its next update) and the time until the copy is ready; medians over `--repeats` publishes.
"""

from __future__ import annotations

import argparse
import os
import runpy
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--sampler-devices", type=int, default=4)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args()
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={args.devices}"
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    import jax
    from flax import nnx

    from posttrain.config import run_config
    from posttrain.core.state import init_model_state
    from posttrain.models.decoder import Decoder
    from posttrain.rl.rollout.placement import place_devices, sampler_weights

    print("| model | layout | model MB | MB on sampler devices | dispatch ms | ready ms | MB/s (ready) |")
    print("|---|---|---|---|---|---|---|")
    for name, model in (("rlvr_tiny", {}), ("wide", dict(embed_dim=512, num_layers=4, mlp_dim=2048, head_dim=64))):
        cfg = runpy.run_path(str(ROOT / "configs" / "rlvr_tiny.py"))["get_config"]()
        cfg.model.update(model)
        cfg.rl.placement, cfg.rl.sampler_devices = "split", args.sampler_devices
        cfg = run_config(cfg)
        learner, rules, sampler = place_devices(cfg)
        params, rest = init_model_state(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0)), learner, rules)
        model_mb = sum(x.nbytes for x in jax.tree.leaves((params, rest))) / 2**20
        for layout in ("learner", "tensor"):
            cfg = cfg.replace({"sampling.layout": layout})
            dispatch, ready, landed = [], [], 0
            for i in range(args.repeats + 1):  # the first: shardings and transfers set up, not timed
                t0 = time.perf_counter()
                out = sampler_weights(params, rest, cfg.sampling, (learner, rules, sampler))
                t1 = time.perf_counter()
                jax.block_until_ready(out)
                t2 = time.perf_counter()
                if i:
                    dispatch.append(t1 - t0)
                    ready.append(t2 - t0)
                landed = sum(s.data.nbytes for x in jax.tree.leaves(out) for s in x.addressable_shards) / 2**20
            d, r = statistics.median(dispatch) * 1e3, statistics.median(ready) * 1e3
            print(f"| {name} | {layout} | {model_mb:.2f} | {landed:.2f} | {d:.2f} | {r:.2f} | {landed / r * 1e3:.0f} |")


if __name__ == "__main__":
    main()
