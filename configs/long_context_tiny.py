"""Staged context extension on CPU: SFT of a tiny decoder on generated needle / multi-hop problems,
256 tokens for the first steps, then 1024 in the same run, with the long-context evals.

    python -m posttrain.main --config configs/long_context_tiny.py
    python tools/long_context_eval.py --run runs/long_context_tiny --step 32   # before: 256-token stage only
    python tools/long_context_eval.py --run runs/long_context_tiny            # after (also in metrics.jsonl)

Training problems come from the training name space, evaluation problems from a disjoint one
(`posttrain/eval/long_context.py`). The end-of-run evaluation reports `eval/long_ctx_needle` and
`eval/long_ctx_multihop` (per length too), writes runs/long_context_tiny/long_context.{jsonl,png}.

Measured on the 2-core CPU box, one run each, one initialisation (seed 0; grid 256,1024 x depth
0,0.5,1, 4 problems per cell): this config (48 steps) goes from CE 6.3 to 2.26 and answers
well-formed numbers but retrieves nothing — needle 0.00 / multi-hop 0.00 before (step 32) and after
(step 48). 32x longer (`--config.train.steps=1024 --config.train.seq_len_schedule=256:1000,1024`,
~25 min) reaches answer CE 0.99 at 256 tokens, still needle 0.00, multi-hop 0.04 (guesses) before
and after the extension: a 2-layer byte model needs far more steps to learn retrieval; the pipeline
(staged data, evaluation, gates, heat maps) is what this config exercises.
"""

from posttrain.config import base_config


def get_config():
    cfg = base_config()
    cfg.stage = "sft"
    cfg.workdir = "runs/long_context_tiny"
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        264,
        64,
        2,
        4,
        2,
        16,
        128,
    )
    m.rope_theta = 10_000.0
    cfg.data.synthetic, cfg.data.synthetic_size = "long_context", 2000
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files, cfg.sft.sample_tokens = "", 0
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 48, 8, 1024
    cfg.train.seq_len_schedule = "256:32,1024"
    cfg.train.log_every = 4
    cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 8
    cfg.checkpoint.every = 16
    lc = cfg.eval.long_context
    lc.lengths, lc.depths, lc.samples, lc.hops = "256,1024", "0,0.5,1", 4, 2
    cfg.sft.gate = ""
    return cfg
