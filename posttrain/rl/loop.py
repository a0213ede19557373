"""Stage `rlvr`: the GRPO-family loop.

    scheduler ─tasks─▶ sampler (policy v, groups of G) ─▶ verifiers (thread pool) ─▶ buffer ─▶ learner (v → v+1)

The sampler and the learner share the same weight arrays on one mesh. With `rl.max_staleness = 0`
each step samples with the current weights, verifies, then updates (on-policy, deterministic for a
seed). With `>= 1` a producer thread samples and verifies the next batches while the learner
updates on the current one (host work overlaps device work); the learner corrects for the lag
with truncated importance weights between the behaviour log-probs the sampler recorded and its
own, and rollouts staler than the bound are dropped and counted.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import logging
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from posttrain.data.tokenizer import load_tokenizer
from posttrain.eval.passk import mean_pass_at_k
from posttrain.models.decoder import Decoder
from posttrain.parallel import make_mesh, parse_rules, use_sharding
from posttrain.rl import domains as domain_lib
from posttrain.rl.advantages import group_advantages
from posttrain.rl.buffer import BufferClosed, Rollout, RolloutBuffer
from posttrain.rl.envs import SingleTurnEnv
from posttrain.rl.losses import entropy_from_logits, policy_loss
from posttrain.rl.reward import RewardConfig, RewardFunction
from posttrain.rl.scheduler import Group, TaskScheduler
from posttrain.rl.verifiers.code import CodeTask, CodeVerifier
from posttrain.rl.verifiers.math import MathTask, MathVerifier
from posttrain.sampling.generate import bucket, generate
from posttrain.sampling.rules import SamplingParams
from posttrain.train.checkpoint import Checkpointer
from posttrain.train.loop import CHECKPOINT_ITEMS, Result, put_batch, starting_state
from posttrain.train.losses import token_logprobs
from posttrain.train.metrics import MetricsWriter
from posttrain.train.optim import lr_schedule, make_optimizer
from posttrain.train.stages import init_model_from, moe_penalty, with_stage_overrides
from posttrain.train.state import create_train_state, model_params
from posttrain.train.step import make_train_step


# ---------------------------------------------------------------------------------------------
# Tasks, environments, rewards


def parse_weights(spec: str) -> dict[str, float]:
    """"arithmetic:2,gsm8k" → {"arithmetic": 2.0, "gsm8k": 1.0}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, w = part.partition(":")
        out[name] = float(w) if w else 1.0
    if not out:
        raise ValueError("rl.domains is empty: name at least one of arithmetic, gsm8k, humaneval")
    return out


def make_domains(cfg, tok, reward_fn) -> tuple[dict[str, domain_lib.Domain], list[tuple[str, object]]]:
    """Training domains and held-out (domain, task) pairs for evaluation, from `rl.domains`."""
    r = cfg.rl
    env = lambda: SingleTurnEnv(tok, reward_fn, max_turn_tokens=r.max_new_tokens)
    kw = dict(instruction=r.instruction, max_value=cfg.data.synthetic_max_value)
    table = {
        "arithmetic": lambda: (domain_lib.arithmetic_domain(env, n=r.arithmetic_size, seed=cfg.seed + 1, **kw),
                               domain_lib.arithmetic_tasks(r.eval_size, seed=cfg.seed + 10_000, **kw)),
        "gsm8k": lambda: (domain_lib.gsm8k_domain(env, split="train"),
                          domain_lib.gsm8k_tasks(split="test", limit=r.eval_size)),
        "humaneval": lambda: (domain_lib.humaneval_domain(env), domain_lib.humaneval_tasks(limit=r.eval_size)),
    }
    domains, held_out = {}, []
    for name in parse_weights(r.domains):
        if name not in table:
            raise ValueError(f"rl.domains: unknown {name!r}; valid: {sorted(table)}")
        domains[name], tasks = table[name]()
        held_out += [(name, t) for t in tasks]
    return domains, held_out


