"""Command line: `python -m posttrain.main --config configs/X.py [--config.a.b=value ...]`.

Runs the job named by `config.stage`. The config is locked: an unknown key fails before anything is
compiled, naming the key and the valid keys at that level. At this edge the ConfigDict becomes one
frozen `RunConfig` (`posttrain.config.command_line`), whose fields check their values; the stages'
start-up checks follow (`posttrain.stages.checks`).

Errors reach the user as one line naming the config key and path (`error: ...`, exit status 2 for
bad input, 1 otherwise; SIGINT / SIGTERM save a checkpoint at the step and exit 130 / 143); the
traceback goes to `{workdir}/error.log`, and to the console with `--verbose`. The workdir is locked
for the run (`core/workdir.py`): a second run there fails at once, naming the first.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import logging
import os
import runpy
import shlex
import sys
import tempfile
import time
import traceback

import ml_collections
from absl import app, flags
from ml_collections import config_flags

from posttrain import storage
from posttrain.config import RunConfig
from posttrain.config import stages as stage_table
from posttrain.config.command_line import apply_command_line_precedence, base_config, command_line_keys, run_config
from posttrain.errors import UserError
from posttrain.platform import platform_line, quiet_platform

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().", lock_config=True)
_VERBOSE = flags.DEFINE_bool(
    "verbose", False, "Print the full traceback of an error (it always goes to {workdir}/error.log)."
)


def check_overrides(argv: list[str], config) -> None:
    """Fail on `--config.a.b=v` whose path does not exist, naming the bad key and the valid ones."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config.") :].split("=", 1)[0].split(".")
        node, seen = config, "config"
        for key in path:
            keys = sorted(node.keys()) if hasattr(node, "keys") else []
            if key not in keys:
                raise SystemExit(
                    f"error: unknown config key '{seen}.{key}' in {arg!r}; "
                    f"valid keys of {seen}: {', '.join(keys) or '(none: not a group)'}"
                )
            node, seen = node[key], f"{seen}.{key}"


def run(config: RunConfig | ml_collections.ConfigDict) -> object:
    """Run `config.stage` with `config` (a RunConfig, or a ConfigDict made one here), holding the
    workdir's lock; the entry point for tools, notebooks and tests too."""
    cfg = run_config(config)  # types, values and rules: before the heavy imports
    import jax

    from posttrain.core.workdir import workdir_lock
    from posttrain.parallel import maybe_initialize_distributed

    maybe_initialize_distributed(cfg.distributed)
    if jax.process_index() == 0:
        print(platform_line(), file=sys.stderr)
    if cfg.stage == "rlvr" and cfg.rl.role == "sampler":  # the learner's workdir: the learner locks it
        from posttrain.stages.rlvr_sampler import run_sampler

        return run_sampler(cfg)
    primary = jax.process_index() == 0
    # The lock comes first (before the heavy imports): a second run in a busy workdir fails at once.
    with workdir_lock(cfg.workdir) if primary else contextlib.nullcontext():
        try:
            return _run_locked(cfg)
        except Exception as e:  # logged while the workdir is still ours
            e.error_log = write_error_log(cfg.workdir, e)
            raise


def _run_locked(cfg: RunConfig) -> object:
    from posttrain.core.alerts import AlertStop
    from posttrain.core.compile_cache import enable_compilation_cache
    from posttrain.eval.gates import GateFailed, check_gate, gate_record_dir
    from posttrain.parallel import is_primary
    from posttrain.stages.checks import check_run
    from posttrain.stages.pipeline import gate_metrics

    stage = stage_table.BY_NAME[cfg.stage]
    check_run(cfg)  # data files, gates, what needs live objects: before anything trains
    if cfg.init_from:
        from posttrain.core.init import require_init_from

        require_init_from(cfg.init_from)
    enable_compilation_cache(cfg.compilation_cache)
    if is_primary():
        storage.makedirs(cfg.workdir)
        storage.write_text(storage.join(cfg.workdir, "config.json"), json.dumps(cfg.to_dict(), indent=2))
    try:
        result = stage.runner()(cfg)
        if stage.gated:  # a stage run alone must pass its gate too (exit status 1)
            logging.info(
                check_gate(
                    stage.name, cfg.section(stage.name).gate, gate_metrics(result), workdir=gate_record_dir(cfg.workdir)
                )
            )
        return result
    except GateFailed as e:
        raise SystemExit(f"error: stopped by a failed gate:\n{e}") from None
    except AlertStop as e:
        raise SystemExit(f"error: {e}") from None


