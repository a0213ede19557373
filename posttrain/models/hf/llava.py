"""LLaVA (`LlavaForConditionalGeneration`) ↔ posttrain: a SigLIP tower + projector (`models.vit`,
`model.vision.encoder = vit`) and a text family posttrain imports (Llama, Qwen2, ...).

Supported exactly, else an error naming the key: a `siglip_vision_model` tower (no CLS token, no
pre-LayerNorm; gelu_pytorch_tanh, layer_norm_eps 1e-6), `vision_feature_layer = -1` (the last
layer's output, before the tower's unused post_layernorm and pooling head) with
`vision_feature_select_strategy = full` (every patch is an image token: `image_seq_length` =
num_patches), a biased GELU projector. The processor's normalisation (`preprocessor_config.json`:
rescale 1/255, then (x - image_mean) / image_std) becomes `model.vision.image_mean / image_std`,
applied by the tower to posttrain's [0, 1] patches; resizing is posttrain's (`data.images`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import sys

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from posttrain import storage
from posttrain.config import ModelConfig, VisionConfig
from posttrain.models import vit
from posttrain.models.hf.checkpoint import _flat, _load_array, _to_host
from posttrain.models.hf.config import VISION_FAMILIES, hf_config_from_model, infer_architecture, model_config_from_dict
from posttrain.models.hf.files import SafetensorsFolder, ShardWriter
from posttrain.models.hf.layout import expected_shapes, hf_tensors, param_entries
from posttrain.parallel.sharding import shardings_for

ARCH = "LlavaForConditionalGeneration"
PROCESSOR = "preprocessor_config.json"
# where the parts live: transformers >= 5 module names, or the original checkpoints' names
LAYOUTS = (
    ("model.language_model.", "lm_head.weight", "model.vision_tower.", "model.multi_modal_projector."),
    ("language_model.model.", "language_model.lm_head.weight", "vision_tower.", "multi_modal_projector."),
)
UNUSED = ("post_layernorm.", "head.")  # tower parts LLaVA's selected layer never reaches


def is_llava(hf: dict) -> bool:
    """Whether config.json `hf` is a LLaVA model."""
    return hf.get("architectures") == [ARCH] or hf.get("model_type") == "llava"


def read_processor(path: str) -> dict | None:
    """The parsed preprocessor_config.json of HF folder `path`, or None."""
    file = storage.join(path, PROCESSOR)
    return json.loads(storage.read_text(file)) if storage.isfile(file) else None


def model_config_from_llava(hf: dict, processor: dict | None, where: str = "config.json") -> ModelConfig:
    """The posttrain model config of LLaVA config.json `hf` with its processor config."""

    def bad(key, value, why):
        raise ValueError(f"{where}: {key}={value!r} is not supported for {ARCH} ({why})")

    text, tower = dict(hf.get("text_config") or {}), dict(hf.get("vision_config") or {})
    if tower.get("model_type") != "siglip_vision_model":
        bad("vision_config.model_type", tower.get("model_type"), "only a SigLIP tower (no CLS token) is mapped")
    checks = [
        ("vision_feature_layer", hf.get("vision_feature_layer", -2), -1, "only the last layer's output is mapped"),
        ("vision_feature_select_strategy", hf.get("vision_feature_select_strategy", "default"), "full", "every patch"),
        ("projector_hidden_act", hf.get("projector_hidden_act", "gelu"), "gelu", "the projector is GELU (erf)"),
        ("multimodal_projector_bias", hf.get("multimodal_projector_bias", True), True, "the projector has biases"),
        ("vision_config.hidden_act", tower.get("hidden_act", "gelu_pytorch_tanh"), "gelu_pytorch_tanh", "GELU-tanh"),
        ("vision_config.layer_norm_eps", tower.get("layer_norm_eps", 1e-6), vit.NORM_EPS, "the tower's eps"),
        ("vision_config.num_channels", tower.get("num_channels", 3), 3, "RGB"),
        ("vision_config.attention_dropout", tower.get("attention_dropout", 0.0), 0.0, "posttrain has no dropout"),
    ]
    for key, value, want, why in checks:
        if value != want:
            bad(key, value, f"expected {want!r}: {why}")
    text_tie = bool(text.get("tie_word_embeddings", False))
    if "tie_word_embeddings" in hf and bool(hf["tie_word_embeddings"]) != text_tie:
        bad("tie_word_embeddings", hf["tie_word_embeddings"], "it disagrees with text_config.tie_word_embeddings")
    cfg = model_config_from_dict(text, f"{where} (text_config)")
    image_size, patch_size = int(tower["image_size"]), int(tower["patch_size"])
    patches = (image_size // patch_size) ** 2
    if hf.get("image_seq_length", patches) != patches:
        bad("image_seq_length", hf.get("image_seq_length"), f"expected {patches} (one token per patch)")
    mean, std = _normalisation(processor, where)
    vision = VisionConfig(
        encoder="vit",
        image_size=image_size,
        patch_size=patch_size,
        image_token_id=int(hf.get("image_token_id", hf.get("image_token_index"))),
        vit_layers=int(tower["num_hidden_layers"]),
        vit_width=int(tower["hidden_size"]),
        vit_heads=int(tower["num_attention_heads"]),
        vit_mlp_dim=int(tower["intermediate_size"]),
        vit_final_norm=False,
        image_mean=mean,
        image_std=std,
    )
    return cfg.replace(vision=vision)


def _normalisation(processor: dict | None, where: str) -> tuple[tuple, tuple]:
    """(image_mean, image_std) of the [0, 1] pixels from a HF image processor config."""
    name = os.path.join(os.path.dirname(where), PROCESSOR)
    if processor is None:
        raise ValueError(f"{name}: missing; the tower's pixel normalisation (image_mean / image_std) is unknown")
    if processor.get("do_rescale", True) and not math.isclose(processor.get("rescale_factor", 1 / 255), 1 / 255):
        raise ValueError(f"{name}: rescale_factor={processor['rescale_factor']} (posttrain scales pixels by 1/255)")
    if not processor.get("do_normalize", True):
        return (0.0,) * 3, (1.0,) * 3
    mean, std = processor.get("image_mean", 0.5), processor.get("image_std", 0.5)
    triple = lambda x: tuple(float(a) for a in (x if isinstance(x, list | tuple) else [x] * 3))
    return triple(mean), triple(std)


def text_config(cfg: ModelConfig) -> ModelConfig:
    """`cfg` without the vision part: the text decoder's model config."""
    return dataclasses.replace(cfg, vision=VisionConfig())


