"""Start-up checks of the `rl.*` keys: a value that cannot take effect is an error, not ignored."""

from __future__ import annotations

from posttrain.rl.algo.advantages import ADVANTAGE_METHODS
from posttrain.rl.algo.critic import check_critic
from posttrain.rl.tasks.registry import ENVS, VERIFIERS, curriculum_options, domain_spec


def ppo_steps(r) -> int:
    """Optimizer steps per rollout batch (epochs × minibatches)."""
    return r.updates_per_batch * r.minibatches


# key -> (when it takes effect, what to set). Checked only when the key differs from its default.
INERT_UNLESS = {
    "clip_low": (
        lambda r: ppo_steps(r) > 1,
        "the ratio π/π_old is 1 with one optimizer step per batch: set rl.updates_per_batch > 1 or rl.minibatches > 1",
    ),
    "clip_high": (
        lambda r: ppo_steps(r) > 1,
        "the ratio π/π_old is 1 with one optimizer step per batch: set rl.updates_per_batch > 1 or rl.minibatches > 1",
    ),
    "ratio_level": (
        lambda r: ppo_steps(r) > 1,
        "sequence-level ratios equal token-level ones while π = π_old: "
        "set rl.updates_per_batch > 1 or rl.minibatches > 1",
    ),
    "kl_estimator": (lambda r: r.kl_coef > 0, "no KL term without rl.kl_coef > 0"),
    # --- off-policy corrections ---
    "loss_type": (
        lambda r: ppo_steps(r) > 1,
        "with π = π_old CISPO's gradient −A·∇log π is the clipped surrogate's: "
        "set rl.updates_per_batch > 1 or rl.minibatches > 1",
    ),
    "is_mask_low": (lambda r: r.is_mask != "off", "no masked importance sampling without rl.is_mask"),
    "is_mask_high": (lambda r: r.is_mask != "off", "no masked importance sampling without rl.is_mask"),
    # --- end off-policy corrections ---
    "max_resample_rounds": (lambda r: r.filter_groups, "resampling needs rl.filter_groups=True"),
    "eval_samples": (lambda r: r.eval_every > 0, "no evaluation without rl.eval_every > 0"),
    "eval_size": (lambda r: r.eval_every > 0, "no evaluation without rl.eval_every > 0"),
    "instruction": (
        lambda r: "arithmetic" in domain_spec(r),
        "only the arithmetic domain's prompts take rl.instruction, and rl.domains has no arithmetic",
    ),
    "arithmetic_size": (lambda r: "arithmetic" in domain_spec(r), "rl.domains has no arithmetic"),
    "rollouts_fraction": (lambda r: r.rollouts_every > 0, "no rollouts are written without rl.rollouts_every > 0"),
    "eval_files": (lambda r: r.eval_every > 0, "no evaluation without rl.eval_every > 0"),
    "verifier_timeout_s": (
        lambda r: bool(r.verifiers or VERIFIERS),
        "only user verifiers (rl.verifiers) have this timeout; the math and code verifiers have their own",
    ),
    **{
        k: (lambda r: r.advantage == "gae", "only the critic (rl.advantage='gae') uses it")
        for k in ("critic", "gamma", "lam", "value_coef", "value_clip")
    },
    **{
        k: (lambda r: r.env != "single", "only multi-turn episodes (rl.env='tool' or 'screen') take it")
        for k in ("max_turns", "episode_cohorts", "invalid_tool_call_penalty")  # screen: a malformed turn
    },
    **{
        k: (lambda r: r.env == "tool", "only multi-turn episodes (rl.env='tool') make tool calls")
        for k in ("tool_timeout_s", "redundant_tool_call_penalty")
    },
    "kl_in_reward": (lambda r: r.kl_coef > 0, "no KL to pay without rl.kl_coef > 0"),
    "reward_model_weight": (lambda r: bool(r.reward_model), "no learned reward without rl.reward_model"),
    "reward_model_normalize": (lambda r: bool(r.reward_model), "no learned reward without rl.reward_model"),
}


