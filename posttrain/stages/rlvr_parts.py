"""The parts of an `rlvr` run, built in one place (`build`), and the state it starts from (`resume`):
the policy's train state, the learner, the rollout worker, the scheduler, the reward sources and the
producer of rollout batches that `rl.placement` picks (`PRODUCERS`). `stages/rlvr.py` runs them."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.config import RunConfig
from posttrain.config.rl import ppo_steps
from posttrain.core.harness import Harness, starting_state
from posttrain.core.init import init_model_from
from posttrain.core.optim import lr_schedule, make_optimizer
from posttrain.core.state import TrainState, create_train_state, model_params
from posttrain.data.tokenizer import load_tokenizer
from posttrain.models.decoder import Decoder
from posttrain.parallel import sequence_shards
from posttrain.rl.algo.advantages import uses_critic
from posttrain.rl.algo.critic import ValueDecoder
from posttrain.rl.algo.learner import Learner
from posttrain.rl.algo.reward_model import RewardComposer
from posttrain.rl.rollout.episodes import rollout_episodes
from posttrain.rl.rollout.log import RolloutLog
from posttrain.rl.rollout.placement import sampler_weights
from posttrain.rl.rollout.producer import AsyncProducer
from posttrain.rl.rollout.remote import RemoteProducer
from posttrain.rl.rollout.worker import BusyClock, RolloutWorker
from posttrain.rl.tasks.registry import curriculum_options, domain_weights, make_domains, make_reward_fn
from posttrain.rl.tasks.scheduler import TaskScheduler
from posttrain.sampling.generate import SlotConfig
from posttrain.sampling.layout import sampler_rules
from posttrain.sampling.prefix_cache import PrefixCache
from posttrain.sampling.rules import SamplingParams
from posttrain.stages.common import rl_sampling


@dataclasses.dataclass
class RLState:
    """Where an RLVR run stands between steps (host side). `step` is the number of batches trained
    and the policy version; `scheduler_state` is the scheduler as of the last trained batch (what
    a checkpoint saves: no draws of batches not yet trained on)."""

    train: TrainState
    step: int
    scheduler_state: dict | None = None
    skipped_updates: int = 0
    last_eval: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(kw_only=True)
class Components:
    """The fixed parts of a run that the step functions use."""

    cfg: object
    worker: RolloutWorker
    learner: Learner
    scheduler: TaskScheduler
    producer: AsyncProducer | None
    ref: tuple
    base_key: jax.Array
    held_out: list
    clock: BusyClock
    pad_id: int
    rewards: RewardComposer
    rollout_log: RolloutLog | None = None
    learner_sharding: tuple | None = None  # (mesh, rules) of the learner's params, (…, sampler mesh) if split
    graphdef: object = None

    def weights(self, rl: RLState) -> tuple:
        """(params, rest) the policy samples with: the learner's, resharded into the decode layout
        when sampling.layout says so (a second copy), quantised when sampling.quantize says so (the
        behaviour log-probs are then the quantised policy's, the learner's importance weights correct
        the gap); on the sampler's own devices under rl.placement = split (`placement.sampler_weights`)."""
        params = model_params(rl.train, self.cfg.lora)
        return sampler_weights(params, rl.train.rest, self.cfg.sampling, self.learner_sharding)


def rollout_sampling(cfg, stop_ids) -> SamplingParams:
    """The rollouts' sampling params: rl.temperature/top_k/top_p/max_new_tokens/group_size, the
    sampler's sampling.speculative_k / draft_layers, and whether it records routing (replay)."""
    return rl_sampling(
        cfg.rl,
        stop_ids,
        cfg.rl.group_size,
        speculative_k=cfg.sampling.speculative_k,
        draft_layers=cfg.sampling.draft_layers,
        record_routing=cfg.model.moe.routing_replay == "sampler",
    )


def rollout_prefix_cache(cfg) -> PrefixCache | None:
    """The rollouts' prefix cache: `sampling.prefix_cache` tokens of prompt KV kept across sampler calls
    (the turns of multi-turn episodes, resampled prompts), emptied when the weights change; 0: none."""
    return PrefixCache(cfg.sampling.prefix_cache) if cfg.sampling.prefix_cache else None


def policy_factories(cfg: RunConfig) -> tuple[Callable, Callable]:
    """(the decoder, the policy) to build: with a critic (PPO with GAE) the policy carries the value
    head (a fresh head on an init_from decoder)."""
    decoder = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    if uses_critic(cfg.rl.advantage):
        return decoder, lambda: ValueDecoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    return decoder, decoder


