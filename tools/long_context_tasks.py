"""Long-context RL task files: needle, multi-hop and recall problems over long documents, as
`rl.train_files` / `rl.eval_files` records with exact integer answers (the math verifier).

    python tools/long_context_tasks.py --out runs/lc_tasks --lengths 256,512 --kinds multihop,needle
    python -m posttrain.main --config configs/rlvr_tiny.py --config.rl.train_files=runs/lc_tasks/train.jsonl \\
        --config.rl.eval_files=runs/lc_tasks/eval.jsonl --config.rl.domains= --config.mesh.sequence=2

Training records come from the `train` name space of `posttrain.eval.long_context` and held-out
ones from its `eval` name space, whose names are disjoint by construction (every fact asked in an
evaluation document names a thing no training document mentions). Each record's domain is
`long_context_<kind>` and its difficulty the document's length, so the run's metrics break
accuracy down by kind and length. Lengths count tokens of the byte tokenizer (`--tokenizer` for
another); the prompt is the document and question, the answer the integer asked for.
"""

from __future__ import annotations

import argparse
import json
import os

from posttrain.data.tokenizer import load_tokenizer
from posttrain.eval.long_context import KINDS, generate_problem


def task_records(split: str, n: int, lengths, kinds, *, hops: int = 2, seed: int = 0, count=None) -> list[dict]:
    """`n` RL task records of `split` ("train" or "eval"), kinds and lengths in turn, depths spread
    over [0, 1]: {"prompt", "answer", "domain", "id", "difficulty"}."""
    count = count or (lambda s: len(s.encode()))
    records = []
    for i in range(n):
        kind, length = kinds[i % len(kinds)], lengths[(i // len(kinds)) % len(lengths)]
        depth = (i * 0.618034) % 1.0  # golden-ratio steps: every depth band, no two alike
        p = generate_problem(kind, length, depth, hops=hops, index=i, seed=seed, split=split, count=count)
        records.append(
            {
                "prompt": p.prompt,
                "answer": p.answer,
                "domain": f"long_context_{kind}",
                "id": f"{split}-{i}",
                "difficulty": length,
            }
        )
    return records


def main(argv=None) -> None:
    """Write `<out>/train.jsonl` and `<out>/eval.jsonl`."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--lengths", default="256", help="document lengths in tokens, comma-separated")
    p.add_argument("--kinds", default="multihop", help=f"comma-separated, of {KINDS}")
    p.add_argument("--hops", type=int, default=2, help="facts chained per multi-hop problem")
    p.add_argument("--train", type=int, default=512, help="training problems")
    p.add_argument("--eval", type=int, default=64, help="held-out problems")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--tokenizer", default="byte", help="what lengths are counted in (data.tokenizer)")
    args = p.parse_args(argv)
    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    if bad := [k for k in kinds if k not in KINDS]:
        p.error(f"--kinds {','.join(bad)}: expected some of {KINDS}")
    lengths = tuple(int(x) for x in args.lengths.split(","))
    tok = load_tokenizer(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    for split, n in (("train", args.train), ("eval", args.eval)):
        recs = task_records(
            split, n, lengths, kinds, hops=args.hops, seed=args.seed, count=lambda s: len(tok.encode(s))
        )
        with open(os.path.join(args.out, f"{split}.jsonl"), "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in recs)
        print(f"{args.out}/{split}.jsonl: {n} problems, kinds {kinds}, lengths {lengths}")


if __name__ == "__main__":
    main()
