"""A learning claim over initialisation seeds, with one command: run a recipe end to end once per
seed and write the table BENCHMARKS.md quotes.

    python tools/seeds.py configs/vision_tiny.py --seeds 0,1,2 [--parallel N | --threads T] \\
        [--metrics rlvr:eval/accuracy@first,eval/accuracy] [--threshold 'eval/accuracy>0.7'] \\
        [--out table.md] [--json table.json] [--workdir_root DIR] [-- --config.key=value ...]

Each seed S runs `python -m posttrain.main --config CONFIG --config.seed=S
--config.workdir=ROOT/seedS OVERRIDES` (every stage of the config: a `pipeline` runs them all, as
posttrain.main does), ROOT defaulting to runs/seeds/<config name>. `config.seed` is the one seed of
a run: the model's initialisation (`nnx.Rngs(seed)` in every stage), the training data's order,
the RL tasks, sampling and the held-out draw of the built-in RL domains; generated data files, task
files written by tools and `eval.long_context.seed` do not follow it. A config that starts from a
checkpoint (`init_from`) gives every seed that one initialisation: the table's head says so.
`{seed}` in an override is the seed: `-- --config.init_from=runs/seeds/long_context_recall/seed{seed}`
chains recipes, each seed from its own run of the one before.

`--parallel` runs at a time (default: the usable cores // `--threads`, each run pinned to its own
cores; without either flag one run on every core, as a JAX CPU run uses them all; on an
accelerator keep one: each run takes the device). The cores are the ones this process may use, so
two commands at once share them unless each is given its own (`taskset -c 1 python tools/seeds.py ...`).
A line per finished seed. Resuming: a seed whose run finished (ROOT/seedS.json, exit status 0, the
same arguments) is not rerun; one that failed or was killed reruns the same command in the same
workdir, which resumes from its newest checkpoint (posttrain.main). Each run's output goes to ROOT/seedS.log.

Metrics: `[STAGE:]KEY[@first]`: KEY's value in the last (`@first`: first) row that logged it, in
STAGE's metrics.jsonl (`rlvr` or `1_rlvr` in a pipeline; default: the last stage that logged KEY).
Default: the accuracies and losses (`eval/*`) of the last evaluation row of the last stage that
evaluated. The table: one row per seed (a failed seed is a row marked failed, with its exit status
and log), the mean and range (min-max) over finished seeds, and with `--threshold` how many seeds
pass. The exact command line heads it. Exit status: 0 all seeds finished, 1 one failed, 2 bad input.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import math
import os
import re
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OPS = {"<": float.__lt__, "<=": float.__le__, ">": float.__gt__, ">=": float.__ge__}
_THRESHOLD = re.compile(r"^\s*(\S+?)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")
_STAGE_DIR = re.compile(r"^(\d+)_(\w+)$")


class BadInput(Exception):
    """Bad input the user can fix (exit status 2), naming it."""


@dataclasses.dataclass
class SeedRun:
    """One seed's run: its workdir, its arguments to `python`, where its record and log go."""

    seed: int
    workdir: Path
    argv: list[str]
    record: Path
    log: Path
    status: str = "pending"  # finished | failed | skipped (finished before)
    exit_status: int | None = None
    seconds: float | None = None


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command line: options before `--`, posttrain.main overrides after it."""
    ours, overrides = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(
        prog="tools/seeds.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="config file (configs/X.py, or configs/X.py:ARG)")
    p.add_argument("--seeds", default="0,1,2", help="initialisation seeds, e.g. 0,1,2 (default)")
    p.add_argument("--parallel", type=int, default=0, help="runs at a time (default: cores // --threads)")
    p.add_argument("--threads", type=int, default=0, help="cores per run (default: cores // --parallel)")
    p.add_argument("--metrics", default="", help="[STAGE:]KEY[@first],... (default: the last eval row's)")
    p.add_argument("--threshold", default="", help="'METRIC>VALUE': how many seeds pass")
    p.add_argument("--out", default="", help="also write the Markdown table here")
    p.add_argument("--json", default="", help="also write the table as JSON here")
    p.add_argument("--workdir_root", default="", help="default runs/seeds/<config name>")
    args = p.parse_args(ours)
    args.overrides = overrides
    return args


def seed_list(text: str) -> list[int]:
    """'0,1,2' → [0, 1, 2]; distinct non-negative integers."""
    try:
        seeds = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise BadInput(f"--seeds={text!r}: expected non-negative integers separated by commas, e.g. 0,1,2") from None
    if not seeds or min(seeds) < 0 or len(set(seeds)) != len(seeds):
        raise BadInput(f"--seeds={text!r}: expected distinct non-negative integers, e.g. 0,1,2")
    return seeds


def config_name(spec: str) -> str:
    """configs/long_context_recall.py:extend:llama3 → long_context_recall_extend_llama3; a folder
    argument stays one folder name (configs/smollm2_rg.py:models/smollm2 → smollm2_rg_models_smollm2)."""
    path, _, arg = spec.partition(":")
    return "_".join([Path(path).stem, *[re.sub(r"[^\w.-]+", "_", a) for a in arg.split(":") if a]])


def plan(args: argparse.Namespace) -> list[SeedRun]:
    """One SeedRun per seed; the overrides may not set what the tool sets per seed."""
    path = args.config.partition(":")[0]
    if not Path(path).is_file():
        raise BadInput(f"config {path!r}: no such file")
    for o in args.overrides:
        key = o.split("=", 1)[0]
        if key in ("--config.seed", "--config.workdir"):
            raise BadInput(f"override {o!r}: the tool sets {key[2:]} per seed (use --seeds / --workdir_root)")
        if not key.startswith("--config."):
            raise BadInput(f"override {o!r}: after '--' come posttrain.main's --config.KEY=VALUE overrides")
    root = Path(args.workdir_root or Path("runs") / "seeds" / config_name(args.config))
    runs = []
    for s in seed_list(args.seeds):
        workdir = root / f"seed{s}"
        argv = ["-m", "posttrain.main", f"--config={args.config}", f"--config.seed={s}", f"--config.workdir={workdir}"]
        mine = [o.replace("{seed}", str(s)) for o in args.overrides]
        runs.append(SeedRun(s, workdir, argv + mine, root / f"seed{s}.json", root / f"seed{s}.log"))
    return runs


def initialisation_note(spec: str, overrides: list[str]) -> str:
    """What a seed changes in this config: its initialisation, or only the rest when every seed
    starts from one checkpoint (`init_from`)."""
    sys.path.insert(0, str(ROOT))  # configs that import configs.<other>
    from posttrain.main import config_from_file

    init_from = config_from_file(spec).get("init_from", "")
    for o in overrides:
        if o.startswith("--config.init_from="):
            init_from = o.split("=", 1)[1]
    if "{seed}" in init_from:
        return (
            f"each seed starts from its own earlier run (init_from={init_from}): that run's initialisation; "
            "config.seed also changes the data order, RL tasks and sampling"
        )
    if init_from:
        return (
            f"every seed starts from one checkpoint (init_from={init_from}): one initialisation; "
            "config.seed changes the data order, RL tasks and sampling only"
        )
    return "config.seed changes the initialisation (and the data order, RL tasks and sampling)"


def finished_before(run: SeedRun) -> bool:
    """Whether `run` finished in an earlier call with these arguments; a finished run with other
    arguments is an error (its workdir holds another experiment)."""
    if not run.record.is_file() or not run.workdir.is_dir():
        return False
    record = json.loads(run.record.read_text())
    if record.get("exit_status") != 0:
        return False
    if record.get("argv") != run.argv:
        raise BadInput(
            f"seed {run.seed}: {run.workdir} finished with other arguments ({shlex.join(record.get('argv', []))}); "
            "use another --workdir_root or remove it"
        )
    run.status, run.exit_status, run.seconds = "skipped", 0, record.get("seconds")
    return True


def subprocess_runner(run: SeedRun, cores: set[int] | None) -> int:
    """Run `python ARGV` (this repository first on the path) pinned to `cores`, output appended
    to the run's log; its exit status (negative: killed by that signal)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    pin = (lambda: os.sched_setaffinity(0, cores)) if cores else None
    run.log.parent.mkdir(parents=True, exist_ok=True)
    with open(run.log, "a") as log:
        log.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} python {shlex.join(run.argv)}\n")
        log.flush()
        return subprocess.run(
            [sys.executable, *run.argv], stdout=log, stderr=subprocess.STDOUT, env=env, preexec_fn=pin
        ).returncode