_GRPO_SCALE = (
    "and a positive scale on the whole reward cancels in grpo's group normalisation (r − mean) / std: "
    "use rl.advantage='drgrpo', 'rloo' or 'gae'"
)
_KL_IN_LOSS = "losses.policy_loss: as a loss term"
# (key, when another key makes it inert or changes what it means, why). Checked only when the key
# differs from its default, after INERT_UNLESS.
INERT_WITH = (
    (
        "verifier_weight",
        lambda r: r.advantage == "grpo" and not r.reward_model,
        f"without rl.reward_model the verifier reward is the whole reward, {_GRPO_SCALE}",
    ),
    *(
        (
            key,
            lambda r: r.advantage == "grpo" and bool(r.reward_model) and not r.verifier_weight,
            f"with rl.verifier_weight=0 the learned reward is the whole reward, {_GRPO_SCALE}",
        )
        for key in ("reward_model_weight", "reward_model_normalize")
    ),
    (
        "verifier_delay",
        lambda r: r.env != "single",
        "multi-turn episodes (rl.env='tool', 'screen') are scored inside their environment steps; the delay "
        "applies to single-turn verification only",
    ),
    (
        "format_penalty",
        lambda r: set(domain_spec(r)) == {"repo_fix"},
        "rl.domains is repo_fix only, whose verdicts always have format_ok (a state check decides, "
        "not the answer's form)",
    ),
    *(
        (key, lambda r: not r.verifier_weight, "it shapes the verifier reward, which rl.verifier_weight=0 drops")
        for key in ("format_penalty", "overlong_buffer")
    ),
    (
        "ratio_level",
        lambda r: r.ratio_level == "sequence" and r.aggregation != "seq-mean-token-mean",
        "the sequence ratio is GSPO's only with rl.aggregation='seq-mean-token-mean' (every sequence "
        "weighs the same and its tokens share its ratio); set that aggregation",
    ),
    (
        "value_clip",
        lambda r: ppo_steps(r) == 1,
        "with one optimizer step per batch the critic's values are the rollout's (V = V_old), so the "
        "clip around them never acts: set rl.updates_per_batch > 1 or rl.minibatches > 1",
    ),
    (
        "kl_estimator",
        lambda r: not r.kl_in_reward and r.kl_estimator == "k1",
        f"{_KL_IN_LOSS} k1's gradient β·∇log π has expectation 0 (it adds noise, no pull towards the "
        "reference): use k2 or k3 as a loss term, or k1 paid as reward (rl.kl_in_reward=True)",
    ),
    (
        "kl_in_reward",
        lambda r: r.kl_in_reward and r.kl_estimator != "k1",
        "paid as reward, the penalty is differentiated through the score function only, which is "
        "∇KL(π‖π_ref) for k1 alone (k2's mean is not the KL; k3's own gradient does not vanish): set "
        "rl.kl_estimator='k1'",
    ),
    (
        "filter_groups",
        lambda r: r.group_size < 2,
        "a group of one sample never has differing rewards: dynamic sampling would drop every group",
    ),
    (
        "is_cap",
        lambda r: r.is_mask == r.is_level and r.is_mask_high <= r.is_cap,
        "rl.is_mask at rl.is_level drops every token (sequence) whose ratio exceeds rl.is_mask_high <= "
        "rl.is_cap, so the truncation never acts: set rl.is_cap below rl.is_mask_high",
    ),
    (
        "loss_norm_tokens",
        lambda r: r.aggregation != "seq-mean-token-sum",
        "only rl.aggregation='seq-mean-token-sum' (Dr. GRPO) divides by a constant token count",
    ),
)


def check_inert_with(r, defaults) -> None:
    """Raise ValueError for a key set away from its default that `INERT_WITH` says another key
    makes inert (or changes into something its name does not say)."""
    for key, inert, why in INERT_WITH:
        if r[key] != defaults[key] and inert(r):
            raise ValueError(f"rl.{key}={r[key]!r} cannot take effect as set: {why}")


