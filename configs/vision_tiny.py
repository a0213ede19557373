"""Vision on CPU: SFT then GRPO on rendered visual tasks (bar charts, shape scenes) with a tiny
dense decoder whose image placeholders take linearly projected 8x8 patches (`model.vision`).

Write the task files first (PNGs and JSONL records; held-out scenes are disjoint by meaning), then run:

    python tools/visual_tasks.py --out runs/vision_tiny_tasks --n 4000 --eval 128 --kinds bar_max,shape_count
    python -m posttrain.main --config configs/vision_tiny.py

Stage 1 (SFT) trains on runs/vision_tiny_tasks/sft_train.jsonl (an image, a question, `\\boxed{answer}`;
held-out loss on runs/vision_tiny_tasks/sft_eval.jsonl);
stage 2 (RLVR, GRPO) on runs/vision_tiny_tasks/rl_train.jsonl (another draw of the training split),
evaluating greedy held-out accuracy (runs/vision_tiny_tasks/rl_eval.jsonl) before RL (= after SFT) and
every 10 updates. The control: the same policy on the held-out questions with a blank image
(runs/vision_tiny_tasks/rl_eval_blank.jsonl) should fall to chance (the image, not the text, carries
the answer):

    python -m posttrain.main --config configs/vision_tiny.py --config.stage=rlvr \\
        --config.workdir=runs/vision_tiny_blank --config.init_from=runs/vision_tiny/1_rlvr \\
        --config.rl.eval_files=runs/vision_tiny_tasks/rl_eval_blank.jsonl --config.rl.steps=1 --config.rl.lr=0

Measured (BENCHMARKS.md, "Vision: rendered visual tasks"; seed 0, n = 128): 31.2% greedy held-out
accuracy after SFT, 31.2% after 40 GRPO updates, 31.2% on blank images -- short of the goal: this
tiny model answers each question kind with its commonest answer (the text-only baseline is 32.8%)
and does not read the images; RL then has nothing to sharpen. The learner's log-probs equal the
sampler's with the images (rl/behav_gap_max 0.0).
"""

from posttrain.config import base_config

TASKS = "runs/vision_tiny_tasks"


def get_config():
    cfg = base_config()
    cfg.stage = "pipeline"
    cfg.workdir = "runs/vision_tiny"
    cfg.pipeline.stages = ("sft", "rlvr")
    m = cfg.model
    m.vocab_size, m.embed_dim, m.num_layers, m.num_heads, m.num_kv_heads, m.head_dim = 264, 64, 2, 4, 2, 16
    m.mlp_dim = 128
    # 48x48 scenes as drawn (no resampling of the 3x5 glyphs), 36 patches of 8x8 each
    m.vision.encoder, m.vision.image_size, m.vision.patch_size = "linear", 48, 8
    cfg.data.tokenizer = "byte"
    cfg.sft.train_files = f"{TASKS}/sft_train.jsonl"
    cfg.sft.eval_files = f"{TASKS}/sft_eval.jsonl"
    cfg.sft.steps, cfg.sft.lr = 600, 3e-3
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 16, 192, 10
    cfg.sft.sample_tokens = 12
    cfg.train.eval_every = 100
    cfg.rl.domains = ""
    cfg.rl.train_files = f"{TASKS}/rl_train.jsonl"
    cfg.rl.eval_files = f"{TASKS}/rl_eval.jsonl"
    cfg.rl.steps, cfg.rl.lr = 40, 1e-4
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 8, 8, 12
    cfg.rl.eval_every, cfg.rl.eval_size, cfg.rl.eval_samples = 10, 128, 4
    cfg.checkpoint.every = 100
    return cfg
