"""Hugging Face checkpoint interop: Llama, Qwen2, Qwen3, Qwen3-MoE and Mixtral folders, and LLaVA
(a SigLIP tower + projector + one of those text models, `models.hf.llava`)
(config.json + safetensors) loaded straight into sharded posttrain parameters and saved back.

    cfg.model = model_config_from_hf("/models/qwen3")            # the matching model config
    cfg.init_from = "hf:/models/qwen3"                           # stages start from its weights
    cfg.data.tokenizer = "/models/qwen3"                         # tokenizer + chat template

`tools/convert_hf.py` converts between such folders and posttrain (orbax) checkpoints;
`tools/gguf_to_hf.py` (`models.hf.gguf`) writes a llama GGUF file as such a folder.
"""

from posttrain.models.hf import llava  # noqa: F401 (registers the LLaVA vision family)
from posttrain.models.hf.checkpoint import check_model_matches, load_model_state, load_params, save_hf
from posttrain.models.hf.config import (
    ARCHITECTURES,
    hf_config_from_model,
    model_config_from_dict,
    model_config_from_hf,
    read_hf_config,
)

__all__ = [
    "ARCHITECTURES",
    "check_model_matches",
    "hf_config_from_model",
    "load_model_state",
    "load_params",
    "model_config_from_dict",
    "model_config_from_hf",
    "read_hf_config",
    "save_hf",
]
