"""`config.compilation_cache`: where JAX's persistent compilation cache goes, and off means off.

The suite itself runs with the cache off (POSTTRAIN_COMPILATION_CACHE=off in conftest): results and
timings must not depend on what earlier runs left behind. The switch is checked in subprocesses.
"""

import os
import subprocess
import sys

import pytest

from posttrain.core.compile_cache import ENV, compilation_cache_dir
from posttrain.errors import UserError
from tests.support.paths import ROOT

COMPILE = """
import sys
import jax, jax.numpy as jnp
from posttrain.core.compile_cache import enable_compilation_cache
print(enable_compilation_cache(sys.argv[1]))
jax.jit(lambda x: jnp.sin(x) @ x.T)(jnp.ones((8, 8))).block_until_ready()
"""


def test_setting_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    monkeypatch.delenv(ENV, raising=False)
    assert compilation_cache_dir("auto") == str(tmp_path / "xdg" / "posttrain" / "jax")
    monkeypatch.setenv(ENV, str(tmp_path / "env"))
    assert compilation_cache_dir("auto") == str(tmp_path / "env")
    assert compilation_cache_dir(str(tmp_path / "explicit")) == str(tmp_path / "explicit")  # the key wins
    assert compilation_cache_dir("gs://bucket/jax-cache") == "gs://bucket/jax-cache"
    monkeypatch.setenv(ENV, "off")
    assert compilation_cache_dir("auto") is None and compilation_cache_dir("off") is None
    with pytest.raises(UserError, match="compilation_cache"):
        compilation_cache_dir("")


def test_cache_folder_fills_when_on_and_off_sets_nothing(tmp_path):
    folder = tmp_path / "cache"
    out = subprocess.run(
        [sys.executable, "-c", COMPILE, str(folder)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0"},
    )  # a tiny program too
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == str(folder) and list(folder.rglob("*"))
    import jax

    from posttrain.core.compile_cache import enable_compilation_cache

    before = jax.config.jax_compilation_cache_dir
    assert enable_compilation_cache("off") is None and jax.config.jax_compilation_cache_dir == before