def core_slots(parallel: int, threads: int) -> tuple[int, list[set[int] | None]]:
    """How many runs at a time and the cores each slot is pinned to (None: not pinned)."""
    cores = sorted(os.sched_getaffinity(0))
    if parallel < 0 or threads < 0:
        raise BadInput(f"--parallel={parallel} --threads={threads}: expected positive numbers")
    if not parallel and not threads:
        return 1, [None]
    threads = threads or max(1, len(cores) // parallel)
    parallel = parallel or max(1, len(cores) // threads)
    slots = [set(cores[(i * threads) % len(cores) :][:threads]) or set(cores[:threads]) for i in range(parallel)]
    return parallel, slots


def run_seeds(runs: list[SeedRun], parallel: int, slots: list, runner=subprocess_runner, say=print) -> None:
    """Run the seeds not finished before, `parallel` at a time, each in a free slot of cores; a
    line per finished seed; each run's record beside its workdir."""
    todo = [r for r in runs if not finished_before(r)]
    for r in runs:
        if r.status == "skipped":
            say(f"seed {r.seed}: finished before, not rerun ({r.workdir})")
    free, lock = list(slots), threading.Lock()

    def one(run: SeedRun) -> SeedRun:
        with lock:
            cores = free.pop()
        start = time.time()
        try:
            run.exit_status = runner(run, cores)
        finally:
            with lock:
                free.append(cores)
        run.seconds = round(time.time() - start, 1)
        run.status = "finished" if run.exit_status == 0 else "failed"
        run.record.parent.mkdir(parents=True, exist_ok=True)
        fields = {"seed": run.seed, "argv": run.argv, "exit_status": run.exit_status, "seconds": run.seconds}
        run.record.write_text(json.dumps({**fields, "log": str(run.log)}, indent=1) + "\n")
        return run

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, parallel)) as pool:
        for done, future in enumerate(concurrent.futures.as_completed([pool.submit(one, r) for r in todo]), 1):
            r = future.result()
            what = "finished" if r.status == "finished" else f"FAILED (exit status {r.exit_status}, log {r.log})"
            say(f"seed {r.seed}: {what} in {r.seconds:.0f} s [{done}/{len(todo)}] {r.workdir}")


