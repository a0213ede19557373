"""RL rollouts with continuous batching vs static batches on a skewed length distribution
(`python tools/bench.py --section rl-continuous`): rollout throughput and RLVR steps/s.

The policy is the bench's tiny MoE decoder (tools/bench.py `bench_rl`) with weights set so that
at every step it ends its turn with probability `p_stop` (else it says "a", "b" or " "): response
lengths are geometric, most short and a few long, whatever the prompt. (The residual stream is
dominated by one direction u, a large shared part of every embedding row, and the head reads the
logits off u, as tests/stages/test_rejection_sampling.py's policy.)

- Rollouts: `RolloutWorker.rollout` (generate + verify) of the same groups with the same key,
  static and continuous back to back in each round, after a warm-up pass over every round's
  groups (compilation of each prompt-length bucket);
  the two return the same samples (checked: same new tokens), so the per-round time ratio is the
  throughput ratio. Rows: new tokens/s (best round) and the per-round ratio (median, range).
- RLVR steps/s: `loop.run` static, then continuous, `steps` steps each from the same checkpoint
  and seed (the same tasks and, to float rounding, the same rollouts); step i of one run paired
  with step i of the other (the first two skipped: compilation), ratio of wall s/step (rollout +
  update), median and range. The two runs are minutes apart: their load can differ.
"""

from __future__ import annotations

import concurrent.futures
import math
import tempfile
import time

import jax
import numpy as np
from bench import tiny_rlvr_config  # tools/ is on the path: bench.py runs this module
from flax import nnx

from posttrain.core.checkpoint import Checkpointer
from posttrain.core.metrics import read_metrics
from posttrain.core.state import abstract_model, init_model_state
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules, use_sharding
from posttrain.rl.rollout.worker import RolloutWorker
from posttrain.rl.tasks.registry import make_domains, make_reward_fn
from posttrain.sampling.continuous import SlotConfig
from posttrain.stages import rlvr as loop
from posttrain.stages.rlvr_parts import rollout_sampling


def bench_config(workdir: str, steps: int):
    """The bench's RLVR config (`bench.tiny_rlvr_config`): 8 prompts × 8 samples per step, up to 64
    new tokens."""
    shape = {"rl.prompts_per_step": 8, "rl.group_size": 8, "rl.max_new_tokens": 64, "rl.arithmetic_size": 200}
    # optim.lr: the length distribution stays what the weights set
    return tiny_rlvr_config(workdir, steps, {**shape, "optim.lr": 1e-7})


def skewed_policy(cfg, p_stop: float):
    """(params, rest) of `cfg.model` whose every next token is eos with probability `p_stop`."""
    m, tok = cfg.model, load_tokenizer(cfg.data.tokenizer)
    u = np.random.default_rng(0).standard_normal(m.embed_dim)
    u /= np.linalg.norm(u)
    logits = np.full(m.vocab_size, -30.0)
    logits[[tok.encode(c)[0] for c in "ab "]] = 0.0
    logits[tok.eos_id] = math.log(3 * p_stop / (1 - p_stop))
    mesh, rules = mesh_and_rules(cfg)
    with use_sharding(mesh, rules):
        params, rest = init_model_state(lambda: Decoder(m, rngs=nnx.Rngs(0)), mesh, rules)
        flat = dict(nnx.to_flat_state(params))
        for name, value in (
            (("embed",), flat[("embed",)][...] + 100 * math.sqrt(m.embed_dim) * u),
            (("head",), np.outer(u, logits) / math.sqrt(m.embed_dim)),
        ):
            flat[name][...] = jax.device_put(np.asarray(value, np.float32), flat[name][...].sharding)
    return params, rest


