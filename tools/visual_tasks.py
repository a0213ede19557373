"""Verifiable visual tasks as files: rendered charts, tables and shape scenes (PNG) with SFT and RL
task records that point at them (`posttrain/rl/tasks/visual.py` says what the problems are).

    python tools/visual_tasks.py --out runs/visual --n 2000 --eval 128 --seed 0
    python -m posttrain.main --config configs/x.py --config.sft.train_files=runs/visual/sft_train.jsonl ...
    python -m posttrain.main --config configs/x.py --config.rl.train_files=runs/visual/rl_train.jsonl \\
        --config.rl.eval_files=runs/visual/rl_eval.jsonl --config.rl.domains=

Writes, under --out:
- `images/<hash>.png`: one file per distinct rendering (named by a hash of its bytes);
- `sft_train.jsonl`, `sft_eval.jsonl`: `{"messages": [user turn with the image and the question,
  assistant turn "\\boxed{answer}"]}`; with `--sft-error-rate p`, that fraction of the SFT
  training answers that are integers come from a sloppy teacher who counts one too many (as the
  quickstart's arithmetic teacher): imitation learns the mistake, RL with the exact verifier can
  unlearn it (held-out and RL answers are always exact);
- `rl_train.jsonl`, `rl_eval.jsonl`: `{"prompt": [user turn], "answer", "domain", "id",
  "difficulty"}`, plus `"verifier": "label", "choices"` where the answer is a label;
- `rl_eval_blank.jsonl`: the held-out tasks with a blank image instead (the control: a policy that
  reads the image should fall to chance on it).
Image paths in records are relative to the JSONL file's folder. SFT training problems and RL
training problems are separate draws of the train split; held-out problems are from the test split
(disjoint by meaning: see `visual_split`). The same arguments write the same bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os

import numpy as np

from posttrain.rl.envs.draw import png_bytes
from posttrain.rl.tasks.visual import INSTRUCTION, KINDS, SCENE_OF, SIZES, sft_record, task_record, visual_problems
from posttrain.rl.tasks.visual_render import blank, render

IMAGES = "images"


def _write_image(out: str, data: bytes) -> str:
    """Write PNG bytes under `out/images/` by content hash; returns the path relative to `out`."""
    rel = f"{IMAGES}/{hashlib.sha256(data).hexdigest()[:20]}.png"
    path = os.path.join(out, rel)
    if not os.path.exists(path):
        with open(path, "wb") as f:
            f.write(data)
    return rel


def _write_jsonl(path: str, records: list[dict]) -> None:
    with open(path, "w") as f:
        f.writelines(json.dumps(r, sort_keys=True) + "\n" for r in records)


def write_visual_tasks(
    out: str,
    n: int,
    n_eval: int,
    seed: int = 0,
    *,
    kinds: tuple[str, ...] = KINDS,
    sizes: dict[str, int] | None = None,
    max_value: int = 8,
    instruction: str = INSTRUCTION,
    sft_error_rate: float = 0.0,
) -> dict[str, int]:
    """Write the images and record files (module docstring) under `out`; returns records per file."""
    if not 0.0 <= sft_error_rate <= 1.0:
        raise ValueError(f"sft_error_rate={sft_error_rate}: expected a fraction in [0, 1]")
    os.makedirs(os.path.join(out, IMAGES), exist_ok=True)
    kw = dict(kinds=kinds, sizes=sizes, max_value=max_value)
    sft_train = visual_problems(n, seed, "train", **kw)
    rl_train = visual_problems(n, seed + 1, "train", **kw)
    held_out = visual_problems(n_eval, seed, "test", **kw)
    image = {id(p): _write_image(out, png_bytes(render(p.scene))) for p in sft_train + rl_train + held_out}
    sloppy = np.random.default_rng([seed, 7]).random(len(sft_train)) < sft_error_rate
    taught = [
        dataclasses.replace(p, answer=str(int(p.answer) + 1)) if wrong and p.choices is None else p
        for p, wrong in zip(sft_train, sloppy)
    ]
    blanks = {s: _write_image(out, png_bytes(blank(s))) for s in {p.scene.size for p in held_out}}
    files = {
        "sft_train.jsonl": [sft_record(t, image[id(p)], instruction) for p, t in zip(sft_train, taught)],
        "sft_eval.jsonl": [sft_record(p, image[id(p)], instruction) for p in held_out],
        "rl_train.jsonl": [task_record(p, image[id(p)], f"train-{i}", instruction) for i, p in enumerate(rl_train)],
        "rl_eval.jsonl": [task_record(p, image[id(p)], f"eval-{i}", instruction) for i, p in enumerate(held_out)],
        "rl_eval_blank.jsonl": [
            task_record(p, blanks[p.scene.size], f"eval-blank-{i}", instruction) for i, p in enumerate(held_out)
        ],
    }
    for name, records in files.items():
        _write_jsonl(os.path.join(out, name), records)
    return {name: len(records) for name, records in files.items()}


def _sizes(spec: str) -> dict[str, int]:
    """ "48" (every scene) or "chart=48,table=64" → {scene: side}."""
    if spec.isdigit():
        return dict.fromkeys(SIZES, int(spec))
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, side = part.partition("=")
        if name not in SIZES or not side.isdigit():
            raise ValueError(f"--size {spec!r}: expected a side or scene=side with scenes {sorted(SIZES)}")
        out[name] = int(side)
    return out


def main(argv=None) -> None:
    """The command line (module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--n", type=int, default=2000, help="training problems (SFT and RL each)")
    p.add_argument("--eval", type=int, default=128, help="held-out problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {KINDS}")
    p.add_argument("--size", default="", help="image side in pixels: 48, or chart=48,table=64,shapes=32")
    p.add_argument("--max-value", type=int, default=8, help="the tallest bar a chart may have")
    p.add_argument(
        "--sft-error-rate", type=float, default=0.0, help="fraction of SFT training integer answers one too many"
    )
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds {','.join(bad)}: expected some of {KINDS}")
    try:
        sizes = _sizes(args.size) if args.size else None
    except ValueError as e:
        p.error(str(e))
    if min((sizes or SIZES)[SCENE_OF[k]] for k in kinds) < 24:
        p.error("--size: images under 24 pixels cannot show the labels")
    counts = write_visual_tasks(
        args.out,
        args.n,
        args.eval,
        args.seed,
        kinds=kinds,
        sizes=sizes,
        max_value=args.max_value,
        sft_error_rate=args.sft_error_rate,
    )
    for name, count in counts.items():
        print(f"{args.out}/{name}: {count} records")


if __name__ == "__main__":
    main()