def _tower_tensors(cfg) -> dict[tuple, tuple[str, object]]:
    """Our vision parameter path → (tensor name under the tower / projector prefix, to_ours) where
    to_ours maps the HF tensor to our array (and `_from_ours` inverts it)."""
    v = cfg.vision
    out = {
        ("vision", "patch"): ("T:embeddings.patch_embedding.weight", "conv"),
        ("vision", "patch_bias"): ("T:embeddings.patch_embedding.bias", "id"),
        ("vision", "pos"): ("T:embeddings.position_embedding.weight", "id"),
        ("vision", "proj1"): ("P:linear_1.weight", "t"),
        ("vision", "proj1_bias"): ("P:linear_1.bias", "id"),
        ("vision", "proj2"): ("P:linear_2.weight", "t"),
        ("vision", "proj2_bias"): ("P:linear_2.bias", "id"),
    }
    hf_names = dict(wq="self_attn.q_proj", wk="self_attn.k_proj", wv="self_attn.v_proj", wo="self_attn.out_proj")
    hf_names.update(fc1="mlp.fc1", fc2="mlp.fc2")
    for i in range(v.vit_layers):
        p = f"T:encoder.layers.{i}."
        for ours, theirs in hf_names.items():
            out[("vision", "layers", i, ours)] = (p + theirs + ".weight", "t")
            out[("vision", "layers", i, ours + "_bias")] = (p + theirs + ".bias", "id")
        for n in "12":
            out[("vision", "layers", i, f"ln{n}_scale")] = (p + f"layer_norm{n}.weight", "id")
            out[("vision", "layers", i, f"ln{n}_bias")] = (p + f"layer_norm{n}.bias", "id")
    return out


