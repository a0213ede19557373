"""Write a run's report, one self-contained HTML page: `python tools/report.py RUN [--out FILE]`.

RUN is a run's workdir (a pipeline's top folder covers its stages). The page holds the curves, the
eval table across checkpoints, gate outcomes, alerts and a sample of rollouts with their rewards
(see posttrain/eval/report.py); it needs no network to view.
"""

from __future__ import annotations

import argparse

from posttrain.eval.report import write_report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="the run's workdir")
    p.add_argument("--out", default=None, help="HTML path (default RUN/report.html)")
    args = p.parse_args()
    print(write_report(args.run, args.out))


if __name__ == "__main__":
    main()
