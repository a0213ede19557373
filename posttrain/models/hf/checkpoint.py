"""Load a Hugging Face model folder straight into sharded posttrain parameters, and save them back.

Loading is tensor by tensor: every parameter is built with `jax.make_array_from_callback`, whose
callback reads from the memory-mapped safetensors only the slice that one device holds (so each
process reads only what its devices need); parameters stacked over scan repeats are filled one
layer at a time into a device array, so host memory stays near one layer's slice of one weight.
Saving gathers one layer's slice of one weight at a time and writes shards of bounded size.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import re
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from posttrain import storage
from posttrain.config import ModelConfig
from posttrain.models.decoder import Decoder
from posttrain.models.hf.config import (
    VISION_FAMILIES,
    architecture,
    hf_config_from_model,
    model_config_from_hf,
    read_hf_config,
)
from posttrain.models.hf.files import SafetensorsFolder, ShardWriter
from posttrain.models.hf.layout import Entry, checkpoint_order, expected_shapes, hf_tensors, param_entries, read_entry
from posttrain.parallel.sharding import Rules, abstract_model, shardings_for

# Checkpoint tensors that carry no weights of ours: old Llama checkpoints store RoPE buffers.
IGNORED = re.compile(r".*\.rotary_emb\.inv_freq$")
# Module settings that change what the weights compute, and the config keys that set them.
MATH_SETTINGS = {
    "num_heads": "model.num_heads",
    "num_kv_heads": "model.num_kv_heads",
    "head_dim": "model.head_dim",
    "rope_theta": "model.rope_theta",
    "rope_scaling": "model.rope_scaling",
    "eps": "model.norm_eps",
    "spec": "model.moe (top_k, router, norm_topk_prob, routed_scaling)",
    "token_id": "model.vision.image_token_id",
    "heads": "model.vision.vit_heads",
    "mean": "model.vision.image_mean",
    "std": "model.vision.image_std",
}
DEFAULT_SHARD_BYTES = 4 << 30


def _key(path) -> str:
    return "/".join(str(p) for p in path)


def _flat(state: nnx.State) -> dict[tuple, nnx.Variable]:
    return {tuple(getattr(p, "key", p) for p in path): v for path, v in nnx.to_flat_state(state)}


def model_settings(model: nnx.Module) -> dict[str, tuple[str, object]]:
    """'path/setting' → (config key, value) for every math setting of `model`'s modules, and
    'path' → ("parameter", shape) for every parameter: equal settings mean equal computations."""
    out = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for name in MATH_SETTINGS.keys() & vars(node).keys():
                value = getattr(node, name)
                if name == "spec":  # capacity is how we run the layer, not what it computes
                    value = dataclasses.replace(value, capacity_factor=0.0)
                out[_key((*path, name))] = (MATH_SETTINGS[name], value)
    for path, v in _flat(nnx.state(model, nnx.Param)).items():
        out[_key(path)] = ("parameter", tuple(v.shape))
    return out


def check_model_matches(model: nnx.Module, path: str) -> ModelConfig:
    """The model config of HF folder `path`, after checking that `model` (e.g. abstract) computes
    the same function; otherwise ValueError listing the differing settings and parameters."""
    hf_cfg = model_config_from_hf(path)
    ours = model_settings(model)
    theirs = model_settings(abstract_model(lambda: Decoder(hf_cfg, rngs=nnx.Rngs(0))))
    diffs = {}
    for name in sorted(ours.keys() | theirs.keys()):
        a, b = ours.get(name, (None, "none")), theirs.get(name, (None, "none"))
        if a[1] != b[1]:
            label = a[0] or b[0]
            key = label if label != "parameter" else f"parameter {name}"
            diffs.setdefault(key, f"{key}: model has {a[1]}, the checkpoint needs {b[1]}")
    if diffs:
        lines = sorted(diffs.values(), key=lambda line: (line.startswith("parameter"), line))
        raise ValueError(
            f"init_from='hf:{path}': the model config does not match {path}/config.json:\n  "
            + "\n  ".join(lines[:12])
            + (f"\n  ... and {len(lines) - 12} more" if len(lines) > 12 else "")
            + "\nBuild the model config with posttrain.models.hf.model_config_from_hf(path) "
            "(e.g. --config configs/hf.py:PATH) and keep only dtype/remat/attention/dispatch changes."
        )
    return hf_cfg


def _check_checkpoint(folder: SafetensorsFolder, entries: dict, shapes: dict, tied: bool) -> None:
    """Every tensor we need exists with the right shape, and every stored tensor is used."""
    used = set()
    for path, entry_list in entries.items():
        layer_shape = shapes[path][1:] if path[0] == "stacks" else shapes[path]
        for entry in entry_list:
            for name, want in expected_shapes(entry, layer_shape).items():
                got = folder.shape(name)
                if got != want:
                    raise ValueError(
                        f"{folder.path}: tensor {name!r} has shape {got}, expected {want} (for {_key(path)})"
                    )
                used.add(name)
    extra = sorted(
        n for n in folder.weight_map.keys() - used if not IGNORED.match(n) and not (tied and n == "lm_head.weight")
    )
    if extra:
        raise ValueError(
            f"{folder.path}: {len(extra)} tensors have no place in the model config, e.g. "
            f"{extra[:5]}; the config.json and weights disagree, or the layout is not supported"
        )


@functools.cache
def _layer_setter(sharding: NamedSharding) -> Callable:
    """jit: stack[i] = layer, in place (the stack is donated), result in `sharding`."""
    return jax.jit(
        lambda stack, layer, i: jax.lax.dynamic_update_index_in_dim(stack, layer, i, 0),
        out_shardings=sharding,
        donate_argnums=0,
    )


def _layer_sharding(sharding: NamedSharding, ndim: int) -> NamedSharding:
    """The sharding of one layer of a stacked array (the leading dim dropped)."""
    spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
    return NamedSharding(sharding.mesh, P(*spec[1:]))


def _load_array(
    folder: SafetensorsFolder,
    entries: tuple[Entry, ...],
    stacked: bool,
    shape: tuple[int, ...],
    dtype,
    sharding: NamedSharding,
    bar: tqdm,
) -> jax.Array:
    """One parameter on the mesh: each device's callback reads its own slice from disk."""

    def piece(entry, shape, sharding):
        array = jax.make_array_from_callback(
            shape, sharding, lambda index: read_entry(folder.read, entry, shape, index, dtype)
        )
        folder.release()
        bar.update()
        return array

    if not stacked:
        return piece(entries[0], shape, sharding)
    out = jnp.zeros(shape, dtype, device=sharding)
    for r, entry in enumerate(entries):
        out = _layer_setter(sharding)(out, piece(entry, shape[1:], _layer_sharding(sharding, len(shape))), r)
        out.block_until_ready()  # one layer in flight at a time bounds host memory
    return out