def check_curriculum(c, defaults) -> None:
    """`rl.curriculum.*`: values in range, and none set that the rest leaves without effect."""
    if not 0 <= c.hard_below <= c.easy_above <= 1 or not 0 <= c.pass_threshold <= 1:
        raise ValueError(
            f"rl.curriculum: expected 0 <= hard_below ({c.hard_below}) <= easy_above ({c.easy_above}) "
            f"<= 1 and pass_threshold ({c.pass_threshold}) in [0, 1]"
        )
    if c.min_attempts < 1 or c.window < 0 or c.retire_after < 1:
        raise ValueError(
            f"rl.curriculum: expected min_attempts >= 1 ({c.min_attempts}), window >= 0 ({c.window}), "
            f"retire_after >= 1 ({c.retire_after})"
        )
    weighted, retiring = bool(c.band_weights.strip()), c.retire_above >= 0 or c.retire_below >= 0
    inert = {
        "hard_below": weighted,
        "easy_above": weighted,
        "min_attempts": weighted or retiring,
        "window": weighted or retiring,
        "retire_after": retiring,
    }
    for key, active in inert.items():
        if c[key] != defaults[key] and not active:
            why = (
                "only retirement uses it: set rl.curriculum.retire_above or retire_below >= 0"
                if key == "retire_after"
                else "it places tasks in bands, and bands steer nothing without rl.curriculum.band_weights"
                + ("" if key in ("hard_below", "easy_above") else " or retirement (retire_above / retire_below >= 0)")
            )
            raise ValueError(f"rl.curriculum.{key}={c[key]!r} cannot take effect: {why}")
    curriculum_options(c)  # band_weights parse


def check_env(r) -> None:
    """`rl.env` and its limits and penalties."""
    if r.env not in ENVS:
        raise ValueError(f"rl.env={r.env!r}: expected one of {ENVS}")
    if r.max_turns < 1 or not r.tool_timeout_s > 0:
        raise ValueError(
            f"rl.max_turns={r.max_turns}, rl.tool_timeout_s={r.tool_timeout_s}: expected max_turns >= 1 "
            "and tool_timeout_s > 0"
        )
    if r.episode_cohorts < 1:
        raise ValueError(f"rl.episode_cohorts={r.episode_cohorts}: expected >= 1 (1: all episodes in lockstep rounds)")
    for key in ("invalid_tool_call_penalty", "redundant_tool_call_penalty"):
        if r[key] < 0:
            raise ValueError(f"rl.{key}={r[key]}: a penalty size, expected >= 0")


def check_episode_cohorts(cfg, stage_names) -> None:
    """`rl.episode_cohorts` other than 1 needs a stage that runs multi-turn episodes: rlvr (whose
    `rl.env='tool'` `check_rl_config` checks) or eval with a multi-turn suite."""
    if cfg.rl.episode_cohorts == 1 or "rlvr" in stage_names:
        return
    from posttrain.rl.tasks.suites import multi_turn_suites

    if "eval" not in stage_names or not multi_turn_suites(cfg.eval.suites):
        raise ValueError(
            f"rl.episode_cohorts={cfg.rl.episode_cohorts} cannot take effect: only multi-turn episodes "
            "(stage rlvr with rl.env='tool', or stage eval with a multi-turn suite such as repo_fix) "
            f"run in cohorts, and this run ({', '.join(stage_names)}) has none"
        )


