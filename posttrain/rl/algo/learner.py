"""The RLVR learner: rollouts → a padded learner batch → advantages → PPO-style update epochs.

One rollout batch is trained on for `rl.updates_per_batch` epochs of `rl.minibatches` optimizer
steps each. The proximal log-probs `old_logp` are computed once, with the weights before the
first step, so the ratio π/π_old moves from the second step on and the clip (DAPO clip-higher)
and sequence-level ratios (GSPO) act. Log-probs are those of the distribution the sampler drew
from (temperature, top-k, top-p), so the importance weights against the recorded behaviour
log-probs compare like with like.

With `rl.advantage = "gae"` (PPO with a critic) the policy carries a value head
(`critic.ValueDecoder`): the pass before the first update also records the rollout's values, GAE
turns the outcome reward at the last generated token into per-token advantages (whitened) and
returns, and the clipped value loss joins the policy loss. With `rl.kl_in_reward` the KL to the
reference is paid per token as reward (from the same pass) instead of as a loss term.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.core.batch import put_batch
from posttrain.core.state import model_params
from posttrain.core.step import dispatched, make_train_step, moe_penalty
from posttrain.parallel import local_rows
from posttrain.parallel.zigzag import balanced_batch, unzigzag
from posttrain.rl.algo.advantages import (
    gae_advantages,
    group_advantages,
    kl_penalized_advantages,
    terminal_rewards,
    uses_critic,
    whiten,
)
from posttrain.rl.algo.kl import kl_estimate
from posttrain.rl.algo.losses import entropy_from_logprobs, loss_norm, policy_loss, value_loss
from posttrain.rl.rollout.buffer import Rollout
from posttrain.rl.rollout.routing import batch_routing
from posttrain.sampling.generate import bucket
from posttrain.sampling.rules import SamplingParams, policy_logprobs, support_logprobs

ROW_KEYS = ("inputs", "targets", "loss_mask", "positions", "segment_ids")
HOST_ONLY = ("rollout_logp", "rewards", "judged", "versions")  # batch keys the update step does not read


def rl_batch(
    rollouts: list[Rollout],
    *,
    pad_id: int,
    num_rows: int | None = None,
    longest: int | None = None,
    sequence_shards: int = 1,
    seq_bucket: int = 0,
) -> dict:
    """Rollouts → one learner batch of [N, S] rows (S: a power of two, at least 8, or a multiple of
    `seq_bucket`, rl.seq_bucket): inputs, targets, loss_mask (generated target tokens), positions,
    segment_ids, behav_logp (the sampler's log-prob of each target), rewards [N] and judged [N]
    (False where the verifier reached no verdict: such a sample's loss mask is empty, so it trains
    nothing, and `compute_advantages` leaves it out of its group); with rollouts that carry the
    sampler's routing (`model.moe.routing_replay = sampler`) also routing [N, S, MoE layers, k], the
    experts to replay; with rollouts that carry token versions (`rl.inflight_update_every`) versions
    [N, S] of the targets; with trajectories that showed images, patches [N, S, patch_dim] at their
    inputs (the sampler's).

    num_rows pads the batch with empty rows (zero loss mask, zero reward) to a fixed size, so
    batches with different numbers of groups reuse one compiled step. `longest` (>= every
    trajectory's length) sets S instead of these rollouts' longest: every process of a
    multi-process run builds its rows at the global longest. S is also a multiple of
    2 × sequence_shards, so the rows can be zig-zagged over that many context shards.
    """
    trajs = [t for ro in rollouts for t in ro.group.trajectories]
    behav = [b for ro in rollouts for b in ro.behav_logprobs]
    n = len(trajs) if num_rows is None else num_rows
    if n < len(trajs):
        raise ValueError(f"num_rows={num_rows} is less than the {len(trajs)} sequences of the rollouts")
    s = max([len(t.tokens) for t in trajs] + [longest or 0]) - 1
    s = -(-s // seq_bucket) * seq_bucket if seq_bucket else bucket(s, 8)
    s = -(-s // (2 * sequence_shards)) * 2 * sequence_shards
    out = {k: np.zeros((n, s), np.int32) for k in ROW_KEYS}
    out["inputs"][:] = out["targets"][:] = pad_id
    out["behav_logp"] = np.zeros((n, s), np.float32)
    out["rewards"] = np.zeros((n,), np.float32)
    out["rewards"][: len(trajs)] = [x for ro in rollouts for x in ro.group.rewards]
    out["judged"] = np.ones((n,), bool)  # padding rows: whole groups of equal rewards, no tokens
    out["judged"][: len(trajs)] = [x is not None for ro in rollouts for x in ro.group.verdicts]
    for i, (t, b) in enumerate(zip(trajs, behav)):
        toks, mask, m = np.asarray(t.tokens), np.asarray(t.loss_mask, np.int32), len(t.tokens) - 1
        out["inputs"][i, :m], out["targets"][i, :m], out["loss_mask"][i, :m] = toks[:-1], toks[1:], mask[1:]
        out["positions"][i, :m], out["segment_ids"][i, :m] = np.arange(m), 1
        out["behav_logp"][i, :m] = b[1:]
    out["loss_mask"][~out["judged"]] = 0
    shown = [(i, t.patches) for i, t in enumerate(trajs) if t.patches is not None]
    if shown:
        out["patches"] = np.zeros((n, s, shown[0][1].shape[-1]), np.float32)
        for i, p in shown:
            out["patches"][i, : len(p) - 1] = p[:-1]
    routing = [r for ro in rollouts for r in ro.routing]
    if routing:
        if len(routing) != len(trajs):
            raise ValueError(f"routing of {len(routing)} trajectories of {len(trajs)}: some rollouts carry none")
        out["routing"] = batch_routing(routing, n, s)
    versions = [v for ro in rollouts for v in ro.versions]
    if versions:
        if len(versions) != len(trajs):
            raise ValueError(f"versions of {len(versions)} trajectories of {len(trajs)}: some rollouts carry none")
        out["versions"] = np.full((n, s), -1, np.int32)
        for i, v in enumerate(versions):
            out["versions"][i, : len(v) - 1] = v[1:]
    return out


def compute_advantages(batch: dict, rl_cfg) -> np.ndarray:
    """The advantages of a learner batch (one function for every estimator): [N] per sequence.

    Critic-free estimators (rl.advantage = grpo | drgrpo | rloo) are group-relative over the
    batch's contiguous groups of `rl.group_size` rows; padding rows form groups of equal (zero)
    rewards and get zero advantage; samples without a verdict (batch["judged"] False) get zero
    and stay out of their group's statistics.
    """
    judged = batch.get("judged")
    valid = None if judged is None or judged.all() else jnp.asarray(judged)
    return np.asarray(
        group_advantages(jnp.asarray(batch["rewards"]), rl_cfg.group_size, method=rl_cfg.advantage, valid=valid)
    )


def advantage_targets(batch: dict, rl_cfg) -> dict[str, np.ndarray]:
    """What the update needs beyond the rollout: `advantages` ([N] per sequence, or [N, S] per
    token) and, for GAE, the critic's `returns` [N, S].

    gae: the (combined) reward at each sequence's last generated token, GAE over the rollout's
    values `old_values` with rl.gamma, rl.lam, whitened over the batch's generated tokens.
    With rl.kl_in_reward every generated token also pays −rl.kl_coef · KL(π_rollout ‖ π_ref)
    (estimator rl.kl_estimator, k1: the only one whose score-function gradient is ∇KL, from
    `rollout_logp` and `ref_logp`): inside GAE's rewards, or as
    the per-token reward-to-go on top of group advantages.
    """
    mask = jnp.asarray(batch["loss_mask"]).astype(bool)
    kl = None
    if rl_cfg.kl_in_reward:
        kl = kl_estimate(jnp.asarray(batch["rollout_logp"]), jnp.asarray(batch["ref_logp"]), rl_cfg.kl_estimator)
    if not uses_critic(rl_cfg.advantage):
        adv = jnp.asarray(compute_advantages(batch, rl_cfg))
        if kl is not None:
            adv = kl_penalized_advantages(adv, kl, mask, kl_coef=rl_cfg.kl_coef)
        return {"advantages": np.asarray(adv)}
    rewards = terminal_rewards(jnp.asarray(batch["rewards"]), mask)
    if kl is not None:
        rewards = rewards - rl_cfg.kl_coef * jnp.where(mask, kl, 0.0)
    adv, returns = gae_advantages(rewards, jnp.asarray(batch["old_values"]), mask, gamma=rl_cfg.gamma, lam=rl_cfg.lam)
    return {"advantages": np.asarray(whiten(adv, mask)), "returns": np.asarray(returns)}


def batch_rows(num_groups: int, rl_cfg, row_multiple: int = 1) -> int:
    """Rows of the learner batch for `num_groups` kept groups: the group count bucketed to a
    power of two (capped at rl.prompts_per_step), times the group size, rounded up to a multiple
    of `row_multiple` (minibatches × batch shards) that is also a multiple of the group size (the
    padding forms whole groups, so group advantages see [num_groups × group_size] rewards).
    Full batches always have the same size."""
    groups = min(bucket(num_groups), rl_cfg.prompts_per_step)
    unit = math.lcm(rl_cfg.group_size, row_multiple)
    return -(-groups * rl_cfg.group_size // unit) * unit


def learner_logprobs(
    model: nnx.Module, batch: dict, sampling: SamplingParams, *, update_bias: bool
) -> tuple[jax.Array, jax.Array, dict]:
    """(log-probs of the targets under the sampled distribution [B, S], that distribution's log-probs
    [B, S, V] (−inf off the top-k / top-p support), MoE aux); a batch with "routing" replays it."""
    logp, scaled, _, aux = learner_outputs(model, batch, sampling, update_bias=update_bias, values=False)
    return logp, scaled, aux


def learner_outputs(
    model: nnx.Module, batch: dict, sampling: SamplingParams, *, update_bias: bool, values: bool
) -> tuple[jax.Array, jax.Array, jax.Array | None, dict]:
    """`learner_logprobs` plus, with `values` (a `critic.ValueDecoder`), the critic's values [B, S]
    from the same forward pass (else None)."""
    args = (batch["inputs"], batch["positions"], batch["segment_ids"])
    kw = {"routing": batch.get("routing"), **({"patches": batch["patches"]} if "patches" in batch else {})}
    if values:
        logits, v, aux = model.logits_and_values(*args, update_bias=update_bias, **kw)
    else:
        (logits, aux), v = model(*args, update_bias=update_bias, **kw), None
    targets = batch["targets"]
    return policy_logprobs(logits, targets, sampling), support_logprobs(logits, targets, sampling), v, aux


def rl_loss(model, batch, *ref, graphdef, rl_cfg, moe_cfg, sampling: SamplingParams):
    """The policy loss on one (mini)batch (see `rl.losses.policy_loss`), plus MoE aux terms.

    batch["old_logp"] holds the proximal log-probs (weights before the batch's first update);
    without it (a single update per batch) they equal the current ones. `ref` is
    (ref_params, ref_rest) when `rl.kl_coef > 0` and the KL is a loss term; with rl.kl_in_reward
    the KL was paid as reward and batch["ref_logp"] only feeds the `rl/kl` metric. With GAE the
    critic's clipped value loss (× rl.value_coef) is added.
    """
    gae = uses_critic(rl_cfg.advantage)
    logp, support, values, aux = learner_outputs(model, batch, sampling, update_bias=True, values=gae)
    old_logp = batch["old_logp"] if "old_logp" in batch else jax.lax.stop_gradient(logp)
    ref_logp = batch.get("ref_logp")
    if ref:  # the reference routes on its own (`rl.rollout.routing`)
        ref_model = nnx.merge(graphdef, jax.lax.stop_gradient(ref[0]), ref[1])
        ref_logp = jax.lax.stop_gradient(
            learner_logprobs(ref_model, own_routing(batch), sampling, update_bias=False)[0]
        )
    entropy = entropy_from_logprobs(support)  # of the distribution sampled (after top-k / top-p)
    if not rl_cfg.entropy_coef:
        entropy = jax.lax.stop_gradient(entropy)
    loss, metrics = policy_loss(
        logp,
        old_logp,
        batch["advantages"],
        batch["loss_mask"],
        rl_cfg,
        ref_logp=ref_logp,
        behav_logp=batch["behav_logp"],
        entropy=entropy,
        positions=batch["positions"],
    )
    if gae:
        v_loss, v_metrics = value_loss(
            values,
            batch["old_values"],
            batch["returns"],
            batch["loss_mask"],
            clip=rl_cfg.value_clip,
            aggregation=rl_cfg.aggregation,
            max_len_norm=loss_norm(rl_cfg),
        )
        loss = loss + rl_cfg.value_coef * v_loss
        metrics.update(v_metrics)
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


class Learner:
    """PPO-style updates of one rollout batch: `updates_per_batch` epochs × `minibatches` steps.

    Holds the compiled train step and the compiled proximal log-prob pass; `update` is the only
    entry point. Minibatches take rows strided from a per-epoch permutation of the real rows (then
    the padding), so every minibatch holds real rows. `context`: (the context shards the length
    is split over, `parallel.zigzag.sequence_shards`; model.attention_block), for `device_batch`.
    """

    def __init__(
        self,
        graphdef,
        tx,
        schedule,
        shardings,
        *,
        rl_cfg,
        moe_cfg,
        lora_cfg,
        sampling: SamplingParams,
        donate: bool,
        seed: int,
        context: tuple[int, int] = (1, 512),
    ):
        self.rl_cfg, self.seed = rl_cfg, seed
        self.lora_cfg = lora_cfg
        self.shards, self.block = context
        loss = functools.partial(rl_loss, graphdef=graphdef, rl_cfg=rl_cfg, moe_cfg=moe_cfg, sampling=sampling)
        train_step = make_train_step(graphdef, tx, loss, schedule, lora_cfg)

        def step(state, batch, *ref):
            """`train_step`; a reference given as (ref_rest,) alone has the state's frozen LoRA base
            as its params, read inside the step: passed beside the donated state, the same buffers
            would be both donated and read in one call."""
            return train_step(state, batch, *((state.frozen, ref[0]) if len(ref) == 1 else ref))

        # Donation is only safe when no producer thread may still read the old weights.
        self.step_fn = jax.jit(step, out_shardings=(shardings, None), donate_argnums=0 if donate else ())

        def rollout_pass(params, rest, batch, *ref):
            """Log-probs (and values) of the rollout under the weights before the update, and the
            reference's log-probs when `ref` is given."""
            logp, _, values, _ = learner_outputs(
                nnx.merge(graphdef, params, rest),
                batch,
                sampling,
                update_bias=False,
                values=uses_critic(rl_cfg.advantage),
            )
            out = {"rollout_logp": logp, **({"old_values": values} if values is not None else {})}
            if ref:
                ref_model = nnx.merge(graphdef, *ref)
                out["ref_logp"] = learner_logprobs(ref_model, own_routing(batch), sampling, update_bias=False)[0]
            return out

        self.rollout_pass_fn = jax.jit(rollout_pass)
        self.old_logprobs_fn = jax.jit(lambda params, rest, batch: rollout_pass(params, rest, batch)["rollout_logp"])

    def device_batch(self, batch: dict) -> tuple[dict, bool]:
        """(a host batch as it goes to the device, whether zig-zagged): every per-token array
        ([N, S]) zig-zagged over the context shards where that balances the attention tiles
        (`parallel.zigzag.balanced_batch`), per-row arrays as they are."""
        return balanced_batch(batch, self.shards, self.block)

    @property
    def steps_per_batch(self) -> int:
        """Optimizer steps per rollout batch."""
        return self.rl_cfg.updates_per_batch * self.rl_cfg.minibatches

    def prepare(self, state, batch: dict, ref: tuple) -> dict:
        """The host batch with what the weights before the update say about it: `old_logp` (the
        proximal log-probs, when there are several steps per batch), `old_values` (GAE), and
        `rollout_logp` with `ref_logp` (rl.kl_in_reward: the KL paid as reward)."""
        r = self.rl_cfg
        kl_reward = bool(r.kl_in_reward and r.kl_coef)
        needed = {"old_logp"} if self.steps_per_batch > 1 else set()
        needed |= {"old_values"} if uses_critic(r.advantage) else set()
        needed |= {"rollout_logp", "ref_logp"} if kl_reward else set()
        if needed <= batch.keys():
            return batch
        rows, zigzagged = self.device_batch({k: batch[k] for k in (*ROW_KEYS, "routing", "patches") if k in batch})
        out = self.rollout_pass_fn(
            model_params(state, self.lora_cfg),
            state.rest,
            put_batch(rows),
            *(reference(state, ref) if kl_reward else ()),
        )
        # this process's rows of the global batch, back in token order
        out = {k: unzigzag(local_rows(v), self.shards if zigzagged else 1) for k, v in out.items()}
        if self.steps_per_batch > 1:
            out["old_logp"] = out["rollout_logp"]
        if not kl_reward:
            out.pop("rollout_logp")
        return {**batch, **out}

    def update(self, state, batch: dict, ref: tuple, step: int, num_real_rows: int):
        """Train on one host batch (`prepare`d, with `advantage_targets`); returns (state, metrics
        on the host). `ref` ((params, rest), or (None, rest) under LoRA: see `reference`; () without
        a KL) is passed to the loss (a KL loss term) unless rl.kl_in_reward."""
        r = self.rl_cfg
        batch = {k: v for k, v in self.prepare(state, batch, ref).items() if k not in HOST_ONLY}
        ref = () if r.kl_in_reward or not ref else ref[1:] if ref[0] is None else ref
        rng = np.random.default_rng([self.seed, step])
        all_metrics = []
        n = len(batch["inputs"])
        for _ in range(r.updates_per_batch):
            order = np.concatenate([rng.permutation(num_real_rows), np.arange(num_real_rows, n)])
            for j in range(r.minibatches):
                rows = np.sort(order[j :: r.minibatches])
                state, m = self.step_fn(
                    state, put_batch(self.device_batch({k: v[rows] for k, v in batch.items()})[0]), *ref
                )
                dispatched(all_metrics, m)
        return state, combine_metrics(jax.device_get(all_metrics))


def own_routing(batch: dict) -> dict:
    """The batch without the sampler's routing: for the KL reference, whose own routing is part of
    the reference policy (replay makes the sampler and the *current* policy agree)."""
    return {k: v for k, v in batch.items() if k != "routing"}


def reference(state, ref: tuple) -> tuple:
    """The KL reference as (params, rest): `ref` itself, or under LoRA (ref = (None, rest)) the
    state's frozen base (the starting weights, never trained) with the reference's own rest."""
    return (state.frozen, ref[1]) if ref and ref[0] is None else ref


def combine_metrics(metrics: list[dict]) -> dict:
    """Metrics of several optimizer steps as one row: `*_min` the min, `*_max` and the running
    divergence-guard counters (`nonfinite_*`) the max, the rest the mean; `rl/optimizer_steps` the count.
    A step's min / max over no tokens is +inf / −inf (every token dropped by rl.is_mask):
    the identity of the reduction; when every step's is, the key is left out of the row (not a
    non-finite metric)."""
    out = {}
    for k in metrics[0]:
        v = np.stack([np.asarray(m[k], np.float32) for m in metrics])
        biggest = k.endswith("_max") or k.startswith("nonfinite_")
        out[k] = v.min(axis=0) if k.endswith("_min") else v.max(axis=0) if biggest else v.mean(axis=0)
        if (k.endswith("_min") and np.all(out[k] == np.inf)) or (k.endswith("_max") and np.all(out[k] == -np.inf)):
            del out[k]
    out["rl/optimizer_steps"] = len(metrics)
    return out
