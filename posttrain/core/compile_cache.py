"""JAX's persistent compilation cache: a second run of the same config skips XLA compilation.

`config.compilation_cache`: "auto" (default) uses `$POSTTRAIN_COMPILATION_CACHE` when set, else
`~/.cache/posttrain/jax` (`$XDG_CACHE_HOME` respected); "off" disables it; anything else is the
cache folder (local or gs://). An explicit config value wins over the environment variable.
"""

from __future__ import annotations

import logging
import os

import jax

from posttrain.core.workdir import user_cache_dir
from posttrain.errors import UserError

ENV = "POSTTRAIN_COMPILATION_CACHE"
OFF = ("off", "none", "false", "0")


def compilation_cache_dir(setting: str) -> str | None:
    """The cache folder `setting` (see the module doc) resolves to, or None when off."""
    if not isinstance(setting, str) or not setting.strip():
        raise UserError(f"compilation_cache={setting!r}: expected 'auto', 'off' or a folder", key="compilation_cache")
    if setting == "auto":
        setting = os.environ.get(ENV, "").strip() or os.path.join(user_cache_dir(), "jax")
    if setting.lower() in OFF:
        return None
    return setting if "://" in setting else os.path.abspath(os.path.expanduser(setting))


def enable_compilation_cache(setting: str) -> str | None:
    """Point jax's persistent compilation cache at `setting`'s folder (before the first compile);
    returns the folder, or None when the cache is off. jax caches programs that took at least
    $JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS (default 1 s) to compile: caching every
    sub-second one too made the first run slower without making the second measurably faster
    (BENCHMARKS.md)."""
    path = compilation_cache_dir(setting)
    if path is None:
        return None
    jax.config.update("jax_compilation_cache_dir", path)
    logging.info("compilation cache: %s (config.compilation_cache / $%s; 'off' disables)", path, ENV)
    return path
