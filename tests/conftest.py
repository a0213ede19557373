"""Test setup: 8 simulated CPU devices (set before jax is imported) and shared fixtures."""

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The persistent compilation cache stays off in tests (and the runs they start): timings and
# behaviour must not depend on what earlier runs left in ~/.cache. test_robust checks the switch.
os.environ.setdefault("POSTTRAIN_COMPILATION_CACHE", "off")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

import pytest  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--runslow", action="store_true",
                     help="also run the slow end-to-end tests (e.g. the quickstart's learning goal, ~5 min)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with `pytest --runslow -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