def load_params(
    path: str, abstract_params: nnx.State, cfg: ModelConfig, mesh: Mesh, rules: Rules, *, progress: bool = True
) -> nnx.State:
    """The weights of HF folder `path` as `abstract_params` (shapes and dtypes of a model built
    from `cfg`), sharded on `mesh` by `rules`, read tensor by tensor."""
    hf = read_hf_config(path)
    if hf.get("model_type") in VISION_FAMILIES:
        return VISION_FAMILIES[hf["model_type"]].load_params(path, abstract_params, cfg, mesh, rules)
    arch = architecture(hf, os.path.join(path, "config.json"))
    flat = _flat(abstract_params)
    shardings = {p: v.get_value() for p, v in _flat(shardings_for(abstract_params, mesh, rules)).items()}
    with SafetensorsFolder(path) as folder:
        entries = param_entries(
            cfg, arch, lambda layer: f"model.layers.{layer}.mlp.experts.gate_up_proj" in folder.weight_map
        )
        if entries.keys() != flat.keys():
            raise ValueError(
                f"{path}: model parameters {sorted(map(_key, flat.keys() ^ entries.keys()))} "
                "do not match the checkpoint layout of the model config"
            )
        _check_checkpoint(folder, entries, {p: v.shape for p, v in flat.items()}, cfg.tie_embeddings)
        bar = tqdm(
            total=sum(map(len, entries.values())),
            desc=f"load {os.path.basename(path.rstrip('/'))}",
            unit="array",
            disable=not progress or jax.process_index() != 0,
        )
        out = [
            (
                p,
                v.replace(
                    _load_array(folder, entries[p], p[0] == "stacks", tuple(v.shape), v.dtype, shardings[p], bar)
                ),
            )
            for p, v in flat.items()
        ]
        bar.close()
    return nnx.from_flat_state(out)