def stage_rows(workdir: Path) -> dict[str, list[dict]]:
    """{stage label: metrics rows} in run order: a pipeline's `{i}_{stage}` folders, else the run's own."""
    from posttrain.core.metrics import read_metrics

    dirs = sorted((int(m.group(1)), p) for p in workdir.glob("*") if (m := _STAGE_DIR.match(p.name)) and p.is_dir())
    if not dirs:
        stage = (
            json.loads((workdir / "config.json").read_text())["stage"] if (workdir / "config.json").is_file() else ""
        )
        return {stage or "run": read_metrics(str(workdir)) if (workdir / "metrics.jsonl").is_file() else []}
    return {p.name: read_metrics(str(p)) if (p / "metrics.jsonl").is_file() else [] for _, p in dirs}


def stage_name(label: str) -> str:
    """A pipeline folder's stage: 1_rlvr → rlvr."""
    return _STAGE_DIR.sub(r"\2", label)


def scalar(v) -> bool:
    """A number a table can hold (not a vector, not a flag's text)."""
    return isinstance(v, int | float) and not isinstance(v, bool)


def default_metrics(stages: dict[str, list[dict]], pipeline: bool) -> list[str]:
    """The accuracies and losses of the last evaluation row of the last stage that evaluated."""
    for label, rows in reversed(stages.items()):
        for row in reversed(rows):
            keys = [k for k, v in row.items() if k.startswith("eval/") and scalar(v)]
            chosen = [k for k in keys if re.search(r"accuracy|loss|long_ctx", k)] or keys
            if chosen:
                return [f"{stage_name(label)}:{k}" if pipeline else k for k in chosen]
    return []


def value_of(spec: str, stages: dict[str, list[dict]]) -> float | None:
    """`[STAGE:]KEY[@first]` in these rows; None when no row logged it."""
    stage, _, rest = spec.rpartition(":") if ":" in spec else ("", "", spec)
    key, _, which = rest.partition("@")
    labels = [s for s in stages if not stage or s == stage or stage_name(s) == stage]
    for label in reversed(labels):
        hits = [row[key] for row in stages[label] if key in row and scalar(row[key])]
        if hits:
            return float(hits[0] if which == "first" else hits[-1])
    return None


def logged_metrics(stages: dict[str, list[dict]]) -> list[str]:
    """Every `STAGE:KEY` these rows logged as a number."""
    keys = {f"{stage_name(s)}:{k}" for s, rows in stages.items() for r in rows for k, v in r.items() if scalar(v)}
    return sorted(k for k in keys if not k.endswith(":step"))


def check_spec(spec: str) -> None:
    """A metric spec's syntax: `[STAGE:]KEY[@first]`."""
    key = spec.rpartition(":")[2]
    if not key or "@" in key and key.partition("@")[2] not in ("first", "last"):
        raise BadInput(f"metric {spec!r}: expected [STAGE:]KEY[@first|@last], e.g. rlvr:eval/accuracy@first")


def parse_threshold(text: str) -> tuple[str, str, float] | None:
    """'eval/accuracy>0.7' → (metric, op, value); None for ''."""
    if not text:
        return None
    m = _THRESHOLD.match(text)
    if not m:
        raise BadInput(f"--threshold={text!r}: expected 'METRIC OP NUMBER' with OP one of {' '.join(OPS)}")
    check_spec(m.group(1))
    return m.group(1), m.group(2), float(m.group(3))


