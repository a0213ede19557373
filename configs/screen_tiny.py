"""The screenshot agent on CPU: SFT then GRPO on multi-turn episodes on rendered 64x64 screens
(`rl/envs/screen_env.py`; `rl.env=screen`, `rl.domains=screen`): list items, fields and buttons,
one action a turn (`click(X, Y)`, `click("LABEL")`, `type("TEXT")`), reward 1 only when OK is pressed
in the goal state. A dense decoder whose image placeholders take linearly projected 16x16 patches,
each plus a learned embedding of its place in the screen (`model.vision`: 16 per screen,
`patch_positions`).

Write the demonstrations first (PNGs and JSONL records; held-out tasks disjoint by meaning), then run:

    python tools/screen_demos.py --out runs/screen_tiny_demos --n 4000 --eval 56 --by named --error-rate 0.5 \\
        --error-kinds select,type --kinds marked,select,marked,type
    python -m posttrain.main --config configs/screen_tiny.py

Stage 1 (SFT, 800 steps on runs/screen_tiny_demos/screen_sft_train.jsonl; held-out loss on
runs/screen_tiny_demos/screen_sft_eval.jsonl) imitates a teacher that clicks by label what the
instruction names (the `select` item, the `type` field, OK) and at pixels the `marked` item (which
one is marked, filled red, only the screen shows; half the demonstrations are `marked`). It is
sloppy where the instruction holds the answer: half its `select` and `type` demonstrations press OK
one action too early (before selecting, or before typing), so imitation learns the habit. Stage 2
(RLVR, GRPO) plays episodes in the environment and is paid only for the goal state. Greedy held-out
success (`eval/accuracy`, all 56 distinct held-out tasks: 19 select, 19 marked, 18 type; per kind
`eval/accuracy/<kind>`) is evaluated before RL (= after SFT) and every `rl.eval_every` updates.
Other seeds: `--config.seed=1 --config.workdir=runs/screen_tiny_s1` with the same demonstrations
(the RL tasks and the held-out draw follow the seed). The blank-screen control (the RL'd policy
with every screen white; its step-0 `eval/accuracy` is the figure, before the one update the command
makes):

    python tools/screen_blank.py --config configs/screen_tiny.py --config.stage=rlvr \\
        --config.workdir=runs/screen_tiny_blank --config.init_from=runs/screen_tiny/1_rlvr --config.rl.steps=1

Measured (BENCHMARKS.md, "Screenshot agent"; n = 56 held-out tasks, 3 seeds): greedy held-out
success 23.2% after SFT (14.3-37.5%), 63.1% after 30 GRPO updates (57.1-73.2%), a gain of +39.9
points (+35.7 to +42.9), from the unlearned early OK on `select` and `type`; the learner's log-probs
equal the sampler's (rl/behav_gap_max <= 4.8e-6). Screen reading (`marked`) formed in one seed of
three: seed 2 clicks the marked item on 19/19 held-out screens, 6/19 with blank screens; seeds 0
and 1 click one fixed point (26-32%, as much with blank screens), and RL did not teach them to read.
"""

from configs.vision_tiny import get_config as vision_config

DEMOS = "runs/screen_tiny_demos"


def get_config():
    cfg = vision_config()  # its policy: the dense decoder with linear patches, byte tokens, SFT and RL lrs
    cfg.workdir = "runs/screen_tiny"
    # screens render at 64x64 (screen_domain.screen_tasks): 16 patches of 16x16 (8x8 patches, 64 per
    # screen, made an RL update of 64 episodes take ~1 CPU-minute)
    cfg.model.vision.image_size = 64
    # where the marked item stands is what the policy must read: a learned embedding of each patch's
    # place (with it and the red fill, 600 steps on `marked` alone read 72/72 held-out screens; with a
    # 3-pixel mark neither it, the plain linear embedding nor the vit tower left the image-blind loss)
    cfg.model.vision.patch_positions = True
    cfg.sft.train_files = f"{DEMOS}/screen_sft_train.jsonl"
    cfg.sft.eval_files = f"{DEMOS}/screen_sft_eval.jsonl"
    cfg.sft.steps, cfg.sft.sample_tokens = 800, 0
    # an episode is 280-370 tokens (the system prompt, 1-3 screens of 16 patches, the actions)
    cfg.train.batch_size, cfg.train.seq_len, cfg.train.log_every, cfg.train.eval_every = 16, 384, 10, 50
    r = cfg.rl
    r.env, r.domains, r.train_files, r.eval_files, r.max_turns, r.max_new_tokens = "screen", "screen", "", "", 4, 16
    r.steps = 30
    r.prompts_per_step, r.group_size = 4, 8
    r.eval_every, r.eval_size, r.eval_samples = 10, 56, 2
    return cfg
