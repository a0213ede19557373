"""SFT records from reasoning-gym's training split, for a policy that answers in the format RL pays.

    python tools/rg_sft_data.py --domains rg:chain_sum,rg:count_bits --levels 0 --out runs/rg_sft

writes `train.jsonl` and `eval.jsonl` ({"prompt", "response"}) under --out: the training tasks an
rlvr run with the same `rl.domains`, `rl.rg_settings`, `rl.curriculum.rg_levels`, `rl.eval_size`,
`rl.arithmetic_size` and `seed` draws (so never a held-out task, by seed range or by meaning), each
answered with a worked line and a boxed answer: "4 + 2 = 6. The answer is \\boxed{6}." (the
restatement of `posttrain/rl/verifiers/rg_redteam.py`). The eval file is a tenth of the records
(shuffled), for the SFT loss.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

from posttrain.config import RunConfig
from posttrain.config.rl import domain_weights
from posttrain.rl.tasks.registry import DOMAINS
from posttrain.rl.verifiers.rg_redteam import RESTATEMENTS


def records(cfg: RunConfig) -> list[dict]:
    """One SFT record per training task of the run's rg: domains, in domain order."""
    out = []
    for name in domain_weights(cfg.rl):
        if not name.startswith("rg:"):
            raise SystemExit(f"--domains: {name!r} is not a reasoning-gym domain (rg:<dataset>)")
        domain, _ = DOMAINS[name](cfg, lambda: None)
        for task in domain.tasks:
            t = task.target
            work = RESTATEMENTS.get(t.dataset, lambda m, a: "")(t.metadata, t.answer)
            lead = f"{work} = {t.answer}. " if work else ""
            out.append({"prompt": task.prompt[0]["content"], "response": f"{lead}The answer is \\boxed{{{t.answer}}}."})
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--domains", required=True, help="rl.domains, rg:<dataset>[:weight],...")
    p.add_argument("--settings", default="", help="rl.rg_settings")
    p.add_argument("--levels", default="", help="rl.curriculum.rg_levels")
    p.add_argument("--size", type=int, default=2000, help="rl.arithmetic_size: training tasks per domain")
    p.add_argument("--eval-size", type=int, default=128, help="rl.eval_size of the RL run (its held-out tasks)")
    p.add_argument("--seed", type=int, default=0, help="the RL run's seed")
    p.add_argument("--out", required=True, help="folder for train.jsonl and eval.jsonl")
    args = p.parse_args()
    cfg = RunConfig(seed=args.seed).replace(
        {
            "rl.domains": args.domains,
            "rl.rg_settings": args.settings,
            "rl.curriculum.rg_levels": args.levels,
            "rl.arithmetic_size": args.size,
            "rl.eval_size": args.eval_size,
        }
    )
    rows = records(cfg)
    random.Random(args.seed).shuffle(rows)  # the domains mixed in both files
    cut = len(rows) - max(1, len(rows) // 10)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, part in (("train", rows[:cut]), ("eval", rows[cut:])):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    print(f"{out}/train.jsonl: {cut} records, {out}/eval.jsonl: {len(rows) - cut}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
