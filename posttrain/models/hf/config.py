"""Hugging Face `config.json` ↔ the posttrain `model` config, for the supported decoder families.

Every key that changes the math is mapped; a value we cannot reproduce exactly (sliding windows,
unknown RoPE types, dropout, biases the decoder lacks, ...) is an error naming the file and key,
never an approximation. Runtime keys (dtypes, remat, attention kernel, MoE dispatch and capacity)
keep the `model_config()` defaults: set them in your config.
"""

from __future__ import annotations

import json
import math

from posttrain import storage
from posttrain.config import ModelConfig
from posttrain.models.attention import dynamic_theta

# architecture → model_type
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "MixtralForCausalLM": "mixtral",
}
QK_NORM = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")
MOE = ("Qwen3MoeForCausalLM", "MixtralForCausalLM")
DEFAULT_ROPE_THETA = {"MixtralForCausalLM": 1_000_000.0}  # transformers' class defaults
ROPE_KEYS = {  # what each RoPE type may carry
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
}
ROPE_COMMON_KEYS = {"type", "rope_type", "rope_theta", "partial_rotary_factor"}
_REQUIRED = object()
# model_type → a vision family's module (config, load, save), registered by the module itself
# (`models.hf.llava`, imported by the package) so that this module needs no import of it
VISION_FAMILIES: dict = {}
# Keys the import checks, written explicitly so an exported file never relies on a class default.
EXPLICIT_DEFAULTS = {
    "LlamaForCausalLM": dict(attention_bias=False, mlp_bias=False),
    "Qwen2ForCausalLM": dict(use_sliding_window=False),
    "Qwen3ForCausalLM": dict(attention_bias=False, use_sliding_window=False),
    "Qwen3MoeForCausalLM": dict(attention_bias=False, use_sliding_window=False),
    "MixtralForCausalLM": dict(sliding_window=None, router_jitter_noise=0.0),
}


def read_hf_config(path: str) -> dict:
    """The parsed `config.json` of a Hugging Face model folder (local or URL)."""
    file = storage.join(path, "config.json")
    if not storage.isfile(file):
        raise FileNotFoundError(f"{file}: not found (expected a Hugging Face model folder)")
    return json.loads(storage.read_text(file))


def architecture(hf: dict, where: str = "config.json") -> str:
    """The supported architecture `hf` declares (`architectures`, else `model_type`), or an error."""
    archs = hf.get("architectures") or [a for a, t in ARCHITECTURES.items() if t == hf.get("model_type")]
    if len(archs) != 1 or archs[0] not in ARCHITECTURES:
        raise ValueError(
            f"{where}: architectures={hf.get('architectures')} model_type={hf.get('model_type')!r} "
            f"is not supported; supported: {', '.join(ARCHITECTURES)}"
        )
    return archs[0]


def model_config_from_hf(path: str) -> ModelConfig:
    """The posttrain `model` config of the Hugging Face model folder `path` (its config.json).

    Use it in Python (`RunConfig(model=model_config_from_hf(path))`), in a config file
    (`cfg.model = to_config_dict(model_config_from_hf(path))`, then set dtypes) or through
    `--config configs/hf.py:PATH`.
    """
    hf, where = read_hf_config(path), storage.join(path, "config.json")
    family = VISION_FAMILIES.get(hf.get("model_type"))
    if family is not None:  # a vision family: tower, projector and a text model
        return family.model_config(hf, path, where)
    return model_config_from_dict(hf, where)


