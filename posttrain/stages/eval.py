"""Stage `eval`: evaluate one checkpoint, or every checkpoint of a run, on named suites.

Suites (`eval.suites`, comma-separated): the built-in held-out sets of the RL domains
(`arithmetic`, `gsm8k` test, `humaneval`, the agent domain `repo_fix`'s "test" split, via
`rl.tasks.make_domains`) and user JSONL suites `name=path.jsonl` of `rl.eval_files` records
(`rl/tasks/suites.py`: images too). Each suite reports greedy accuracy, mean sampled accuracy over
`eval.samples` samples, pass@k (unbiased estimator) for each k of `eval.pass_k` — all three count
a sample as right when its verdict's correctness is 1, whatever the reward shaping (format,
overlong, tool-call penalties) took off its score — the mean shaped score of the sampled
responses (`score_mean`), mean response length, verifier errors and its wall time. A multi-turn
suite (`repo_fix`) runs whole episodes as `rl.env='tool'` does (`rl.max_turns` turns of
`rl.max_new_tokens`, sandboxed calls, the configured tool-call penalties): a problem counts as
solved when its final check passes, penalties aside (`tool_success_rate`, greedy;
`tool_success_rate_sampled`), and it also reports `turns_per_episode`, `calls_per_turn` and
`tool_call_ok_rate` of the greedy episodes.
lm-eval tasks are suites too (`lm_eval:<task>`, e.g. `lm_eval:posttrain_gsm8k`: posttrain's offline
tasks or any lm-eval knows), run by lm-eval on this checkpoint's weights through `eval/lm_harness.py`
(`eval.size` documents, `eval.lm_eval_batch_size` requests per call); each reports lm-eval's metrics
as `<suite>/<metric>[@<filter>]` (the gate's metric names are checked against the task's configuration
at start-up), `sample_len` and `seconds`.
Sampling uses the `rl.*` settings (temperature, top_k, top_p, max_new_tokens) and the seed, so
checkpoints are compared on the same draws. Every result is appended to
`{workdir}/eval/<suite>.jsonl` with the checkpoint path and step and the suite version (a hash of
its records), so runs and checkpoints can be compared over time; `{workdir}/metrics.jsonl` gets
one row per checkpoint (`eval/<suite>/<metric>`) for the curves.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import time
from collections.abc import Callable
from functools import partial

import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from posttrain import storage
from posttrain.config import RunConfig
from posttrain.core import lineage
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.harness import Result
from posttrain.core.init import checkpoint_dir, load_model_state
from posttrain.core.metrics import MetricsWriter
from posttrain.core.state import abstract_model
from posttrain.data.tokenizer import load_tokenizer
from posttrain.eval.lm_model import DEFAULT_MAX_LENGTH, LoadedModel
from posttrain.eval.long_context_eval import make_long_context_eval, parse_grid
from posttrain.eval.passk import mean_pass_at_k
from posttrain.models.decoder import Decoder
from posttrain.parallel import agree, mesh_and_rules, use_sharding
from posttrain.rl.envs.base import Task
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.hosts import all_rewards, combine_info
from posttrain.rl.rollout.worker import SUMMED_INFO, RolloutWorker, all_solved
from posttrain.rl.tasks.suites import (
    HEADLINE,
    LM_EVAL,
    lm_eval_suites,
    make_suites,
    multi_turn_suites,
    parse_suites,
    suite_version,
)
from posttrain.sampling.rules import SamplingParams
from posttrain.stages.common import rl_sampling


def pass_ks(cfg) -> list[int]:
    """eval.pass_k as ints, each in 1..eval.samples."""
    try:
        ks = [int(k) for k in str(cfg.eval.pass_k).split(",") if k.strip()]
    except ValueError:
        raise ValueError(f"eval.pass_k={cfg.eval.pass_k!r}: expected comma-separated integers, e.g. '1,4'") from None
    bad = [k for k in ks if not 1 <= k <= cfg.eval.samples]
    if bad or not ks:
        raise ValueError(f"eval.pass_k={cfg.eval.pass_k!r}: each k must be in 1..eval.samples={cfg.eval.samples}")
    return ks


def evaluate_suite(
    worker: RolloutWorker,
    params,
    rest,
    name: str,
    tasks: list[Task],
    key,
    samples: int,
    ks: list[int],
    *,
    episodes: bool = False,
) -> dict:
    """Greedy accuracy, mean sampled accuracy, pass@k, response length, verifier errors, seconds;
    with `episodes` (the worker runs multi-turn tool episodes) also the `EPISODE_METRICS`.

    Same draws as `rollout.evaluate`: greedy with `key`, `samples` samples with fold_in(key, 1)."""
    t0 = time.perf_counter()
    pairs = [(name, t) for t in tasks]
    greedy = worker.rollout(params, rest, pairs, key, num_samples=1, greedy=True, exact_share=False)
    sampled = worker.rollout(params, rest, pairs, jax.random.fold_in(key, 1), num_samples=samples, exact_share=False)
    # several processes: each verified its share of the problems; results from all of them
    correct = all_solved(sampled.groups)  # verdict correctness, shaping aside
    greedy_ok = [row[0] for row in all_solved(greedy.groups)]
    score = float(np.mean(all_rewards(sampled.groups)))
    greedy, sampled = (dataclasses.replace(b, info=combine_info(b.info, SUMMED_INFO)) for b in (greedy, sampled))
    out = {
        "accuracy": float(np.mean(greedy_ok)),
        "mean_accuracy": float(np.mean(correct)),
        **{f"pass@{k}": mean_pass_at_k(correct, k) for k in ks},
        "score_mean": score,
        "response_len": sampled.info["response_len_mean"],
        "greedy_response_len": greedy.info["response_len_mean"],
        "verifier_errors": greedy.info["verifier_errors"] + sampled.info["verifier_errors"],
    }
    if episodes:
        out.update(
            tool_success_rate=out["accuracy"],
            tool_success_rate_sampled=out["mean_accuracy"],
            **{k: greedy.info[k] for k in ("turns_per_episode", "calls_per_turn", "tool_call_ok_rate")},
        )
    return {**out, "seconds": time.perf_counter() - t0}


SUITE_METRICS = (
    "accuracy",
    "mean_accuracy",
    "score_mean",
    "response_len",
    "greedy_response_len",
    "verifier_errors",
    "seconds",
)
EPISODE_METRICS = (
    "tool_success_rate",
    "tool_success_rate_sampled",
    "turns_per_episode",
    "calls_per_turn",
    "tool_call_ok_rate",
)


def check_eval_config(cfg) -> None:
    """Start-up check of `eval.suites`, `eval.pass_k` and the metrics `eval.gate` names (no data is
    read: a pipeline runs it before its first stage trains)."""
    check_gate_metrics(cfg, [n for n, _ in parse_suites(cfg.eval.suites)], pass_ks(cfg))


def lm_harness(cfg):
    """`posttrain.eval.lm_harness`, or a ValueError naming eval.suites and the extra to install."""
    try:
        from posttrain.eval import lm_harness
    except ImportError as e:
        raise ValueError(f"eval.suites={cfg.eval.suites!r}: {e}") from None
    return lm_harness


def lm_eval_metrics(cfg) -> set[str]:
    """`<suite>/<metric>` of every lm-eval suite (`lm_eval:<task>`), from the tasks' configurations
    (no data read); an unknown task is an error naming eval.suites."""
    names = lm_eval_suites(cfg.eval.suites)
    if not names:
        return set()
    harness = lm_harness(cfg)
    try:
        manager = harness.find_tasks([n.removeprefix(LM_EVAL) for n in names])
    except ValueError as e:
        raise ValueError(f"eval.suites={cfg.eval.suites!r}: {e}") from None
    return {f"{n}/{m}" for n in names for m in harness.task_metric_names(n.removeprefix(LM_EVAL), manager)}


def check_gate_metrics(cfg, suites, ks: list[int]) -> None:
    """Every metric `eval.gate` names is one this evaluation reports (suites: their names)."""
    from posttrain.eval.gates import REGRESSION_DROP, parse_gate

    known = {REGRESSION_DROP, *(HEADLINE[n] for n in suites if n in HEADLINE), *lm_eval_metrics(cfg)}
    multi = multi_turn_suites(cfg.eval.suites)
    for n in (n for n in suites if not n.startswith(LM_EVAL)):
        known |= {
            f"{n}/{m}" for m in (*SUITE_METRICS, *(f"pass@{k}" for k in ks), *(EPISODE_METRICS if n in multi else ()))
        }
    if cfg.eval.long_context.lengths:
        grid = parse_grid(cfg.eval.long_context)
        known |= {f"long_ctx_{kind}" for kind in grid["kinds"]}
        known |= {f"long_ctx_{kind}/len{n}" for kind in grid["kinds"] for n in grid["lengths"]}
    unknown = [c.metric for c in parse_gate(cfg.eval.gate, "config.eval.gate") if c.metric not in known]
    if unknown:
        raise ValueError(
            f"config.eval.gate={cfg.eval.gate!r}: stage eval does not report {unknown}; "
            f"it reports {', '.join(sorted(known))}"
        )


def checkpoint_steps(cfg, path: str) -> list[int]:
    """The steps of `path` that `eval.steps` selects (latest | all | "10,20")."""
    if path.startswith("hf:"):
        if str(cfg.eval.steps).strip() != "latest":
            raise ValueError(
                f"eval.steps={cfg.eval.steps!r} cannot take effect: eval.checkpoint={path!r} is a "
                "Hugging Face folder (one set of weights, step 0)"
            )
        return [0]
    ckpt = Checkpointer(checkpoint_dir(path), every=0, keep=1, async_save=False)
    # the steps every process lists (a run still saving may add one between two processes' looks)
    available = sorted(agree(ckpt.all_steps(), name=f"checkpoints of {path}", reduce="intersection"))
    ckpt.close()
    if not available:
        raise FileNotFoundError(f"eval.checkpoint={path!r}: no checkpoint under {checkpoint_dir(path)}")
    spec = str(cfg.eval.steps).strip()
    if spec == "latest":
        return available[-1:]
    if spec == "all":
        return available
    try:
        steps = [int(s) for s in spec.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"eval.steps={spec!r}: expected latest, all or comma-separated steps") from None
    missing = [s for s in steps if s not in available]
    if missing or not steps:
        raise ValueError(f"eval.steps={spec!r}: no checkpoint {missing} in {path} (has {available})")
    return steps


def write_record(workdir: str, record: dict) -> None:
    """Append one suite's result to `{workdir}/eval/<suite>.jsonl` (process 0 only)."""
    if jax.process_index() != 0:
        return
    storage.makedirs(storage.join(workdir, "eval"))
    storage.append_text(storage.join(workdir, "eval", f"{record['suite']}.jsonl"), json.dumps(record) + "\n")


