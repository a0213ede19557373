"""Draw a run's main curves to PNG: `python tools/plot_metrics.py WORKDIR [--out FILE]` (either may be gs://)."""

from __future__ import annotations

import argparse

from posttrain import storage
from posttrain.core.plot import plot


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("workdir")
    p.add_argument("--out", default=None, help="PNG path (default WORKDIR/metrics.png)")
    args = p.parse_args()
    print(plot(args.workdir, args.out or storage.join(args.workdir, "metrics.png")))


if __name__ == "__main__":
    main()