def _to_ours(x: np.ndarray, how: str) -> np.ndarray:
    if how == "conv":  # [W, 3, p, p] → [p·p·3, W]: our patches are row-major pixels, RGB last
        return x.transpose(2, 3, 1, 0).reshape(-1, x.shape[0])
    return x.T if how == "t" else x


def _from_ours(x: np.ndarray, how: str, patch: int) -> np.ndarray:
    if how == "conv":
        return np.ascontiguousarray(x.reshape(patch, patch, 3, -1).transpose(3, 2, 0, 1))
    return np.ascontiguousarray(x.T if how == "t" else x)


def _layout(names) -> tuple[str, ...]:
    for layout in LAYOUTS:
        if layout[0] + "embed_tokens.weight" in names:
            tower = (
                layout[2] + "vision_model."
                if layout[2] + "vision_model.embeddings.patch_embedding.weight" in names
                else layout[2]
            )
            return (layout[0], layout[1], tower, layout[3])
    raise ValueError(f"no LLaVA language model tensors found (expected one of {[lay[0] for lay in LAYOUTS]}...)")


def _name(layout, tag_name: str) -> str:
    tag, name = tag_name.split(":", 1)
    return (layout[2] if tag == "T" else layout[3]) + name


def _text_entries(cfg, layout) -> dict:
    """Our text parameter path → its Entries, named as in a LLaVA checkpoint."""
    text = text_config(cfg)

    def rename(n):
        return layout[1] if n == "lm_head.weight" else layout[0] + n.removeprefix("model.")

    return {
        p: tuple(dataclasses.replace(e, names=tuple(map(rename, e.names))) for e in es)
        for p, es in param_entries(text, infer_architecture(text)).items()
    }


def model_config(hf: dict, path: str, where: str) -> ModelConfig:
    """`config.model_config_from_hf` for LLaVA folder `path` (its config.json `hf`)."""
    return model_config_from_llava(hf, read_processor(path), where)


def load_params(path, abstract_params, cfg, mesh, rules) -> nnx.State:
    """`checkpoint.load_params` for a LLaVA folder: text weights slice by slice, tower and
    projector whole (small), each placed by `rules`."""

    flat = _flat(abstract_params)
    shardings = {p: v.get_value() for p, v in _flat(shardings_for(abstract_params, mesh, rules)).items()}
    with SafetensorsFolder(path) as folder:
        layout = _layout(folder.weight_map)
        text, tower = _text_entries(cfg, layout), _tower_tensors(cfg)
        if flat.keys() != text.keys() | tower.keys():
            raise ValueError(
                f"{path}: model parameters {sorted(flat.keys() ^ (text.keys() | tower.keys()))} do not match"
            )
        _check_names(folder, layout, text, tower, {p: tuple(flat[p].shape) for p in text}, cfg.tie_embeddings)
        out = []
        bar = tqdm(  # the text model's arrays, as checkpoint.load_params counts them
            total=sum(map(len, text.values())),
            desc=f"load {os.path.basename(str(path).rstrip('/'))}",
            unit="array",
            disable=jax.process_index() != 0,
        )
        for p, v in flat.items():
            if p in text:
                value = _load_array(folder, text[p], p[0] == "stacks", tuple(v.shape), v.dtype, shardings[p], bar)
            else:
                name, how = tower[p]
                full = _name(layout, name)
                array = _to_ours(np.asarray(folder.read(full, (slice(None),))), how)
                if array.shape != tuple(v.shape):
                    raise ValueError(f"{path}: tensor {full!r} gives shape {array.shape}, expected {tuple(v.shape)}")
                value = jax.device_put(array.astype(v.dtype), shardings[p])
            out.append((p, v.replace(value)))
        bar.close()
    return nnx.from_flat_state(out)


