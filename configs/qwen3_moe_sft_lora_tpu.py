"""SFT of Qwen3-30B-A3B with LoRA on a TPU slice of 64 chips (v5p-128): the intended production shape.

Compiled for v5p-128 on a CPU host (`python tools/compile_plan.py --config
configs/qwen3_moe_sft_lora_tpu.py --topology v5p-128 --programs sft`): 80.6 GB per chip of 95 GB
(78.5 GB of it temporaries: 4 rows of 4096 tokens per chip with `remat=dots`); see BENCHMARKS.md
"Pod plan".

Expects the base weights as a posttrain checkpoint (convert the Hugging Face folder once with
`tools/convert_hf.py --from_hf DIR --run gs://BUCKET/qwen3-30b-a3b`) and chat data as JSONL on
GCS. Override paths on the command line:

  python -m posttrain.main --config configs/qwen3_moe_sft_lora_tpu.py \
      --config.init_from=gs://BUCKET/qwen3-30b-a3b --config.data.tokenizer=gs://BUCKET/qwen3-30b-a3b \
      --config.sft.train_files='gs://BUCKET/sft/train-*.jsonl' --config.workdir=gs://BUCKET/runs/sft-lora
"""

from posttrain.config import base_config


def get_config():
    cfg = base_config()
    cfg.stage = "sft"
    cfg.workdir = "gs://BUCKET/runs/qwen3-30b-a3b-sft-lora"
    cfg.init_from = "gs://BUCKET/qwen3-30b-a3b"
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers = 151_936, 2048, 48
    m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = 32, 4, 128, 6144
    m.rope_theta, m.qk_norm, m.norm_eps, m.tie_embeddings = 1_000_000.0, True, 1e-6, False
    m.param_dtype, m.dtype, m.remat = "bfloat16", "bfloat16", "dots"
    m.moe.num_experts, m.moe.top_k, m.moe.expert_mlp_dim, m.moe.norm_topk_prob = 128, 8, 768, True
    m.moe.aux_loss_coef, m.moe.z_loss_coef = 0.001, 0.0
    # 64 chips: experts over 8, ZeRO-3 over the rest; sequences of 4k tokens, global batch 256.
    cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.expert, cfg.mesh.tensor = 1, -1, 8, 1
    cfg.data.tokenizer = "gs://BUCKET/qwen3-30b-a3b"
    cfg.sft.train_files = "gs://BUCKET/sft/train-*.jsonl"
    cfg.sft.eval_files = "gs://BUCKET/sft/eval.jsonl"
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 2000, 256, 4096
    cfg.train.eval_every, cfg.checkpoint.every, cfg.checkpoint.keep = 200, 200, 3
    cfg.lora.rank, cfg.lora.alpha = 16, 32.0
    cfg.lora.targets = ("q", "k", "v", "o", "w_gate", "w_up", "w_down")
    cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.weight_decay = 2e-4, 50, 0.0
    return cfg
