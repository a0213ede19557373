"""The RL sections: `rl` (with `rl.curriculum`), `sampling`, `rejection` and `alerts`, and the values
their enum keys take."""

from __future__ import annotations

import math

from posttrain.config.fields import Section, bounded, choice, section
from posttrain.config.train import StageConfig
from posttrain.errors import UserError

ENVS = ("single", "tool", "screen")  # rl.tasks.registry: one answer per sample; multi-turn tool / screen episodes
ADVANTAGE_METHODS = ("grpo", "drgrpo", "rloo", "gae")  # rl.algo.advantages
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # rl.algo.losses
KL_ESTIMATORS = ("k1", "k2", "k3")  # rl.algo.losses
RATIO_LEVELS = ("token", "sequence")  # rl.algo.losses
# --- off-policy corrections (rl.loss_type, rl.is_level, rl.is_mask) ---
POLICY_LOSSES = ("ppo", "cispo")  # rl.algo.losses
IS_LEVELS = ("token", "sequence")  # rl.algo.offpolicy: truncated IS per token or per sequence
IS_MASKS = ("off", "token", "sequence", "geometric")  # rl.algo.offpolicy: masked IS
# --- end off-policy corrections ---
QUANT_MODES = ("none", "int8", "int4")  # models.quant
SAMPLING_LAYOUTS = ("learner", "tensor")  # sampling.layout
ALERT_MODES = ("off", "warn", "stop")  # core.alerts.MODES
# --- rl.placement (issue 27 item 1) ---
PLACEMENTS = ("colocated", "split", "disaggregated")  # rl.rollout.placement
ROLES = ("none", "learner", "sampler")  # rl.rollout.remote: a disaggregated run's process groups
# --- end rl.placement ---


@section
class CurriculumConfig(Section):
    """`rl.curriculum`: the task scheduler's pass-rate bands and retirement."""

    KEY = "rl.curriculum"
    band_weights: str
    hard_below: float
    easy_above: float
    min_attempts: int
    window: int
    retire_above: float
    retire_below: float
    retire_after: int
    pass_threshold: float


@section
class RLConfig(StageConfig):
    """`rl`: the rlvr stage: tasks, episodes, sampling, the policy loss, the critic and rewards."""

    KEY = "rl"
    domains: str
    verifiers: str
    verifier_timeout_s: float
    curriculum: CurriculumConfig
    env: str = choice(ENVS)
    max_turns: int = bounded(ge=1)
    episode_cohorts: int = bounded(ge=1)
    tool_timeout_s: float = bounded(gt=0)
    invalid_tool_call_penalty: float = bounded(ge=0)
    redundant_tool_call_penalty: float = bounded(ge=0)
    rollouts_every: int
    rollouts_fraction: float
    instruction: str
    arithmetic_size: int
    eval_size: int
    eval_every: int = bounded(ge=0)
    eval_samples: int
    prompts_per_step: int
    group_size: int = bounded(ge=1)
    max_new_tokens: int = bounded(ge=1)
    temperature: float
    top_k: int = bounded(ge=0)
    top_p: float = bounded(gt=0, le=1)
    advantage: str = choice(ADVANTAGE_METHODS)
    clip_low: float
    clip_high: float
    ratio_level: str = choice(RATIO_LEVELS)
    updates_per_batch: int
    minibatches: int
    aggregation: str = choice(AGGREGATIONS)
    loss_norm_tokens: int = bounded(ge=0)
    kl_coef: float = bounded(ge=0)
    kl_estimator: str = choice(KL_ESTIMATORS)
    entropy_coef: float = bounded(ge=0)
    is_cap: float = bounded(gt=0)
    # --- off-policy corrections (rl.algo.offpolicy, rl.algo.losses) ---
    loss_type: str = choice(POLICY_LOSSES)
    is_level: str = choice(IS_LEVELS)
    is_mask: str = choice(IS_MASKS)
    is_mask_low: float = bounded(ge=0, lt=1)
    is_mask_high: float = bounded(gt=1)
    # --- end off-policy corrections ---
    max_staleness: int
    inflight_update_every: int = bounded(ge=0)  # rl.rollout.inflight
    filter_groups: bool
    max_resample_rounds: int
    seq_bucket: int = bounded(ge=0)
    format_penalty: float
    overlong_buffer: int
    verifier_workers: int = bounded(ge=1)
    verifier_delay: float
    critic: str
    gamma: float
    lam: float
    value_coef: float
    value_clip: float
    reward_model: str
    reward_model_weight: float
    verifier_weight: float
    reward_model_normalize: bool
    kl_in_reward: bool
    truncated_reward: str  # what an unfinished response is paid (rl.algo.reward_model): min | none | a number
    # --- rl.placement (issue 27 item 1): which devices sample ---
    placement: str = choice(PLACEMENTS)
    sampler_devices: int = bounded(ge=0)
    role: str = choice(ROLES)
    lease_timeout_s: float = bounded(gt=0)
    # --- end rl.placement ---

    def check_rules(self) -> None:
        """rl.truncated_reward is "min", "none" or a finite number; rl.placement, rl.sampler_devices
        and rl.role agree."""
        parse_truncated_reward(self.truncated_reward)
        check_placement(self.placement, self.sampler_devices, self.role)