def _check_names(folder, layout, text: dict, tower: dict, shapes: dict, tied: bool) -> None:
    """Every text tensor we need exists with the right shape, and every stored tensor is used
    (or is a tower part LLaVA never reaches)."""
    used = {_name(layout, n) for n, _ in tower.values()}
    for p, entries in text.items():
        for entry in entries:
            for name, want in expected_shapes(entry, shapes[p][1:] if p[0] == "stacks" else shapes[p]).items():
                if folder.shape(name) != want:
                    raise ValueError(f"{folder.path}: tensor {name!r} has shape {folder.shape(name)}, expected {want}")
                used.add(name)
    unused = tuple(layout[2] + u for u in UNUSED)
    extra = sorted(
        n for n in folder.weight_map.keys() - used if not n.startswith(unused) and not (tied and n == layout[1])
    )
    if extra:
        raise ValueError(f"{folder.path}: {len(extra)} tensors have no place in the model config, e.g. {extra[:5]}")


def save(path, params, cfg, *, base_config=None, context=0, dtype=None, max_shard_bytes=4 << 30) -> dict:
    """`checkpoint.save_hf` for a model with `model.vision.encoder = vit`: a LLaVA folder
    (config.json, preprocessor_config.json, safetensors in transformers' module names)."""
    v = cfg.vision
    if v.vit_final_norm:
        raise ValueError("model.vision.vit_final_norm=True: LLaVA's selected tower layer has no final LayerNorm")
    base = dict(base_config or {})
    text = text_config(cfg)
    hf = dict(base)
    hf.update(
        architectures=[ARCH],
        model_type="llava",
        text_config=hf_config_from_model(text, base.get("text_config"), context=context),
        image_token_id=v.image_token_id,
        image_token_index=v.image_token_id,
        image_seq_length=(v.image_size // v.patch_size) ** 2,
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
        multimodal_projector_bias=True,
        tie_word_embeddings=cfg.tie_embeddings,
    )
    hf["text_config"].pop("architectures", None)
    hf["vision_config"] = {
        **dict(base.get("vision_config") or {}),
        "model_type": "siglip_vision_model",
        "hidden_size": v.vit_width,
        "intermediate_size": v.vit_mlp_dim,
        "num_hidden_layers": v.vit_layers,
        "num_attention_heads": v.vit_heads,
        "image_size": v.image_size,
        "patch_size": v.patch_size,
        "num_channels": 3,
        "hidden_act": "gelu_pytorch_tanh",
        "layer_norm_eps": vit.NORM_EPS,
        "attention_dropout": 0.0,
        "vision_use_head": False,
    }
    flat = _flat(params)
    layout = LAYOUTS[0][:2] + (LAYOUTS[0][2], LAYOUTS[0][3])
    text_entries, tower = _text_entries(cfg, layout), _tower_tensors(cfg)
    out_dtype = np.dtype(jax.numpy.dtype(dtype)) if dtype else np.dtype(next(iter(flat.values())).dtype)
    writer = jax.process_index() == 0
    if writer:
        storage.makedirs(path)
    shards = ShardWriter(path, max_shard_bytes)
    for p, entries in text_entries.items():
        value = flat[p][...]
        for r, entry in enumerate(entries):
            host = _to_host(value[r] if p[0] == "stacks" else value)
            for name, tensor in hf_tensors(entry, host) if writer else ():
                shards.add(name, tensor.astype(out_dtype))
    for p, (name, how) in tower.items():
        host = _to_host(flat[p][...])
        if writer:
            shards.add(_name(layout, name), _from_ours(host, how, v.patch_size).astype(out_dtype))
    if writer:
        width = v.vit_width  # the unused post_layernorm, written as identity so transformers finds it
        shards.add(layout[2] + "post_layernorm.weight", np.ones(width, out_dtype))
        shards.add(layout[2] + "post_layernorm.bias", np.zeros(width, out_dtype))
        shards.finish()
        hf["dtype"] = str(out_dtype)
        storage.write_text(storage.join(path, "config.json"), json.dumps(hf, indent=2, sort_keys=True))
        processor = {
            "image_processor_type": "SiglipImageProcessor",
            "do_resize": True,
            "size": {"height": v.image_size, "width": v.image_size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": list(v.image_mean),
            "image_std": list(v.image_std),
        }
        storage.write_text(storage.join(path, PROCESSOR), json.dumps(processor, indent=2))
    return hf


VISION_FAMILIES["llava"] = sys.modules[__name__]  # config.model_config_from_hf and checkpoint dispatch here