def check_rl_config(cfg) -> None:
    """Raise ValueError naming the `rl.*` key whose value is invalid or cannot take effect."""
    from posttrain.config import base_config

    r, defaults = cfg.rl, base_config().rl
    if not r.temperature > 0:
        raise ValueError(
            f"rl.temperature={r.temperature}: RL samples groups from the policy; expected > 0 "
            "(0 is greedy: every sample of a group would be the same)"
        )
    if r.advantage not in ADVANTAGE_METHODS:
        raise ValueError(f"rl.advantage={r.advantage!r}: expected one of {ADVANTAGE_METHODS}")
    if r.advantage == "gae":
        check_critic(r, cfg.lora)
        if not (0 <= r.gamma <= 1 and 0 <= r.lam <= 1) or r.value_coef < 0 or r.value_clip < 0:
            raise ValueError(
                f"rl.gamma={r.gamma}, rl.lam={r.lam}, rl.value_coef={r.value_coef}, "
                f"rl.value_clip={r.value_clip}: expected gamma, lam in [0, 1] and value_coef, "
                "value_clip >= 0"
            )
    elif r.group_size < 2:
        raise ValueError(f"rl.group_size={r.group_size}: a group-relative baseline needs at least 2 samples")
    for key in ("updates_per_batch", "minibatches", "prompts_per_step"):
        if r[key] < 1:
            raise ValueError(f"rl.{key}={r[key]}: expected >= 1")
    rows = r.prompts_per_step * r.group_size
    if rows % r.minibatches:
        raise ValueError(
            f"rl.minibatches={r.minibatches} must divide the sequences per batch, rl.prompts_per_step × "
            f"rl.group_size = {rows}"
        )
    if not 0 <= r.clip_low < 1 or r.clip_high < 0:
        raise ValueError(
            f"rl.clip_low={r.clip_low}, rl.clip_high={r.clip_high}: expected 0 <= clip_low < 1 and clip_high >= 0"
        )
    if r.rollouts_every < 0 or not 0 < r.rollouts_fraction <= 1:
        raise ValueError(
            f"rl.rollouts_every={r.rollouts_every}, rl.rollouts_fraction={r.rollouts_fraction}: expected "
            "rollouts_every >= 0 and 0 < rollouts_fraction <= 1"
        )
    if r.max_staleness < 0:
        raise ValueError(f"rl.max_staleness={r.max_staleness}: expected >= 0")
    if r.filter_groups and r.max_staleness > 0:
        raise ValueError(
            "rl.filter_groups needs rl.max_staleness=0 (dynamic sampling decides on verified rewards "
            "before the next generation)"
        )
    if not r.reward_model and not r.verifier_weight:
        raise ValueError("rl.verifier_weight=0 without rl.reward_model: there is no reward left")
    if r.reward_model and r.filter_groups:
        raise ValueError(
            f"rl.filter_groups with rl.reward_model={r.reward_model!r}: dynamic sampling filters on "
            "verifier rewards before the learned reward is scored; set rl.filter_groups=False"
        )
    if "," in cfg.train.seq_len_schedule:
        raise ValueError(
            f"train.seq_len_schedule={cfg.train.seq_len_schedule!r}: the RL stage samples at one "
            "length (rl.max_new_tokens); staged context applies to sft and lm only"
        )
    if cfg.eval.long_context.lengths:
        raise ValueError(
            f"eval.long_context.lengths={cfg.eval.long_context.lengths!r}: the RL stage does not run "
            "the long-context evals; evaluate its checkpoint with tools/long_context_eval.py"
        )
    check_env(r)
    check_curriculum(r.curriculum, defaults.curriculum)
    for key, (active, why) in INERT_UNLESS.items():
        if r[key] != defaults[key] and not active(r):
            raise ValueError(f"rl.{key}={r[key]!r} cannot take effect: {why}")
    check_inert_with(r, defaults)
    if r.top_k >= cfg.model.vocab_size:
        raise ValueError(
            f"rl.top_k={r.top_k} >= model.vocab_size={cfg.model.vocab_size}: it would keep every token "
            "(top_k=0 switches the filter off)"
        )


CONTINUOUS_KEYS = ("continuous_batching", "num_slots", "refill_batch")


def slot_config(sampling_cfg):
    """`sampling.continuous_batching`'s slots (`sampling.continuous.SlotConfig`), or None: static batches."""
    from posttrain.sampling.continuous import SlotConfig

    s = sampling_cfg
    return SlotConfig(s.num_slots, s.refill_batch) if s.continuous_batching else None


# sampling.* keys of every stage that samples (the others configure the rlvr stage's sampler)
EVERY_STAGE_KEYS = ("max_context",)
SAMPLING_STAGES = ("sft", "dpo", "eval", "rejection_sampling", "rlvr")  # their evals, samples or rollouts


