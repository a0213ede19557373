"""The screenshot agent on CPU: SFT then GRPO on multi-turn episodes on rendered 64x64 screens
(`rl/envs/screen_env.py`; `rl.env=screen`, `rl.domains=screen`): list items, fields and buttons,
one action a turn (`click(X, Y)`, `click("LABEL")`, `type("TEXT")`), reward 1 only when OK is pressed
in the goal state. A dense decoder whose image placeholders take linearly projected 16x16 patches,
each plus a learned embedding of its place in the screen (`model.vision`: 16 per screen,
`patch_positions`).

Write the demonstrations first (PNGs and JSONL records; held-out tasks disjoint by meaning), then
run the `marked` stage and the recipe from it:

    python tools/screen_demos.py --out runs/screen_tiny_demos --n 4000 --eval 56 --by named --error-rate 0.5 \\
        --error-kinds select,type --kinds marked,select,marked,type
    python tools/screen_demos.py --out runs/screen_tiny_marked_demos --n 3000 --eval 72 --by named --kinds marked
    python -m posttrain.main --config configs/screen_tiny.py:marked      # → runs/screen_tiny_marked
    python -m posttrain.main --config configs/screen_tiny.py             # init_from runs/screen_tiny_marked

`:marked` (SFT, 600 steps from scratch on runs/screen_tiny_marked_demos/screen_sft_train.jsonl,
held-out loss on runs/screen_tiny_marked_demos/screen_sft_eval.jsonl: honest `marked` demonstrations,
"Select the marked item", which one only the screen shows, filled red) forms screen reading
first. Then stage 1 (SFT, 800 steps on runs/screen_tiny_demos/screen_sft_train.jsonl; held-out loss
on runs/screen_tiny_demos/screen_sft_eval.jsonl) imitates a teacher that clicks by label what the
instruction names (the `select` item, the `type` field, OK) and at pixels the `marked` item (half
the demonstrations are `marked`). It is sloppy where the instruction holds the answer: half its
`select` and `type` demonstrations press OK one action too early (before selecting, or before
typing), so imitation learns the habit. Stage 2 (RLVR, GRPO) plays episodes in the environment and
is paid only for the goal state. Greedy held-out success (`eval/accuracy`, all 56 distinct held-out
tasks: 19 select, 19 marked, 18 type; per kind `eval/accuracy/<kind>`) is evaluated before RL (=
after SFT) and every `rl.eval_every` updates. The blank-screen control (the RL'd policy with every
screen white; its step-0 `eval/accuracy` is the figure, before the one update the command makes):

    python tools/screen_blank.py --config configs/screen_tiny.py --config.stage=rlvr \\
        --config.workdir=runs/screen_tiny_blank --config.init_from=runs/screen_tiny/1_rlvr --config.rl.steps=1

Measured over 3 initialisations with tools/seeds.py (BENCHMARKS.md, "The screenshot agent over
initialisations"; each seed's recipe from its own `:marked` run): the policy reads the screen in 3
of 3, clicking the marked item on 19/19 held-out screens after SFT (18-19/19 after RL) and on
5-8/19 with blank screens (the fixed-guess level); greedy held-out success 39.9% after SFT
(33.9-46.4%), 56.5% after 30 GRPO updates (50.0-62.5%), +16.7 points (+16.1 to +17.9); 60 updates
end at 58.3%, flat from update 20 in every seed. Without `:marked` reading formed in 1 seed of 3
(1600 SFT steps did not form it in seed 0 either), and RL's gain was larger (23.2% -> 63.1%, +39.9),
all of it the early OK unlearned on `select` and `type` ("Screenshot agent").
"""

from configs.vision_tiny import get_config as vision_config

DEMOS = "runs/screen_tiny_demos"
MARKED_DEMOS = "runs/screen_tiny_marked_demos"
MODES = ("", "marked")


def get_config(arg: str = ""):
    if arg not in MODES:
        raise ValueError(f"configs/screen_tiny.py:{arg}: expected one of {MODES}")
    cfg = vision_config()  # its policy: the dense decoder with linear patches, byte tokens, SFT and RL lrs
    cfg.workdir = "runs/screen_tiny"
    # screens render at 64x64 (screen_domain.screen_tasks): 16 patches of 16x16 (8x8 patches, 64 per
    # screen, made an RL update of 64 episodes take ~1 CPU-minute)
    cfg.model.vision.image_size = 64
    # where the marked item stands is what the policy must read: a learned embedding of each patch's
    # place (with it and the red fill, 600 steps on `marked` alone read 72/72 held-out screens; with a
    # 3-pixel mark neither it, the plain linear embedding nor the vit tower left the image-blind loss)
    cfg.model.vision.patch_positions = True
    # reading first: the mixed demonstrations alone formed it in 1 seed of 3 in 800 steps (seed 0 not
    # in 1600: held-out loss 0.081); 600 steps on `marked` alone formed it in 3 of 3, and the mixed SFT
    # from there kept it (issue 46, BENCHMARKS.md "The screenshot agent over initialisations")
    cfg.init_from = "runs/screen_tiny_marked"
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
    if arg == "marked":  # the first stage: SFT on honest `marked` demonstrations only, from scratch
        cfg.stage, cfg.init_from, cfg.workdir = "sft", "", "runs/screen_tiny_marked"
        cfg.sft.train_files = f"{MARKED_DEMOS}/screen_sft_train.jsonl"
        cfg.sft.eval_files = f"{MARKED_DEMOS}/screen_sft_eval.jsonl"
        cfg.sft.steps = 600
    return cfg
