"""Stage `rejection_sampling`: the data flywheel — verified samples of the policy become SFT data.

    training prompts ─▶ sampler (policy: init_from, in a pipeline the previous stage) ─▶ N candidates
        ─▶ verifier (the task's: math, code, user) ─▶ pass (score >= min_score, not truncated,
        no verifier error) ─▶ length filter ─▶ dedup ─▶ best `keep_per_prompt`
        ─▶ SFT JSONL with provenance + yield report

Prompts are RL *training* tasks (the registry of `rl/tasks.py`: `rl.domains`, `rl.train_files` with
their verifiers), `rejection.prompts` distinct ones (case and whitespace normalised), split over the
domains by their `rl.domains` weights; held-out tasks are never sampled, so evaluation stays clean.
Candidates are generated and verified by the RL `RolloutWorker` (`rl.prompts_per_step` prompts per
sampler call; `rl.max_new_tokens`, `rl.top_k`, `rl.top_p`; `rejection.temperature`).

Selection per prompt: passing candidates ranked by score (high first), then length (short first),
then sample index; one kept per normalised response text (surrounding whitespace stripped, runs of
whitespace as one space; case kept); responses over `rejection.max_tokens` tokens dropped; at
most `rejection.keep_per_prompt` kept.

Output (`rejection.output`, default `{workdir}/sft.jsonl`, local or gs://): one SFT record per kept
candidate, `{"prompt", "response"}` (or `{"messages"}` for multi-message prompts; names as
`data.fields` maps them, so the next SFT stage reads them) plus `"provenance"`: policy checkpoint
and step, domain, task id, difficulty, verifier, score and its parts, sample index. With
`rejection.mix_original`, `{output stem}.mixed.jsonl` holds `sft.train_files`'s records, then the
kept ones. In a pipeline the next `sft` stage trains on the kept records (or the mixed file),
starting from the policy that sampled them.

Re-run in the same workdir (a resumed pipeline) with the same config and policy checkpoint, the stage
finds its report and files and does not sample again.

Yield report (`{workdir}/rejection_report.json`, and one console line per domain and difficulty):
prompts, candidates, passing, verifier errors, truncated, too long, duplicates, kept, prompts with
a kept candidate; `yield` = prompts with a kept candidate / prompts, `pass_rate` = passing /
candidates. Gate metrics (`rejection.gate`): `rejection/{yield,pass_rate,kept,prompts}` and
`rejection/<domain>/{yield,pass_rate,kept}`.

This module holds the stage's config check, prompt choice, sampling and `run`; the candidates'
selection, records and report are in `rejection_records`.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import itertools
import json
import logging
import os

import fsspec
import jax
import numpy as np
from flax import nnx
from tqdm import tqdm

from posttrain.config import RunConfig
from posttrain.core import lineage
from posttrain.core.checkpoint import Checkpointer
from posttrain.core.init import checkpoint_dir, load_model_state
from posttrain.core.loop import Result
from posttrain.core.state import abstract_model, init_model_state
from posttrain.data.sources import read_jsonl
from posttrain.data.tokenizer import Tokenizer, load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import allgather_json, mesh_and_rules, use_sharding
from posttrain.rl.envs.base import Task
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks.domains import Domain
from posttrain.rl.tasks.files import normalise_prompt
from posttrain.rl.tasks.registry import domain_weights, make_domains, make_reward_fn
from posttrain.sampling.generate import SlotConfig
from posttrain.sampling.rules import SamplingParams
from posttrain.stages.data_files import resolve_data_files
from posttrain.stages.rejection_records import (
    Candidate,
    candidate_fields,
    gate_metrics,
    log_report,
    open_for_writing,
    select,
    sft_record,
    write_jsonl,
    yield_report,
)

REPORT = "rejection_report.json"


def original_sft_files(cfg: RunConfig, tok) -> RunConfig:
    """`cfg` with `sft.train_files` naming files: `"synthetic:"` generated (into
    `{workdir}/synthetic`, by process 0) as the sft stage would, named files checked."""
    return resolve_data_files(cfg.replace({"sft.eval_files": ""}), "sft", "sft", tok)


def original_sft_records(sub):
    """The records of `sft.train_files` (resolved by `original_sft_files`) that `rejection.mix_original` mixes in."""
    return (rec.data for rec in read_jsonl(sub.sft.train_files, on_error=sub.data.on_error))


def output_path(cfg) -> str:
    """The kept records' file: `rejection.output`, or `{workdir}/sft.jsonl`."""
    return cfg.rejection.output or os.path.join(cfg.workdir, "sft.jsonl")


