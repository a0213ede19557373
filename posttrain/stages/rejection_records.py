"""Rejection sampling's records: the verified candidates of a prompt, which of them are kept
(`passes`, `select`: pass, length, dedup, best `keep`), and what is written and reported — the
SFT record with provenance, the yield report, its gate metrics and console lines, the JSONL
writer. Pure functions over candidates; the stage (`rejection_sampling`) samples and runs them.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import os

import fsspec

from posttrain.data.examples import field_key
from posttrain.data.tokenizer import Tokenizer
from posttrain.rl.envs.base import Task, Trajectory
from posttrain.rl.verifiers.code import CodeTask
from posttrain.rl.verifiers.math import MathTask
from posttrain.rl.verifiers.user import UserTask

COUNTS = (
    "prompts",
    "candidates",
    "passing",
    "verifier_errors",
    "truncated",
    "too_long",
    "duplicates",
    "kept",
    "prompts_with_kept",
)


@dataclasses.dataclass(frozen=True)
class Candidate:
    """One verified sample: its prompt's domain and task, its index among the prompt's samples,
    the response text and its length in tokens (stop token excluded), the reward and its parts,
    whether the sampler cut it off, and the verifier's error (None when it judged the response)."""

    domain: str
    task: Task
    index: int
    response: str
    num_tokens: int
    score: float
    parts: dict
    truncated: bool = False
    error: str | None = None


def normalise_response(text: str) -> str:
    """A response's text for duplicate detection: stripped, runs of whitespace as one space."""
    return " ".join(text.split())


def passes(c: Candidate, min_score: float) -> bool:
    """Whether a candidate passes: judged (no verifier error), not cut off, score >= min_score."""
    return c.error is None and not c.truncated and c.score >= min_score


def select(
    candidates: list[Candidate], *, keep: int, min_score: float, max_tokens: int
) -> tuple[list[Candidate], collections.Counter]:
    """The kept candidates of one prompt (module docstring: pass, length, dedup, best `keep`) and
    the counts of each filter (`COUNTS`, all but prompts)."""
    counts = collections.Counter(
        candidates=len(candidates),
        prompts_with_kept=0,
        verifier_errors=sum(c.error is not None for c in candidates),
        truncated=sum(c.truncated for c in candidates),
    )
    ranked = sorted((c for c in candidates if passes(c, min_score)), key=lambda c: (-c.score, c.num_tokens, c.index))
    counts["passing"] = len(ranked)
    kept, seen = [], set()
    for c in ranked:
        if max_tokens and c.num_tokens > max_tokens:
            counts["too_long"] += 1
            continue
        text = normalise_response(c.response)
        if text in seen:
            counts["duplicates"] += 1
            continue
        seen.add(text)
        if len(kept) < keep:
            kept.append(c)
    counts["kept"] = len(kept)
    counts["prompts_with_kept"] = int(bool(kept))
    return kept, counts


def candidate_fields(index: int, traj: Trajectory, tok: Tokenizer) -> dict:
    """A verified single-turn trajectory as a Candidate's JSON fields (all but its domain and task)."""
    tokens = traj.tokens[traj.prompt_len :]
    if tokens and tokens[-1] in tok.stop_ids:
        tokens = tokens[:-1]
    reward = traj.reward
    return dict(
        index=index,
        response=tok.decode(tokens),
        num_tokens=len(tokens),
        score=float(reward.score),
        parts=dict(reward.parts),
        truncated=traj.info.get("truncated") is not None,
        error=reward.error,
    )


def candidate(domain: str, task: Task, index: int, traj: Trajectory, tok: Tokenizer) -> Candidate:
    """A verified trajectory of a single-turn episode as a Candidate."""
    return Candidate(domain, task, **candidate_fields(index, traj, tok))


def verifier_name(target) -> str:
    """The name of the verifier that scores a task's target (as `rl.train_files` records name it)."""
    if isinstance(target, UserTask):
        return target.verifier
    return {MathTask: "math", CodeTask: "code"}.get(type(target), type(target).__name__)


def _portable_image(part):
    """An image part whose path reads the same from any folder: a relative local path (the sampler
    read it from the working directory) made absolute; absolute paths and URLs as they are."""
    if not isinstance(part, dict) or part.get("type") != "image" or not isinstance(part.get("image"), str):
        return part
    path = part["image"]
    return part if "://" in path or os.path.isabs(path) else {**part, "image": os.path.abspath(path)}


