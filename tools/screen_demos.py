"""SFT demonstrations for the screenshot agent: honest episodes of screen tasks (`rl/tasks/screen_domain.py`)
written as `{"messages": [...]}` records, each screen a PNG under `--out/screens/` (paths relative to
the JSONL file's folder), exactly the conversation `ScreenEnv` shows in an RL episode.

    python tools/screen_demos.py --out runs/screens --n 600 --eval 60 --seed 1

Writes `screen_sft_train.jsonl` (train-split tasks) and `screen_sft_eval.jsonl` (held-out tasks, for
the SFT evaluation loss; never trained on). `--by xy` clicks at pixel coordinates (the policy must
find the element in the image), `label` clicks by label, `both` alternates.
"""

from __future__ import annotations

import argparse
import json
import os

from posttrain.rl.envs.screen_env import SCREEN_SYSTEM_PROMPT, demo_messages
from posttrain.rl.tasks.screen_domain import KINDS, screen_tasks

SCREENS = "screens"


def _relative(messages: list[dict], out: str) -> list[dict]:
    """The messages with image paths made relative to `out` (the JSONL file's folder)."""
    rel = []
    for m in messages:
        content = m["content"]
        if isinstance(content, list):
            content = [{**p, "image": os.path.relpath(p["image"], out)} if p["type"] == "image" else p for p in content]
        rel.append({**m, "content": content})
    return rel


def write_screen_demos(
    out: str,
    n: int,
    n_eval: int,
    seed: int = 1,
    *,
    by: str = "both",
    kinds: tuple[str, ...] = KINDS,
    system_prompt: str | None = SCREEN_SYSTEM_PROMPT,
) -> dict[str, int]:
    """Write the demonstration files (module docstring) under `out`; returns records per file."""
    if by not in ("xy", "label", "both"):
        raise ValueError(f"by={by!r}: expected xy, label or both")
    os.makedirs(out, exist_ok=True)
    image_dir = os.path.join(os.path.abspath(out), SCREENS)
    counts = {}
    for name, split, count in (("screen_sft_train.jsonl", "train", n), ("screen_sft_eval.jsonl", "test", n_eval)):
        records = []
        for i, task in enumerate(screen_tasks(count, seed, split, kinds=kinds)):
            by_xy = by == "xy" or (by == "both" and i % 2 == 0)
            messages = demo_messages(task, image_dir, by_xy=by_xy, system_prompt=system_prompt)
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
    p.add_argument("--by", default="both", choices=("xy", "label", "both"))
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds {','.join(bad)}: expected some of {KINDS}")
    for name, count in write_screen_demos(args.out, args.n, args.eval, args.seed, by=args.by, kinds=kinds).items():
        print(f"{args.out}/{name}: {count} demonstrations")


if __name__ == "__main__":
    main()