def resume(cfg: RunConfig, harness: Harness, scheduler: TaskScheduler, mesh, rules) -> tuple:
    """The policy's train state, from `init_from` or resumed from the harness's newest readable
    checkpoint with the scheduler's state: (graphdef, shardings, RLState, KL reference, saved data)."""
    decoder, make = policy_factories(cfg)
    tx = make_optimizer(cfg.optim, cfg.train.steps * ppo_steps(cfg.rl))
    graphdef, state, shardings = create_train_state(make, tx, mesh, rules, cfg.lora, cfg.seed)
    state, start_weights, data = starting_state(
        state,
        shardings,
        harness.ckpt,
        harness.start,
        init_model_from(cfg.init_from, decoder, mesh, rules),
        need_start_weights=bool(cfg.rl.kl_coef),
        optim_name=cfg.optim.name,
    )
    start = int(state.step)  # older than the newest checkpoint if that one was unreadable
    # The KL reference: the starting weights, a copy since the policy's buffers are donated to each update.
    # Under LoRA its params are the frozen base the state carries (None here: read from it), its rest a copy.
    ref = ()
    if cfg.rl.kl_coef:
        ref = jax.tree.map(jnp.copy, start_weights[1] if state.frozen is not None else start_weights)
        ref = (None, ref) if state.frozen is not None else ref
    rl = RLState(state, start)
    if start:
        scheduler.set_state(data["scheduler"])
        steps = jnp.asarray(data.get("optimizer_steps", start), jnp.int32)
        rl = RLState(state.replace(step=steps), start, data["scheduler"], int(data.get("skipped_updates", 0)))
    return graphdef, shardings, rl, ref, data


def build(cfg: RunConfig, harness: Harness, pool, placement: tuple) -> tuple[Components, RLState]:
    """Every part of the run, built in one place, and the RL state it starts from (`resume`).
    `placement`: (the learner's mesh, rules, the sampler's own mesh or None)."""
    r, (mesh, rules, sampler_mesh) = cfg.rl, placement
    tok = load_tokenizer(cfg.data.tokenizer)
    domains, held_out = make_domains(cfg, tok, make_reward_fn(r))
    scheduler = TaskScheduler(domains, domain_weights(r, domains), seed=cfg.seed, **curriculum_options(r.curriculum))
    sampling = rollout_sampling(cfg, tok.stop_ids)
    graphdef, shardings, rl, ref, data = resume(cfg, harness, scheduler, mesh, rules)
    steps = cfg.train.steps * ppo_steps(r)
    learner = Learner(
        graphdef,
        make_optimizer(cfg.optim, steps),
        lr_schedule(cfg.optim, steps),
        shardings,
        rl_cfg=r,
        moe_cfg=cfg.model.moe,
        lora_cfg=cfg.lora,
        sampling=sampling,
        donate=r.max_staleness == 0,
        seed=cfg.seed,
        context=(sequence_shards(mesh, rules)[1], cfg.model.attention_block),  # zig-zag where it balances
    )
    clock = BusyClock()
    worker = RolloutWorker(
        graphdef,
        domains,
        sampling,
        tok.pad_id,
        pool,
        r.verifier_delay,
        clock,
        episodes=partial(rollout_episodes, cohorts=r.episode_cohorts) if r.env != "single" else None,
        prefix_cache=rollout_prefix_cache(cfg),
        continuous=SlotConfig.of(cfg.sampling),
        rules=sampler_rules(rules, cfg.sampling.layout),
        mesh=sampler_mesh,
        inflight_every=r.inflight_update_every,
    )
    policy = (cfg.data.tokenizer, cfg.model.vocab_size)
    resumed = data.get("reward_model_step") if rl.step else None
    rewards = RewardComposer.from_config(r, mesh, rules, pad_id=tok.pad_id, policy=policy, step=resumed)
    if rl.step and "reward_stats" in data:
        rewards.stats.set_state(data["reward_stats"])
    c = Components(
        cfg=cfg,
        worker=worker,
        learner=learner,
        scheduler=scheduler,
        producer=None,
        ref=ref,
        base_key=jax.random.key(cfg.seed),
        held_out=held_out,
        clock=clock,
        pad_id=tok.pad_id,
        rewards=rewards,
        learner_sharding=placement,
        graphdef=graphdef,
    )
    if r.rollouts_every:
        kept = dict(every=r.rollouts_every, fraction=r.rollouts_fraction, seed=cfg.seed)
        c.rollout_log = RolloutLog(cfg.workdir, tok, **kept, enabled=jax.process_index() == 0)
    return c, rl


def local_producer(c: Components, rl: RLState) -> AsyncProducer | None:
    """`rl.max_staleness >= 1`: sampling overlaps the updates on the producer's threads; else none
    (each step samples with the current weights)."""
    if c.cfg.rl.max_staleness == 0:
        return None
    kw = dict(num_groups=c.cfg.rl.prompts_per_step, max_staleness=c.cfg.rl.max_staleness, base_key=c.base_key)
    mesh, rules = c.learner_sharding[:2]
    return AsyncProducer(
        c.worker, c.scheduler, **kw, start=rl.step, weights=c.weights(rl), mesh=mesh, rules=rules
    ).start()


# rl.placement → the producer of rollout batches (or None: the learner's step samples them itself)
PRODUCERS: dict[str, Callable[[Components, RLState], object]] = {
    "colocated": local_producer,
    "split": local_producer,
    "disaggregated": lambda c, rl: RemoteProducer.for_learner(c, rl.step, c.weights(rl)),  # sampler groups
}