def collect(runs: list[SeedRun], specs: list[str], threshold) -> dict:
    """The table as data: each seed's values (of finished seeds), per metric mean / min / max over
    them, the seeds passing the threshold. An unknown metric is an error listing the logged ones."""
    done = [r for r in runs if r.exit_status == 0]
    stages = {r.seed: stage_rows(r.workdir) for r in done}
    pipeline = any(len(s) > 1 or _STAGE_DIR.match(next(iter(s), "")) for s in stages.values())
    if not specs:
        specs = next((m for r in done if (m := default_metrics(stages[r.seed], pipeline))), [])
    if threshold and threshold[0] not in specs:
        specs = [*specs, threshold[0]]
    values = {r.seed: {m: value_of(m, stages[r.seed]) for m in specs} for r in done}
    unknown = [m for m in specs if done and all(values[s][m] is None for s in values)]
    if unknown:
        logged = sorted({k for s in stages.values() for k in logged_metrics(s)})
        raise BadInput(f"metric(s) {unknown} not logged by any finished seed; logged: {', '.join(logged)}")
    summary = {}
    for m in specs:
        got = [v[m] for v in values.values() if v[m] is not None and not math.isnan(v[m])]
        summary[m] = {"mean": sum(got) / len(got), "min": min(got), "max": max(got), "n": len(got)} if got else None
    seeds = [
        {
            "seed": r.seed,
            "workdir": str(r.workdir),
            "status": "failed" if r.exit_status != 0 else "finished",
            "exit_status": r.exit_status,
            "seconds": r.seconds,
            "log": str(r.log),
            "values": values.get(r.seed, {}),
        }
        for r in runs
    ]
    out = {"metrics": specs, "seeds": seeds, "summary": summary}
    if threshold:
        m, op, bound = threshold
        passing = [s["seed"] for s in seeds if s["values"].get(m) is not None and OPS[op](s["values"][m], bound)]
        out["threshold"] = {"condition": f"{m}{op}{bound:g}", "passing": passing, "seeds": len(runs)}
    return out


def number(v: float | None) -> str:
    """A value as the table shows it (4 significant digits)."""
    return "—" if v is None else f"{v:.4g}"


def markdown(table: dict) -> str:
    """The Markdown table under its command line and note."""
    specs, row = table["metrics"], lambda cells: "| " + " | ".join(map(str, cells)) + " |"
    lines = [f"    {table['command']}", "", f"Seeds: {table['note']}.", ""]
    lines += [row(["seed", *(f"`{m}`" for m in specs), "run"]), row(["---"] * (len(specs) + 2))]
    for s in table["seeds"]:
        if s["status"] == "failed":
            run = f"failed: exit status {s['exit_status']}, log {s['log']}"
            lines.append(row([s["seed"], *["failed"] * len(specs), run]))
        else:
            values = [number(s["values"].get(m)) for m in specs]
            lines.append(row([s["seed"], *values, f"{s['seconds'] or 0:.0f} s, {s['workdir']}"]))
    finished = sum(s["status"] == "finished" for s in table["seeds"])
    cells = [
        f"**{number(x['mean'])}** ({number(x['min'])}–{number(x['max'])}"
        + (f"; {x['n']} seeds)" if x["n"] < finished else ")")
        if x
        else "—"
        for x in (table["summary"][m] for m in specs)
    ]
    lines.append(row(["**mean (range)**", *cells, f"{finished} of {len(table['seeds'])} seeds finished"]))
    if "threshold" in table:
        t = table["threshold"]
        lines += ["", f"{len(t['passing'])} of {t['seeds']} seeds pass `{t['condition']}` (seeds {t['passing']})."]
    return "\n".join(lines) + "\n"


def main(argv: list[str], runner=subprocess_runner, say=print) -> int:
    """The tool: plan, run (resuming), tabulate; the exit status."""
    try:
        args = parse_args(argv)
        runs, threshold = plan(args), parse_threshold(args.threshold)
        specs = [m.strip() for m in args.metrics.split(",") if m.strip()]
        for m in specs:
            check_spec(m)
        note = initialisation_note(args.config, args.overrides)
        parallel, slots = core_slots(args.parallel, args.threads)
        say(f"{len(runs)} seeds of {args.config}, {parallel} at a time, under {runs[0].workdir.parent}; {note}")
        run_seeds(runs, parallel, slots, runner, say)
        table = {"command": shlex.join(["python", "tools/seeds.py", *argv]), "note": note}
        table |= collect(runs, specs, threshold)
    except BadInput as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = markdown(table)
    say(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps(table, indent=1) + "\n")
    return 0 if all(s["status"] == "finished" for s in table["seeds"]) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