def load_model_state(
    path: str, make_model: Callable[[], nnx.Module], mesh: Mesh, rules: Rules, *, progress: bool = True
) -> tuple[nnx.State, nnx.State]:
    """(params, rest) of HF folder `path` for the model `make_model` builds (its config must match
    path's config.json up to dtypes and runtime settings), placed on `mesh` by `rules`."""
    model = abstract_model(make_model)
    hf_cfg = check_model_matches(model, path)
    _, params, rest = nnx.split(model, nnx.Param, ...)
    rest_shardings = shardings_for(rest, mesh, rules)
    rest = jax.tree.map(lambda x, s: jnp.zeros(x.shape, x.dtype, device=s), rest, rest_shardings)
    return load_params(path, params, hf_cfg, mesh, rules, progress=progress), rest


def _to_host(x: jax.Array) -> np.ndarray:
    """A (possibly multi-process) global array as one numpy array on every process."""
    if x.is_fully_addressable:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def save_hf(
    path: str,
    params: nnx.State,
    cfg: ModelConfig,
    *,
    base_config: dict | None = None,
    context: int = 0,
    dtype: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    progress: bool = True,
) -> dict:
    """Write `params` (full weights: merge LoRA adapters first) of a model built from `cfg` as a
    Hugging Face folder: config.json (`base_config`, e.g. the source model's, updated with every
    math key; `max_position_embeddings` from `context`, the longest trained context, see
    `hf_config_from_model`) and safetensors shards of at most `max_shard_bytes` with their index,
    per-expert layout. `dtype` (e.g. "bfloat16") defaults to the parameters' own. Returns the config written.

    Every process must call it (gathers are collective); process 0 writes.
    """
    if cfg.vision.encoder == "vit":  # the ViT tower: saved as LLaVA
        kw = dict(base_config=base_config, context=context, dtype=dtype, max_shard_bytes=max_shard_bytes)
        return VISION_FAMILIES["llava"].save(path, params, cfg, **kw)
    hf = hf_config_from_model(cfg, base_config, context=context)
    flat = _flat(params)
    entries = param_entries(cfg, hf["architectures"][0])
    if entries.keys() != flat.keys():
        raise ValueError(
            f"save_hf: parameters {sorted(map(_key, flat.keys() ^ entries.keys()))} do not match "
            "the checkpoint layout of the model config"
        )
    units = sorted(
        ((p, r, e) for p, es in entries.items() for r, e in enumerate(es)), key=lambda u: checkpoint_order(u[2])
    )
    out_dtype = np.dtype(jnp.dtype(dtype)) if dtype else np.dtype(next(iter(flat.values())).dtype)
    writer = jax.process_index() == 0
    if writer:
        storage.makedirs(path)
    shards = ShardWriter(path, max_shard_bytes)
    for p, r, entry in tqdm(
        units, desc=f"save {os.path.basename(path.rstrip('/'))}", unit="array", disable=not progress or not writer
    ):
        value = flat[p][...]
        host = _to_host(value[r] if p[0] == "stacks" else value)
        if writer:
            for name, tensor in hf_tensors(entry, host):
                shards.add(name, tensor.astype(out_dtype))
    if writer:
        shards.finish()
        hf["dtype"] = str(out_dtype)
        if "torch_dtype" in hf:
            hf["torch_dtype"] = str(out_dtype)
        storage.write_text(storage.join(path, "config.json"), json.dumps(hf, indent=2, sort_keys=True))
        logging.info("saved %s: %d files, %.1f MB", path, len(shards.files), shards.total_bytes / 2**20)
    return hf