def make_reward_fn(cfg) -> RewardFunction:
    """Math and code verifiers with the configured format and overlong shaping."""
    r = cfg.rl
    config = RewardConfig(format_penalty=r.format_penalty,
                          max_tokens=r.max_new_tokens if r.overlong_buffer else None,
                          overlong_buffer=r.overlong_buffer)
    verifiers = {MathTask: MathVerifier()}
    if "humaneval" in parse_weights(r.domains):
        verifiers[CodeTask] = CodeVerifier()
    return RewardFunction(verifiers, config)


# ---------------------------------------------------------------------------------------------
# Rollouts


@dataclasses.dataclass
class Sampler:
    """Samples groups for tasks with given weights and verifies them on a thread pool."""

    graphdef: nnx.GraphDef
    domains: dict
    sampling: SamplingParams
    pad_id: int
    pool: concurrent.futures.ThreadPoolExecutor
    verifier_delay: float = 0.0       # extra host seconds per response (benchmarks of overlap)
    clock: "BusyClock | None" = None

    def sample(self, params, rest, tasks: list[tuple[str, object]], key, *, num_samples: int | None = None,
               greedy: bool = False) -> "Pending":
        """Generate one group per (domain, task) on the device; verification comes later."""
        g = num_samples or self.sampling.num_samples
        sampling = dataclasses.replace(self.sampling, num_samples=g, **({"temperature": 0.0} if greedy else {}))
        envs = [[self.domains[d].make_env() for _ in range(g)] for d, _ in tasks]
        prompts = [[e.reset(t) for e in row][0] for row, (_, t) in zip(envs, tasks)]
        t0 = time.perf_counter()
        with (self.clock or BusyClock()).busy():
            samples = generate(self.graphdef, params, rest, prompts, sampling, key, pad_id=self.pad_id)
        return Pending(tasks, envs, samples, time.perf_counter() - t0)

    def verify(self, pending: "Pending") -> tuple[list[Group], list[np.ndarray], dict]:
        """Score a generated batch on the verifier pool: (groups, behaviour log-probs per sample, info)."""
        flat, samples, g = [e for row in pending.envs for e in row], pending.samples, len(pending.envs[0])

        def verify(i):
            if self.verifier_delay:
                time.sleep(self.verifier_delay)
            return flat[i].step(samples.completion(i)).reward.score
        t0 = time.perf_counter()
        scores = list(self.pool.map(verify, range(len(flat))))
        groups, behav = [], []
        for j, (d, task) in enumerate(pending.tasks):
            idx = range(j * g, (j + 1) * g)
            groups.append(Group(d, task, [scores[i] for i in idx], [flat[i].trajectory() for i in idx]))
            for i in idx:
                traj = flat[i].trajectory()
                lp = np.zeros(len(traj.tokens), np.float32)
                lp[traj.prompt_len:] = samples.logprobs[i, :len(traj.tokens) - traj.prompt_len]
                behav.append(lp)
        info = {"gen_s": pending.gen_s, "verify_s": time.perf_counter() - t0,
                "response_len_mean": float(samples.lengths.mean()), "response_len_max": int(samples.lengths.max()),
                "truncated_frac": float(np.mean(samples.stop_reason == 1)),
                "new_tokens": int(samples.lengths.sum())}
        return groups, behav, info

    def groups(self, params, rest, tasks, key, **kw) -> tuple[list[Group], list[np.ndarray], dict]:
        """`sample` then `verify`."""
        return self.verify(self.sample(params, rest, tasks, key, **kw))


@dataclasses.dataclass
class Pending:
    """A generated batch waiting for verification."""
    tasks: list
    envs: list
    samples: object
    gen_s: float


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


