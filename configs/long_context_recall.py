"""Long-context retrieval that a small byte-level decoder learns on CPU: key-value recall
("... QZX=4821. ... BDW=7730. ..." → "QZX=?" → "QZX=4821", `posttrain/eval/long_context.py`,
kind `recall`), 1 + length/64 facts per context, held-out keys disjoint from training ones by a hash
of the key. Two runs: 256 tokens, then an extension to 1024 from its checkpoint under a RoPE scaling.

    python -m posttrain.main --config configs/long_context_recall.py                     # 256 tokens
    python -m posttrain.main --config configs/long_context_recall.py:extend:yarn         # → 1024
    python tools/long_context_eval.py --run runs/long_context_recall_yarn --samples 50

`:extend:<scaling>` starts from runs/long_context_recall (`init_from`) with `model.rope_scaling`
none | linear | dynamic | yarn | llama3 (factor 4 over the 256 trained tokens) and writes
runs/long_context_recall_<scaling>. Training records ask the facts of their context (one turn
each, as many as fit) and mix lengths log-uniformly from 64 tokens to train.seq_len, so the
extension keeps the short data. The 256-token run measures 1024 tokens too, past its trained
context, so it says so: `sampling.max_context=1024`.

Measured on the shared 2-core CPU (50 held-out problems per length x depth cell, depths 0/0.5/1):
NOT yet the issue's target. Retrieval forms (training loss on the answers falls from 1.0, digits
guessed, to 0.07 between steps 250 and 1000 of this config, a 2-layer d=64 model, on the earlier
records whose contexts were shorter than the evaluated ones), but held-out
accuracy at 256 tokens stays low: 0.14 at step 1000 (the run was killed for memory in its
end-of-run eval, fixed since), 0.21 (depth 0 / 0.5 / 1: 0.10 / 0.36 / 0.18) after 300 more steps
at lr 2e-3 on records whose contexts reach the evaluated length; 0.00 at 512 and 1024 before any
extension. A 4-layer d=128 model (600 steps planned) was still at digit-guessing loss (1.0) and
0/60 after 321 steps. Per-digit accuracy near 80% (loss 0.07 nats per answer token) gives ~50%
whole answers: it needs more steps than ~30 CPU-minutes gave. Extended from that checkpoint for
100 of the 200 steps (`:extend:<scaling> --config.train.steps=100`), 256 / 1024 tokens: yarn
0.28 / 0.03, none 0.25 / 0.01 (training loss at 1024 from 3.5 / 5.2 to 0.21 / 0.29); linear,
dynamic and llama3 not run yet.
"""

from posttrain.config import base_config

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")


def get_config(arg: str = ""):
    mode, _, scaling = arg.partition(":")
    if mode not in ("", "extend") or (mode == "extend") != bool(scaling) or (scaling and scaling not in SCALINGS):
        raise ValueError(f"configs/long_context_recall.py:{arg}: expected '' or 'extend:<one of {SCALINGS}>'")
    cfg = base_config()
    cfg.stage = "sft"
    cfg.workdir = "runs/long_context_recall"
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        264,
        64,
        2,
        4,
        4,
        16,
        256,
    )
    cfg.data.synthetic, cfg.data.synthetic_size = "long_context", 4000
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files, cfg.sft.sample_tokens, cfg.sft.gate = "", 0, ""
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 1500, 16, 256, 50
    cfg.optim.lr, cfg.optim.warmup_steps = 5e-3, 50
    cfg.checkpoint.every = 500
    lc = cfg.eval.long_context
    lc.kinds, lc.lengths, lc.depths, lc.samples, lc.max_new_tokens = "recall", "256,1024", "0,0.5,1", 50, 10
    cfg.sampling.max_context = 1024  # the 1024-token cells are past the 256 trained: measured on purpose
    if mode == "extend":
        cfg.init_from, cfg.workdir = "runs/long_context_recall", f"runs/long_context_recall_{scaling}"
        cfg.sampling.max_context = 0  # trained at 1024 now: nothing past it
        cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 200, 4, 1024
        cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
        cfg.checkpoint.every = 100
        lc.lengths = "256,512,1024"
        if scaling != "none":
            cfg.model.rope_scaling.update(type=scaling, factor=4.0, original_max_position_embeddings=256)
            if scaling == "linear":
                cfg.model.rope_scaling.original_max_position_embeddings = 0
    return cfg