def sft_prompt(task: Task) -> list[dict]:
    """A task's prompt messages for an SFT record: contents as they are, image parts' paths made
    readable from wherever the record is written (`_portable_image`; SFT resolves a relative path
    against the record file's folder, not the task file's)."""
    return [
        {**m, "content": [_portable_image(p) for p in m["content"]]} if isinstance(m["content"], list) else dict(m)
        for m in task.prompt
    ]


def sft_record(c: Candidate, policy: dict, cfg, fields: dict | None) -> dict:
    """One kept candidate as an SFT record (field names as `data.fields` maps them) with provenance:
    `{"prompt", "response"}` for one user turn of text, else `{"messages"}` (several messages, or
    content parts such as images, `sft_prompt`)."""
    prompt = sft_prompt(c.task)
    if len(prompt) == 1 and prompt[0]["role"] == "user" and isinstance(prompt[0]["content"], str):
        record = {field_key("prompt", fields): prompt[0]["content"], field_key("response", fields): c.response}
    else:
        record = {field_key("messages", fields): prompt + [{"role": "assistant", "content": c.response}]}
    record["provenance"] = {
        "stage": "rejection_sampling",
        **policy,
        "domain": c.domain,
        "task_id": c.task.id,
        "difficulty": c.task.difficulty,
        "verifier": verifier_name(c.task.target),
        "score": c.score,
        "parts": c.parts,
        "sample_index": c.index,
        "samples_per_prompt": cfg.rejection.samples_per_prompt,
        "temperature": cfg.rejection.temperature,
        "response_tokens": c.num_tokens,
        "seed": cfg.seed,
    }
    return record


def yield_report(per_prompt: list[tuple[Candidate | None, collections.Counter]], pairs: list[tuple[str, Task]]) -> dict:
    """Counts (`COUNTS`) with yield and pass rate: in total, per domain, per domain and difficulty."""

    def rates(c: collections.Counter) -> dict:
        out = {k: int(c[k]) for k in COUNTS}
        out["yield"] = c["prompts_with_kept"] / c["prompts"] if c["prompts"] else 0.0
        out["pass_rate"] = c["passing"] / c["candidates"] if c["candidates"] else 0.0
        return out

    total, by_domain, by_difficulty = collections.Counter(), {}, {}
    for (_, counts), (domain, task) in zip(per_prompt, pairs):
        counts = counts + collections.Counter(prompts=1)
        total.update(counts)
        by_domain.setdefault(domain, collections.Counter()).update(counts)
        label = task.difficulty if task.difficulty is not None else "none"
        by_difficulty.setdefault(domain, {}).setdefault(label, collections.Counter()).update(counts)
    return {
        "total": rates(total),
        "domains": {d: rates(c) for d, c in by_domain.items()},
        "difficulty": {d: {lab: rates(c) for lab, c in sorted(labels.items())} for d, labels in by_difficulty.items()},
    }


def open_for_writing(path: str):
    """`fsspec.open(path, "w")` (local or URL) with the parent folders made."""
    fs, p = fsspec.core.url_to_fs(path)
    if "/" in p:
        fs.makedirs(p.rsplit("/", 1)[0], exist_ok=True)
    return fsspec.open(path, "w")


def write_jsonl(path: str, records) -> int:
    """Write records as JSONL to `path` (local or fsspec URL); how many."""
    n = 0
    with open_for_writing(path) as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
            n += 1
    return n


def gate_metrics(report: dict) -> dict:
    """The flat numbers a `rejection.gate` reads."""
    keys = ("yield", "pass_rate", "kept")
    out = {f"rejection/{k}": report["total"][k] for k in (*keys, "prompts")}
    for d, r in report["domains"].items():
        out.update({f"rejection/{d}/{k}": r[k] for k in keys})
    return out


def log_report(report: dict) -> None:
    """One console line per domain and per difficulty label, then the total."""
    line = lambda name, r: (
        f"rejection_sampling {name}: {r['kept']} kept from {r['prompts']} prompts, yield "
        f"{r['yield']:.1%}, pass rate {r['pass_rate']:.1%} ({r['passing']} of {r['candidates']} "
        f"passed; {r['too_long']} too long, {r['duplicates']} duplicates, {r['truncated']} "
        f"truncated, {r['verifier_errors']} verifier errors)"
    )
    for d, r in report["domains"].items():
        logging.info(line(d, r))
        for label, rr in report["difficulty"][d].items():
            if label != "none" or len(report["difficulty"][d]) > 1:
                logging.info(line(f"{d} difficulty {label}", rr))
    logging.info(line("total", report["total"]))