def gate_view(results: dict[str, dict], versions: dict[str, str]) -> dict:
    """Flat metrics for gates: `<suite>/<metric>`, `<suite>/version` and the headline aliases."""
    out = {}
    for name, m in results.items():
        out.update({f"{name}/{k}": v for k, v in m.items()})
        out[f"{name}/version"] = versions[name]
        if name in HEADLINE:
            out[HEADLINE[name]] = m["accuracy"]
    return out


@dataclasses.dataclass
class Evaluation:
    """What each checkpoint's evaluation shares: the suites and their versions, the workers (one-
    answer and multi-turn), the pass@k values, the long-context eval, the metrics writer."""

    cfg: RunConfig
    path: str
    suites: dict
    versions: dict
    ks: list[int]
    worker: RolloutWorker
    episode_worker: RolloutWorker
    graphdef: nnx.GraphDef
    long_context: Callable | None
    lm_eval: Callable | None  # (params, rest) -> {suite: (metrics, version)} of the lm-eval suites
    writer: MetricsWriter
    bar: tqdm


def run(cfg: RunConfig, baseline: dict | None = None) -> Result:
    """Evaluate the selected checkpoints of `eval.checkpoint` (or `init_from`) on `eval.suites`.

    `Result.eval` holds the last checkpoint's gate metrics, with `regression_drop` against the
    previous checkpoint evaluated here, else against `baseline` (a pipeline's previous eval)."""
    from posttrain.eval.gates import regression_drop

    path = cfg.eval.checkpoint or cfg.init_from
    if not path:
        raise ValueError("eval.checkpoint is empty and there is no init_from: give a run dir or checkpoints dir")
    if cfg.lora.rank:
        raise ValueError(
            "stage eval with lora.rank > 0: evaluating adapter checkpoints is not supported; "
            "evaluate the merged model (lora.rank=0)"
        )
    ks, tok = pass_ks(cfg), load_tokenizer(cfg.data.tokenizer)
    suites = make_suites(cfg, tok)
    check_gate_metrics(cfg, [n for n, _ in parse_suites(cfg.eval.suites)], ks)
    steps = checkpoint_steps(cfg, path)
    # sampling.max_context: the checkpoint's trained and configured context unless the key is set
    limit = lineage.max_context(cfg, lineage.of_init(path))
    mesh, rules = mesh_and_rules(cfg)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    graphdef = nnx.split(abstract_model(make), nnx.Param, ...)[0]
    previous, metrics = baseline, {}
    total = len(steps) * (len(suites) + len(lm_eval_suites(cfg.eval.suites)))
    bar = tqdm(total=total, desc="eval", disable=not cfg.train.progress or jax.process_index() != 0)
    # Curves too: one row per checkpoint in metrics.jsonl, appended (earlier rows, e.g. of training, are kept).
    writer = MetricsWriter(cfg.workdir, enabled=jax.process_index() == 0, resume_step=2**62)
    with concurrent.futures.ThreadPoolExecutor(cfg.rl.verifier_workers) as pool, use_sharding(mesh, rules):
        worker = RolloutWorker(graphdef, suites, eval_sampling(cfg, tok, limit), tok.pad_id, pool)
        episodes = partial(rollout_episodes, cohorts=cfg.rl.episode_cohorts)
        versions = {n: suite_version(d.tasks) for n, d in suites.items()}
        long_context = make_long_context_eval(cfg.eval.long_context, cfg.workdir, tok, limit)  # None: no lengths
        e = Evaluation(
            cfg,
            path,
            suites,
            versions,
            ks,
            worker,
            dataclasses.replace(worker, episodes=episodes),
            graphdef,
            long_context,
            make_lm_eval(cfg, graphdef, tok, limit, mesh, rules),
            writer,
            bar,
        )
        for step in steps:
            params, rest, _ = load_model_state(path, make, mesh, rules, step=None if path.startswith("hf:") else step)
            metrics = evaluate_checkpoint(e, params, rest, step)
            if previous is not None and (drop := regression_drop(metrics, previous)) is not None:
                metrics["regression_drop"] = drop
            previous = metrics
    bar.close()
    writer.close()
    return Result(graphdef, None, [], metrics)


