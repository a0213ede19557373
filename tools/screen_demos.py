"""SFT demonstrations for the screenshot agent: episodes of screen tasks (`rl/tasks/screen_domain.py`)
written as `{"messages": [...]}` records, each screen a PNG under `--out/screens/` (paths relative to
the JSONL file's folder), exactly the conversation `ScreenEnv` shows in an RL episode.

    python tools/screen_demos.py --out runs/screens --n 600 --eval 60 --seed 1

Writes `screen_sft_train.jsonl` (train-split tasks) and `screen_sft_eval.jsonl` (held-out tasks, for
the SFT evaluation loss; never trained on). `--by xy` clicks at pixel coordinates (the policy must
find the element in the image), `label` clicks by label, `both` alternates, `named` clicks by label
what the instruction names (select's item, type's field, OK) and at pixels the marked item (only the
screen shows which one it is).

`--error-rate p` makes the teacher sloppy, as `tools/visual_tasks.py --sft-error-rate` does: a share
p of the training demonstrations (a seeded draw) press OK one action too early -- before selecting
the item, or after focusing the field but before typing -- a well-formed episode that fails the
state check, so imitation learns the habit and RL (`configs/screen_tiny.py`) has it to unlearn. The
held-out file stays honest. `--error-kinds` limits the sloppiness to some kinds (the rest honest).
"""

from __future__ import annotations

import argparse
import json
import os

import numpy as np

from posttrain.rl.envs.screen import solution
from posttrain.rl.envs.screen_env import SCREEN_SYSTEM_PROMPT, demo_messages
from posttrain.rl.tasks.screen_domain import KINDS, screen_tasks

SCREENS = "screens"
BY = ("xy", "label", "both", "named")


def _relative(messages: list[dict], out: str) -> list[dict]:
    """The messages with image paths made relative to `out` (the JSONL file's folder)."""
    rel = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{**p, "image": os.path.relpath(p["image"], out)} if p["type"] == "image" else p for p in content]
        rel.append({**m, "content": content})
    return rel


def demo_actions(task, by_xy: bool, *, named: bool = False, early_ok: bool = False) -> list[str]:
    """The actions of a demonstration of `task` (a screen Task): the honest ones (`screen.solution`,
    at pixels or by label; `named`: by label except the marked item, at pixels), or with `early_ok`
    the sloppy teacher's: OK pressed in place of the action before it (the item's click, or the
    typing), an episode that fails the state check."""
    if named:
        xy = solution(task.target, by_xy=True)
        actions = [xy[0] if task.difficulty == "marked" else solution(task.target, by_xy=False)[0]]
        actions += solution(task.target, by_xy=False)[1:]
    else:
        actions = solution(task.target, by_xy)
    if early_ok:
        actions = [*actions[:-2], actions[-1]]  # the last action presses OK, in the demonstration's mode
    return actions


def write_screen_demos(
    out: str,
    n: int,
    n_eval: int,
    seed: int = 1,
    *,
    by: str = "both",
    kinds: tuple[str, ...] = KINDS,
    system_prompt: str | None = SCREEN_SYSTEM_PROMPT,
    error_rate: float = 0.0,
    error_kinds: tuple[str, ...] = KINDS,
) -> dict[str, int]:
    """Write the demonstration files (module docstring) under `out`; returns records per file."""
    if by not in BY:
        raise ValueError(f"by={by!r}: expected one of {BY}")
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate={error_rate}: expected a fraction in [0, 1]")
    os.makedirs(out, exist_ok=True)
    image_dir = os.path.join(os.path.abspath(out), SCREENS)
    counts = {}
    for name, split, count in (("screen_sft_train.jsonl", "train", n), ("screen_sft_eval.jsonl", "test", n_eval)):
        sloppy = np.random.default_rng([seed, 7]).random(count) < (error_rate if split == "train" else 0.0)
        records = []
        for i, task in enumerate(screen_tasks(count, seed, split, kinds=kinds)):
            by_xy = by == "xy" or (by == "both" and i % 2 == 0)
            early_ok = bool(sloppy[i]) and task.difficulty in error_kinds
            actions = demo_actions(task, by_xy, named=by == "named", early_ok=early_ok)
            messages = demo_messages(task, image_dir, system_prompt=system_prompt, actions=actions)
            records.append({"messages": _relative(messages, os.path.abspath(out))})
        with open(os.path.join(out, name), "w") as f:
            f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)
        counts[name] = len(records)
    return counts


def main(argv=None) -> None:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=600, help="training demonstrations")
    p.add_argument("--eval", type=int, default=45, help="held-out demonstrations")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--by", default="both", choices=BY)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    p.add_argument("--error-rate", type=float, default=0.0, help="share of training demonstrations pressing OK early")
    p.add_argument(
        "--error-kinds", default=",".join(KINDS), help="the kinds whose demonstrations --error-rate makes sloppy"
    )
    args = p.parse_args(argv)
    kinds, error_kinds = (tuple(k.strip() for k in a.split(",") if k.strip()) for a in (args.kinds, args.error_kinds))
    for flag, given in (("--kinds", kinds), ("--error-kinds", error_kinds)):
        if bad := [k for k in given if k not in KINDS]:
            p.error(f"{flag} {','.join(bad)}: expected some of {KINDS}")
    if not 0.0 <= args.error_rate <= 1.0:
        p.error(f"--error-rate {args.error_rate}: expected a fraction in [0, 1]")
    counts = write_screen_demos(
        args.out,
        args.n,
        args.eval,
        args.seed,
        by=args.by,
        kinds=kinds,
        error_rate=args.error_rate,
        error_kinds=error_kinds,
    )
    for name, count in counts.items():
        print(f"{args.out}/{name}: {count} demonstrations")


if __name__ == "__main__":
    main()