def check_sampling_config(cfg, stage_names) -> None:
    """Raise ValueError naming the `sampling.*` key whose value is invalid or cannot take effect: the
    keys configure the rlvr stage's sampler, so another stage alone must leave them at their defaults
    (but `EVERY_STAGE_KEYS`, which bound the sampler calls of every stage that samples)."""
    from posttrain.config import base_config
    from posttrain.models.quant import check_mode
    from posttrain.rl.rollout.routing import check_routing_replay
    from posttrain.sampling.layout import check_layout

    s, defaults = cfg.sampling, base_config().sampling
    check_routing_replay(cfg, stage_names)
    check_mode(s.quantize)
    check_layout(s.layout)
    if s.speculative_k < 0 or not 1 <= s.draft_layers <= cfg.model.num_layers:
        raise ValueError(
            f"sampling.speculative_k={s.speculative_k}, sampling.draft_layers={s.draft_layers}: "
            f"expected speculative_k >= 0 and draft_layers in 1..model.num_layers "
            f"({cfg.model.num_layers})"
        )
    if s.prefix_cache and s.speculative_k:
        raise ValueError(
            f"sampling.prefix_cache={s.prefix_cache}: not supported with sampling.speculative_k="
            f"{s.speculative_k} (set one of them to 0)"
        )
    if s.prefix_cache and cfg.distributed.num_processes > 1:
        raise ValueError(
            f"sampling.prefix_cache={s.prefix_cache}: runs in a single process for now "
            f"(distributed.num_processes={cfg.distributed.num_processes})"
        )
    if s.prefix_cache and s.continuous_batching:
        raise ValueError(
            f"sampling.prefix_cache={s.prefix_cache}: not supported with sampling.continuous_batching "
            "(the continuous engine prefills every prompt whole); turn one of them off"
        )
    if s.draft_layers != defaults.draft_layers and not s.speculative_k:
        raise ValueError(f"sampling.draft_layers={s.draft_layers}: no draft without sampling.speculative_k > 0")
    if s.continuous_batching and s.speculative_k:
        raise ValueError(
            f"sampling.continuous_batching with sampling.speculative_k={s.speculative_k}: speculative "
            "decoding runs in static batches only; turn one of them off"
        )
    if not 1 <= s.refill_batch <= s.num_slots:
        raise ValueError(f"sampling.refill_batch={s.refill_batch}: expected 1..sampling.num_slots ({s.num_slots})")
    for key in ("num_slots", "refill_batch"):
        if s[key] != defaults[key] and not s.continuous_batching:
            raise ValueError(f"sampling.{key}={s[key]!r} cannot take effect without sampling.continuous_batching")
    if s.max_context and not set(stage_names) & set(SAMPLING_STAGES):
        raise ValueError(
            f"sampling.max_context={s.max_context}: no stage of this run ({', '.join(stage_names)}) samples; "
            f"it bounds the sampler calls of {', '.join(SAMPLING_STAGES)}"
        )
    if "rejection_sampling" in stage_names and "rlvr" not in stage_names:  # it samples with the continuous keys only
        changed = [k for k in defaults if s[k] != defaults[k] and k not in (*CONTINUOUS_KEYS, *EVERY_STAGE_KEYS)]
        if changed:
            raise ValueError(
                f"sampling.{changed[0]}={s[changed[0]]!r}: of the sampling.* keys, the rejection_sampling "
                f"stage takes only {', '.join(CONTINUOUS_KEYS)}"
            )
    elif "rlvr" not in stage_names:
        changed = [k for k in defaults if s[k] != defaults[k] and k not in EVERY_STAGE_KEYS]
        if changed:
            raise ValueError(
                f"sampling.{changed[0]}={s[changed[0]]!r}: the sampling.* keys configure the rlvr "
                f"stage's sampler, and this run ({', '.join(stage_names)}) has no rlvr stage"
            )


def check_rlvr_stage(cfg) -> None:
    """The rlvr stage's start-up checks: the `rl.*` rules, then what RL cannot split over processes
    and what `rl.placement = disaggregated` cannot do yet."""
    from posttrain.rl.envs.images import check_rl_images
    from posttrain.rl.rollout.hosts import check_multihost_rl
    from posttrain.rl.rollout.inflight import check_inflight
    from posttrain.rl.rollout.remote import check_disaggregated

    check_rl_config(cfg)
    check_rl_images(cfg)
    check_multihost_rl(cfg)
    check_inflight(cfg)
    if cfg.rl.placement == "disaggregated":
        check_disaggregated(cfg)