def mixed_path(cfg) -> str:
    """The file of `sft.train_files`'s records then the kept ones (`rejection.mix_original`)."""
    return output_path(cfg).removesuffix(".jsonl") + ".mixed.jsonl"


def next_sft_files(cfg) -> str:
    """What the `sft` stage after this one in a pipeline trains on."""
    return mixed_path(cfg) if cfg.rejection.mix_original else output_path(cfg)


def choose_prompts(domains: dict[str, Domain], weights: dict[str, float], n: int, seed: int) -> list[tuple[str, Task]]:
    """`n` distinct training prompts (normalised text) as (domain, task): each domain's share by
    weight (largest remainder), capped at its distinct prompts, each domain's in a seeded order."""
    pools = {}
    for i, (name, domain) in enumerate(domains.items()):
        seen, tasks = set(), []
        for t in domain.tasks:
            if (key := normalise_prompt(t)) not in seen:
                seen.add(key)
                tasks.append(t)
        pools[name] = [tasks[k] for k in np.random.default_rng([seed, i]).permutation(len(tasks))]
    total = sum(weights[d] for d in domains)
    quota = {d: n * weights[d] / total for d in domains}
    counts = {d: min(int(quota[d]), len(pools[d])) for d in domains}
    while sum(counts.values()) < n:
        open_ = [d for d in domains if counts[d] < len(pools[d])]
        if not open_:
            logging.warning(
                "rejection.prompts=%d: the training domains have only %d distinct prompts", n, sum(counts.values())
            )
            break
        counts[max(open_, key=lambda d: quota[d] - counts[d])] += 1
    return [(d, t) for d in domains for t in pools[d][: counts[d]]]


def sample_candidates(
    worker: RolloutWorker,
    params,
    rest,
    pairs: list[tuple[str, Task]],
    key,
    *,
    samples: int,
    chunk: int,
    tok: Tokenizer,
    progress: bool = True,
) -> list[list[Candidate]]:
    """`samples` verified candidates for each (domain, task), `chunk` prompts per sampler call.

    With several processes each verifies a contiguous share of a chunk's groups (`hosts.group_share`);
    their candidates are gathered, so every process returns every prompt's, in `pairs` order."""
    out = []
    with tqdm(total=len(pairs), desc="rejection_sampling", disable=not progress) as bar:
        for start in range(0, len(pairs), chunk):
            part = pairs[start : start + chunk]
            batch = worker.rollout(
                params, rest, part, jax.random.fold_in(key, start), num_samples=samples, exact_share=False
            )
            mine = [[candidate_fields(i, t, tok) for i, t in enumerate(g.trajectories)] for g in batch.groups]
            groups = [g for share in allgather_json(mine) for g in share]
            if len(groups) != len(part):
                raise RuntimeError(f"rejection_sampling: {len(groups)} groups gathered for {len(part)} prompts")
            out += [[Candidate(d, task, **fields) for fields in group] for (d, task), group in zip(part, groups)]
            bar.update(len(part))
    return out


def load_policy(cfg, make, mesh, rules) -> tuple:
    """(params, rest, provenance) of the policy: `init_from`'s newest checkpoint, else the seed's init."""
    if cfg.init_from:
        params, rest, step = load_model_state(cfg.init_from, make, mesh, rules)
        return params, rest, {"policy_checkpoint": cfg.init_from, "policy_step": int(step)}
    params, rest = init_model_state(make, mesh, rules)
    return params, rest, {"policy_checkpoint": "", "policy_step": 0}


def fingerprint(cfg) -> str:
    """A hash of everything in the config but the workdir and stage name: what the records depend on."""
    config = json.loads(json.dumps(cfg.to_dict()))
    config.pop("workdir"), config.pop("stage")
    if not config["rl"]["options"]:  # (configs before rl.options existed hash as they did)
        del config["rl"]["options"]
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()[:16]


def policy_step(init_from: str) -> int:
    """The step `load_policy` will read: `init_from`'s newest checkpoint (0: none, or a HF folder)."""
    if not init_from or init_from.startswith("hf:"):
        return 0
    ckpt = Checkpointer(checkpoint_dir(init_from), every=0, keep=1, async_save=False, create=False)
    try:
        return ckpt.latest_step() or 0
    finally:
        ckpt.close()