def produce(sampler: Sampler, scheduler: TaskScheduler, params, rest, version: int, key, cfg) -> tuple[list[Rollout], dict]:
    """One batch of rollouts: `rl.prompts_per_step` groups, with dynamic sampling (groups whose
    rewards are all equal carry no signal) when `rl.filter_groups`."""
    r = cfg.rl
    info_all: dict = {}
    behav_of: dict[int, list[np.ndarray]] = {}

    def sample_groups(tasks):
        nonlocal key
        key, sub = jax.random.split(key)
        groups, behav, info = sampler.groups(params, rest, tasks, sub)
        for k, v in info.items():
            info_all[k] = info_all.get(k, 0) + v if k in ("gen_s", "verify_s", "new_tokens") else v
        for j, grp in enumerate(groups):
            behav_of[id(grp)] = behav[j * r.group_size:(j + 1) * r.group_size]
            scheduler.record(grp.domain, grp.task.id, grp.rewards)
        return groups

    if r.filter_groups:
        groups = scheduler.dynamic_sample(sample_groups, r.prompts_per_step, max_rounds=r.max_resample_rounds)
    else:
        groups = sample_groups(scheduler.next_batch(r.prompts_per_step))
    info_all["kept_groups"] = len(groups)
    return [Rollout(g, version, behav_of[id(g)]) for g in groups], info_all


def rl_batch(rollouts: list[Rollout], *, group_size: int, method: str, pad_id: int, eps: float = 1e-6) -> dict:
    """Rollouts → one learner batch [N, S] (S bucketed): inputs, targets, loss_mask (generated
    target tokens), positions, segment_ids, behav_logp (the sampler's log-prob of each target),
    advantages [N] (group-relative) and rewards [N]."""
    trajs = [t for ro in rollouts for t in ro.group.trajectories]
    behav = [b for ro in rollouts for b in ro.behav_logprobs]
    rewards = np.asarray([x for ro in rollouts for x in ro.group.rewards], np.float32)
    adv = np.asarray(group_advantages(jnp.asarray(rewards), group_size, method=method, eps=eps))
    s = bucket(max(len(t.tokens) for t in trajs) - 1, 8)
    n = len(trajs)
    out = {k: np.zeros((n, s), np.int32) for k in ("inputs", "targets", "loss_mask", "positions", "segment_ids")}
    out["inputs"][:] = out["targets"][:] = pad_id
    out["behav_logp"] = np.zeros((n, s), np.float32)
    for i, (t, b) in enumerate(zip(trajs, behav)):
        toks, mask, m = np.asarray(t.tokens), np.asarray(t.loss_mask, np.int32), len(t.tokens) - 1
        out["inputs"][i, :m], out["targets"][i, :m], out["loss_mask"][i, :m] = toks[:-1], toks[1:], mask[1:]
        out["positions"][i, :m], out["segment_ids"][i, :m] = np.arange(m), 1
        out["behav_logp"][i, :m] = b[1:]
    out["advantages"], out["rewards"] = adv.astype(np.float32), rewards
    return out


# ---------------------------------------------------------------------------------------------
# Learner


def rl_loss(model, batch, *ref, graphdef, rl_cfg, moe_cfg):
    """The policy loss on one batch (see `rl.losses.policy_loss`), plus MoE aux terms. `ref` is
    (ref_params, ref_rest) when `rl.kl_coef > 0`."""
    logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"], update_bias=True)
    logp = token_logprobs(logits, batch["targets"])
    old = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    ref_logp = None
    if ref:
        ref_model = nnx.merge(graphdef, jax.lax.stop_gradient(ref[0]), ref[1])
        ref_logits, _ = ref_model(batch["inputs"], batch["positions"], batch["segment_ids"])
        ref_logp = jax.lax.stop_gradient(token_logprobs(ref_logits, batch["targets"]))
    entropy = entropy_from_logits(logits)
    if not rl_cfg.entropy_coef:
        entropy = jax.lax.stop_gradient(entropy)
    loss, metrics = policy_loss(
        logp, old, batch["advantages"], batch["loss_mask"], clip_low=rl_cfg.clip_low, clip_high=rl_cfg.clip_high,
        ratio_level=rl_cfg.ratio_level, aggregation=rl_cfg.aggregation, ref_logp=ref_logp,
        kl_coef=rl_cfg.kl_coef, kl_estimator=rl_cfg.kl_estimator, behav_logp=batch["behav_logp"],
        is_cap=rl_cfg.is_cap, entropy=entropy, entropy_coef=rl_cfg.entropy_coef)
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


