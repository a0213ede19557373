"""Convert between Hugging Face model folders and posttrain runs, or measure a load's host memory.

    # HF folder → posttrain checkpoint (step 0 of RUN/checkpoints, any mesh can restore it)
    python tools/convert_hf.py --from_hf /models/Qwen3-0.6B --run runs/qwen3-base [--dtype bfloat16]

    # a run's newest checkpoint (LoRA adapters merged into its init_from base) → HF folder
    python tools/convert_hf.py --run runs/qwen3-sft --to_hf /models/qwen3-sft [--dtype bfloat16] \
        [--hf_base /models/Qwen3-0.6B]

    # peak host memory of loading a folder onto one CPU device, in a fresh process
    python tools/convert_hf.py --measure /models/some-llama

The run's model config comes from its config.json (written by `posttrain.main` or --from_hf). The
exported config.json keeps every key of the source model's (carried in the checkpoints' lineage
through --from_hf, init_from and further runs) and advertises the longest context trained
(`max_position_embeddings`, e.g. after `train.seq_len_schedule`) with the run's RoPE scaling.
Start training from either form: `--config configs/hf.py:/models/Qwen3-0.6B` (init_from=hf:...)
or the same plus `--config.init_from=runs/qwen3-base`. `--mesh` (e.g. "fsdp=-1", the default)
only sets how the weights are spread while converting.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import subprocess
import sys
import time

from absl import app, flags

flags.DEFINE_string("from_hf", None, "Hugging Face model folder to convert into the run --run.")
flags.DEFINE_string("run", None, "posttrain run folder (workdir): written by --from_hf, read by --to_hf.")
flags.DEFINE_string("to_hf", None, "Write the run's newest weights here as a Hugging Face folder.")
flags.DEFINE_string(
    "hf_base",
    "",
    "--to_hf: folder whose config.json to start from (default: the source "
    "model's config.json, recorded in the run's checkpoints by --from_hf or init_from=hf:...).",
)
flags.DEFINE_string(
    "dtype", "", "Parameter dtype (--from_hf, default float32) or saved dtype (--to_hf, default the run's param_dtype)."
)
flags.DEFINE_string("mesh", "fsdp=-1", "Mesh axis sizes while converting, e.g. 'fsdp=-1' or 'fsdp=4,tensor=2'.")
flags.DEFINE_string("measure", None, "Measure the peak host memory of loading this HF folder.")
flags.DEFINE_string("measure_child", None, "(internal) the measured load, run in a fresh process.")
FLAGS = flags.FLAGS


def _mesh():
    from posttrain.parallel import DEFAULT_RULES, make_mesh

    sizes = {k: int(v) for k, v in (kv.split("=") for kv in FLAGS.mesh.split(",") if kv)}
    return make_mesh(sizes), DEFAULT_RULES


def _rss_bytes() -> int:
    """This process's current resident set size."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def measure_child(hf_dir: str) -> dict:
    """Load `hf_dir` onto one CPU device in the checkpoint's dtype and report host memory: RSS
    before, peak RSS (ru_maxrss) after, the model's bytes and the largest stored tensor's."""
    import jax
    from flax import nnx

    from posttrain.models.decoder import Decoder
    from posttrain.models.hf import load_model_state, model_config_from_hf, read_hf_config
    from posttrain.models.hf.files import SafetensorsFolder
    from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding

    with SafetensorsFolder(hf_dir) as folder:
        sizes = [folder.nbytes(name) for name in folder.weight_map]
        files = len(set(folder.weight_map.values()))
    hf = read_hf_config(hf_dir)
    cfg = model_config_from_hf(hf_dir).replace(param_dtype=hf.get("dtype") or hf.get("torch_dtype") or "float32")
    mesh = make_mesh({"data": 1}, jax.devices("cpu")[:1])
    make = lambda: Decoder(cfg, rngs=nnx.Rngs(0))
    before, t0 = _rss_bytes(), time.perf_counter()
    with use_sharding(mesh, DEFAULT_RULES):
        params, _ = load_model_state(hf_dir, make, mesh, DEFAULT_RULES, progress=False)
        jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    model = sum(x.nbytes for x in jax.tree.leaves(params))
    mb = lambda b: round(b / 2**20, 1)
    return {
        "folder": hf_dir,
        "files": files,
        "tensors": len(sizes),
        "checkpoint_mb": mb(sum(sizes)),
        "largest_tensor_mb": mb(max(sizes)),
        "model_mb": mb(model),
        "rss_before_mb": mb(before),
        "peak_rss_mb": mb(peak),
        "load_peak_mb": mb(peak - before),
        "load_peak_minus_model_mb": mb(peak - before - model),
        "over_model_in_largest_tensors": round((peak - before - model) / max(sizes), 2),
        "seconds": round(seconds, 1),
        "param_dtype": cfg.param_dtype,
    }


def measure(hf_dir: str) -> dict:
    """`measure_child` in a fresh Python process, so its peak RSS is the load's alone."""
    out = subprocess.run(
        [sys.executable, __file__, f"--measure_child={hf_dir}"],
        check=True,
        capture_output=True,
        text=True,
        env={**os.environ, "JAX_PLATFORMS": "cpu"},
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("absl", "jax"):  # orbax's per-item INFO lines drown ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if FLAGS.measure_child:
        print(json.dumps(measure_child(FLAGS.measure_child)))
        return
    if FLAGS.measure:
        print(json.dumps(measure(FLAGS.measure), indent=2))
        return
    from posttrain.core.hf_convert import hf_to_run, read_run_config, run_to_hf

    if not FLAGS.run or bool(FLAGS.from_hf) == bool(FLAGS.to_hf):
        raise app.UsageError("give --run with exactly one of --from_hf and --to_hf (or --measure)")
    mesh, rules = _mesh()
    if FLAGS.from_hf:
        hf_to_run(FLAGS.from_hf, FLAGS.run, mesh, rules, param_dtype=FLAGS.dtype or "float32")
        print(
            f"wrote {FLAGS.run}/checkpoints/0; train from it with --config configs/hf.py:{FLAGS.from_hf} "
            f"--config.init_from={FLAGS.run}"
        )
    else:
        run_to_hf(read_run_config(FLAGS.run), FLAGS.to_hf, mesh, rules, hf_base=FLAGS.hf_base, dtype=FLAGS.dtype)
        print(f"wrote {FLAGS.to_hf}")


if __name__ == "__main__":
    app.run(main)