def finished_report(cfg) -> dict | None:
    """The report of an earlier run in this workdir with the same config and policy step whose files
    are all there (a re-run pipeline resumes after this stage), else None."""
    fs, path = fsspec.core.url_to_fs(os.path.join(cfg.workdir, REPORT))
    if not fs.exists(path):
        return None
    with fs.open(path, "r") as f:
        report = json.load(f)
    files = [output_path(cfg)] + ([mixed_path(cfg)] if cfg.rejection.mix_original else [])
    same = report.get("fingerprint") == fingerprint(cfg) and report["policy"]["policy_step"] == policy_step(
        cfg.init_from
    )
    return report if same and all(fsspec.core.url_to_fs(f)[0].exists(f) for f in files) else None


def run(cfg) -> Result:
    """Sample, verify, select and write the SFT records and the yield report (module docstring).

    When this workdir already holds them from the same config and policy, nothing is sampled again."""
    r = cfg.rejection
    if (done := finished_report(cfg)) is not None:
        logging.info(
            "rejection_sampling: %s holds the records of this config and policy already; not sampling again",
            cfg.workdir,
        )
        log_report(done)
        return Result(None, None, [], gate_metrics(done))
    tok = load_tokenizer(cfg.data.tokenizer)
    rl = dataclasses.replace(cfg.rl, eval_every=0)  # held-out tasks are not needed here (and never sampled)
    domains, _ = make_domains(cfg, tok, make_reward_fn(cfg.rl), rl=rl)
    pairs = choose_prompts(domains, domain_weights(cfg.rl, domains), r.prompts, cfg.seed)
    mesh, rules = mesh_and_rules(cfg)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    graphdef = nnx.split(abstract_model(make), nnx.Param, ...)[0]
    rl = cfg.rl
    sampling = SamplingParams(
        temperature=r.temperature,
        top_k=rl.top_k,
        top_p=rl.top_p,
        max_new_tokens=rl.max_new_tokens,
        stop_ids=tuple(tok.stop_ids),
        num_samples=r.samples_per_prompt,
        max_context=lineage.max_context(cfg, lineage.of_init(cfg.init_from)),  # sampling.max_context
    )
    with concurrent.futures.ThreadPoolExecutor(rl.verifier_workers) as pool, use_sharding(mesh, rules):
        params, rest, policy = load_policy(cfg, make, mesh, rules)
        worker = RolloutWorker(graphdef, domains, sampling, tok.pad_id, pool, continuous=SlotConfig.of(cfg.sampling))
        candidates = sample_candidates(
            worker,
            params,
            rest,
            pairs,
            jax.random.key(cfg.seed),
            samples=r.samples_per_prompt,
            chunk=rl.prompts_per_step,
            tok=tok,
            progress=cfg.train.progress and jax.process_index() == 0,
        )
    selected = [select(cs, keep=r.keep_per_prompt, min_score=r.min_score, max_tokens=r.max_tokens) for cs in candidates]
    report = yield_report(selected, pairs)
    kept = [c for cs, _ in selected for c in cs]
    if not kept:
        raise ValueError(
            f"rejection_sampling kept no candidate of {len(pairs)} prompts × {r.samples_per_prompt} "
            f"samples (pass rate {report['total']['pass_rate']:.1%}, rejection.min_score={r.min_score}): "
            "there is no SFT data to write; sample more (rejection.prompts, samples_per_prompt) or "
            "start from a stronger policy (init_from)"
        )
    original = original_sft_files(cfg, tok) if r.mix_original else None  # every process: a barrier
    fields = dict(kv.split("=", 1) for kv in cfg.data.fields.split(",") if kv) if cfg.data.fields else None
    records = [sft_record(c, policy, cfg, fields) for c in kept]
    if jax.process_index() == 0:
        write_jsonl(output_path(cfg), records)
        if r.mix_original:
            write_jsonl(mixed_path(cfg), itertools.chain(original_sft_records(original), records))
        with open_for_writing(os.path.join(cfg.workdir, REPORT)) as f:
            json.dump(
                {
                    **report,
                    "policy": policy,
                    "output": output_path(cfg),
                    "next_sft_files": next_sft_files(cfg),
                    "rejection": r.to_dict(),
                    "fingerprint": fingerprint(cfg),
                },
                f,
                indent=2,
            )
    if jax.process_count() > 1:  # the next stage reads the files on every process
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices("rejection_sampling: SFT records written")
    log_report(report)
    return Result(graphdef, None, [], gate_metrics(report))
