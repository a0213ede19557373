"""The RLVR learner: rollouts → a padded learner batch → advantages → PPO-style update epochs.

One rollout batch is trained on for `rl.updates_per_batch` epochs of `rl.minibatches` optimizer
steps each. The proximal log-probs `old_logp` are computed once, with the weights before the
first step, so the ratio π/π_old moves from the second step on and the clip (DAPO clip-higher)
and sequence-level ratios (GSPO) act. Log-probs are those of the distribution the sampler drew
from (temperature, top-k, top-p), so the importance weights against the recorded behaviour
log-probs compare like with like.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.rl.advantages import group_advantages
from posttrain.rl.buffer import Rollout
from posttrain.rl.losses import entropy_from_logits, policy_loss
from posttrain.sampling.generate import bucket
from posttrain.sampling.rules import SamplingParams, policy_logprobs
from posttrain.train.loop import put_batch
from posttrain.train.state import model_params
from posttrain.train.step import make_train_step, moe_penalty

ROW_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")


def rl_batch(rollouts: list[Rollout], *, pad_id: int, num_rows: int | None = None) -> dict:
    """Rollouts → one learner batch of [N, S] rows (S bucketed to a multiple of 8): inputs,
    targets, loss_mask (generated target tokens), positions, segment_ids, behav_logp (the
    sampler's log-prob of each target) and rewards [N].

    num_rows pads the batch with empty rows (zero loss mask, zero reward) to a fixed size, so
    batches with different numbers of groups reuse one compiled step.
    """
    trajs = [t for ro in rollouts for t in ro.group.trajectories]
    behav = [b for ro in rollouts for b in ro.behav_logprobs]
    n = len(trajs) if num_rows is None else num_rows
    if n < len(trajs):
        raise ValueError(f"num_rows={num_rows} is less than the {len(trajs)} sequences of the rollouts")
    s = bucket(max(len(t.tokens) for t in trajs) - 1, 8)
    out = {k: np.zeros((n, s), np.int32) for k in ROW_KEYS}
    out["inputs"][:] = out["targets"][:] = pad_id
    out["behav_logp"] = np.zeros((n, s), np.float32)
    out["rewards"] = np.zeros((n,), np.float32)
    out["rewards"][:len(trajs)] = [x for ro in rollouts for x in ro.group.rewards]
    for i, (t, b) in enumerate(zip(trajs, behav)):
        toks, mask, m = np.asarray(t.tokens), np.asarray(t.loss_mask, np.int32), len(t.tokens) - 1
        out["inputs"][i, :m], out["targets"][i, :m], out["loss_mask"][i, :m] = toks[:-1], toks[1:], mask[1:]
        out["positions"][i, :m], out["segment_ids"][i, :m] = np.arange(m), 1
        out["behav_logp"][i, :m] = b[1:]
    return out


def compute_advantages(batch: dict, rl_cfg) -> np.ndarray:
    """The advantages of a learner batch (one function for every estimator): [N] per sequence.

    Critic-free estimators (rl.advantage = grpo | drgrpo | rloo) are group-relative over the
    batch's contiguous groups of `rl.group_size` rows; padding rows form groups of equal (zero)
    rewards and get zero advantage.
    """
    return np.asarray(group_advantages(jnp.asarray(batch["rewards"]), rl_cfg.group_size, method=rl_cfg.advantage))


def batch_rows(num_groups: int, rl_cfg, row_multiple: int = 1) -> int:
    """Rows of the learner batch for `num_groups` kept groups: the group count bucketed to a
    power of two (capped at rl.prompts_per_step), times the group size, rounded up to a multiple
    of `row_multiple` (minibatches × batch shards). Full batches always have the same size."""
    groups = min(bucket(num_groups), rl_cfg.prompts_per_step)
    rows = groups * rl_cfg.group_size
    return -(-rows // row_multiple) * row_multiple


def learner_logprobs(model: nnx.Module, batch: dict, sampling: SamplingParams, *,
                     update_bias: bool) -> tuple[jax.Array, jax.Array, dict]:
    """(log-probs of the targets under the sampled distribution [B, S], logits/T [B, S, V], MoE aux)."""
    logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"], update_bias=update_bias)
    return policy_logprobs(logits, batch["targets"], sampling), logits.astype(jnp.float32) / sampling.temperature, aux


def rl_loss(model, batch, *ref, graphdef, rl_cfg, moe_cfg, sampling: SamplingParams):
    """The policy loss on one (mini)batch (see `rl.losses.policy_loss`), plus MoE aux terms.

    batch["old_logp"] holds the proximal log-probs (weights before the batch's first update);
    without it (a single update per batch) they equal the current ones. `ref` is
    (ref_params, ref_rest) when `rl.kl_coef > 0`.
    """
    logp, scaled_logits, aux = learner_logprobs(model, batch, sampling, update_bias=True)
    old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    ref_logp = None
    if ref:
        ref_model = nnx.merge(graphdef, jax.lax.stop_gradient(ref[0]), ref[1])
        ref_logp = jax.lax.stop_gradient(learner_logprobs(ref_model, batch, sampling, update_bias=False)[0])
    entropy = entropy_from_logits(scaled_logits)
    if not rl_cfg.entropy_coef:
        entropy = jax.lax.stop_gradient(entropy)
    loss, metrics = policy_loss(
        logp, old_logp, batch["advantages"], batch["loss_mask"], clip_low=rl_cfg.clip_low, clip_high=rl_cfg.clip_high,
        ratio_level=rl_cfg.ratio_level, aggregation=rl_cfg.aggregation, ref_logp=ref_logp,
        kl_coef=rl_cfg.kl_coef, kl_estimator=rl_cfg.kl_estimator, behav_logp=batch["behav_logp"],
        is_cap=rl_cfg.is_cap, entropy=entropy, entropy_coef=rl_cfg.entropy_coef)
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


class Learner:
    """PPO-style updates of one rollout batch: `updates_per_batch` epochs × `minibatches` steps.

    Holds the compiled train step and the compiled proximal log-prob pass; `update` is the only
    entry point. Minibatches take rows strided from a per-epoch permutation of the real rows (then
    the padding), so every minibatch holds real rows.
    """

    def __init__(self, graphdef, tx, schedule, shardings, *, rl_cfg, moe_cfg, lora_cfg, sampling: SamplingParams,
                 donate: bool, seed: int):
        self.rl_cfg, self.seed = rl_cfg, seed
        self.lora_cfg = lora_cfg
        loss = functools.partial(rl_loss, graphdef=graphdef, rl_cfg=rl_cfg, moe_cfg=moe_cfg, sampling=sampling)
        # Donation is only safe when no producer thread may still read the old weights.
        self.step_fn = jax.jit(make_train_step(graphdef, tx, loss, schedule, lora_cfg),
                               out_shardings=(shardings, None), donate_argnums=0 if donate else ())

        def old_logprobs(params, rest, batch):
            model = nnx.merge(graphdef, params, rest)
            return learner_logprobs(model, batch, sampling, update_bias=False)[0]
        self.old_logprobs_fn = jax.jit(old_logprobs)

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.rl_cfg.updates_per_batch * self.rl_cfg.minibatches

    def update(self, state, batch: dict, ref: tuple, step: int, num_real_rows: int):
        """Train on one host batch (with advantages); returns (state, metrics on the host)."""
        r = self.rl_cfg
        if self.steps_per_batch > 1:
            old = self.old_logprobs_fn(model_params(state, self.lora_cfg), state.rest, put_batch(batch))
            batch = {**batch, "old_logp": np.asarray(jax.device_get(old))}
        rng = np.random.default_rng([self.seed, step])
        all_metrics = []
        n = len(batch["inputs"])
        for _ in range(r.updates_per_batch):
            order = np.concatenate([rng.permutation(num_real_rows), np.arange(num_real_rows, n)])
            for j in range(r.minibatches):
                rows = np.sort(order[j::r.minibatches])
                state, m = self.step_fn(state, put_batch({k: v[rows] for k, v in batch.items()}), *ref)
                all_metrics.append(m)
        return state, combine_metrics(jax.device_get(all_metrics))


def combine_metrics(metrics: list[dict]) -> dict:
    """Metrics of several optimizer steps as one row: `*_min` the min, `*_max` the max, the rest
    the mean; `rl/optimizer_steps` the count."""
    out = {}
    for k in metrics[0]:
        v = np.stack([np.asarray(m[k], np.float32) for m in metrics])
        out[k] = v.min(axis=0) if k.endswith("_min") else v.max(axis=0) if k.endswith("_max") else v.mean(axis=0)
    out["rl/optimizer_steps"] = len(metrics)
    return out