def model_config_from_dict(hf: dict, where: str = "config.json") -> ModelConfig:
    """`model_config_from_hf` for an already parsed config.json (`where` names it in errors)."""
    arch = architecture(hf, where)

    def get(key, default=_REQUIRED):
        if key in hf and hf[key] is not None:
            return hf[key]
        if default is _REQUIRED:
            raise ValueError(f"{where}: missing key {key!r} (needed for {arch})")
        return default

    _check_supported(hf, arch, get, where)
    heads, embed = get("num_attention_heads"), get("hidden_size")
    theta, scaling = _rope_from_hf(hf, arch, get, where)
    changes = {
        "vocab_size": get("vocab_size"),
        "embed_dim": embed,
        "num_layers": get("num_hidden_layers"),
        "num_heads": heads,
        "num_kv_heads": get("num_key_value_heads", heads),
        "head_dim": get("head_dim", embed // heads),
        "mlp_dim": get("intermediate_size"),
        "norm_eps": float(get("rms_norm_eps")),
        "tie_embeddings": bool(get("tie_word_embeddings", False)),
        "qk_norm": arch in QK_NORM,
        "attention_bias": arch == "Qwen2ForCausalLM",
        "rope_theta": theta,
        **{f"rope_scaling.{k}": v for k, v in scaling.items()},
    }
    moe = {"num_experts": 0}
    if arch == "Qwen3MoeForCausalLM":
        moe = {
            "num_experts": get("num_experts", get("num_local_experts", 0)),
            "expert_mlp_dim": get("moe_intermediate_size"),
            "norm_topk_prob": bool(get("norm_topk_prob", False)),
            "every": get("decoder_sparse_step", 1),
            "dense_layers": tuple(get("mlp_only_layers", ())),
        }
    elif arch == "MixtralForCausalLM":
        moe = {"num_experts": get("num_local_experts"), "expert_mlp_dim": changes["mlp_dim"], "norm_topk_prob": True}
    if arch in MOE:
        moe |= {
            "top_k": get("num_experts_per_tok"),
            "router": "softmax",
            "routed_scaling": 1.0,
            "num_shared_experts": 0,
            "first_dense": 0,
            "aux_loss_coef": float(get("router_aux_loss_coef", 0.001)),
            "z_loss_coef": 0.0,  # the reference implementations have no router z-loss
        }
    return ModelConfig().replace({**changes, **{f"moe.{k}": v for k, v in moe.items()}})


def _check_supported(hf: dict, arch: str, get, where: str) -> None:
    """Raise on config values the decoder cannot reproduce exactly."""

    def bad(key, why):
        raise ValueError(f"{where}: {key}={hf.get(key)!r} is not supported for {arch} ({why})")

    if get("hidden_act", "silu") != "silu":
        bad("hidden_act", "the MLPs are SwiGLU with silu")
    if arch != "Qwen2ForCausalLM" and get("attention_bias", False):
        bad("attention_bias", "biases on q/k/v *and* o are not implemented; only Qwen2's q/k/v biases are")
    if get("mlp_bias", False):
        bad("mlp_bias", "MLP biases are not implemented")
    if get("use_sliding_window", False) or (arch == "MixtralForCausalLM" and hf.get("sliding_window") is not None):
        bad(
            "use_sliding_window" if "use_sliding_window" in hf else "sliding_window",
            "sliding-window attention is not implemented",
        )
    if any(t != "full_attention" for t in get("layer_types", ())):
        bad("layer_types", "only full attention is implemented")
    if get("attention_dropout", 0.0):
        bad("attention_dropout", "posttrain has no dropout")
    if get("router_jitter_noise", 0.0):
        bad("router_jitter_noise", "router noise is not implemented")
    if get("partial_rotary_factor", 1.0) != 1.0:
        bad("partial_rotary_factor", "RoPE covers the whole head")
    if "quantization_config" in hf:
        bad("quantization_config", "quantized checkpoints cannot be loaded; use the unquantized weights")


def _rope_from_hf(hf: dict, arch: str, get, where: str) -> tuple[float, dict]:
    """(rope_theta, model.rope_scaling fields) from `rope_parameters` (transformers >= 5) or the
    older `rope_theta` + `rope_scaling`."""
    key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
    params = dict(hf.get(key) or {})
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ValueError(f"{where}: {key} per layer type ({sorted(params)}) is not supported")
    theta = float(params.get("rope_theta", get("rope_theta", DEFAULT_ROPE_THETA.get(arch, 10_000.0))))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise ValueError(f"{where}: {key}.rope_type={kind!r} is not supported; supported: {sorted(ROPE_KEYS)}")
    unknown = set(params) - ROPE_KEYS[kind] - ROPE_COMMON_KEYS
    if unknown:
        raise ValueError(f"{where}: {key} keys {sorted(unknown)} are not supported for rope_type={kind!r}")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"{where}: {key}.partial_rotary_factor={params['partial_rotary_factor']} is not "
            "supported (RoPE covers the whole head)"
        )
    if kind == "default":
        return theta, {"type": ""}
    max_pos = lambda: int(get("max_position_embeddings"))
    original = int(params.get("original_max_position_embeddings") or (max_pos() if kind != "linear" else 0))
    factor = params.get("factor")
    if factor is None and kind == "yarn":
        factor = max_pos() / original
    elif factor is None:
        raise ValueError(f"{where}: {key}.factor is missing (needed for rope_type={kind!r})")
    out = {"type": kind, "factor": float(factor)}
    if kind == "dynamic":
        out["original_max_position_embeddings"] = max_pos()
    elif kind == "llama3":
        out.update(
            original_max_position_embeddings=original,
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    elif kind == "yarn":
        out.update(
            original_max_position_embeddings=original,
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            attention_factor=_yarn_attention_factor(params, float(factor)),
            truncate=bool(params.get("truncate", True)),
        )
    return theta, out


def _yarn_attention_factor(params: dict, factor: float) -> float:
    """YaRN's q/k scale as transformers derives it: explicit, or from mscale / mscale_all_dim, or
    0.1 ln(factor) + 1."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if params.get("mscale") and params.get("mscale_all_dim"):
        return mscale(factor, params["mscale"]) / mscale(factor, params["mscale_all_dim"])
    return mscale(factor)


def infer_architecture(cfg: ModelConfig) -> str:
    """The Hugging Face architecture that represents model config `cfg` exactly."""
    if cfg.moe.num_experts > 0:
        return "Qwen3MoeForCausalLM" if cfg.qk_norm else "MixtralForCausalLM"
    if cfg.attention_bias:
        return "Qwen2ForCausalLM"
    return "Qwen3ForCausalLM" if cfg.qk_norm else "LlamaForCausalLM"


def hf_config_from_model(
    cfg: ModelConfig, base: dict | None = None, arch: str | None = None, *, context: int = 0
) -> dict:
    """config.json contents for model config `cfg`: `base` (e.g. the source model's config.json,
    keeping its token ids and other keys) with every key the import reads set from `cfg`, so the
    file never leans on a transformers class default. The architecture is `arch`, else base's,
    else inferred; a model it cannot represent raises ValueError.

    `context` is the longest context the weights were trained at (0: unknown); the advertised
    `max_position_embeddings` is the longer of it and base's (see `advertised_context`).
    """
    arch = arch or (architecture(base) if base else infer_architecture(cfg))
    _check_representable(cfg, arch)
    out = dict(base or {})
    out.update(
        architectures=[arch],
        model_type=ARCHITECTURES[arch],
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.embed_dim,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        intermediate_size=cfg.mlp_dim,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
        attention_dropout=0.0,
        **EXPLICIT_DEFAULTS.get(arch, {}),
    )
    out["max_position_embeddings"] = advertised_context(cfg, base, context)
    out.update(_rope_to_hf(cfg, "rope_parameters" in out))
    if arch == "Qwen3MoeForCausalLM":
        out.pop("num_local_experts", None)
        out.update(
            num_experts=cfg.moe.num_experts,
            moe_intermediate_size=cfg.moe.expert_mlp_dim,
            norm_topk_prob=cfg.moe.norm_topk_prob,
            decoder_sparse_step=cfg.moe.every,
            mlp_only_layers=list(cfg.moe.dense_layers),
        )
    elif arch == "MixtralForCausalLM":
        out.update(num_local_experts=cfg.moe.num_experts)
    if arch in MOE:
        out.update(num_experts_per_tok=cfg.moe.top_k, router_aux_loss_coef=cfg.moe.aux_loss_coef)
    return out


def advertised_context(cfg: ModelConfig, base: dict | None, context: int = 0) -> int:
    """`max_position_embeddings` to write: the longest of base's, the trained `context` (fine-tuning
    on shorter sequences does not shrink it) and, under dynamic RoPE (exported as plain RoPE, see
    `_rope_to_hf`), the extended context its base was made for. ValueError when none is known."""
    s = cfg.rope_scaling
    longest = max(int((base or {}).get("max_position_embeddings") or 0), int(context))
    if s.type == "dynamic":
        longest = max(longest, int(s.dynamic_length()))
    if longest <= 0:
        raise ValueError(
            "max_position_embeddings is unknown: no source config.json and no trained context; "
            "pass context= (the longest sequence length the model was trained at)"
        )
    return longest


def _check_representable(cfg: ModelConfig, arch: str) -> None:
    """Raise when `arch` cannot express model config `cfg` (naming the key)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"architecture {arch!r} is not supported; supported: {', '.join(ARCHITECTURES)}")
    moe = cfg.moe
    wrong = []
    if cfg.qk_norm != (arch in QK_NORM):
        wrong.append(f"model.qk_norm={cfg.qk_norm}")
    if cfg.attention_bias != (arch == "Qwen2ForCausalLM"):
        wrong.append(f"model.attention_bias={cfg.attention_bias}")
    if (moe.num_experts > 0 and arch not in MOE) or (moe.num_experts == 0 and arch == "MixtralForCausalLM"):
        wrong.append(f"model.moe.num_experts={moe.num_experts}")
    if moe.num_experts > 0:
        if moe.router != "softmax" or moe.routed_scaling != 1.0 or moe.num_shared_experts or moe.first_dense:
            wrong.append(
                "model.moe.{router, routed_scaling, num_shared_experts, first_dense} "
                f"= {moe.router}, {moe.routed_scaling}, {moe.num_shared_experts}, {moe.first_dense}"
            )
        if arch == "MixtralForCausalLM" and (
            not moe.norm_topk_prob or moe.every != 1 or moe.dense_layers or moe.expert_mlp_dim != cfg.mlp_dim
        ):
            wrong.append(
                "model.moe.{norm_topk_prob, every, dense_layers, expert_mlp_dim} (Mixtral: True, 1, (), model.mlp_dim)"
            )
    if cfg.vision.encoder != "none":  # the text families have no image input
        wrong.append(f"model.vision.encoder={cfg.vision.encoder!r}")
    if wrong:
        raise ValueError(f"{arch} cannot represent {'; '.join(wrong)}")


