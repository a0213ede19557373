"""The tiny MoE config compiled for a TPU slice on the CPU (libtpu's compiler over abstract
devices), the hand count of its parameter bytes, and the skip mark when libtpu is missing."""

import pytest

from posttrain.config import RunConfig
from posttrain.plan import aot
from tests.support.typed_configs import typed

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(), reason="libtpu not installed (pip install -e '.[tpu]'): no TPU compiler"
)


TOPOLOGY = "v5p:2x2x1"


def tiny_moe_config(changes: dict | None = None) -> RunConfig:
    """configs/sft_tiny.py's MoE on 4 chips, with dotted `changes` ({"mesh.fsdp": 2}) applied last."""
    import runpy

    cfg = typed(runpy.run_path("configs/sft_tiny.py")["get_config"]())
    return cfg.replace(
        {
            **{"mesh.data": 2, "mesh.expert": 2},  # 4 chips: batch over both, experts over 2
            # TPU memory holds arrays in (8, 128) tiles: trailing dims of 16 or 64 would pad 2-32x, so the
            # widths are the smallest that tile exactly (memory_analysis reports the padded bytes)
            **{"model.embed_dim": 128, "model.num_heads": 8, "model.num_kv_heads": 8, "model.head_dim": 128},
            "model.moe.expert_mlp_dim": 128,
            **{"train.batch_size": 8, "train.seq_len": 32},
            **{"rl.prompts_per_step": 2, "rl.group_size": 4, "rl.max_new_tokens": 8, "rl.kl_coef": 0.05},
            **(changes or {}),
        }
    )


def hand_param_bytes(cfg, expert_shards: int) -> int:
    """float32 parameter bytes per device, counted from the config: experts split over the
    expert axis, everything else replicated (the default rules on a data × expert mesh)."""
    m = cfg.model
    d, e, f = m.embed_dim, m.moe.num_experts, m.moe.expert_mlp_dim
    attn = 2 * d * m.num_heads * m.head_dim + 2 * d * m.num_kv_heads * m.head_dim
    per_layer = attn + 2 * d + d * e + 3 * e * d * f // expert_shards
    return 4 * (m.num_layers * per_layer + 2 * m.vocab_size * d + d)


def pod_like_tiny_config(changes: dict | None = None) -> RunConfig:
    """The tiny MoE laid out as the pod configs are (configs/pod/moe_shapes.py): ZeRO-3 over
    fsdp × expert, experts over expert, bf16, remat full, capacity 1.25; embed 256 wide (the TPU
    ragged all-to-all pads narrower rows to 256 elements). Dotted `changes` applied last."""
    return tiny_moe_config(
        {
            **{"mesh.data": 1, "mesh.fsdp": 2, "mesh.expert": 2, "sharding.rules.embed": "fsdp,expert"},
            **{"model.embed_dim": 256, "model.param_dtype": "bfloat16", "model.dtype": "bfloat16"},
            **{"model.remat": "full", "model.moe.capacity_factor": 1.25},
            **(changes or {}),
        }
    )
