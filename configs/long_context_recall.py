"""Long-context retrieval that a small byte-level decoder learns on CPU: key-value recall with the
value right after its key ("... QZX4821. ... BDW7730. ..." → "QZX?" → "QZX4821", kind `kv` in
`posttrain/eval/long_context.py`), 1 + length/64 facts per evaluated context, held-out keys
disjoint from training ones by a hash of the key. Three runs: 256 tokens (800 steps), 600 more
steps at 256, then an extension to 1024 from that checkpoint under a RoPE scaling.

    python -m posttrain.main --config configs/long_context_recall.py                     # 256 tokens
    python -m posttrain.main --config configs/long_context_recall.py:more                # +600 steps
    python -m posttrain.main --config configs/long_context_recall.py:extend:yarn         # → 1024
    python tools/long_context_eval.py --run runs/long_context_recall_yarn --samples 50
    python tools/long_context_eval.py --run runs/long_context_recall_yarn --kinds multihop --hops 2 \\
        --lengths 1024 --depths 0 --samples 50 --out runs/long_context_recall_yarn/multihop

`:extend:<scaling>` starts from runs/long_context_recall_more (`init_from`) with
`model.rope_scaling` none | linear | dynamic | yarn | llama3 (factor 4 over the 256 trained
tokens) and writes runs/long_context_recall_<scaling>. Training records ask the facts of their
context (one turn each, as many as fit), mix lengths log-uniformly from 64 tokens to
train.seq_len, so the extension keeps the short data, and hold up to 3 facts per 64 tokens
(`data.synthetic_recall_density`: more distractors and questions per context than evaluated).
The 256-token runs measure 1024 tokens too, past their trained context, so they say so:
`sampling.max_context=1024`.

Why `kv` and not `recall` ("QZX=4821."): with "=" between key and value, the first digit follows
the same "=" in every fact, so the induction match that copies a value (each digit follows the
one before) picks a fact at random. Measured (`recall`, 1000 + 300 steps of the earlier recipe):
86-91% of wrong answers were another fact's value, held-out accuracy at 256 tokens 23% with 4
facts (chance 25%). Neither 392 more steps on contexts only at 160-232 tokens nor 251 steps of
denser contexts (3 facts per 64 tokens) moved it off chance. With the value right after the key,
the last letter of the key is the context of the first digit and the same match reads it.

Measured on the shared 2-core CPU, one core per run, load 4-10. NOT the issue's target (>= 90% at
256, then at 1024). Each cell is 150 held-out problems (50 per depth, at depths 0/0.5/1), with a
95% Wilson interval. Effective context is the longest length up to which accuracy stays >= 90%:
0 everywhere.
- 800 steps (~12 min): 0.23 at 256 (the answer loss fell from 1.0 to 0.27 between steps 400 and
  800).
- `:more`, 600 steps (~6 min): 0.44 [0.36, 0.52] at 256, 0.05 at 512, 0.00 at 1024. Probes at its
  steps 200 / 500 / 600 read 0.27 / 0.40 / 0.54, still rising. A further 600 steps at 3e-3
  (stopped at step 251 for time) probed 0.50.
- `:extend:<scaling>`, 100 steps at 1024 (~10 min), at 256 / 512 / 1024 tokens:
  none: 0.38 [0.31, 0.46] / 0.17 [0.12, 0.24] / 0.08 [0.05, 0.13]
  linear: 0.01 [0.00, 0.04] / 0.01 [0.00, 0.05] / 0.01 [0.00, 0.04]
  dynamic: 0.43 [0.35, 0.51] / 0.27 [0.21, 0.35] / 0.20 [0.14, 0.27]
  yarn: 0.51 [0.43, 0.59] / 0.33 [0.26, 0.41] / 0.18 [0.13, 0.25]
  llama3: 0.47 [0.39, 0.55] / 0.33 [0.26, 0.41] / 0.19 [0.13, 0.26]
- Two-hop (`multihop`, hops 2, 50 problems at 1024) is 0.00 [0.00, 0.07] after every extension
  measured: it is not in the training mix.
"""

from posttrain.config import base_config

SCALINGS = ("none", "linear", "dynamic", "yarn", "llama3")


def get_config(arg: str = ""):
    mode, _, scaling = arg.partition(":")
    if (
        mode not in ("", "more", "extend")
        or (mode == "extend") != bool(scaling)
        or (scaling and scaling not in SCALINGS)
    ):
        raise ValueError(f"configs/long_context_recall.py:{arg}: expected '', 'more' or 'extend:<one of {SCALINGS}>'")
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
    cfg.data.synthetic, cfg.data.synthetic_size, cfg.data.synthetic_recall_density = "long_context", 16000, 3.0
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files, cfg.sft.sample_tokens, cfg.sft.gate = "", 0, ""
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 800, 16, 256, 50
    cfg.optim.lr, cfg.optim.warmup_steps = 5e-3, 50
    cfg.checkpoint.every = 100
    lc = cfg.eval.long_context
    lc.kinds, lc.lengths, lc.depths, lc.samples, lc.max_new_tokens = "kv", "256,1024", "0,0.5,1", 50, 10
    cfg.sampling.max_context = 1024  # the 1024-token cells are past the 256 trained: measured on purpose
    if mode == "more":  # the answer loss was still falling at step 800: more steps, a fresh order
        cfg.init_from, cfg.workdir, cfg.seed = "runs/long_context_recall", "runs/long_context_recall_more", 1
        cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_steps = 600, 3e-3, 10
        lc.lengths = "256"
    if mode == "extend":
        cfg.init_from, cfg.workdir = "runs/long_context_recall_more", f"runs/long_context_recall_{scaling}"
        cfg.sampling.max_context = 0  # trained at 1024 now: nothing past it
        cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 100, 4, 1024
        cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
        cfg.checkpoint.every = 100
        lc.lengths = "256,512,1024"
        if scaling != "none":
            cfg.model.rope_scaling.update(type=scaling, factor=4.0, original_max_position_embeddings=256)
            if scaling == "linear":
                cfg.model.rope_scaling.original_max_position_embeddings = 0
    return cfg
