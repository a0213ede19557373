"""Test setup: 8 simulated CPU devices (set before jax is imported) and the fixtures several
folders share. pytest loads this file before any test module of any folder below (tests/ is a
package: tests/a/b/test_c.py is the module tests.a.b.test_c, so equal basenames collect)."""

import atexit
import os
import shutil
import tempfile

_flags = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
# The tiny test programs are compiled far more than they run: without LLVM's expensive passes and
# at backend optimisation level 0 a session spends ~40% less CPU (measured on tests/stages/test_rlvr.py,
# parallel/test_sharding.py and e2e/test_notebook.py: 159 s vs 258 s). Results differ from the optimised build by
# float rounding only (tests/data/golden_metrics.json is recorded with these flags). Subprocesses
# inherit them. Set an optimisation level in XLA_FLAGS before pytest to override.
if "xla_backend_optimization_level" not in _flags:
    _flags += " --xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
os.environ["XLA_FLAGS"] = _flags.strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# One persistent compilation cache per test session, in a fresh temporary folder removed at exit:
# a program that several tests, or the runs they start in subprocesses (which inherit the
# variable), compile with the same shapes is compiled once. Nothing comes from earlier sessions or
# ~/.cache, so results and timings never depend on what other runs left behind. Set
# POSTTRAIN_COMPILATION_CACHE=off (or a folder) before pytest to override; core/test_compile_cache
# checks the switch itself.
if "POSTTRAIN_COMPILATION_CACHE" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="posttrain-test-jax-cache-")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ["POSTTRAIN_COMPILATION_CACHE"] = _cache

import jax  # noqa: E402

from posttrain.core.compile_cache import enable_compilation_cache  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
enable_compilation_cache("auto")  # this process too, before its first compile

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_rl_policy():
    """(graphdef, params, rest, mesh, rules) of the tiny dense policy the episode tests sample with
    (tests/support/episodes.py `tiny_policy`), made once per session: sampling/test_continuous,
    rl/rollout/test_episodes, rl/rollout/test_inflight and parallel/test_mesh_platform_paths share it
    and its sampler programs. Read-only."""
    from tests.support.episodes import tiny_policy

    return tiny_policy()


def pytest_addoption(parser):
    parser.addoption(
        "--runslow",
        action="store_true",
        help="also run the slow end-to-end tests (e.g. the quickstart's learning goal, ~5 min)",
    )


def pytest_collection_modifyitems(config, items):
    if config.getoption("--runslow"):
        return
    skip = pytest.mark.skip(reason="slow end-to-end test: run with `pytest --runslow -m slow`")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