def _rope_to_hf(cfg: ModelConfig, nested: bool) -> dict:
    """The RoPE keys of config.json: `rope_parameters` (nested=True, transformers >= 5) or
    `rope_theta` + `rope_scaling`. Dynamic scaling is written as plain RoPE with the base it
    computes (`dynamic_theta`): transformers' `dynamic` would grow the base with each call."""
    s = cfg.rope_scaling
    if s.type == "dynamic":
        theta = dynamic_theta(cfg.rope_theta, cfg.head_dim, s)
        if nested:
            return {"rope_parameters": {"rope_theta": theta, "rope_type": "default"}}
        return {"rope_theta": theta, "rope_scaling": None}
    kind = s.type or "default"
    scaling = {"rope_type": kind}
    if s.type:
        scaling["factor"] = s.factor
    if s.type == "llama3":
        scaling.update(
            low_freq_factor=s.low_freq_factor,
            high_freq_factor=s.high_freq_factor,
            original_max_position_embeddings=s.original_max_position_embeddings,
        )
    elif s.type == "yarn":
        scaling.update(
            original_max_position_embeddings=s.original_max_position_embeddings,
            beta_fast=s.beta_fast,
            beta_slow=s.beta_slow,
        )
        if s.attention_factor:
            scaling["attention_factor"] = s.attention_factor
        if not s.truncate:
            scaling["truncate"] = False
    if nested:
        return {"rope_parameters": {"rope_theta": cfg.rope_theta, **scaling}}
    return {"rope_theta": cfg.rope_theta, "rope_scaling": scaling if s.type else None}
