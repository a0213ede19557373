"""Long-context retrieval that a small byte-level decoder learns on CPU: key-value recall with the
value right after its key ("... QZX4821. ... BDW7730. ..." → "QZX?" → "QZX4821", kind `kv` in
`posttrain/eval/long_context.py`; `needle` with `--config.eval.long_context.kinds=needle`), 1 +
length/64 facts per evaluated context, held-out keys disjoint from training ones by a hash of the
key. Two stages: 256 tokens (3200 steps), then an extension to 1024 from that checkpoint under a
RoPE scaling (`:extend:<scaling>`, 200 steps; 300 more from it with `--config.init_from=` the
extension and `--config.train.steps=300`).

    python -m posttrain.main --config configs/long_context_recall.py                     # 256 tokens
    python -m posttrain.main --config configs/long_context_recall.py:extend:llama3       # → 1024
    python tools/long_context_eval.py --run runs/long_context_recall_llama3 --samples 50 \\
        --out runs/long_context_recall_llama3/grid

`:extend:<scaling>` starts from runs/long_context_recall (`init_from`) with `model.rope_scaling`
none | linear | dynamic | yarn | llama3 (factor 4 over the 256 trained tokens), trains on
contexts of 256-1000 tokens (`data.synthetic_min_length`) and writes
runs/long_context_recall_<scaling>; its end-of-run grid is 50 held-out problems per (length,
depth) at 256 / 512 / 1024 × 0 / 0.5 / 1. Training records ask the facts of their context (one
turn each, as many as fit), mix lengths log-uniformly from 64 tokens (256 when extending) to
train.seq_len, and hold up to 3 facts per 64 tokens (`data.synthetic_recall_density`: more
distractors and questions per context than evaluated).

Measured over initialisations (issue 46; BENCHMARKS.md, "kv recall from another initialisation";
150 held-out problems at 256, greedy; one core a run, ~45 min for 3200 steps when the core is free):
- kv at 256 after 3200 steps, seeds 0 / 1 / 2: 0.95 / 0.94 / 0.89 (all three >= 0.85), by
  `python tools/seeds.py configs/long_context_recall.py --seeds 0,1,2 --parallel 2`. At 1600 steps
  0.93 / 0.87 / 0.65: seed 2 forms later. The recipe that came before (width 64, MLP 256, 1600 steps,
  cosine decay to 0.1 × lr) gave 0.89 from seed 0 and 0.19 from seed 1 (0.45 at step 1600 and 0.69 at
  2400 in a longer run). Twice the width (embed 128, MLP 512) with a constant lr after warm-up
  formed the match earliest of the levers tried; qk-norm stalled it at ~0.2 (one seed-1 run a lever:
  directions, not sizes).
- needle at 256 (`--config.eval.long_context.kinds=needle --config.train.steps=1200`), seeds
  0 / 1 / 2: 0.97 / 0.95 / 0.99 (3 of 3 >= 0.9; 0.99 / 0.87 / 0.94 at step 800), ~20 min a seed.
  Each extended to 1024 (`:extend:llama3 --config.init_from=<its run>
  --config.eval.long_context.kinds=needle --config.train.steps=600
  --config.data.synthetic_min_length=512`, ~35 min a seed): needle at 1024 1.00 / 1.00 / 1.00
  (3 of 3 >= 0.9, each past 0.9 after 200 steps; BENCHMARKS.md, "Needle at 256 and at 1024 over
  initialisations").
- kv extended to 1024 (`:extend:llama3 --config.init_from=<its 256-token run>`, the default 200
  steps, ~11 min a seed): kv at 256 / 512 / 1024 0.99 / 1.00 / 0.99, 1.00 / 0.97 / 0.90 and 0.93 /
  0.87 / 0.73 for seeds 0 / 1 / 2 (2 of 3 >= 0.9 at 1024; the weakest at 256 stays the weakest).

Measured on the recipe before (width 64, one initialisation, seed 0; not re-measured on this one;
BENCHMARKS.md, "Retrieval at length: needle >= 90% at 1024 ..." and "Retrieval at length with lr
1e-3", issue 28; shared 2-core CPU, one core per run; 150 held-out problems per length, 50 per depth):
- kv, 1600 steps at 256: 0.89 at 256. + 200 steps of `:extend:<scaling>`, at 256 / 512 / 1024
  (effective context): none 0.92 / 0.85 / 0.43 (256), linear 0.06 / 0.03 / 0.01 (0), dynamic
  0.94 / 0.90 / 0.78 (512; 0.66 / 0.65 / 0.68 while its base grew per call), yarn 0.92 / 0.91 /
  0.71 (512), llama3 0.95 / 0.93 / 0.75 (512).
- needle (800 + 800 steps at 256): 0.96 at 256; + llama3 200 + 300 steps, + 300 steps on contexts
  of 512-1000 tokens (`--config.data.synthetic_min_length=512`): 0.96 / 0.97 / 0.93, effective
  context 1024.

Why lr 1e-3 (one initialisation a setting, on the width-64 recipe): at 5e-3 (the earlier rounds,
BENCHMARKS "... earlier rounds at lr 5e-3") the key match formed in 1 of 4 runs by step 1600; at
1e-3 it forms by step ~1000. Why `kv` and not `recall` ("QZX=4821."): with "=" between key and
value, the first digit follows the same "=" in every fact, so the induction match that copies a
value picks a fact at random (chance in the earlier recipe). With the value right after the key, the
key's letters are the context of the first digit and the match can read them.
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
    # lets the match read the whole key (held-out accuracy at 256: 0.63 -> 0.76, one run each at lr 5e-3;
    # the 0.76 was 1 of 4 runs of that recipe: BENCHMARKS.md).
    # head_dim 32 (16 before): the key match is a content match over up to 1024 positions, which
    # only RoPE's slow frequencies leave intact; 32 dims per head have twice as many of them
    # embed 128 / MLP 512 (64 / 256 before): at width 64 the match formed by step 1600 from seed 0 and
    # not from seed 1 (0.45 at 1600); twice the width formed it in 3 of 3 seeds (issue 46)
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim, m.mlp_dim = (
        264,
        128,
        3,
        4,
        4,
        32,
        512,
    )
    cfg.data.synthetic, cfg.data.synthetic_size, cfg.data.synthetic_recall_density = "long_context", 16000, 3.0
    cfg.sft.train_files = "synthetic:"
    cfg.sft.eval_files, cfg.sft.sample_tokens, cfg.sft.gate = "", 0, ""
    # 3200 steps (1600 before): seed 2 reaches 0.85 between steps 2400 and 2800; held-out kv every 400
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 3200, 16, 256, 50
    cfg.train.eval_every = 400
    # lr 1e-3 (5e-3 before): at 5e-3 the match formed in 1 of 4 runs by step 1600 (kv 0.14-0.23 at 256
    # in the other 3); at 1e-3 it forms by step ~1000 (kv 0.86 at step 1500; needle 0.98)
    cfg.optim.lr, cfg.optim.warmup_steps = 1e-3, 50
    # a constant lr after warm-up (cosine to 0.1 × lr before): the cosine slowed the late part of
    # formation (seed 1 at step 1600: 0.45 with it, 0.67 without); the steps can then be extended by
    # resuming with a larger train.steps, the steps already taken unchanged
    cfg.optim.min_lr_ratio = 1.0
    cfg.checkpoint.every = 250
    lc = cfg.eval.long_context
    lc.kinds, lc.lengths, lc.depths, lc.samples, lc.max_new_tokens = "kv", "256", "0,0.5,1", 50, 10
    if mode == "extend":
        cfg.init_from, cfg.workdir = "runs/long_context_recall", f"runs/long_context_recall_{scaling}"
        cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 200, 4, 1024
        cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.min_lr_ratio = 1e-3, 10, 0.1  # as measured
        cfg.train.eval_every = 0
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
