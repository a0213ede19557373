"""Two-hop retrieval at 512 tokens on CPU, SFT then long-context RLVR with the sequence split over
two devices (`mesh.sequence = 2`): kind `kvchain` of `posttrain/eval/long_context.py`
("... QZX>BDW. ... BDW4821. ..." → "QZX?" → "QZX>BDW4821", the answer checked is the final value),
held-out keys (every key of a problem, intermediate hops included) disjoint from training ones by
a hash of the key.

    python -m posttrain.main --config configs/long_context_recall.py       # the kv model (3 layers)
    python -m posttrain.main --config configs/long_context_hops.py:warm    # SFT from it, 300 steps
    #   (lc28 measured it from a continued kv run: --config.init_from=runs/long_context_recall_more2)
    python tools/long_context_tasks.py --out runs/long_context_hops_tasks --lengths 512 \
        --kinds kvchain --hops 2 --train 512 --eval 128
    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m posttrain.main \
        --config configs/long_context_hops.py:rl --config.seed=0 --config.workdir=runs/long_context_hops_rl_s0
    python tools/long_context_eval.py --run runs/long_context_hops_warm --kinds kvchain,kv \
        --hops 2 --lengths 128,256,512 --depths 0,0.5,1 --samples 17 --out runs/long_context_hops_warm/grid

`:warm` (SFT) starts from runs/long_context_recall (configs/long_context_recall.py's 256-token kv
run; 3 layers, as in branch lcrecall) and trains on kvchain (2 hops) and kv conversations of
64-520 tokens, each asking every chain / fact of its context, for 300 steps: a short run, stopped
early on purpose so RL has something to learn. `:rl` (GRPO) starts from it on 512-token kvchain
problems of the training split (tools/long_context_tasks.py; exact value, the math verifier) with
the learner's attention and the sampler's KV cache split over `mesh.sequence = 2` and rollouts
through continuous batching; it measures greedy held-out accuracy (`eval/accuracy`, 128 problems of
the eval split) before the first update and after the last. Seeds 0, 1, 2 (`--config.seed`)
share the SFT checkpoint. `''` and `:more` are the from-scratch recipe (2 layers, 600 + 600
steps): it learned no retrieval at all (0.00 on kvchain and kv at 128-512 tokens), so RL from it
drew no correct sample and made no update (grad_norm 0).

Measured (BENCHMARKS.md, "Long context: two-hop key chains and RL (issue 28, CPU)"; shared 2-core
CPU). NOT the issue's targets. Chance is 1/3 (3 chains, so 3 values, per 512-token document):
- two-hop (kvchain, 2 hops) at 512 tokens after `:warm` (300 steps, 7.5 min) from
  runs/long_context_recall_more2 (`--config.init_from=`; kv 0.23 at 256, the recall recipe's
  re-run did not form its match, see configs/long_context_recall.py): 0.53 (27/51) [0.40, 0.66],
  kv 0.08; on the RL's 128 held-out problems 0.344: a guess among the 3 values (the intermediate
  key it writes is never the right one). Previous round (kv model at 0.80): 0.35, kv 0.39. From
  scratch (`''` + `:more`, 1200 steps): 0.00 on both.
- RL (20 updates at lr 5e-4, dynamic sampling), greedy held-out (128 problems), before → after:
  seed 0 0.344 → 0.312, seed 1 0.344 → 0.297, seed 2 0.344 → 0.312: no gain (mean −3.6 points);
  train reward 0.26 → 0.33 (mean of updates 1-10 → 11-20). ~20 s per update, ~9.5 min per seed.
  Previous recipe (10 updates at lr 1e-3): 0.258 → 0.234 / 0.227.
- `sampling.prefix_cache` is refused with continuous batching (posttrain/rl/checks.py).
- `sequence = 2` trains as `sequence = 1` (losses equal over the first steps):
  tests/test_long_context_rl.py.
"""

from configs.long_context_recall import get_config as recall_config

TASKS = "runs/long_context_hops_tasks"
MODES = ("", "more", "warm", "rl")


def get_config(arg: str = ""):
    if arg not in MODES:
        raise ValueError(f"configs/long_context_hops.py:{arg}: expected one of {MODES}")
    # the kv model of configs/long_context_recall.py (`:warm` and `:rl` start from its checkpoint,
    # so they keep its shape), its synthetic long-context data and optimiser
    cfg = recall_config()  # '' (from scratch) inherits its lr, 1e-3 since session 15; the from-scratch
    # figures in the docstring were measured at the 5e-3 it had then (not re-measured)
    cfg.workdir = "runs/long_context_hops"
    kv_layers, cfg.model.num_layers = cfg.model.num_layers, 2  # 2: the from-scratch recipe ('' and :more)
    cfg.data.synthetic_size, cfg.data.synthetic_recall_density = 8000, 2.0
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len = 600, 8, 544
    cfg.checkpoint.every = 200
    lc = cfg.eval.long_context
    lc.kinds, lc.hops, lc.lengths, lc.samples, lc.max_new_tokens = "kvchain,kv", 2, "512", 17, 14
    if arg == "more":  # a second SFT run from the first, on the same records (a warm restart of the lr)
        cfg.init_from, cfg.workdir = "runs/long_context_hops", "runs/long_context_hops_more"
        cfg.optim.lr, cfg.optim.warmup_steps = 3e-3, 20
    if arg in ("warm", "rl"):
        cfg.model.num_layers = kv_layers
        cfg.init_from, cfg.workdir = "runs/long_context_recall", "runs/long_context_hops_warm"
        cfg.train.steps, cfg.optim.lr, cfg.optim.warmup_steps = 300, 2e-3, 20
        cfg.checkpoint.every = 100
    if arg == "rl":
        cfg.stage, cfg.init_from, cfg.workdir = "rlvr", "runs/long_context_hops_warm", "runs/long_context_hops_rl"
        lc.lengths = ""  # held-out accuracy is the RL eval's (rl.eval_files); tools/long_context_eval.py for the grid
        cfg.mesh.data, cfg.mesh.sequence = -1, 2
        cfg.sampling.continuous_batching, cfg.sampling.num_slots, cfg.sampling.refill_batch = True, 16, 8
        r = cfg.rl
        r.domains, r.train_files, r.eval_files = "", f"{TASKS}/train.jsonl", f"{TASKS}/eval.jsonl"
        # 20 updates at lr 5e-4 (10 at 1e-3 before: no gain, the train reward did not rise), groups
        # whose 8 rewards are all equal re-drawn (dynamic sampling: every learner row carries signal),
        # held-out accuracy only before the first update and after the last (1.3-2.5 min each)
        r.steps, r.lr, r.filter_groups = 20, 5e-4, True
        r.prompts_per_step, r.group_size, r.max_new_tokens = 4, 8, 14
        r.eval_every, r.eval_size, r.eval_samples = 20, 128, 1
        cfg.optim.warmup_steps = 5
        cfg.checkpoint.every = 20
        cfg.train.log_every = 1
    return cfg
