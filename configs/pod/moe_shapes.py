"""Shapes of large public MoE models for ahead-of-time compile plans (`tools/compile_plan.py`,
`tools/pod_plan.py`); abstract only, no weights. `get_config("<model>:<mode>")`, e.g.
`--config=configs/pod/moe_shapes.py:kimi_k2:sft_full`.

Models: qwen3_30b_a3b, qwen3_235b_a22b (Hugging Face configs), deepseek_v3 (671B: 256 routed +
1 shared expert, top-8, sigmoid router; MLA replaced by a GQA stand-in of 128 query and 8 KV
heads of 128, ~250M attention params per layer vs MLA's ~190M, and a larger KV cache than MLA's
compressed one) and kimi_k2 (~1.03T: DeepSeek-V3's architecture with 384 experts, 64 heads,
1 dense layer; same GQA stand-in); llama3_8b (Llama-3-8B's dense shape, for long-context plans).

Modes: sft_full (all weights trained, bf16 weights and Adam moments), sft_lora (rank-16 adapters on
attention and experts, base frozen in bf16), rl (GRPO learner with a KL reference + the sampler,
on the same mesh). Meshes: experts over `expert`, every other weight ZeRO-3 over fsdp × expert
(`embed: fsdp,expert`), batch over all chips (`train.batch_size` = chips × rows per chip).
"""

from posttrain.config import base_config

MODELS = {
    # vocab, embed, layers, heads, kv heads, head_dim, dense mlp, first dense, experts, top-k,
    # expert mlp, shared experts, router, routed scaling, expert-parallel ways
    "qwen3_30b_a3b": (151_936, 2048, 48, 32, 4, 128, 6144, 0, 128, 8, 768, 0, "softmax", 1.0, 8),
    "qwen3_235b_a22b": (151_936, 4096, 94, 64, 4, 128, 12_288, 0, 128, 8, 1536, 0, "softmax", 1.0, 32),
    "deepseek_v3": (129_280, 7168, 61, 128, 8, 128, 18_432, 3, 256, 8, 2048, 1, "sigmoid", 2.5, 64),
    "kimi_k2": (163_840, 7168, 61, 64, 8, 128, 18_432, 1, 384, 8, 2048, 1, "sigmoid", 2.827, 128),
    "llama3_8b": (128_256, 4096, 32, 32, 8, 128, 14_336, 0, 0, 0, 0, 0, "softmax", 1.0, 1),
}
MODES = ("sft_full", "sft_lora", "rl")


def get_config(spec: str = "qwen3_30b_a3b:sft_full"):
    name, _, mode = spec.partition(":")
    mode = mode or "sft_full"
    if name not in MODELS or mode not in MODES:
        raise ValueError(
            f"config spec {spec!r}: expected MODEL:MODE with MODEL in {sorted(MODELS)} and MODE in {MODES}"
        )
    (
        vocab,
        dim,
        layers,
        heads,
        kv,
        head_dim,
        mlp,
        first_dense,
        experts,
        top_k,
        expert_mlp,
        shared,
        router,
        scaling,
        expert_ways,
    ) = MODELS[name]
    cfg = base_config()
    cfg.stage = "rlvr" if mode == "rl" else "sft"
    cfg.workdir = f"gs://BUCKET/runs/{name}-{mode}"
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers = vocab, dim, layers
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = heads, kv, head_dim, mlp
    m.rope_theta, m.qk_norm, m.norm_eps, m.tie_embeddings = 1_000_000.0, name.startswith("qwen3"), 1e-6, False
    if name == "llama3_8b":
        m.rope_theta, m.norm_eps = 500_000.0, 1e-5
    m.param_dtype, m.dtype, m.remat = "bfloat16", "bfloat16", "full"
    moe = m.moe
    moe.num_experts = experts
    if experts:  # a dense model (llama3_8b) keeps the moe defaults: they take no effect, top_k=0 is invalid
        moe.top_k, moe.expert_mlp_dim, moe.first_dense = top_k, expert_mlp, first_dense
        moe.num_shared_experts, moe.shared_mlp_dim = shared, expert_mlp
        moe.router, moe.routed_scaling, moe.norm_topk_prob = router, scaling, True
        moe.aux_loss_coef, moe.z_loss_coef = 0.001, 0.0
        # dropless needs a receive buffer for the worst case (every peer's rows to one device): with
        # many expert-parallel peers that is peers × tokens × k rows; a capacity bounds it
        moe.capacity_factor = 1.25
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, -1, expert_ways, 1
    cfg.sharding.rules.embed = "fsdp,expert"
    cfg.train.batch_size, cfg.train.seq_len = 64, 4096
    if mode == "sft_lora":
        cfg.lora.rank, cfg.lora.alpha = 16, 32.0
        cfg.lora.targets = ("q", "k", "v", "o", "w_gate", "w_up", "w_down")
    if mode == "rl":
        r = cfg.rl
        r.prompts_per_step, r.group_size, r.max_new_tokens, r.kl_coef = 8, 8, 1024, 0.001
    return cfg
