"""Red-team a verifier: run the attacks of its kind (`posttrain/rl/verifiers/redteam.py`) and say which scored.

    python tools/redteam.py                                   # every built-in domain; --markdown for the table
    python tools/redteam.py --verifier mypkg.scores:score --kind answer [--tasks cases.jsonl]
    python tools/redteam.py --rg [basic_arithmetic,chain_sum,...]   # reasoning-gym's scorers, raw and guarded

A user verifier is the `rl.verifiers` function `score(prompt, response, record)`. Without --tasks it
is tried on the built-in cases as records: answer kind `{"prompt", "answer"}`, program kind
`{"prompt", "test", "entry_point"}` (HumanEval style). A --tasks JSONL file gives your own records:
answer kind with `prompt`, `answer`, `expression` (a computation of the answer taken from the
question: the restatement) and `wrong` (a wrong answer); program kind with `prompt`, `entry_point`
and `solution` (an honest completion); other fields are passed to the verifier as they are.
With --rg, the answer attacks and honest answer forms run on items of reasoning-gym datasets (default:
those posttrain serves and those it refuses), scored by each dataset's raw scorer and through posttrain's
guard (`posttrain/rl/verifiers/rg_redteam.py`); the table (always printed) is BENCHMARKS.md's.
Exit status 1 when an attack scored above 0 or an honest solution below 1 (with --rg: through the
guard, on a dataset posttrain serves).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys

from posttrain.rl.verifiers.answer_attacks import ANSWER_CASES
from posttrain.rl.verifiers.program_attacks import humaneval_cases
from posttrain.rl.verifiers.redteam import AnswerCase, ProgramCase, builtin_cases, markdown_table, redteam
from posttrain.sandbox import Limits, Sandbox

BUILTIN = ("arithmetic", "gsm8k", "math", "humaneval")


def user_cases(kind: str, path: str | None) -> list:
    """Cases whose `task` is a record dict, from `path` or the built-in problems."""
    if path:
        with open(path) as f:
            records = [json.loads(line) for line in f if line.strip()]
        if kind == "answer":
            return [
                AnswerCase(r, str(r["prompt"]), str(r["answer"]), str(r["expression"]), str(r["wrong"]))
                for r in records
            ]
        return [ProgramCase(r, r["entry_point"], r["solution"]) for r in records]
    if kind == "answer":
        return [
            dataclasses.replace(c, task={"prompt": c.question, "answer": c.answer})
            for cases in ANSWER_CASES.values()
            for c in cases
        ]
    return [
        dataclasses.replace(c, task={"prompt": c.task.prompt, "test": c.task.test, "entry_point": c.entry_point})
        for c in humaneval_cases()
    ]


def reasoning_gym(datasets: list[str]) -> int:
    """The raw-vs-guarded table of reasoning-gym's scorers; 1 when the guard lets an attack pay or
    refuses an honest form on a served dataset."""
    from posttrain.rl.verifiers.rg import SUPPORTED
    from posttrain.rl.verifiers.rg_redteam import holes, markdown, red_team, summary

    rows = red_team(datasets or None)
    print(summary(rows) + "\n\n" + markdown(rows))
    served = {name: found for name, found in holes(rows).items() if name in SUPPORTED}
    for name, found in served.items():
        print(f"== rg:{name}: the guard lets through {found}")
    return 1 if served else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--verifier", help="a user verifier 'package.module:function' (default: the built-in domains)")
    p.add_argument("--kind", choices=("answer", "program"), help="what the user verifier checks")
    p.add_argument("--tasks", help="JSONL of your own cases for --verifier (see above)")
    p.add_argument("--domains", default=",".join(BUILTIN), help=f"built-in domains to run (of {BUILTIN})")
    p.add_argument("--markdown", action="store_true", help="print the attacks x domains table")
    p.add_argument("--rg", nargs="?", const="", help="reasoning-gym datasets, comma-separated (default: all measured)")
    p.add_argument("--wall-s", type=float, default=3.0, help="sandbox wall-clock limit for program attacks")
    args = p.parse_args()
    if args.rg is not None:
        return reasoning_gym([n for n in args.rg.split(",") if n])
    if args.verifier:
        if not args.kind:
            p.error("--verifier needs --kind answer|program")
        reports = {args.verifier: redteam(args.verifier, user_cases(args.kind, args.tasks), kind=args.kind)}
    else:
        limits = Limits(cpu_s=max(1, int(args.wall_s) - 1), wall_s=args.wall_s, memory_bytes=512 << 20, processes=16)
        reports = {}
        with Sandbox(max_workers=8) as sandbox:
            for domain in args.domains.split(","):
                kind, make, cases = builtin_cases(domain)
                verifier = make(sandbox, limits) if kind == "program" else make()
                reports[domain] = redteam(verifier, cases, kind=kind)
    for name, report in reports.items():
        print(f"== {name} ({report.kind}): {'all attacks scored 0' if report.ok else 'HOLES'}")
        print(report.summary())
    if args.markdown:
        print(markdown_table(reports))
    return 0 if all(r.ok for r in reports.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
