"""lm-eval's command line with posttrain's model registered and its offline tasks found:

    python -m posttrain.eval.lm_eval_cli --model posttrain --model_args checkpoint=gguf:/m/x.gguf \\
        --tasks posttrain_gsm8k --limit 20 --batch_size 8

(also installed as `posttrain-lm-eval`). lm-eval 0.4.13 finds models only in its registry (no entry
points), so its own `lm_eval` command does not know `posttrain`; this one imports
`posttrain.eval.lm_harness` first and adds `--include_path` for posttrain's tasks (`lm_tasks/`)
unless one is given. Without lm-eval installed it prints one line naming the extra.
"""

from __future__ import annotations

import sys

from posttrain.platform import platform_line, quiet_platform


def main(argv: list[str] | None = None) -> int:
    """Run lm-eval's CLI on `argv` (default: this process's arguments), on the platform
    `posttrain.platform.quiet_platform` leaves JAX (named in the first line on stderr)."""
    quiet_platform()
    try:
        from posttrain.eval import lm_harness
    except ImportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(platform_line(), file=sys.stderr)
    args = list(sys.argv[1:] if argv is None else argv)
    if args and not any(a == "--include_path" or a.startswith("--include_path=") for a in args):
        args += ["--include_path", lm_harness.TASKS_DIR]
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm-eval", *args]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