def rollout_rounds(cfg, params, rest, slot_configs: dict, rounds: int) -> list[dict]:
    """Rollout throughput per round, static and each continuous setting back to back."""
    tok = load_tokenizer(cfg.data.tokenizer)
    domains, _ = make_domains(cfg, tok, make_reward_fn(cfg.rl))
    ((name, domain),) = domains.items()
    sampling = rollout_sampling(cfg, tok.stop_ids)
    graphdef = nnx.split(abstract_model(lambda: Decoder(cfg.model, rngs=nnx.Rngs(0))), nnx.Param, ...)[0]
    mesh, rules = mesh_and_rules(cfg)
    n, times, tokens = cfg.rl.prompts_per_step, {}, {}
    with concurrent.futures.ThreadPoolExecutor(4) as pool, use_sharding(mesh, rules):
        workers = {
            label: RolloutWorker(graphdef, domains, sampling, tok.pad_id, pool, continuous=slots)
            for label, slots in {"static": None, **slot_configs}.items()
        }
        batches = [[(name, t) for t in domain.tasks[r * n : (r + 1) * n]] for r in range(rounds)]
        for r, tasks in enumerate(batches):  # warm-up: compile every prompt bucket
            for worker in workers.values():
                worker.rollout(params, rest, tasks, jax.random.key(r))
        for r, tasks in enumerate(batches):
            for label, worker in workers.items():
                t0 = time.perf_counter()
                batch = worker.rollout(params, rest, tasks, jax.random.key(r))
                times.setdefault(label, []).append(time.perf_counter() - t0)
                tokens.setdefault(label, []).append(batch.info["new_tokens"])
            lengths = [len(t.tokens) - t.prompt_len for g in batch.groups for t in g.trajectories]
            print(
                f"round {r}: response lengths median {np.median(lengths):.0f}, max {max(lengths)}; "
                + ", ".join(f"{k} {v[-1]:.2f}s" for k, v in times.items()),
                flush=True,
            )
    rows = []
    for label, ts in times.items():
        if tokens[label] != tokens["static"]:
            raise RuntimeError(f"{label}: {tokens[label]} new tokens per round, static {tokens['static']}")
        ratios = np.array(times["static"]) / np.array(ts)
        rows.append(
            {
                "name": f"rollouts {label}",
                "new tokens/s (best)": max(np.array(tokens[label]) / ts),
                "x vs static per round (median)": float(np.median(ratios)),
                "min": float(ratios.min()),
                "max": float(ratios.max()),
            }
        )
    return rows


def loop_steps(cfg, init_from: str, slots: SlotConfig | None) -> list[float]:
    """Wall seconds per RLVR step (rollout + update) of a run from `init_from`."""
    changes = {"workdir": tempfile.mkdtemp(), "init_from": init_from, "sampling.continuous_batching": slots is not None}
    if slots is not None:
        changes.update({"sampling.num_slots": slots.num_slots, "sampling.refill_batch": slots.refill_batch})
    cfg = cfg.replace(changes)
    with jax.default_device(jax.devices()[0]):
        loop.run(cfg)
    return [r["rl/wait_s"] + r["rl/update_s"] for r in read_metrics(cfg.workdir) if "rl/update_s" in r]


def rl_continuous_bench(
    *,
    rounds: int = 5,
    p_stop: float = 0.1,
    slot_configs: tuple[SlotConfig, ...] = (SlotConfig(16, 4), SlotConfig(32, 8)),
) -> list[dict]:
    """Rows for BENCHMARKS.md: rollout throughput and RLVR steps/s, continuous vs static."""
    cfg = bench_config(tempfile.mkdtemp(), rounds + 2)
    params, rest = skewed_policy(cfg, p_stop)
    labelled = {f"continuous {s.num_slots} slots, refill by {s.refill_batch}": s for s in slot_configs}
    rows = rollout_rounds(cfg, params, rest, labelled, rounds)
    init_from = tempfile.mkdtemp()
    ckpt = Checkpointer(f"{init_from}/checkpoints", every=1, keep=1, async_save=False)
    ckpt.save(1, {"params": params, "rest": rest})
    ckpt.close()
    static = np.array(loop_steps(cfg, init_from, None)[2:])
    for label, slots in labelled.items():
        steps = np.array(loop_steps(cfg, init_from, slots)[2:])
        ratios = static / steps
        rows.append(
            {
                "name": f"rlvr steps/s {label}",
                "steps/s": 1 / float(np.median(steps)),
                "static steps/s": 1 / float(np.median(static)),
                "x vs static per step (median)": float(np.median(ratios)),
                "min": float(ratios.min()),
                "max": float(ratios.max()),
            }
        )
    return rows