def config_keys_naming(config, text: str, path: str | None = None) -> list[str]:
    """Config keys whose (string) value is `path` or appears in `text`: which key an error is about."""
    found = []

    def walk(node, prefix):
        for k in node.keys():
            v = node[k]
            if isinstance(v, dict):
                walk(v, f"{prefix}{k}.")
            elif (
                isinstance(v, str)
                and len(v) > 2
                and ("/" in v or "." in v)
                and (v == path or (path and fnmatch.fnmatch(path, v)) or v in text)
            ):
                found.append(f"{prefix}{k}")

    walk(config.to_dict(), "")
    return found


def error_line(config, error: BaseException) -> str:
    """One line for the console: the message (first line), with the config key it is about."""
    message = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if not isinstance(error, UserError):
        message = f"{type(error).__name__}: {message}"
    if config is not None and not (isinstance(error, UserError) and error.key):
        keys = config_keys_naming(config, message, getattr(error, "path", None))
        if keys:
            message += f" [config.{', config.'.join(keys)}]"
    return message[:2000]


def write_error_log(workdir: str | None, error: BaseException) -> str:
    """Append the traceback to `{workdir}/error.log` (a workdir that exists, local or URL), else to a
    temp file; its path."""
    text = f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n" + "".join(
        traceback.format_exception(error)
    )
    if workdir:
        try:
            if storage.isdir(workdir):
                path = storage.join(workdir, "error.log")
                storage.append_text(path, text)
                return path
        except Exception:  # an unreachable remote workdir: the traceback still goes somewhere
            pass
    path = os.path.join(tempfile.gettempdir(), f"posttrain-error-{os.getpid()}.log")
    storage.append_text(path, text)
    return path


def resume_command() -> str:
    """The command line of this run, to repeat it (the module form when started as `-m posttrain.main`)."""
    argv = sys.argv[1:]
    program = (
        ["python", "-m", "posttrain.main"]
        if sys.argv[0].endswith(os.path.join("posttrain", "main.py"))
        else [sys.argv[0]]
    )
    return shlex.join(program + argv)


