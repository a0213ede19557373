"""Long-context retrieval that a small byte-level decoder learns on CPU: key-value recall with the
value right after its key ("... QZX4821. ... BDW7730. ..." → "QZX?" → "QZX4821", kind `kv` in
`posttrain/eval/long_context.py`), 1 + length/64 facts per evaluated context, held-out keys
disjoint from training ones by a hash of the key. Two runs: 256 tokens (1600 steps), then an
extension to 1024 from that checkpoint under a RoPE scaling (200 steps).

    python -m posttrain.main --config configs/long_context_recall.py                     # 256 tokens
    python tools/long_context_eval.py --run runs/long_context_recall --lengths 256,512,1024 \\
        --samples 50 --max_context 1024 --out runs/long_context_recall/grid
    python -m posttrain.main --config configs/long_context_recall.py:extend:llama3       # → 1024
    python tools/long_context_eval.py --run runs/long_context_recall_llama3 --samples 50 \\
        --out runs/long_context_recall_llama3/grid
    python tools/long_context_eval.py --run runs/long_context_recall_llama3 --kinds multihop --hops 2 \\
        --lengths 1024 --depths 0 --samples 50 --out runs/long_context_recall_llama3/multihop

At lr 1e-3 (this config; BENCHMARKS "Retrieval at length with lr 1e-3"): kv 0.88 at 256 after
1600 steps (a 51-problem probe); + 200 steps of `:extend:llama3`: 0.95 / 0.93 / 0.75 at 256 / 512 / 1024, + 300 more:
0.95 / 0.97 / 0.88. What follows below about runs that did not form the match is the earlier lr 5e-3.

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

Re-run on a fresh machine (branch lc28; same code, config and training records, the first 300
checked by a hash): the match did NOT form. 0.14 [0.09, 0.21] at 256 (0.00 / 0.00 / 0.42 at
depths 0 / 0.5 / 1: the last fact's value), loss 0.94 at step 1000 and 0.79 at 1600 (against
0.14 by step 1000 below): whether the match forms depends on run-to-run numerics, not on the
recipe alone. Continued from it (`--config.init_from=runs/long_context_recall`, each with
`--config.optim.warmup_steps=10`): 500 steps at a constant 3e-3 (`--config.optim.min_lr_ratio=1.0
--config.train.steps=500 --config.workdir=runs/long_context_recall_more`; loss 0.77 → 0.48,
probes 0.08-0.12), then 600 steps of cosine 3e-3 → 3e-4 from that (`--config.init_from=
runs/long_context_recall_more --config.train.steps=600 --config.workdir=
runs/long_context_recall_more2`; loss 0.13): 0.23 [0.17, 0.31] at 256 (0.04 / 0.44 / 0.22 by
depth), far below the 0.76 below although its training loss is as low. A fresh run with
`--config.seed=1`: loss 0.22 at 1600, 0.23 [0.17, 0.30] at 256 (0.18 / 0.36 / 0.14 by depth).

Measured on the shared 2-core CPU, one core per run, load 5-10. Each grid cell is 150 held-out
problems (50 per depth, at depths 0/0.5/1), with a 95% Wilson interval; effective context is the
longest length up to which accuracy stays >= 90%. This recipe (3 layers, 1600 steps; the earlier
measurement, branch lcrecall):
- 256-token run, 1600 steps (~35 min at ~1.3 s/step): 0.76 [0.69, 0.82] at 256 (0.72 / 0.76 /
  0.80 at depths 0 / 0.5 / 1), 0.14 [0.09, 0.20] at 512, 0.00 [0.00, 0.02] at 1024: effective context 0.
  Probes (51 problems at 256) at steps 750 / 1000 / 1250 / 1500 / 1600: 0.02 / 0.65 / 0.82 /
  0.80 / 0.80; the loss sits at ~1.0 until step ~800 and falls to 0.14 by step 1000 (the match
  forms later than with 2 layers, then at once).
- `:extend:llama3`, 200 steps at 1024 (~28 min at 6-8 s/step under load 10), at 256 / 512 /
  1024: 0.80 [0.73, 0.86] / 0.57 [0.49, 0.64] / 0.27 [0.21, 0.35], effective context 0 (the
  run's own end-of-run grid, eval.long_context: 50 per depth at 0/0.5/1). Below the 2-layer
  recipe's llama3 at 512 and 1024 (0.65 / 0.40): the better match at 256 did not carry over.
  The other scalings were not re-run with this recipe (time).
The previous recipe (2 layers, 1500 steps) measured 0.63 [0.55, 0.71] at 256 (probes 0.20 /
0.33 / 0.43 / 0.61 at 750 / 1000 / 1250 / 1500), its wrong answers another fact's value when
another key ended in the same letter: the 2-layer model matched mostly on the key's last letter.
After its 200-step extensions, at 256 / 512 / 1024: yarn 0.64 / 0.63 / 0.36, none 0.56 / 0.53 /
0.25, dynamic 0.59 / 0.60 / 0.39, llama3 0.63 / 0.65 / 0.40 (BENCHMARKS.md has the intervals
and the earlier head_dim-16 recipe, where linear scored 0.01 everywhere).
Tried and dropped: a curriculum `train.seq_len_schedule="128:1000,256"` (2-layer, 2200 steps
planned): probes 0.04 / 0.06 / 0.08 at steps 1000 / 1250 / 1500, stopped there; records longer
than 128 tokens wait for the 256-token stage (28586 deferred), which then trains on them alone.
- Probes during the 256-token run: --config.train.eval_every=250
  --config.eval.long_context.samples=17 (51 problems at 256).
- Two-hop (`multihop`) is not in the training mix (0.00 [0.00, 0.07] after every extension of
  the previous recipe; not re-measured).
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
    # 3 layers (2 before): the 2-layer model matched mostly on a key's last letter; a third layer
    # lets the match read the whole key (held-out accuracy at 256: 0.63 -> 0.76).
    # head_dim 32 (16 before): the key match is a content match over up to 1024 positions, which
    # only RoPE's slow frequencies leave intact; 32 dims per head have twice as many of them
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        264,
        64,
        3,
        4,
        4,
        32,
        256,
    )
    cfg.data.synthetic, cfg.data.synthetic_size, cfg.data.synthetic_recall_density = "long_context", 16000, 3.0
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files, cfg.sft.sample_tokens, cfg.sft.gate = "", 0, ""
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 1600, 16, 256, 50
    # lr 1e-3 (5e-3 before): at 5e-3 the match formed in 1 of 4 runs by step 1600 (kv 0.14-0.23 at 256
    # in the other 3); at 1e-3 it forms by step ~1000 (kv 0.86 at step 1500; needle 0.98)
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 50
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
