"""GGUF files (llama.cpp) as Hugging Face model folders, which every HF path of posttrain then reads.

    gguf_to_hf("SmolLM2-135M-Instruct.Q4_1.gguf", "/models/smollm2")   # or tools/gguf_to_hf.py
    cfg.model = model_config_from_hf("/models/smollm2"); cfg.init_from = "hf:/models/smollm2"
    cfg.data.tokenizer = "/models/smollm2"

The metadata becomes `config.json` (read by `model_config_from_dict`, so every unsupported setting
is the same error it is for an HF folder); each tensor is dequantised by the `gguf` library and
stored under its Hugging Face name, with llama.cpp's interleaving of the q/k rows undone (its
converter permutes them so that RoPE rotates adjacent pairs); a file without `output.weight` has
tied embeddings. The tokenizer and chat template come from the metadata (`data.gguf_tokenizer`).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator

import ml_dtypes
import numpy as np
from tqdm import tqdm

try:
    import gguf
except ImportError as e:
    raise ImportError("GGUF import needs the gguf library: pip install -e '.[hf]'") from e

from posttrain import storage  # noqa: E402 (after the gguf check, whose error says how to install it)
from posttrain.data.gguf_tokenizer import tokenizer_files  # noqa: E402
from posttrain.models.hf.checkpoint import DEFAULT_SHARD_BYTES  # noqa: E402
from posttrain.models.hf.config import model_config_from_dict  # noqa: E402
from posttrain.models.hf.files import ShardWriter  # noqa: E402

# general.architecture → the Hugging Face architecture its tensors and settings map onto
ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# Tensor types whose dequantisation is tested against transformers (tests/models/hf/test_gguf.py);
# the K-quants are dequantised by the same `gguf.quants` code transformers itself uses.
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
BLOCK_TENSORS = {  # blk.{i}.<name> → model.layers.{i}.<name>
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_REQUIRED = object()


def field_value(field: gguf.ReaderField):
    """A metadata field as Python: str, int, float, bool, or a list of them."""
    kind = gguf.GGUFValueType
    if field.types[0] == kind.ARRAY:
        if field.types[-1] == kind.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if field.types[0] == kind.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8")
    value = field.parts[field.data[0]].tolist()[0]
    return bool(value) if field.types[0] == kind.BOOL else value


def read_metadata(reader: gguf.GGUFReader) -> dict:
    """Every metadata key of the file (the header's GGUF.* fields left out) → its value."""
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def tensor_shape(tensor: gguf.ReaderTensor) -> tuple[int, ...]:
    """A tensor's shape in row-major (numpy, torch) order; GGUF lists dimensions fastest first."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


def hf_config_from_gguf(meta: dict, shapes: dict[str, tuple[int, ...]], where: str = "GGUF") -> dict:
    """config.json contents for a GGUF file's metadata `meta` and tensor `shapes` (GGUF names)."""
    arch = meta.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(
            f"{where}: general.architecture={arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}"
        )

    def get(key, default=_REQUIRED):
        value = meta.get(f"{arch}.{key}", default)
        if value is _REQUIRED:
            raise ValueError(f"{where}: missing metadata key {arch}.{key!r} (needed for {arch})")
        if isinstance(value, list):
            raise ValueError(f"{where}: {arch}.{key}={value[:4]}... per layer is not supported")
        return value

    heads, hidden = get("attention.head_count"), get("embedding_length")
    head_dim = get("attention.key_length", hidden // heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"{where}: {arch}.attention.value_length differs from the key length {head_dim}")
    if get("rope.dimension_count", head_dim) != head_dim:
        raise ValueError(
            f"{where}: {arch}.rope.dimension_count={get('rope.dimension_count')} is not supported "
            f"(RoPE covers the whole head, {head_dim})"
        )
    if get("expert_count", 0):
        raise ValueError(f"{where}: {arch}.expert_count={get('expert_count')} is not supported (dense llama only)")
    if "rope_freqs.weight" in shapes:
        raise ValueError(f"{where}: tensor 'rope_freqs.weight' (llama3 RoPE scaling as factors) is not supported")
    hf = {
        "architectures": [ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": get("vocab_size", shapes.get("token_embd.weight", (None,))[0]),
        "hidden_size": hidden,
        "intermediate_size": get("feed_forward_length"),
        "num_hidden_layers": get("block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": get("attention.head_count_kv", heads),
        "head_dim": head_dim,
        "rms_norm_eps": get("attention.layer_norm_rms_epsilon"),
        "max_position_embeddings": get("context_length"),
        "rope_parameters": _rope_parameters(get, arch, where),
        "tie_word_embeddings": "output.weight" not in shapes,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "attention_dropout": 0.0,
    }
    for name, key in (("bos", "bos"), ("eos", "eos"), ("pad", "padding")):
        if f"tokenizer.ggml.{key}_token_id" in meta:
            hf[f"{name}_token_id"] = meta[f"tokenizer.ggml.{key}_token_id"]
    return hf


def _rope_parameters(get, arch: str, where: str) -> dict:
    """`rope_parameters` of config.json from `{arch}.rope.*`: plain or linear scaling."""
    params = {"rope_theta": float(get("rope.freq_base", 10_000.0)), "rope_type": "default"}
    kind = get("rope.scaling.type", "none")
    if kind == "linear":
        params.update(rope_type="linear", factor=float(get("rope.scaling.factor")))
    elif kind != "none":
        raise ValueError(f"{where}: {arch}.rope.scaling.type={kind!r} is not supported; supported: none, linear")
    return params


def hf_tensor_name(name: str, where: str = "GGUF") -> str:
    """A llama GGUF tensor name → its Hugging Face name."""
    if name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[name]
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    if m and m[2] in BLOCK_TENSORS:
        return f"model.layers.{m[1]}.{BLOCK_TENSORS[m[2]]}"
    raise ValueError(
        f"{where}: tensor {name!r} has no place in a llama model; known: {', '.join(GLOBAL_TENSORS)}, "
        f"blk.N.{{{', '.join(BLOCK_TENSORS)}}}"
    )


def dequantize(tensor: gguf.ReaderTensor, where: str = "GGUF") -> np.ndarray:
    """A tensor's values in float32, in row-major shape."""
    kind = tensor.tensor_type.name
    if kind not in TENSOR_TYPES:
        supported = ", ".join(TENSOR_TYPES)
        raise ValueError(f"{where}: tensor {tensor.name!r} has type {kind}, which is not supported ({supported})")
    values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    return np.asarray(values, np.float32).reshape(tensor_shape(tensor))


def unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: per head, its converter interleaves the two halves of
    the rows ([x0..x_{d/2-1}, y0..] → [x0, y0, x1, y1, ...]); Hugging Face keeps them split."""
    half = w.shape[0] // num_heads // 2
    return w.reshape(num_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_tensors(reader: gguf.GGUFReader, hf: dict, where: str = "GGUF") -> Iterator[tuple[str, np.ndarray]]:
    """(Hugging Face name, float32 array) for every tensor of the file, one at a time."""
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name, where)
        values = dequantize(tensor, where)
        if name.endswith("q_proj.weight"):
            values = unpermute_rope_rows(values, hf["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            values = unpermute_rope_rows(values, hf["num_key_value_heads"])
        yield name, values


def gguf_to_hf(
    path: str, out: str, *, dtype: str = "float32", max_shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = True
) -> dict:
    """Write GGUF file `path` as Hugging Face folder `out` (local or URL): config.json, safetensors
    in `dtype` (float32 keeps every dequantised value exact), tokenizer.json, tokenizer_config.json
    (special tokens, chat template) and generation_config.json. Returns the config.json written."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    reader = gguf.GGUFReader(path)
    meta = read_metadata(reader)
    hf = hf_config_from_gguf(meta, {t.name: tensor_shape(t) for t in reader.tensors}, path)
    model_config_from_dict(hf, path)  # what posttrain cannot compute fails here, before anything is written
    files = tokenizer_files(meta, path)
    out_dtype = _storage_dtype(dtype)
    storage.makedirs(out)
    shards = ShardWriter(out, max_shard_bytes)
    desc = f"dequantise {os.path.basename(path)}"
    bar = tqdm(total=len(reader.tensors), desc=desc, unit="tensor", disable=not progress)
    for name, values in hf_tensors(reader, hf, path):
        shards.add(name, values.astype(out_dtype))
        bar.update()
    bar.close()
    shards.finish()
    hf["dtype"] = str(out_dtype)
    storage.write_text(storage.join(out, "config.json"), json.dumps(hf, indent=2, sort_keys=True))
    for name, text in files.items():
        storage.write_text(storage.join(out, name), text)
    logging.info("%s → %s: %d tensors, %.1f MB", path, out, len(reader.tensors), shards.total_bytes / 2**20)
    return hf


def _storage_dtype(dtype: str) -> np.dtype:
    """The numpy dtype a folder's tensors are written in: float32, bfloat16 or float16."""
    if dtype not in ("float32", "bfloat16", "float16"):
        raise ValueError(f"dtype={dtype!r}: expected float32, bfloat16 or float16")
    return np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(dtype)
