"""Command line: `python -m posttrain.main --config configs/X.py [--config.a.b=value ...]`.

Runs the job named by `config.stage`. The config is locked: an unknown key fails before anything is
compiled, naming the key and the valid keys at that level.
"""

from __future__ import annotations

import logging
import os
import runpy
import sys

from absl import app
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", None, "Path to a config file with get_config().",
                                          lock_config=True)


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
    from posttrain.rl import loop as rl_loop
    from posttrain.rl import evaluation
    from posttrain.train import lm, pipeline, stages
    return {"lm": lm.run, "sft": stages.sft, "reward_model": stages.reward_model, "dpo": stages.dpo,
            "rlvr": rl_loop.run, "eval": evaluation.run, "pipeline": pipeline.run}


def run(config) -> object:
    """Run `config.stage` with `config`; the entry point for tools and tests too."""
    from posttrain.parallel import maybe_initialize_distributed
    from posttrain.eval.alerts import AlertMonitor, AlertStop
    from posttrain.eval.gates import GATED_STAGES, SECTION, GateFailed, check_gate, validate_gates
    from posttrain.rl import evaluation
    from posttrain.train.pipeline import gate_metrics
    table = stages()
    if config.stage not in table:
        raise SystemExit(f"error: config.stage={config.stage!r}; valid stages: {', '.join(sorted(table))}")
    try:
        stage_names = config.pipeline.stages if config.stage == "pipeline" else (config.stage,)
        validate_gates(config, stage_names)
        AlertMonitor.from_config(config)
        if "eval" in stage_names:
            evaluation.check_eval_config(config)
    except ValueError as e:
        raise SystemExit(f"error: {e}") from None
    maybe_initialize_distributed()
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


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("absl", "jax"):     # orbax's per-item and jax's backend INFO lines drown ours
        logging.getLogger(noisy).setLevel(logging.WARNING)
    run(_CONFIG.value)


def entry() -> None:
    """Validate overrides against the config file first, so a typo fails with a useful message."""
    for i, arg in enumerate(sys.argv):
        if arg.startswith("--config=") or arg == "--config":
            path = arg.split("=", 1)[1] if "=" in arg else sys.argv[i + 1]
            check_overrides(sys.argv[1:], runpy.run_path(path.split(":", 1)[0])["get_config"]())
    app.run(main)


if __name__ == "__main__":
    entry()
