"""Vision on CPU: SFT then GRPO on a rendered visual task a tiny policy learns to read
(`colour_count`: "How many green shapes are there?", 0-3 of each colour on a 3x3 grid of 48x48
pixels), with a dense decoder whose image placeholders take linearly projected 16x16 patches
(`model.vision`), one patch per grid cell.

Write the task files first (PNGs and JSONL records; held-out scenes are disjoint by meaning), then run:

    python tools/visual_tasks.py --out runs/vision_tiny_tasks --n 4000 --eval 128 --kinds colour_count \\
        --sft-error-rate 0.6
    python -m posttrain.main --config configs/vision_tiny.py

Stage 1 (SFT, 800 steps) trains on runs/vision_tiny_tasks/sft_train.jsonl (an image, a question,
`\\boxed{answer}`; held-out loss on runs/vision_tiny_tasks/sft_eval.jsonl). As the quickstart's
arithmetic teacher, the SFT teacher is sloppy: 60% of its answers count one too many, so imitation
learns to read the image and to overcount; stage 2 (RLVR, GRPO, 60 updates) on
runs/vision_tiny_tasks/rl_train.jsonl (another draw of the training split, exact answers) unlearns
the overcount. Greedy held-out accuracy (runs/vision_tiny_tasks/rl_eval.jsonl, exact answers) is
evaluated before RL (= after SFT) and every 10 updates. The control: the RL'd policy on the
held-out questions with a blank image (runs/vision_tiny_tasks/rl_eval_blank.jsonl); its step-0
`eval/accuracy` (before the one update this command makes) is the figure:

    python -m posttrain.main --config configs/vision_tiny.py --config.stage=rlvr \\
        --config.workdir=runs/vision_tiny_blank --config.init_from=runs/vision_tiny/1_rlvr \\
        --config.rl.eval_files=runs/vision_tiny_tasks/rl_eval_blank.jsonl --config.rl.steps=1

(`rl.lr=0` would not stop the blank run's update: a stage's lr 0 means `optim.lr`.) Over
initialisations, every seed with its own SFT run and the same task files, then each seed's control:

    python tools/seeds.py configs/vision_tiny.py --seeds 0,1,2 --threads 1 \\
        --metrics sft:eval/loss,rlvr:eval/accuracy@first,rlvr:eval/accuracy
    python tools/seeds.py configs/vision_tiny.py --seeds 0,1,2 --threads 1 \\
        --workdir_root runs/seeds/vision_tiny_blank --metrics rlvr:eval/accuracy@first -- \\
        --config.stage=rlvr --config.init_from=runs/seeds/vision_tiny/seed{seed}/1_rlvr \\
        --config.rl.eval_files=runs/vision_tiny_tasks/rl_eval_blank.jsonl --config.rl.steps=1

Measured over three initialisations with tools/seeds.py (BENCHMARKS.md, "Vision over
initialisations"; n = 128 held-out questions, greedy): seeds 0 / 1 / 2 24.2 / 39.8 / 33.6% after
SFT, 82.0 / 82.0 / 93.0% after 60 GRPO updates, mean 32.6% -> 85.7%, a gain of +53.1 points (+42.2
to +59.4); the RL'd policy given blank images scores 18.8% in every seed, the share of questions
whose answer is "0" (what a blank image shows), below a uniform guess (25%) and the best image-blind
answer (31.2%): it reads the images. The learner's log-probs equal the sampler's with the images
(rl/behav_gap_max <= 2.9e-6). By seed-0 probes (one initialisation each): with an exact teacher the
same SFT reaches 99.2% and leaves RL nothing to learn; the earlier recipe (bar_max and shape_count,
8x8 patches) stayed image-blind at 31.2%.
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
    # 48x48 scenes as drawn, 9 patches of 16x16: one per cell of the colour_count grid (8x8 patches
    # cut each shape in four and learned far slower: BENCHMARKS.md)
    m.vision.encoder, m.vision.image_size, m.vision.patch_size = "linear", 48, 16
    cfg.data.tokenizer = "byte"
    cfg.sft.train_files = f"{TASKS}/sft_train.jsonl"
    cfg.sft.eval_files = f"{TASKS}/sft_eval.jsonl"
    cfg.sft.steps, cfg.sft.lr = 800, 3e-3
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every = 16, 192, 10
    cfg.sft.sample_tokens = 12
    cfg.train.eval_every = 100
    cfg.rl.domains = ""
    cfg.rl.train_files = f"{TASKS}/rl_train.jsonl"
    cfg.rl.eval_files = f"{TASKS}/rl_eval.jsonl"
    cfg.rl.steps, cfg.rl.lr = 60, 5e-4
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 8, 8, 12
    cfg.rl.eval_every, cfg.rl.eval_size, cfg.rl.eval_samples = 10, 128, 4
    cfg.checkpoint.every = 100
    return cfg
