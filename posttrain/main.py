"""Command line: `python -m posttrain.main --config configs/X.py [--config.a.b=value ...]`.

Runs the job named by `config.stage`. The config is locked: an unknown key fails before anything is
compiled, naming the key and the valid keys at that level.

Errors reach the user as one line naming the config key and path (`error: ...`, exit status 2 for
bad input, 1 otherwise); the traceback goes to `{workdir}/error.log`, and to the console with
`--verbose`. The workdir is locked for the run (`train/workdir.py`): a second run there fails at
once, naming the first.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import runpy
import sys
import tempfile
import time
import traceback

from absl import app, flags
from ml_collections import config_flags

from posttrain.errors import UserError

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                          lock_config=True)
_VERBOSE = flags.DEFINE_bool("verbose", False, "Print the full traceback of an error (it always goes to "
                             "{workdir}/error.log).")


def check_overrides(argv: list[str], config) -> None:
    """Fail on `--config.a.b=v` whose path does not exist, naming the bad key and the valid ones."""
    for arg in argv:
        if not arg.startswith("--config."):
            continue
        path = arg[len("--config."):].split("=", 1)[0].split(".")
        node, seen = config, "config"
        for key in path:
            keys = sorted(node.keys()) if hasattr(node, "keys") else []
            if key not in keys:
                raise SystemExit(f"error: unknown config key '{seen}.{key}' in {arg!r}; "
                                 f"valid keys of {seen}: {', '.join(keys) or '(none: not a group)'}")
            node, seen = node[key], f"{seen}.{key}"


def stages() -> dict:
    """config.stage → the function that runs it (imported lazily: jax starts only when needed)."""
    from posttrain.rl import evaluation
    from posttrain.rl import loop as rl_loop
    from posttrain.train import lm, pipeline, stages
    return {"lm": lm.run, "sft": stages.sft, "reward_model": stages.reward_model, "dpo": stages.dpo,
            "rlvr": rl_loop.run, "eval": evaluation.run, "pipeline": pipeline.run}


def run(config) -> object:
    """Run `config.stage` with `config`, holding the workdir's lock; the entry point for tools and
    tests too."""
    import jax
    from posttrain.parallel import maybe_initialize_distributed
    from posttrain.train.workdir import workdir_lock
    maybe_initialize_distributed()
    primary = not jax.distributed.is_initialized() or jax.process_index() == 0
    # The lock comes first (before the heavy imports): a second run in a busy workdir fails at once.
    with workdir_lock(config.workdir) if primary else contextlib.nullcontext():
        try:
            return _run_locked(config)
        except Exception as e:       # logged while the workdir is still ours
            e.error_log = write_error_log(config.workdir, e)
            raise


def _run_locked(config) -> object:
    from posttrain.eval.alerts import AlertMonitor, AlertStop
    from posttrain.eval.gates import GATED_STAGES, SECTION, GateFailed, check_gate, validate_gates
    from posttrain.rl import evaluation
    from posttrain.rl.checks import check_sampling_config
    from posttrain.train.compile_cache import enable_compilation_cache
    from posttrain.train.pipeline import gate_metrics
    table = stages()
    if config.stage not in table:
        raise UserError(f"config.stage={config.stage!r}; valid stages: {', '.join(sorted(table))}", key="stage")
    try:       # gates, alerts and eval suites are checked before anything trains
        stage_names = config.pipeline.stages if config.stage == "pipeline" else (config.stage,)
        validate_gates(config, stage_names)
        check_sampling_config(config, stage_names)
        AlertMonitor.from_config(config)
        if "eval" in stage_names:
            evaluation.check_eval_config(config)
    except ValueError as e:
        raise UserError(str(e)) from None
    if config.init_from:
        from posttrain.train.init import require_init_from
        require_init_from(config.init_from)
    enable_compilation_cache(config.compilation_cache)
    os.makedirs(config.workdir, exist_ok=True)
    with open(os.path.join(config.workdir, "config.json"), "w") as f:
        f.write(config.to_json_best_effort(indent=2))
    try:
        result = table[config.stage](config)
        if config.stage in GATED_STAGES:       # a stage run alone must pass its gate too (exit status 1)
            logging.info(check_gate(config.stage, config[SECTION.get(config.stage, config.stage)].gate,
                                    gate_metrics(result)))
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
            if hasattr(v, "keys"):
                walk(v, f"{prefix}{k}.")
            elif isinstance(v, str) and len(v) > 2 and ("/" in v or "." in v) and (
                    v == path or (path and fnmatch.fnmatch(path, v)) or v in text):
                found.append(f"{prefix}{k}")
    walk(config, "")
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
    """Append the traceback to `{workdir}/error.log` (a local workdir) or a temp file; its path."""
    local = workdir and "://" not in workdir and os.path.isdir(workdir)
    path = os.path.join(workdir, "error.log") if local else os.path.join(
        tempfile.gettempdir(), f"posttrain-error-{os.getpid()}.log")
    with open(path, "a") as f:
        f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(sys.argv)}\n")
        f.write("".join(traceback.format_exception(error)))
    return path


def run_cli(config, *, verbose: bool = False) -> int:
    """`run(config)` with errors as one line on stderr; the exit status (0 ok, 2 bad input, 1 other).

    With `verbose` the exception propagates (full traceback)."""
    try:
        run(config)
        return 0
    except Exception as e:           # the boundary: everything below raises, the user reads one line
        if verbose:
            raise
        log = getattr(e, "error_log", None) or write_error_log(None, e)
        hint = "" if isinstance(e, UserError) else f" (traceback in {log}; rerun with --verbose)"
        print(f"error: {error_line(config, e)}{hint}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("absl", "jax"):     # orbax's per-item and jax's backend INFO lines drown ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if _CONFIG.value is None:
        configs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")
        names = sorted(f for f in os.listdir(configs) if f.endswith(".py")) if os.path.isdir(configs) else []
        raise SystemExit("error: no config given: pass --config path/to/config.py, e.g. --config "
                         f"configs/quickstart.py{' (configs/: ' + ', '.join(names) + ')' if names else ''}")
    sys.exit(run_cli(_CONFIG.value, verbose=_VERBOSE.value))


def entry(program=None) -> None:
    """Validate overrides against the config file first, so a typo fails with a useful message;
    then run `program(argv)` (default: `main`) under absl, `--config` parsed."""
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--config=") or arg == "--config":
            path = arg.split("=", 1)[1] if "=" in arg else sys.argv[i + 1]
            check_overrides(sys.argv[1:], runpy.run_path(path.split(":", 1)[0])["get_config"]())
    app.run(program or main)


if __name__ == "__main__":
    entry()
