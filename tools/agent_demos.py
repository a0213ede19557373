"""Write SFT demonstrations of the repo_fix agent domain: scripted episodes (read the test, fix
the module, finish) run for real in the sandboxed workspace, as `{"messages": [...]}` JSONL.

    python tools/agent_demos.py --out runs/data/repo_fix_sft.jsonl --n 800 --seed 1

Tasks come from the "train" split only (held-out RL episodes are disjoint by construction).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from posttrain import storage
from posttrain.data.tokenizer import ByteTokenizer
from posttrain.rl.envs.workspace import WORKSPACE_LIMITS, WorkspaceEnv
from posttrain.rl.reward import RewardFunction
from posttrain.rl.tasks import repo_domain
from posttrain.sandbox import Sandbox


def main() -> None:
    """Parse the flags, run the scripted episodes, write the records."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSONL written (local or gs://)")
    ap.add_argument("--n", type=int, default=800)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument(
        "--copy_drills",
        type=int,
        default=0,
        help="also write this many copy drills (repo_domain.copy_drills) after the demonstrations",
    )
    ap.add_argument(
        "--extract_frac",
        type=float,
        default=0.0,
        help="the fraction of demonstrations that fix with sed (the value cut out of the test) "
        "instead of copying it by hand (repo_domain.demonstration)",
    )
    args = ap.parse_args()
    tok, sandbox = ByteTokenizer(), Sandbox(WORKSPACE_LIMITS, max_workers=args.workers)
    make_env = lambda: WorkspaceEnv(tok, RewardFunction({}), sandbox)
    t0 = time.perf_counter()
    records = repo_domain.demonstration_records(
        repo_domain.repo_tasks("train", args.n, args.seed),
        make_env,
        workers=args.workers,
        extract_frac=args.extract_frac,
        seed=args.seed,
    )
    records += repo_domain.copy_drills(args.copy_drills, args.seed)
    if not storage.is_url(args.out):
        storage.makedirs(os.path.dirname(os.path.abspath(storage.local(args.out))))
    storage.write_text(args.out, "".join(json.dumps(rec) + "\n" for rec in records))  # local or gs://
    extracted = sum(r.get("fix") == "extract" for r in records)
    print(
        f"{len(records) - args.copy_drills}/{args.n} demonstrations passed their final check"
        + (f" ({extracted} fix with sed)" if args.extract_frac else "")
        + (f", {args.copy_drills} copy drills" if args.copy_drills else "")
        + f" -> {args.out} ({time.perf_counter() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
