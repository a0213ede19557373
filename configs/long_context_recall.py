"""Long-context retrieval that a small byte-level decoder learns on CPU: key-value recall with the
value right after its key ("... QZX4821. ... BDW7730. ..." → "QZX?" → "QZX4821", kind `kv` in
`posttrain/eval/long_context.py`), 1 + length/64 facts per evaluated context, held-out keys
disjoint from training ones by a hash of the key. Two runs: 256 tokens (1500 steps), then an
extension to 1024 from that checkpoint under a RoPE scaling (200 steps).

    python -m posttrain.main --config configs/long_context_recall.py                     # 256 tokens
    python tools/long_context_eval.py --run runs/long_context_recall --lengths 256,512,1024 \\
        --samples 50 --max_context 1024 --out runs/long_context_recall/grid
    python -m posttrain.main --config configs/long_context_recall.py:extend:yarn         # → 1024
    python tools/long_context_eval.py --run runs/long_context_recall_yarn --samples 50 \\
        --out runs/long_context_recall_yarn/grid
    python tools/long_context_eval.py --run runs/long_context_recall_yarn --kinds multihop --hops 2 \\
        --lengths 1024 --depths 0 --samples 50 --out runs/long_context_recall_yarn/multihop

`:extend:<scaling>` starts from runs/long_context_recall (`init_from`) with `model.rope_scaling`
none | linear | dynamic | yarn | llama3 (factor 4 over the 256 trained tokens), trains on
contexts of 256-1000 tokens (`data.synthetic_min_length`) and writes
runs/long_context_recall_<scaling>. Training records ask the facts of their context (one turn
each, as many as fit), mix lengths log-uniformly from 64 tokens (256 when extending) to
train.seq_len, and hold up to 3 facts per 64 tokens (`data.synthetic_recall_density`: more
distractors and questions per context than evaluated).

Why `kv` and not `recall` ("QZX=4821."): with "=" between key and value, the first digit follows
the same "=" in every fact, so the induction match that copies a value picks a fact at random
(held-out 23% with 4 facts, chance 25%, in the earlier recipe). With the value right after the
key, the key's letters are the context of the first digit and the match can read them.

Measured on the shared 2-core CPU, one core per run, load 5-10. NOT the issue's target (>= 90%
at 256, then at 1024). Each cell is 150 held-out problems (50 per depth, at depths 0/0.5/1),
with a 95% Wilson interval; effective context (the longest length up to which accuracy stays
>= 90%) is 0 for every checkpoint measured.
- 256-token run, 1500 steps (~27 min at ~0.9 s/step): 0.63 [0.55, 0.71] at 256, 0.01 at 512,
  0.02 at 1024. Probes (51 problems) at steps 750 / 1000 / 1250 / 1500 read 0.20 / 0.33 / 0.43 /
  0.61: still rising when the schedule ended. 54 of its 55 wrong answers at 256 are another
  fact's whole value (the key match, not the copy, fails); when another fact's key ends in the
  same letter it is right 43% of the time, otherwise 67%.
- `:extend:<scaling>`, 200 steps at 1024 (8-14 min, ~2-4 s/step), at 256 / 512 / 1024 tokens:
  yarn: 0.64 [0.56, 0.71] / 0.63 [0.55, 0.70] / 0.36 [0.29, 0.44]
  none: 0.56 [0.48, 0.64] / 0.53 [0.45, 0.60] / 0.25 [0.18, 0.32]
  dynamic: 0.59 [0.51, 0.67] / 0.60 [0.52, 0.67] / 0.39 [0.31, 0.47]
  llama3: 0.63 [0.55, 0.71] / 0.65 [0.57, 0.72] / 0.40 [0.33, 0.48]
  At 1024, 79 of yarn's 96 wrong answers are another fact's value; half the problems (76 / 150)
  have another key ending in the asked key's letter, and those score 0.29 against 0.43.
- The previous recipe (head_dim 16, 800 + 600 steps at 256, 100 steps at 1024) measured 0.44 at
  256 before extension and, after it, 0.38 / 0.17 / 0.08 (none), 0.01 / 0.01 / 0.01 (linear),
  0.43 / 0.27 / 0.20 (dynamic), 0.51 / 0.33 / 0.18 (yarn), 0.47 / 0.33 / 0.19 (llama3) at
  256 / 512 / 1024; its table is in BENCHMARKS.md. Linear (0.01 everywhere there) was not re-run
  with this recipe.
- Probes during the 256-token run: --config.train.eval_every=250
  --config.eval.long_context.samples=17 (51 problems at 256).
- Two-hop (`multihop`, hops 2, 50 problems at 1024) is not in the training mix: 0.00 [0.00, 0.07]
  after every extension measured.
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
    # head_dim 32 (16 before): the key match is a content match over up to 1024 positions, which
    # only RoPE's slow frequencies leave intact; 32 dims per head have twice as many of them
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        264,
        64,
        2,
        4,
        4,
        32,
        256,
    )
    cfg.data.synthetic, cfg.data.synthetic_size, cfg.data.synthetic_recall_density = "long_context", 16000, 3.0
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files, cfg.sft.sample_tokens, cfg.sft.gate = "", 0, ""
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 1500, 16, 256, 50
    cfg.optim.lr, cfg.optim.warmup_steps = 5e-3, 50
    cfg.checkpoint.every = 250
    lc = cfg.eval.long_context
    lc.kinds, lc.lengths, lc.depths, lc.samples, lc.max_new_tokens = "kv", "256", "0,0.5,1", 50, 10
    if mode == "extend":
        cfg.init_from, cfg.workdir = "runs/long_context_recall", f"runs/long_context_recall_{scaling}"
        cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 200, 4, 1024
        cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 10
        cfg.checkpoint.every = 100
        # contexts from 256 tokens (the trained length) up: 1024-token batches spent on long
        # retrievals, not on the short contexts the 256-token run already learned
        cfg.data.synthetic_min_length = 256
        lc.lengths = "256,512,1024"
        if scaling != "none":
            cfg.model.rope_scaling.update(type=scaling, factor=4.0, original_max_position_embeddings=256)
            if scaling == "linear":
                cfg.model.rope_scaling.original_max_position_embeddings = 0
    return cfg