def evaluate(sampler: Sampler, params, rest, held_out, key, k: int) -> dict:
    """Held-out accuracy (greedy), mean sampled accuracy and pass@k (unbiased, k samples)."""
    greedy, _, _ = sampler.groups(params, rest, held_out, key, num_samples=1, greedy=True)
    sampled, _, info = sampler.groups(params, rest, held_out, jax.random.fold_in(key, 1), num_samples=k)
    correct = [[r >= 1.0 for r in g.rewards] for g in sampled]
    return {"eval/accuracy": float(np.mean([g.rewards[0] >= 1.0 for g in greedy])),
            "eval/mean_accuracy": float(np.mean(correct)), f"eval/pass@{k}": mean_pass_at_k(correct, k),
            "eval/response_len": info["response_len_mean"]}


def run(cfg) -> Result:
    """Train with RLVR for `train.steps` (or `rl.steps`) policy updates; `Result.eval` is the
    final evaluation."""
    cfg = with_stage_overrides(cfg, "rl")
    r = cfg.rl
    tok = load_tokenizer(cfg.data.tokenizer)
    reward_fn = make_reward_fn(cfg)
    domains, held_out = make_domains(cfg, tok, reward_fn)
    scheduler = TaskScheduler(domains, parse_weights(r.domains), seed=cfg.seed)
    mesh, rules = make_mesh(cfg.mesh.to_dict()), parse_rules(cfg.sharding.rules.to_dict())
    steps = cfg.train.steps
    tx = make_optimizer(cfg.optim, steps)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    sampling = SamplingParams(temperature=r.temperature, top_k=r.top_k, top_p=r.top_p, max_new_tokens=r.max_new_tokens,
                              stop_ids=tuple(tok.stop_ids), num_samples=r.group_size)
    ckpt = Checkpointer(os.path.join(cfg.workdir, "checkpoints"), every=cfg.checkpoint.every,
                        keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    start = ckpt.latest_step() or 0
    writer = MetricsWriter(cfg.workdir, enabled=jax.process_index() == 0, resume_step=start)
    clock = BusyClock()
    pool = concurrent.futures.ThreadPoolExecutor(r.verifier_workers)
    with use_sharding(mesh, rules):
        graphdef, state, shardings = create_train_state(make, tx, mesh, rules, cfg.lora, cfg.seed)
        state, start_weights, data = starting_state(state, shardings, ckpt, start, init_model_from(cfg, make),
                                                    need_start_weights=bool(r.kl_coef))
        # The KL reference: the starting weights (under LoRA the frozen base: no extra memory; else a
        # copy, since the policy's buffers are donated to each update).
        ref = ()
        if r.kl_coef:
            ref = start_weights if state.frozen is not None else jax.tree.map(jnp.copy, start_weights)
        produced, last_eval = 0, {}
        if start:
            scheduler.set_state(data["scheduler"])
            produced = data["produced"]
        loss = functools.partial(rl_loss, graphdef=graphdef, rl_cfg=r, moe_cfg=cfg.model.moe)
        # Donation is only safe when no producer thread may still read the old weights.
        step_fn = jax.jit(make_train_step(graphdef, tx, loss, lr_schedule(cfg.optim, steps), cfg.lora),
                          out_shardings=(shardings, None), donate_argnums=0 if r.max_staleness == 0 else ())
        sampler = Sampler(graphdef, domains, sampling, tok.pad_id, pool, r.verifier_delay, clock)
        base_key = jax.random.key(cfg.seed)
        weights = lambda: (model_params(state, cfg.lora), state.rest)
        eval_key = jax.random.fold_in(base_key, 2**31 - 1)

        def run_eval(step):
            nonlocal last_eval
            last_eval = evaluate(sampler, *weights(), held_out, eval_key, r.eval_samples)
            writer.write(step, last_eval)
            logging.info("rlvr step %d: %s", step, {k: round(v, 4) for k, v in last_eval.items()})

        buffer = RolloutBuffer(r.prompts_per_step * (r.max_staleness + 1), r.max_staleness)
        published = {"version": start, "weights": weights()}
        lock, stop = threading.Lock(), threading.Event()
        published_cv = threading.Condition(lock)
        infos: list[dict] = []
        rows: list[dict] = []

        def finish(pending: Pending, version: int) -> None:
            """Verify a generated batch and hand its groups to the learner (verifier thread)."""
            groups, behav, info = sampler.verify(pending)
            g = r.group_size
            for j, grp in enumerate(groups):
                with lock:
                    scheduler.record(grp.domain, grp.task.id, grp.rewards)
                buffer.put(Rollout(grp, version, behav[j * g:(j + 1) * g]))
            infos.append({**info, "kept_groups": len(groups)})

        def producer():
            """Generate batch i+1 on the device while the verifier thread scores batch i."""
            nonlocal produced
            verifying = None
            with use_sharding(mesh, rules), concurrent.futures.ThreadPoolExecutor(1) as verifier:
                try:
                    while not stop.is_set():
                        with published_cv:
                            # Batch p is trained at step p: sample it no earlier than version p - max_staleness.
                            published_cv.wait_for(lambda: stop.is_set() or
                                                  published["version"] >= produced - r.max_staleness)
                            version, (params, rest) = published["version"], published["weights"]
                            tasks = scheduler.next_batch(r.prompts_per_step)
                        pending = sampler.sample(params, rest, tasks, jax.random.fold_in(base_key, produced))
                        produced += 1
                        if verifying is not None:
                            verifying.result()
                        verifying = verifier.submit(finish, pending, version)
                    if verifying is not None:
                        verifying.result()
                except BufferClosed:
                    return

        thread = None
        if r.max_staleness > 0:
            if r.filter_groups:
                raise ValueError("rl.filter_groups needs rl.max_staleness=0 (dynamic sampling decides on "
                                 "verified rewards before the next generation)")
            thread = threading.Thread(target=producer, daemon=True, name="rollouts")
            thread.start()
        if r.eval_every and start == 0:
            run_eval(0)
        bar = tqdm(range(start, steps), desc="rlvr", initial=start, total=steps,
                   disable=not cfg.train.progress or jax.process_index() != 0)
        wall0, busy0 = time.perf_counter(), clock.total
        for step in bar:
            t0 = time.perf_counter()
            if thread is None:
                rollouts, info = produce(sampler, scheduler, *weights(), step, jax.random.fold_in(base_key, produced), cfg)
                produced += 1
            else:
                rollouts = buffer.get(r.prompts_per_step, step)
                info = infos.pop(0) if infos else {}
            t1 = time.perf_counter()
            batch = rl_batch(rollouts, group_size=r.group_size, method=r.advantage, pad_id=tok.pad_id)
            rewards = batch.pop("rewards")
            with clock.busy():
                state, metrics = step_fn(state, put_batch(batch), *ref)
                metrics = jax.device_get(metrics)
            with published_cv:
                published["version"], published["weights"] = step + 1, weights()
                task_metrics = scheduler.metrics()
                published_cv.notify_all()
            t2 = time.perf_counter()
            wall, busy = time.perf_counter() - wall0, clock.total - busy0
            metrics.update({
                "rl/reward_mean": float(rewards.mean()), "rl/reward_std": float(rewards.std()),
                "rl/wait_s": t1 - t0, "rl/update_s": t2 - t1, "rl/device_idle_frac": max(0.0, 1 - busy / wall),
                **{f"rl/{k}": v for k, v in info.items()}, **buffer.stats(), **task_metrics})
            if step % cfg.train.log_every == 0 or step == steps - 1:
                rows.append(writer.write(step, metrics))
                bar.set_postfix(reward=f"{metrics['rl/reward_mean']:.3f}")
            done = step + 1
            if r.eval_every and (done % r.eval_every == 0 or done == steps):
                run_eval(step)
            if ckpt.should_save(done, steps):
                ckpt.save(done, {k: getattr(state, k) for k in CHECKPOINT_ITEMS},
                          data={"scheduler": scheduler.get_state(), "produced": produced},  # async: approximate
                          meta={"seed": cfg.seed, "stage": "rlvr"})
        stop.set()
        with published_cv:
            published_cv.notify_all()
        buffer.close()
        if thread is not None:
            thread.join(timeout=60)
    pool.shutdown()
    ckpt.close()
    writer.close()
    return Result(graphdef, state, rows, last_eval)
