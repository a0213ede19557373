"""Rollouts: generate groups on the device with the learner's weights, verify them on a thread pool.

`RolloutWorker.generate` runs the sampler (device work); `RolloutWorker.verify` scores the
responses (host work) and returns a `RolloutBatch`. The sampler is `generate`: static batches or,
with `sampling.continuous_batching` (`RolloutWorker.continuous`), continuously refilled slots: the
same samples for the same key, a few long responses no longer holding every row of the batch.
`collect_batch` is one synchronous batch with dynamic sampling; the overlapped path runs the same
two phases on `producer.AsyncProducer`'s threads.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.eval.passk import mean_pass_at_k
from posttrain.parallel import allgather_json
from posttrain.rl.envs.images import episode_patches
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.rollout.hosts import (
    SAMPLED_REWARD_KEYS,
    all_group_rewards,
    all_rewards,
    combine_info,
    combine_rounds,
    group_share,
    sampled_rewards,
)
from posttrain.rl.rollout.inflight import oldest, token_versions
from posttrain.rl.rollout.routing import trajectory_routing
from posttrain.rl.tasks.scheduler import Group, TaskScheduler
from posttrain.sampling.generate import Samples, SlotConfig, generate, image_rows
from posttrain.sampling.inflight import Latest, generate_inflight
from posttrain.sampling.layout import sampling_sharding
from posttrain.sampling.rules import SamplingParams

SUMMED_INFO = (
    "gen_s",
    "verify_s",
    "new_tokens",
    "verifier_errors",
    "responses",  # added over sampling rounds
    "episodes_solved",
    "episode_turns",
    "episode_calls",
    "episode_calls_ok",
    "episode_calls_invalid",
)


class BusyClock:
    """Wall time during which at least one device program (sampling or update) is running."""

    def __init__(self):
        self.lock, self.active, self.since, self.total = threading.Lock(), 0, 0.0, 0.0

    @contextlib.contextmanager
    def busy(self):
        """Count the enclosed wall time as busy (overlapping intervals counted once)."""
        with self.lock:
            if self.active == 0:
                self.since = time.perf_counter()
            self.active += 1
        try:
            yield
        finally:
            with self.lock:
                self.active -= 1
                if self.active == 0:
                    self.total += time.perf_counter() - self.since


@dataclasses.dataclass
class Pending:
    """A generated batch waiting for verification."""

    tasks: list
    envs: list
    samples: Samples | None
    gen_s: float
    done: RolloutBatch | None = None  # multi-turn episodes run to the end in `generate`


@dataclasses.dataclass
class RolloutBatch:
    """The verified groups of one learner batch: behav[j][g] is the behaviour log-prob of every
    token of group j's sample g (0 on the prompt); `info` holds host numbers for metrics;
    `scheduler_state` is the scheduler as of this batch (all its draws and records, no later ones);
    routing[j][g] the experts the sampler chose for each token (`SamplingParams.record_routing`; else None);
    versions[j][g] the policy version that drew each token (in-flight updates; else None)."""

    groups: list[Group]
    behav: list[list[np.ndarray]]
    info: dict[str, Any]
    scheduler_state: dict | None = None
    task_metrics: dict | None = None
    routing: list[list[np.ndarray]] | None = None
    versions: list[list[np.ndarray]] | None = None

    def rollouts(self, version: int) -> list[Rollout]:
        """The groups as buffer/learner rollouts sampled by policy `version` (with in-flight
        updates: by their oldest token's version, which is never older)."""
        routing = self.routing or [()] * len(self.groups)
        if self.versions is None:
            return [Rollout(g, version, b, r) for g, b, r in zip(self.groups, self.behav, routing)]
        parts = zip(self.groups, self.behav, routing, self.versions)
        return [Rollout(g, oldest(v, version), b, r, v) for g, b, r, v in parts]


@dataclasses.dataclass
class RolloutWorker:
    """Generates groups for (domain, task) pairs and verifies them on a thread pool."""

    graphdef: nnx.GraphDef
    domains: dict
    sampling: SamplingParams
    pad_id: int
    pool: concurrent.futures.ThreadPoolExecutor
    verifier_delay: float = 0.0  # extra host seconds per response (benchmarks of overlap)
    clock: BusyClock | None = None
    episodes: Callable | None = None  # multi-turn rollouts (`episodes.rollout_episodes`, rl.env = "tool")
    rules: dict | None = None  # the sampler's logical-axis rules (`sampling.layout`); None: those in force
    prefix_cache: Any = None  # `sampling.prefix_cache.PrefixCache` (sampling.prefix_cache > 0)
    continuous: SlotConfig | None = None  # continuous batching (sampling.continuous_batching); None: static
    mesh: Any = None  # the sampler's own mesh (rl.placement = split, rollout.placement); None: the current one
    inflight_every: int = 0  # rl.inflight_update_every: decode steps between weight checks (with `latest`)
    progress: Callable[[], None] = lambda: None  # called as work moves: a batch generated, a response verified

    def sample(
        self, params, rest, prompts: list, sampling: SamplingParams, key, latest: Latest | None = None, patches=None
    ) -> Samples:
        """The sampler call of every rollout: `sampling.num_samples` samples per prompt, sample
        i*G+g drawing from fold_in(key, i*G+g), in a static batch or continuously refilled slots;
        given `latest` (and `inflight_every`), with the newest weights it names, switched in flight.
        `patches`: per prompt, its images' patches at its tokens or None (`envs.images`)."""
        patches = image_rows(patches)
        if patches is not None and latest is not None and self.inflight_every:
            raise ValueError("rl.inflight_update_every: prompts with images are sampled without in-flight updates")
        args = (self.graphdef, params, rest, prompts, sampling, key)
        with (self.clock or BusyClock()).busy():
            if latest is not None and self.inflight_every:
                samples = generate_inflight(
                    self.graphdef, latest, prompts, sampling, key, every=self.inflight_every, pad_id=self.pad_id
                )
            else:
                cache, slots = self.prefix_cache, self.continuous
                samples = generate(*args, pad_id=self.pad_id, prefix_cache=cache, patches=patches, slots=slots)
        self.progress()  # tokens generated (multi-turn episodes: at every turn's call)
        return samples

    def generate(
        self,
        params,
        rest,
        tasks: list[tuple[str, object]],
        key,
        *,
        num_samples: int | None = None,
        greedy: bool = False,
        latest: Latest | None = None,
    ) -> Pending:
        """Generate one group per (domain, task) on the device, traced under the sampler's rules;
        verification comes later. `latest`: the newest published weights, switched to in flight
        when `inflight_every` says so (`sample`; the overlapped producer always offers them)."""
        if self.mesh is not None:  # the key was made on the learner's mesh: replicate it on the sampler's
            key = jax.device_put(key, NamedSharding(self.mesh, PartitionSpec()))
        with sampling_sharding(self.rules, self.mesh):
            return self._generate(params, rest, tasks, key, num_samples=num_samples, greedy=greedy, latest=latest)

    def group_sampling(self, num_samples: int | None = None, greedy: bool = False) -> SamplingParams:
        """The sampling of one call: `num_samples` per task (None: the worker's), at temperature 0
        when `greedy`."""
        greedy_change = {"temperature": 0.0} if greedy else {}
        return dataclasses.replace(self.sampling, num_samples=num_samples or self.sampling.num_samples, **greedy_change)

    def _generate(self, params, rest, tasks, key, *, num_samples, greedy, latest=None) -> Pending:
        if self.episodes is not None:  # episodes interleave sampling and tool calls: run them to the end here
            if self.sampling.record_routing:
                raise ValueError("model.moe.routing_replay=sampler: multi-turn episodes do not record routing")
            t0 = time.perf_counter()
            done = self.episodes(self, params, rest, tasks, key, self.group_sampling(num_samples, greedy))
            return Pending(tasks, [], None, time.perf_counter() - t0, done)
        sampling = self.group_sampling(num_samples, greedy)
        g = sampling.num_samples
        envs = [[self.domains[d].make_env() for _ in range(g)] for d, _ in tasks]
        prompts = [[e.reset(t) for e in row][0] for row, (_, t) in zip(envs, tasks)]
        t0 = time.perf_counter()
        patches = [episode_patches(row[0], p) for row, p in zip(envs, prompts)]  # None: no images
        images = {"patches": patches} if any(p is not None for p in patches) else {}  # text only: the call as before
        samples = self.sample(params, rest, prompts, sampling, key, latest, **images)
        return Pending(tasks, envs, samples, time.perf_counter() - t0)

    def verify(self, pending: Pending) -> RolloutBatch:
        """Score a generated batch on the verifier pool. The behaviour log-probs are those of the
        distribution actually sampled (temperature, top-k, top-p), as the learner computes them."""
        if pending.done is not None:
            return pending.done
        flat, samples = [e for row in pending.envs for e in row], pending.samples
        g = len(pending.envs[0]) if pending.envs else 0  # no groups: an empty share (several processes)

        def verify(i):
            if self.verifier_delay:
                time.sleep(self.verifier_delay)
            reward = flat[i].step(samples.completion(i)).reward
            self.progress()
            return reward

        t0 = time.perf_counter()
        rewards = list(self.pool.map(verify, range(len(flat))))
        groups, behav, routing = [], [], None if samples.routing is None else []
        versions = None if samples.versions is None else []
        for j, (d, task) in enumerate(pending.tasks):
            idx = range(j * g, (j + 1) * g)
            trajs = [with_patches(flat[i]) for i in idx]
            groups.append(Group(d, task, [rewards[i].score for i in idx], trajs, [rewards[i].correct for i in idx]))
            behav.append([_token_aligned(samples.sampling_logprobs[i], t) for i, t in zip(idx, trajs)])
            if routing is not None:
                routing.append([trajectory_routing(samples, i, t) for i, t in zip(idx, trajs)])
            if versions is not None:
                versions.append([token_versions(samples.versions[i], t) for i, t in zip(idx, trajs)])
        lengths, stops = samples.lengths, samples.stop_reason
        info = {
            "gen_s": pending.gen_s,
            "verify_s": time.perf_counter() - t0,
            # means of no responses are 0: weighted by `responses` (0) when processes combine them
            "response_len_mean": float(lengths.mean()) if lengths.size else 0.0,
            "response_len_max": int(lengths.max()) if lengths.size else 0,
            "truncated_frac": float(np.mean(stops == 1)) if stops.size else 0.0,
            "new_tokens": int(lengths.sum()),
            "responses": len(flat),
            "verifier_errors": sum(getattr(r, "error", None) is not None for r in rewards),
        }
        return RolloutBatch(groups, behav, info, routing=routing, versions=versions)

    def rollout(self, params, rest, tasks, key, *, exact_share: bool = True, **kw) -> RolloutBatch:
        """`generate` then `verify`; with several processes each verifies only its share of the
        groups (`hosts.group_share`; `exact_share`: as many groups on every process)."""
        return self.verify(local_share(self.generate(params, rest, tasks, key, **kw), exact=exact_share))


def local_share(pending: Pending, *, exact: bool) -> Pending:
    """This process's groups of a generated batch (all of them in a single-process run; none when
    an evaluation has fewer tasks than processes). Multi-turn episodes (`pending.done`) are
    already this process's share (`episodes.rollout_episodes`)."""
    if jax.process_count() == 1 or pending.done is not None:
        return pending
    share = group_share(len(pending.tasks), exact=exact)
    g = len(pending.envs[0]) if pending.envs else 0
    rows = slice(share.start * g, share.stop * g)
    per_row = {f.name: getattr(pending.samples, f.name) for f in dataclasses.fields(Samples)}
    samples = dataclasses.replace(
        pending.samples, **{k: v[rows] for k, v in per_row.items() if isinstance(v, np.ndarray)}
    )
    return Pending(pending.tasks[share], pending.envs[share], samples, pending.gen_s)


def with_patches(env):
    """`env`'s trajectory, carrying the patches of the images it showed (`Trajectory.patches`)."""
    traj = env.trajectory()
    traj.patches = episode_patches(env, traj.tokens)
    return traj


def _token_aligned(logprobs: np.ndarray, traj) -> np.ndarray:
    """A sample's log-probs placed at its generated tokens in the trajectory (0 on the prompt)."""
    lp = np.zeros(len(traj.tokens), np.float32)
    lp[traj.prompt_len :] = logprobs[: len(traj.tokens) - traj.prompt_len]
    return lp


def collect_batch(
    worker: RolloutWorker,
    scheduler: TaskScheduler,
    params,
    rest,
    key,
    *,
    num_groups: int,
    filter_groups: bool,
    max_rounds: int,
) -> RolloutBatch:
    """One synchronous batch of `num_groups` groups; with `filter_groups`, dynamic sampling (DAPO):
    groups whose rewards are all equal carry no signal and are re-drawn, up to `max_rounds`
    rounds, so the batch may be short or empty. Every group is recorded in the scheduler once."""
    parts: list[RolloutBatch] = []

    def sample_groups(tasks):
        nonlocal key
        key, sub = jax.random.split(key)
        parts.append(worker.rollout(params, rest, tasks, sub))
        return parts[-1].groups

    if filter_groups:
        kept = scheduler.dynamic_sample(sample_groups, num_groups, max_rounds=max_rounds)  # records each group
    else:
        kept = sample_groups(scheduler.next_batch(num_groups))
        for domain, task_id, rewards in all_group_rewards(kept):  # every process's groups
            scheduler.record(domain, task_id, rewards)
    behav_of = {id(g): b for part in parts for g, b in zip(part.groups, part.behav)}
    routing_of = {id(g): r for part in parts if part.routing for g, r in zip(part.groups, part.routing)}
    info: dict[str, Any] = combine_rounds([part.info for part in parts], SUMMED_INFO)  # every round
    info.update(sampled_rewards([g for part in parts for g in part.groups]), kept_groups=len(kept))
    info = combine_info(info, SUMMED_INFO + SAMPLED_REWARD_KEYS + ("kept_groups",))
    routing = [routing_of[id(g)] for g in kept] if routing_of else None
    return RolloutBatch(
        kept, [behav_of[id(g)] for g in kept], info, scheduler.get_state(), scheduler.metrics(), routing
    )


def all_solved(groups: list[Group]) -> list[list[bool]]:
    """Per problem (every process's groups, global task order), whether each sample solved it: its
    verdict's correctness is 1 (`Group.correct`), whatever shaping (format, overlong, tool-call
    penalties) took off its reward."""
    for g in groups:
        if len(g.correct) != len(g.rewards):
            raise ValueError(f"group of task {g.task.id!r} carries no verdict correctness (Group.correct)")
    mine = [[float(c) >= 1.0 for c in g.correct] for g in groups]
    return [row for part in allgather_json(mine) for row in part]


def evaluate(worker: RolloutWorker, params, rest, held_out, key, k: int, score_fn=None) -> dict:
    """Held-out accuracy (greedy; per difficulty label too, `eval/accuracy/<label>`, when every
    held-out task has a string label), mean sampled accuracy and pass@k (unbiased, k samples), all of
    verdict correctness (`all_solved`), and beside them the mean shaped reward of the sampled
    responses (`eval/score_mean`, what the learner is paid); with `score_fn` (token rows → learned
    rewards, RLHF) also the mean learned reward of the sampled responses, `eval/rm_score`."""
    greedy = worker.rollout(params, rest, held_out, key, num_samples=1, greedy=True, exact_share=False)
    sampled = worker.rollout(params, rest, held_out, jax.random.fold_in(key, 1), num_samples=k, exact_share=False)
    correct = all_solved(sampled.groups)
    greedy_ok = [row[0] for row in all_solved(greedy.groups)]
    greedy_info, sampled_info = combine_info(greedy.info, SUMMED_INFO), combine_info(sampled.info, SUMMED_INFO)
    out = {
        "eval/accuracy": float(np.mean(greedy_ok)),
        "eval/mean_accuracy": float(np.mean(correct)),
        f"eval/pass@{k}": mean_pass_at_k(correct, k),
        "eval/score_mean": float(np.mean(all_rewards(sampled.groups))),
        "eval/response_len": sampled_info["response_len_mean"],
    }
    labels = [d for part in allgather_json([g.task.difficulty for g in greedy.groups]) for d in part]
    if labels and all(isinstance(d, str) for d in labels):  # greedy accuracy per label (e.g. a screen task's kind)
        for label in sorted(set(labels)):
            out[f"eval/accuracy/{label}"] = float(np.mean([ok for ok, d in zip(greedy_ok, labels) if d == label]))
    if "tool_success_rate" in greedy.info:  # multi-turn episodes: solved by the final check, penalties aside
        out.update(
            {
                "eval/tool_success_rate": greedy_info["tool_success_rate"],
                "eval/tool_success_rate_sampled": sampled_info["tool_success_rate"],
                "eval/turns_per_episode": greedy_info["turns_per_episode"],
            }
        )
    if score_fn is not None:
        out["eval/rm_score"] = float(np.mean(score_fn([t.tokens for g in sampled.groups for t in g.trajectories])))
    return out
