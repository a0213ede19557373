"""tools/bench_transfer.py: a learner group publishes versions, a sampler group takes each (checking
its values are the version's) and the tool reports MiB/s rates per round."""

import argparse
import importlib.util

from tests.support import paths


def test_the_transfer_bench_measures_each_published_version():
    spec = importlib.util.spec_from_file_location("bench_transfer", paths.ROOT / "tools" / "bench_transfer.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    args = argparse.Namespace(mib=1, rounds=3, devices=2)
    measured = bench.measure(args, processes=1)  # (a sampler holding another version's values fails inside)
    assert measured["processes"] == 1
    assert all(len(measured[k]) == 2 and min(measured[k]) > 0 for k in ("ask_pull_s", "pull_s"))
