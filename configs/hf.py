"""Start a stage from a local Hugging Face model folder (Llama, Qwen2, Qwen3, Qwen3-MoE, Mixtral).

    python -m posttrain.main --config configs/hf.py:/models/Qwen3-0.6B --config.stage=sft \
        --config.sft.train_files=data/train.jsonl --config.workdir=runs/qwen3-sft \
        --config.model.param_dtype=bfloat16 --config.model.dtype=bfloat16

The model config comes from the folder's config.json (`model_config_from_hf`), the weights from its
safetensors (`init_from = "hf:PATH"`) and the tokenizer and chat template from its tokenizer files
(`data.tokenizer = PATH`). In your own config file, do the same three assignments.
"""

from posttrain.config import base_config
from posttrain.models.hf.config import model_config_from_hf


def get_config(path: str = ""):
    cfg = base_config()
    cfg.stage = "sft"
    if path:
        cfg.model.update(model_config_from_hf(path).to_dict())
        cfg.init_from = f"hf:{path}"
        cfg.data.tokenizer = path
    return cfg
