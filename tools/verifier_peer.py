"""posttrain's math verifier against `math-verify` alone on the two corpora of issue 42.

    python tools/verifier_peer.py [--markdown] [--failures]

Grades every row of posttrain/rl/verifiers/corpora/{attacks,honest}.jsonl twice: with
`MathVerifier` (the reward posttrain trains on) and with math-verify as its README uses it,
`verify(parse("$" + reference + "$"), parse(response))` on the whole response. Prints, per corpus and
per family, the attacks refused (scored 0) and the honest answers accepted (scored 1), each as
count/total and percent. A verifier error (no verdict) counts as neither refused nor accepted.
"""

from __future__ import annotations

import argparse
import collections
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from posttrain.rl.verifiers.corpus import EXPECTED, CorpusRow, load_corpus  # noqa: E402
from posttrain.rl.verifiers.math import MathTask, MathVerifier  # noqa: E402

GOAL = 0.98


def peer_score(row: CorpusRow) -> float | None:
    """math-verify alone on the whole response: 1.0 or 0.0, None when it raised."""
    from math_verify import parse, verify

    try:
        return float(bool(verify(parse(f"${row.reference}$"), parse(row.response))))
    except Exception:
        return None


def grade(
    rows: list[CorpusRow], verifier: MathVerifier
) -> dict[str, list[tuple[CorpusRow, float | None, float | None]]]:
    """(row, posttrain score or None on a verifier error, math-verify score) per family."""
    out = collections.defaultdict(list)
    for r in rows:
        verdict = verifier.verify(MathTask(r.reference), r.response)
        out[r.family].append((r, None if verdict.error else verdict.correct, peer_score(r)))
    return out


def _cell(hits: int, total: int) -> str:
    return f"{hits}/{total} ({100 * hits / total:.1f}%)" if total else "-"


def table(name: str, graded: dict, markdown: bool) -> tuple[list[str], dict[str, float]]:
    """Rows of the report for one corpus, and each verifier's overall rate."""
    want = EXPECTED[name]
    what = "refused" if want == 0.0 else "accepted"
    lines = [f"| {name}: {what} | rows | posttrain | math-verify |", "|---|---:|---:|---:|"]
    totals = collections.Counter()
    for family, graded_rows in graded.items():
        shown = family.replace("*", "\\*") if markdown else family
        ours = sum(s == want for _, s, _ in graded_rows)
        peer = sum(s == want for _, _, s in graded_rows)
        totals.update(rows=len(graded_rows), ours=ours, peer=peer)
        count = len(graded_rows)
        lines.append(f"| {shown} | {count} | {_cell(ours, count)} | {_cell(peer, count)} |")
    n = totals["rows"]
    lines.append(f"| **all** | {n} | **{_cell(totals['ours'], n)}** | **{_cell(totals['peer'], n)}** |")
    if not markdown:
        lines = [line.replace("**", "") for line in lines if not line.startswith("|---")]
    return lines, {"posttrain": totals["ours"] / n, "math-verify": totals["peer"] / n}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", action="store_true", help="print markdown tables (for BENCHMARKS.md)")
    parser.add_argument("--failures", action="store_true", help="list the rows posttrain gets wrong")
    args = parser.parse_args()
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    verifier = MathVerifier()
    ok = True
    for name in EXPECTED:
        graded = grade(load_corpus(name), verifier)
        lines, rates = table(name, graded, args.markdown)
        print("\n".join(lines) + "\n")
        ok &= rates["posttrain"] >= GOAL and rates["posttrain"] > rates["math-verify"]
        if args.failures:
            for family, graded_rows in graded.items():
                for r, s, _ in graded_rows:
                    if s != EXPECTED[name]:
                        print(f"  {name} {r.id} [{family}] ref={r.reference!r} score={s}: ...{r.response[-160:]!r}")
    print(f"goal (>= {GOAL:.0%} on each corpus and above math-verify): {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
