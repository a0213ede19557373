"""Conversions between Hugging Face model folders and posttrain runs (orbax checkpoints)."""

from __future__ import annotations

import dataclasses
import json
import logging

import fsspec
import jax
from flax import nnx
from jax.sharding import Mesh

from posttrain import storage
from posttrain.config import RunConfig
from posttrain.core import init, lineage
from posttrain.core.checkpoint import Checkpointer, abstract_with_shardings
from posttrain.core.state import lora_scale, shardings_for
from posttrain.models import lora
from posttrain.models.decoder import Decoder
from posttrain.models.hf.checkpoint import load_model_state, save_hf
from posttrain.models.hf.config import model_config_from_hf, read_hf_config
from posttrain.parallel.sharding import Rules, use_sharding

# What a model folder needs besides the weights: tokenizer, chat template, generation defaults.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "generation_config.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def hf_to_run(
    hf_dir: str, workdir: str, mesh: Mesh, rules: Rules, *, param_dtype: str = "float32", progress: bool = True
) -> RunConfig:
    """Write HF folder `hf_dir` as step 0 of `{workdir}/checkpoints` (restorable on any mesh, so
    `init_from=workdir` works; workdir may be gs://) and the run config, which it returns, as
    `{workdir}/config.json`."""
    model = dataclasses.replace(model_config_from_hf(hf_dir), param_dtype=param_dtype)
    cfg = RunConfig(workdir=workdir, model=model).replace({"data.tokenizer": hf_dir})
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    with use_sharding(mesh, rules):
        params, rest = load_model_state(hf_dir, make, mesh, rules, progress=progress)
    ckpt = Checkpointer(storage.join(workdir, "checkpoints"), every=0, keep=1, async_save=False)
    ckpt.save(0, {"params": params, "rest": rest}, meta={"hf_config": read_hf_config(hf_dir)})
    ckpt.close()
    if jax.process_index() == 0:
        with fsspec.open(f"{workdir.rstrip('/')}/config.json", "w") as f:
            f.write(json.dumps(cfg.to_dict(), indent=2))
    return cfg


def _merged_lora(cfg: RunConfig, make, mesh: Mesh, rules: Rules) -> nnx.State:
    """Base weights of `cfg.init_from` with the newest LoRA adapters of `cfg.workdir` merged in."""
    if not cfg.init_from:
        raise ValueError(
            f"lora.rank={cfg.lora.rank} but init_from is empty: a LoRA run's checkpoints hold only "
            "adapters; set init_from to the base model the run started from"
        )
    base, _, _ = init.load_model_state(cfg.init_from, make, mesh, rules)
    abstract = jax.eval_shape(lambda p: lora.init_adapters(p, cfg.lora.targets, cfg.lora.rank, jax.random.key(0)), base)
    ckpt = Checkpointer(init.checkpoint_dir(cfg.workdir), every=0, keep=1, async_save=False)
    step = ckpt.latest_step()
    if step is None:
        raise FileNotFoundError(f"workdir={cfg.workdir!r}: no checkpoint found")
    target = abstract_with_shardings(abstract, shardings_for(abstract, mesh, rules))
    trees, _, _ = ckpt.restore(step, {"params": target})
    ckpt.close()
    scale = lora_scale(cfg.lora)
    return jax.jit(lambda b, a: lora.merge(b, a, scale))(base, trees["params"])


def run_to_hf(
    cfg: RunConfig, out: str, mesh: Mesh, rules: Rules, *, hf_base: str = "", dtype: str = "", progress: bool = True
) -> dict:
    """Write the newest checkpoint of run `cfg` (`cfg.workdir`; under LoRA its adapters merged into
    the base weights of `cfg.init_from`) as HF folder `out`, and return the config.json written.

    config.json starts from `hf_base`'s (default: the source model's config.json recorded in the
    run's lineage, see `posttrain.core.lineage`) so token ids and other keys carry over, and
    advertises the longest context the weights were trained at; tokenizer files are copied from
    `cfg.data.tokenizer` when it is a folder. `out` may be a URL (gs://). `dtype` (e.g. "bfloat16")
    defaults to `cfg.model.param_dtype`.
    """
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    source = lineage.of_run(cfg.workdir)
    if source == lineage.empty():  # e.g. adapters saved without meta: the run's init_from
        source = lineage.of_init(cfg.init_from)
    base = read_hf_config(hf_base) if hf_base else source["hf_config"]
    context = source["trained_context"]
    if not context and not base:
        context = cfg.train.seq_len
        logging.warning("%s records no trained context; advertising train.seq_len=%d", cfg.workdir, context)
    with use_sharding(mesh, rules):
        if cfg.lora.rank > 0:
            params = _merged_lora(cfg, make, mesh, rules)
        else:
            params, _, _ = init.load_model_state(cfg.workdir, make, mesh, rules)
        hf = save_hf(out, params, cfg.model, base_config=base, context=context, dtype=dtype or None, progress=progress)
    if jax.process_index() == 0 and storage.isdir(cfg.data.tokenizer):
        for name in TOKENIZER_FILES:
            if storage.isfile(storage.join(cfg.data.tokenizer, name)):
                storage.copy_file(storage.join(cfg.data.tokenizer, name), storage.join(out, name))
    return hf


def read_run_config(workdir: str) -> RunConfig:
    """The config a run saved as `{workdir}/config.json`, whose workdir is `workdir` (the run may
    have moved); keys added since take their defaults, an unknown key is an error naming it."""
    with fsspec.open(f"{workdir.rstrip('/')}/config.json") as f:
        saved = json.load(f)
    return RunConfig.from_dict({**saved, "workdir": workdir})