def run_cli(config, *, verbose: bool = False) -> int:
    """`run(config)` with errors as one line on stderr; the exit status (0 ok, 2 bad input, 1 other,
    128 + signal when stopped by SIGINT/SIGTERM after saving a checkpoint).

    With `verbose` the exception propagates (full traceback)."""
    from posttrain.core.interrupt import Interrupted

    try:
        run(config)
        return 0
    except Interrupted as e:  # SIGINT/SIGTERM: the loop saved a checkpoint and stopped
        print(
            f"{e}; to resume, run the same command again (it resumes from {config.workdir}): {resume_command()}",
            file=sys.stderr,
        )
        return e.exit_code
    except KeyboardInterrupt:  # a second signal, or one outside a training loop
        if verbose:
            raise
        print(
            f"error: aborted; the checkpoints already in {config.workdir} are kept: run the same command again "
            "to resume",
            file=sys.stderr,
        )
        return 130
    except Exception as e:  # the boundary: everything below raises, the user reads one line
        if verbose:
            raise
        log = getattr(e, "error_log", None) or write_error_log(None, e)
        hint = "" if isinstance(e, UserError) else f" (traceback in {log}; rerun with --verbose)"
        print(f"error: {error_line(config, e)}{hint}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("absl", "jax"):  # orbax's per-item and jax's backend INFO lines drown ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if _CONFIG.value is None:
        configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
        names = sorted(f for f in os.listdir(configs) if f.endswith(".py")) if os.path.isdir(configs) else []
        raise SystemExit(
            "error: no config given: pass --config path/to/config.py, e.g. --config "
            f"configs/quickstart.py{' (configs/: ' + ', '.join(names) + ')' if names else ''}"
        )
    apply_command_line_precedence(_CONFIG.value, command_line_keys(sys.argv[1:]))
    sys.exit(run_cli(_CONFIG.value, verbose=_VERBOSE.value))


ENVIRONMENT = {
    "POSTTRAIN_DATA": "folder of the ready-made data sets (gsm8k/, humaneval/: rl.domains, eval.suites); "
    "default: shared/data beside the repository",
    "POSTTRAIN_COMPILATION_CACHE": "JAX's persistent compilation cache folder for compilation_cache=auto "
    "(default ~/.cache/posttrain/jax; off: none)",
    "JAX_PLATFORMS": "JAX's platforms (e.g. tpu, cuda, cpu); unset on a machine with neither a TPU nor a GPU: "
    "cpu, so an installed libtpu stays quiet (the run's first line names the platform)",
    "POSTTRAIN_ACCELERATOR_PATHS": "1: a test switch, the CPU takes the GPU/TPU code paths that can run on it "
    "(stacked KV cache, ragged_dot experts; parallel.accelerator_paths); default 0",
}


def usage() -> str:
    """`--help`: how to call, the stages, every config section with its keys, the environment."""
    cfg = base_config()
    top = [k for k in cfg.keys() if not hasattr(cfg[k], "keys")]
    lines = [
        "usage: python -m posttrain.main --config configs/X.py [--config.section.key=value ...] [--verbose]",
        "",
        f"Runs config.stage, one of: {', '.join(sorted(stage_table.BY_NAME))} (pipeline: pipeline.stages in order).",
        "A run in the same workdir resumes from its newest checkpoint; Ctrl-C / SIGTERM saves one and stops.",
        "",
        "Config keys (defaults and allowed values declared on the typed sections in posttrain/config/;",
        "an unknown --config.a.b lists every valid key at its level):",
        f"  {' '.join(top)}",
    ]
    for section in (k for k in cfg.keys() if hasattr(cfg[k], "keys")):
        keys = [f"{k}.*" if hasattr(cfg[section][k], "keys") else k for k in cfg[section].keys()]
        lines.append(
            f"  {section}.{{{', '.join(keys)}}}"
            if len(keys) < 12
            else f"  {section}.{{{', '.join(keys[:11])}, ... {len(keys) - 11} more}}"
        )
    lines += [
        "",
        "Environment:",
        *(f"  ${k}: {v}" for k, v in ENVIRONMENT.items()),
        "",
        "Exit status: 0 done, 1 error, 2 bad input (a config key or path), 130 / 143 stopped by "
        "SIGINT / SIGTERM after saving a checkpoint.",
        "",
    ]
    return "\n".join(lines)


def entry(program=None) -> None:
    """Validate overrides against the config file first, so a typo fails with a useful message;
    then run `program(argv)` (default: `main`) under absl, `--config` parsed. `--help` starts with
    `usage()`. Without a TPU or GPU and with `JAX_PLATFORMS` unset, JAX is told to use the CPU
    (`quiet_platform`) before anything imports it."""
    quiet_platform()
    if any(a in ("--help", "-h", "-?") for a in sys.argv[1:]):
        print(usage() + "\nFlags:\n" + flags.FLAGS.module_help(sys.modules[__name__]))
        sys.exit(0)
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--config=") or arg == "--config":
            path = arg.split("=", 1)[1] if "=" in arg else sys.argv[i + 1]
            check_overrides(sys.argv[1:], config_from_file(path))
    app.run(program or main)


def config_from_file(spec: str):
    """The config `--config=PATH[:ARG]` names, as ml_collections builds it: PATH's `get_config(ARG)`,
    or `get_config()` when there is no ARG."""
    path, has_arg, arg = spec.partition(":")
    get_config = runpy.run_path(path)["get_config"]
    return get_config(arg) if has_arg else get_config()


if __name__ == "__main__":
    entry()
