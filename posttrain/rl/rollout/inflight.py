"""In-flight weight updates in RL (`rl.inflight_update_every`, issue 27 item 2): the rollout side of
`sampling.inflight`, the learner's staleness bound per token, and the start-up check.

With `rl.max_staleness >= 1` and `rl.inflight_update_every = N` the sampler (the overlapped
producer's, or a disaggregated sampler group's, `stages/rlvr_sampler.py`) looks for a newer
published policy every N decode steps and decodes on with it (PipelineRL: sequences in flight keep
their KV cache). Each generated token carries the policy version that drew it beside
its behaviour log-prob; a rollout's `version` is its oldest token's, so the staleness bound
(`rl.max_staleness`: `RolloutBuffer`, `RemoteProducer.take`) is per sequence: a sequence with one
token past the bound is dropped whole, and every token the learner receives is within it.

There is no per-token bound (PipelineRL's keeping a long sequence's recent tokens and masking only
the older ones): with the sequence bound upstream it could never act, and keeping the recent
tokens of a sequence whose prefix is past the bound changes what is trained on (advantages of
partly masked samples, sequence-level ratios and aggregation) — a design of its own, not a mask.
`token_version_metrics` reports the lags and refuses a batch that breaks the invariant.
"""

from __future__ import annotations

import jax
import numpy as np

from posttrain.errors import UserError

KEY = "rl.inflight_update_every"


def check_inflight(cfg) -> None:
    """Refuse, naming `rl.inflight_update_every`, the runs where in-flight updates cannot act: no
    weights are published during a generation (max_staleness 0), or the sampler path is not the
    static, single-process one."""
    r, s = cfg.rl, cfg.sampling
    if not r.inflight_update_every:
        return
    refusals = [
        (
            r.max_staleness < 1,
            "rl.max_staleness=0 samples each batch with the current weights: no newer ones can arrive",
        ),
        (s.continuous_batching, "sampling.continuous_batching refills its slots inside one device loop"),
        (s.speculative_k > 0, "sampling.speculative_k drafts inside one device loop"),
        (s.prefix_cache > 0, "sampling.prefix_cache keeps prompt KV of one version"),
        (r.env != "single", f"rl.env={r.env!r} runs multi-turn episodes, sampled turn by turn"),
        (cfg.model.moe.routing_replay != "off", "model.moe.routing_replay records routing in one device loop"),
        (  # a sampler group of several processes agrees on each switch (rl/rollout/group.py)
            jax.process_count() > 1 and r.placement != "disaggregated",
            "several processes would have to agree on each switch",
        ),
    ]
    for refused, why in refusals:
        if refused:
            raise UserError(
                f"{KEY}={r.inflight_update_every} cannot act here: {why}; set it to 0 (off) or change that key", key=KEY
            )


def token_versions(versions: np.ndarray, traj) -> np.ndarray:
    """A sample's token versions (`Samples.versions` row) placed at its generated tokens in the
    trajectory; its prompt gets its first token's (the version that prefilled it)."""
    out = np.empty(len(traj.tokens), np.int32)
    n = len(traj.tokens) - traj.prompt_len
    out[traj.prompt_len :] = versions[:n]
    out[: traj.prompt_len] = versions[0] if n else -1
    return out


def oldest(versions: list[np.ndarray], default: int) -> int:
    """A group's version: its oldest token's (`default` when it has no generated token)."""
    return min((int(v.min()) for v in versions if v.size and v.min() >= 0), default=default)


def token_version_metrics(batch: dict, version: int, max_staleness: int) -> dict:
    """Metrics of the token versions of the generated tokens (`batch["loss_mask"]`) at the learner's
    `version`: `rl/version_lag_max` and `_mean`, and `rl/mixed_version_frac` (the fraction of
    sequences whose tokens carry more than one version). A token lagging by more than
    `max_staleness` is a broken per-sequence bound upstream (module docstring): ValueError."""
    mask = batch["loss_mask"].astype(bool)
    lag = np.where(mask, version - batch["versions"], 0)
    if (lag > max_staleness).any():
        raise ValueError(
            f"a token of version {version - int(lag.max())} reached the learner at version {version}: past "
            f"rl.max_staleness={max_staleness}, which bounds whole sequences by their oldest token before this"
        )
    rows = [v[m] for v, m in zip(batch["versions"], mask) if m.any()]
    return {
        "rl/version_lag_max": float(lag.max(initial=0)),
        "rl/version_lag_mean": float(lag[mask].mean()) if mask.any() else 0.0,
        "rl/mixed_version_frac": float(np.mean([v.min() != v.max() for v in rows])) if rows else 0.0,
    }
