"""One process of a multi-process test run (tests/e2e/test_multihost.py starts several of these).

    python tests/support/multihost_worker.py OUT CONFIG DEVICES PROCESS_ID NUM_PROCESSES PORT OVERRIDES_JSON

Runs `posttrain.main.run` on `DEVICES` simulated CPU devices, as process PROCESS_ID of
NUM_PROCESSES (coordinator 127.0.0.1:PORT, via `config.distributed`), and writes
`OUT/process{i}.json`: the logged rows, and the JSONL lines this process read (counted at the
source, so the test can check that each process read only its own shard). Process 0 also writes
`OUT/params.npz`, the final parameters gathered from every process. `POSTTRAIN_TEST_HOOK=module:function`
names a function called before the run (e.g. one that scripts the sampler's turns).
"""

import json
import logging
import os
import runpy
import sys

out, config_path, devices, process_id, num_processes, port, overrides = sys.argv[1:8]
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
os.environ["JAX_PLATFORMS"] = "cpu"
os.environ.setdefault("POSTTRAIN_COMPILATION_CACHE", "off")

import jax  # noqa: E402
import numpy as np  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from posttrain import main  # noqa: E402
from posttrain.data import sources  # noqa: E402

read_lines: list[str] = []
_getitem = sources.JsonlSource.__getitem__


def counting_getitem(self, index):
    raw = _getitem(self, index)
    read_lines.append(f"{os.path.basename(raw.path)}:{raw.line}")
    return raw


sources.JsonlSource.__getitem__ = counting_getitem

logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
logging.getLogger("absl").setLevel(logging.WARNING)
cfg = runpy.run_path(config_path)["get_config"]()
for key, value in json.loads(overrides).items():
    node = cfg
    *parents, leaf = key.split(".")
    for p in parents:
        node = node[p]
    node[leaf] = value
if int(num_processes) > 1:
    cfg.distributed.coordinator = f"127.0.0.1:{port}"
    cfg.distributed.num_processes = int(num_processes)
    cfg.distributed.process_id = int(process_id)

if os.environ.get("POSTTRAIN_TEST_HOOK"):
    import importlib

    module, function = os.environ["POSTTRAIN_TEST_HOOK"].split(":")
    getattr(importlib.import_module(module), function)()
result = main.run(cfg)
rows = getattr(result, "rows", result if isinstance(result, list) else [])
record = {
    "rows": [{k: v for k, v in r.items() if isinstance(v, (int, float))} for r in rows],
    "read_lines": sorted(set(read_lines)),
    "reads": len(read_lines),
    "process_index": jax.process_index(),
    "process_count": jax.process_count(),
}
state = getattr(result, "state", None)
if state is not None:
    from jax.experimental import multihost_utils

    params = (
        multihost_utils.process_allgather(state.params, tiled=True)
        if jax.process_count() > 1
        else jax.device_get(state.params)
    )
    if jax.process_index() == 0:
        flat = {jax.tree_util.keystr(p): np.asarray(x) for p, x in jax.tree_util.tree_leaves_with_path(params)}
        np.savez(os.path.join(out, "params.npz"), **flat)
with open(os.path.join(out, f"process{process_id}.json"), "w") as f:
    json.dump(record, f)