def make_lm_eval(cfg: RunConfig, graphdef: nnx.GraphDef, tok, limit: int, mesh, rules) -> Callable | None:
    """The lm-eval suites on one checkpoint's weights (None without any): `eval.size` documents
    per task, `eval.lm_eval_batch_size` requests per call, rows within `limit` tokens (else 2048)."""
    names = lm_eval_suites(cfg.eval.suites)
    if not names:
        return None
    harness = lm_harness(cfg)

    def run_tasks(params, rest) -> dict:
        model = LoadedModel(graphdef, params, rest, tok, limit or DEFAULT_MAX_LENGTH, mesh, rules)
        tasks = [n.removeprefix(LM_EVAL) for n in names]
        out = harness.evaluate_tasks(model, tasks, limit=cfg.eval.size, batch_size=cfg.eval.lm_eval_batch_size)
        return {LM_EVAL + t: v for t, v in out.items()}

    return run_tasks


def eval_sampling(cfg: RunConfig, tok, limit: int) -> SamplingParams:
    """How the suites are sampled: the `rl` section's temperature, top-k / top-p and new tokens,
    `eval.samples` per problem, within `limit` tokens of context."""
    return rl_sampling(cfg.rl, tok.stop_ids, cfg.eval.samples, max_context=limit)


def evaluate_checkpoint(e: Evaluation, params, rest, step: int) -> dict:
    """Every suite on one checkpoint's weights: each suite's record and log line, then the gate
    metrics (and the long-context grid) as that checkpoint's metrics row."""
    cfg, multi = e.cfg, multi_turn_suites(e.cfg.eval.suites)
    results = {}
    for name, suite in e.suites.items():
        results[name] = evaluate_suite(
            e.episode_worker if name in multi else e.worker,
            params,
            rest,
            name,
            list(suite.tasks),
            jax.random.key(cfg.seed),
            cfg.eval.samples,
            e.ks,
            episodes=name in multi,
        )
        record = {"suite": name, "version": e.versions[name], "checkpoint": e.path, "step": step}
        record |= {"problems": len(suite.tasks), "samples": cfg.eval.samples, **results[name], "time": time.time()}
        write_record(cfg.workdir, record)
        logging.info("eval %s step %d %s: %s", e.path, step, name, {k: round(v, 4) for k, v in results[name].items()})
        e.bar.update(1)
    for name, (result, version) in (e.lm_eval(params, rest) if e.lm_eval else {}).items():
        results[name], e.versions[name] = result, version
        record = {"suite": name, "version": version, "checkpoint": e.path, "step": step, "harness": "lm-eval"}
        write_record(cfg.workdir, {**record, "problems": int(result["sample_len"]), **result, "time": time.time()})
        logging.info("eval %s step %d %s: %s", e.path, step, name, {k: round(v, 4) for k, v in result.items()})
        e.bar.update(1)
    metrics = gate_view(results, e.versions)
    if e.long_context is not None:
        metrics.update(e.long_context(nnx.merge(e.graphdef, params, rest), step))
    curves = {k: v for k, v in metrics.items() if ("/" in k or k.startswith("long_ctx")) and not k.endswith("/version")}
    e.writer.write(step, {f"eval/{k}": v for k, v in curves.items()})
    return metrics
