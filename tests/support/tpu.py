"""The tiny MoE config compiled for a TPU slice on the CPU (libtpu's compiler over abstract
devices), the hand count of its parameter bytes, and the skip mark when libtpu is missing."""

import pytest

from posttrain.plan import aot

needs_libtpu = pytest.mark.skipif(
    not aot.libtpu_available(), reason="libtpu not installed (pip install -e '.[tpu]'): no TPU compiler"
)


TOPOLOGY = "v5p:2x2x1"


def tiny_moe_config():
    import runpy

    cfg = runpy.run_path("configs/sft_tiny.py")["get_config"]()
    cfg.mesh.data, cfg.mesh.expert = 2, 2  # 4 chips: batch over both, experts over 2
    # TPU memory holds arrays in (8, 128) tiles: trailing dims of 16 or 64 would pad 2-32x, so the
    # widths are the smallest that tile exactly (memory_analysis reports the padded bytes)
    m = cfg.model
    m.embed_dim, m.num_heads, m.num_kv_heads, m.head_dim, m.moe.expert_mlp_dim = 128, 8, 8, 128, 128
    cfg.train.batch_size, cfg.train.seq_len = 8, 32
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens, cfg.rl.kl_coef = 2, 4, 8, 0.05
    return cfg


def hand_param_bytes(cfg, expert_shards: int) -> int:
    """float32 parameter bytes per device, counted from the config: experts split over the
    expert axis, everything else replicated (the default rules on a data × expert mesh)."""
    m = cfg.model
    d, e, f = m.embed_dim, m.moe.num_experts, m.moe.expert_mlp_dim
    attn = 2 * d * m.num_heads * m.head_dim + 2 * d * m.num_kv_heads * m.head_dim
    per_layer = attn + 2 * d + d * e + 3 * e * d * f // expert_shards
    return 4 * (m.num_layers * per_layer + 2 * m.vocab_size * d + d)


def pod_like_tiny_config():
    """The tiny MoE laid out as the pod configs are (configs/pod/moe_shapes.py): ZeRO-3 over
    fsdp × expert, experts over expert, bf16, remat full, capacity 1.25; embed 256 wide (the TPU
    ragged all-to-all pads narrower rows to 256 elements)."""
    cfg = tiny_moe_config()
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert = 1, 2, 2
    cfg.sharding.rules.embed = "fsdp,expert"
    m = cfg.model
    m.embed_dim, m.param_dtype, m.dtype, m.remat, m.moe.capacity_factor = 256, "bfloat16", "bfloat16", "full", 1.25
    return cfg