# --- rl.placement (issue 27 item 1) ---
def check_placement(placement: str, sampler_devices: int, role: str = "none") -> None:
    """What the config alone can refuse: `disaggregated` without a role (each process group says
    whether it is the learner or a sampler), a role without `disaggregated`, `split` without
    sampler devices, sampler devices without `split`. Device counts are checked at start-up
    (`rl.rollout.placement.place_devices`)."""
    if placement == "disaggregated" and role == "none":
        raise UserError(
            "rl.placement='disaggregated' runs one command per process group: set rl.role='learner' for the "
            "learner's and rl.role='sampler' for each sampler's (same config and workdir; either may start first)",
            key="rl.role",
        )
    if placement != "disaggregated" and role != "none":
        raise UserError(
            f"rl.role={role!r} is only used with rl.placement='disaggregated' (rl.placement={placement!r}: one "
            "process group learns and samples); set it to 'none'",
            key="rl.role",
        )
    if placement == "split" and sampler_devices < 1:
        raise UserError(
            "rl.placement='split' needs rl.sampler_devices >= 1: the number of devices (the last ones) "
            "that sample while the others learn",
            key="rl.sampler_devices",
        )
    if placement != "split" and sampler_devices:
        raise UserError(
            f"rl.sampler_devices={sampler_devices} is only used with rl.placement='split' "
            f"(rl.placement={placement!r}: the sampler shares the learner's devices); set it to 0",
            key="rl.sampler_devices",
        )


# --- end rl.placement ---


def parse_truncated_reward(value: str) -> str | float:
    """`rl.truncated_reward` → "min", "none" or a finite float; a UserError naming the key otherwise."""
    if value in ("min", "none"):
        return value
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise UserError(
            f"config.rl.truncated_reward={value!r}: expected 'min' (the lowest reward of the batch), "
            "'none' (as the reward sources score it) or a finite number such as '-1'",
            key="rl.truncated_reward",
        )
    return number


@section
class SamplingConfig(Section):
    """`sampling`: the rlvr stage's sampler; `max_context` bounds every sampler call of a run."""

    KEY = "sampling"
    quantize: str = choice(QUANT_MODES)
    layout: str = choice(SAMPLING_LAYOUTS)
    speculative_k: int
    draft_layers: int
    prefix_cache: int = bounded(ge=0)
    continuous_batching: bool
    num_slots: int = bounded(ge=1)
    refill_batch: int = bounded(ge=1)
    max_context: int = bounded(ge=0)


@section
class RejectionConfig(Section):
    """`rejection`: the rejection_sampling stage (verified samples of the policy → SFT data)."""

    KEY = "rejection"
    prompts: int = bounded(ge=1)
    samples_per_prompt: int = bounded(ge=1)
    keep_per_prompt: int = bounded(ge=1)
    min_score: float
    max_tokens: int = bounded(ge=0)
    temperature: float = bounded(ge=0)
    output: str
    mix_original: bool
    gate: str


@section
class AlertsConfig(Section):
    """`alerts`: run health rules (0: a rule is off)."""

    KEY = "alerts"
    on: str = choice(ALERT_MODES)
    reward_drift: float
    entropy_collapse: float
    kl_blowup: float
    response_len_explosion: float
    clip_saturation: float
    nonfinite: bool
    verifier_error_rate: float
    throughput_stall: float
