"""Sample completions for the prompts of a JSONL file with a trained (or freshly initialised) model.

    python tools/generate.py --config configs/X.py --prompts prompts.jsonl --out samples.jsonl \
        [--tokenizer byte] [--temperature 1.0 --top_k 0 --top_p 1.0 --max_new_tokens 128 --num_samples 1]

Weights come from the newest checkpoint in `{config.workdir}/checkpoints` (or `--step`), else from
the config's initialisation. Each input record is `{"prompt": str | messages, ...}`; each output
line is one sample: the prompt's file:line, sample index, completion text and ids, policy
log-probs, length and stop reason.
"""

from __future__ import annotations

import json
import logging
import os

import jax
from absl import app, flags
from flax import nnx
from ml_collections import config_flags
from tqdm import tqdm

from posttrain import storage
from posttrain.config import run_config
from posttrain.core import lineage
from posttrain.core.checkpoint import Checkpointer, abstract_with_shardings
from posttrain.core.state import abstract_model, init_model_state, shardings_for
from posttrain.data.examples import rl_prompt_example
from posttrain.data.pipeline import read_jsonl
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules, use_sharding
from posttrain.sampling import SamplingParams, generate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().")
flags.DEFINE_string("prompts", None, 'JSONL file of {"prompt": ...} records.', required=True)
flags.DEFINE_string("out", None, "Where to write the samples (JSONL; local or gs://).", required=True)
flags.DEFINE_string("tokenizer", "byte", "'byte' or a folder with tokenizer.json.")
flags.DEFINE_integer("step", -1, "Checkpoint step to load (-1: the newest).")
flags.DEFINE_float("temperature", 1.0, "0 = greedy.")
flags.DEFINE_integer("top_k", 0, "0 = off.")
flags.DEFINE_float("top_p", 1.0, "1 = off.")
flags.DEFINE_integer("max_new_tokens", 128, "New tokens per sample at most.")
flags.DEFINE_integer("num_samples", 1, "Samples per prompt.")
flags.DEFINE_integer("batch_size", 16, "Prompts per generate call.")
FLAGS = flags.FLAGS


def load_model(cfg, mesh, rules):
    """(graphdef, params, rest) from the workdir's checkpoint, or initialised from the config."""
    if cfg.lora.rank > 0:
        raise SystemExit(
            f"config.lora.rank={cfg.lora.rank}: LoRA checkpoints hold only adapters; "
            "sample from a merged (full-weight) run"
        )
    make_model = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    graphdef = nnx.graphdef(abstract_model(make_model))
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"), every=0, keep=1, async_save=False)
    step = ckpt.latest_step() if FLAGS.step < 0 else FLAGS.step
    if step is None:
        logging.warning("no checkpoint in %s: sampling from the config's initialisation", cfg.workdir)
        params, rest = init_model_state(make_model, mesh, rules)
    else:
        shapes = jax.eval_shape(lambda: init_model_state(make_model, mesh, rules))
        params, rest = abstract_with_shardings(shapes, shardings_for(shapes, mesh, rules))
        trees, _, _ = ckpt.restore(step, {"params": params, "rest": rest})
        params, rest = trees["params"], trees["rest"]
    ckpt.close()
    return graphdef, params, rest


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = run_config(_CONFIG.value)
    tok = load_tokenizer(FLAGS.tokenizer)
    sampling = SamplingParams(
        temperature=FLAGS.temperature,
        top_k=FLAGS.top_k,
        top_p=FLAGS.top_p,
        max_new_tokens=FLAGS.max_new_tokens,
        stop_ids=tok.stop_ids,
        num_samples=FLAGS.num_samples,
        # sampling.max_context: the run's trained and configured context unless the key is set
        max_context=lineage.max_context(cfg, lineage.of_run(cfg.workdir)),
    )
    records = [(f"{r.path}:{r.line}", rl_prompt_example(r.data, tok)) for r in read_jsonl(FLAGS.prompts)]
    mesh, rules = mesh_and_rules(cfg)
    key = jax.random.key(cfg.seed)
    with use_sharding(mesh, rules):
        graphdef, params, rest = load_model(cfg, mesh, rules)
    with (
        use_sharding(mesh, rules),
        storage.open_file(FLAGS.out, "w") as out,
        tqdm(total=len(records), desc="generate") as bar,
    ):
        for start in range(0, len(records), FLAGS.batch_size):
            batch = records[start : start + FLAGS.batch_size]
            samples = generate(
                graphdef,
                params,
                rest,
                [ex["prompt"] for _, ex in batch],
                sampling,
                jax.random.fold_in(key, start),
                pad_id=tok.pad_id,
            )
            for i, p in enumerate(samples.prompt_index):
                ids = samples.completion(i)
                out.write(
                    json.dumps(
                        {
                            "where": batch[p][0],
                            "prompt": batch[p][1]["record"]["prompt"],
                            "sample": i % sampling.num_samples,
                            "completion": tok.decode(ids),
                            "tokens": ids,
                            "logprobs": samples.logprobs[i, : len(ids)].tolist(),
                            "length": len(ids),
                            "stop_reason": samples.stop_reason_name(i),
                        }
                    )
                    + "\n"
                )
            bar.update(len(batch))


if __name__ == "__main__":
    app.run(main)
