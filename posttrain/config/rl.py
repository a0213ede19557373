"""The RL sections: `rl` (with `rl.curriculum`), `sampling`, `rejection` and `alerts`: their defaults,
the values their keys take, and the rules by which a value that cannot take effect is refused."""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.config.fields import Section, bounded, choice, flag, free, nested, options, parsed, registered, section
from posttrain.config.syntax import finite, parse_truncated_reward, parse_weights
from posttrain.config.train import gate_field
from posttrain.errors import UserError

ENVS = ("single", "tool", "screen")  # rl.envs: one answer per sample; multi-turn tool / screen episodes
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # rl.algo.losses
RATIO_LEVELS = ("token", "sequence")  # rl.algo.losses
IS_LEVELS = ("token", "sequence")  # rl.algo.offpolicy: truncated IS per token or per sequence
IS_MASKS = ("off", "token", "sequence", "geometric")  # rl.algo.offpolicy: masked IS
CRITICS = ("shared",)  # rl.algo.critic: a value head on the policy's decoder
QUANT_MODES = ("none", "int8", "int4")  # models.quant
SAMPLING_LAYOUTS = ("learner", "tensor")  # sampling.layout
ALERT_MODES = ("off", "warn", "stop")  # core.alerts.MODES
PLACEMENTS = ("colocated", "split", "disaggregated")  # rl.rollout.placement
ROLES = ("none", "learner", "sampler")  # rl.rollout.remote: a disaggregated run's process groups


TASK_FILES_WHY = "JSONL files or globs (local or gs://), read and checked at start-up (rl.tasks.files)"


def domain_weights(r) -> dict[str, float]:
    """`rl.domains` as {name: weight}. Empty: arithmetic alone, or with `rl.train_files` the files'
    domains alone (each weight 1; `rl.domains` may also weight them by name)."""
    if r.domains.strip():
        return parse_weights(r.domains)
    return {} if r.train_files else {"arithmetic": 1.0}


def ppo_steps(r) -> int:
    """Optimizer steps per rollout batch (epochs × minibatches)."""
    return r.updates_per_batch * r.minibatches


# Reasons a value cannot act, shared by several keys.
_RATIO_ONE = (
    "the ratio π/π_old is 1 with one optimizer step per batch: set rl.updates_per_batch > 1 or rl.minibatches > 1"
)
_STEPS = (lambda r: ppo_steps(r) > 1, _RATIO_ONE)
_EVAL = (lambda r: r.eval_every > 0, "no evaluation without rl.eval_every > 0")
_ARITHMETIC = lambda r: "arithmetic" in domain_weights(r)  # noqa: E731
_GAE = (lambda r: r.advantage == "gae", "only the critic (rl.advantage='gae') uses it")
_MULTI_TURN = (lambda r: r.env != "single", "only multi-turn episodes (rl.env='tool' or 'screen') take it")
_TOOL = (lambda r: r.env == "tool", "only multi-turn episodes (rl.env='tool') make tool calls")
_KL = (lambda r: r.kl_coef > 0, "no KL term without rl.kl_coef > 0")
_RM = (lambda r: bool(r.reward_model), "no learned reward without rl.reward_model")
_MASK = (lambda r: r.is_mask != "off", "no masked importance sampling without rl.is_mask")
_GRPO_SCALE = (
    "and a positive scale on the whole reward cancels in grpo's group normalisation (r − mean) / std: "
    "use rl.advantage='drgrpo', 'rloo' or 'gae'"
)
_RM_ALONE_SCALE = (
    lambda r: not (r.advantage == "grpo" and bool(r.reward_model) and not r.verifier_weight),
    f"with rl.verifier_weight=0 the learned reward is the whole reward, {_GRPO_SCALE}",
)
_SHAPES_VERIFIER = (
    lambda r: bool(r.verifier_weight),
    "it shapes the verifier reward, which rl.verifier_weight=0 drops",
)
_KL_IN_LOSS = "losses.policy_loss: as a loss term"


@section
class CurriculumConfig(Section):
    """`rl.curriculum`: the task scheduler's pass-rate bands and retirement (rl/tasks/scheduler.py)."""

    KEY = "rl.curriculum"
    STAGE = "rlvr"
    # e.g. "new:1,hard:0.5,medium:4,easy:0.2": draw a band by weight, then a task in it
    band_weights: str = parsed("", parse_weights)
    hard_below: float = bounded(0.2, ge=0, le=1)  # pass rate < this: band "hard"
    easy_above: float = bounded(0.8, ge=0, le=1)  # pass rate > this: band "easy" (else "medium")
    min_attempts: int = bounded(1, ge=1)  # samples before a task leaves band "new"
    window: int = bounded(0, ge=0)  # pass rate over a task's last n samples (0: all of them)
    retire_above: float = bounded(-1.0, le=1)  # >= 0: retire (never draw again) tasks whose pass rate is >= this
    retire_below: float = bounded(-1.0, le=1)  # >= 0: retire tasks whose pass rate is < this (too hard)
    retire_after: int = bounded(16, ge=1)  # samples of a task before it may retire
    pass_threshold: float = bounded(0.5, ge=0, le=1)  # a sample passes when its reward >= this

    def check_rules(self) -> None:
        """Bands in order; no key set that the rest leaves without effect."""
        if not self.hard_below <= self.easy_above:
            raise UserError(
                f"rl.curriculum: expected 0 <= hard_below ({self.hard_below}) <= easy_above ({self.easy_above}) "
                f"<= 1 and pass_threshold ({self.pass_threshold}) in [0, 1]",
                key="rl.curriculum.hard_below",
            )
        weighted = bool(self.band_weights.strip())
        retiring = self.retire_above >= 0 or self.retire_below >= 0
        defaults = CurriculumConfig.__dataclass_fields__
        active = {
            "hard_below": weighted,
            "easy_above": weighted,
            "min_attempts": weighted or retiring,
            "window": weighted or retiring,
            "retire_after": retiring,
        }
        for key, takes_effect in active.items():
            if getattr(self, key) != defaults[key].default and not takes_effect:
                why = (
                    "only retirement uses it: set rl.curriculum.retire_above or retire_below >= 0"
                    if key == "retire_after"
                    else "it places tasks in bands, and bands steer nothing without rl.curriculum.band_weights"
                    + (
                        ""
                        if key in ("hard_below", "easy_above")
                        else " or retirement (retire_above / retire_below >= 0)"
                    )
                )
                raise UserError(
                    f"rl.curriculum.{key}={getattr(self, key)!r} cannot take effect: {why}", key=f"rl.curriculum.{key}"
                )


@section
class RLConfig(Section):
    """`rl`: the rlvr stage: tasks, episodes, sampling, the policy loss, the critic and rewards.

    Keys whose values are names of implementations (`advantage`, `loss_type`, `kl_estimator`,
    `env`, the domains of `domains`) are checked against their registries when the run starts
    (`config.registry.check_registered`): a module may register more."""

    KEY = "rl"
    STAGE = "rlvr"
    # task mixture "name[:weight],...": arithmetic, gsm8k, humaneval, the domains of train_files;
    # "": arithmetic, or with train_files their domains alone (names checked against rl.tasks' registry)
    domains: str = parsed("", parse_weights)
    train_files: str = free("", TASK_FILES_WHY)  # the user's tasks: JSONL files / globs, comma-separated
    eval_files: str = free("", TASK_FILES_WHY, inert_unless=_EVAL)  # held-out user tasks
    # user verifiers "[name=]package.module:function,..." (rl/verifiers/user.py)
    verifiers: str = free("", "functions imported when the run starts (rl.tasks.registry.user_verifiers)")
    # wall-clock limit of one user verifier call (then Reward.error, counted)
    verifier_timeout_s: float = bounded(30.0, gt=0)
    curriculum: CurriculumConfig = nested(CurriculumConfig)
    # single: one answer per sample | tool: multi-turn episodes with sandboxed sh/python calls in a
    # persistent working directory (rl/envs/workspace.py) | screen: the screenshot agent
    env: str = registered("single", "rl.env")
    max_turns: int = bounded(4, ge=1, inert_unless=_MULTI_TURN)  # model turns per episode, calls included
    # episodes split into n cohorts taking turns on the sampler, so one cohort's tool calls overlap
    # another's sampling (rl/rollout/episodes.py); 1: lockstep rounds
    episode_cohorts: int = bounded(1, ge=1)
    tool_timeout_s: float = bounded(5.0, gt=0, inert_unless=_TOOL)  # wall-clock limit of one call
    invalid_tool_call_penalty: float = bounded(0.0, ge=0, inert_unless=_MULTI_TURN)  # per malformed or failed call
    # per call repeating an earlier one on an unchanged directory
    redundant_tool_call_penalty: float = bounded(0.0, ge=0, inert_unless=_TOOL)
    # keep trajectories: every n steps write {workdir}/rollouts/{step}.jsonl; 0: off
    rollouts_every: int = bounded(0, ge=0)
    # the fraction of that step's samples written (chosen by seed and step)
    rollouts_fraction: float = bounded(
        1.0,
        gt=0,
        le=1,
        inert_unless=(lambda r: r.rollouts_every > 0, "no rollouts are written without rl.rollouts_every > 0"),
    )
    # appended to math prompts (e.g. "Give the final answer as \\boxed{}.")
    instruction: str = free(
        "",
        "free text appended to prompts",
        inert_unless=(
            _ARITHMETIC,
            "only the arithmetic domain's prompts take rl.instruction, and rl.domains has no arithmetic",
        ),
    )
    # generated training problems (train split; held-out ones come from the test split)
    arithmetic_size: int = bounded(2000, ge=1, inert_unless=(_ARITHMETIC, "rl.domains has no arithmetic"))
    eval_size: int = bounded(128, ge=1, inert_unless=_EVAL)  # held-out problems per domain
    eval_every: int = bounded(10, ge=0)  # evaluate every n updates (and at start and end); 0: never
    eval_samples: int = bounded(4, ge=1, inert_unless=_EVAL)  # samples per held-out problem (mean accuracy, pass@k)
    prompts_per_step: int = bounded(8, ge=1)  # groups per update
    group_size: int = bounded(8, ge=1)  # G samples per prompt
    max_new_tokens: int = bounded(32, ge=1)
    temperature: float = free(1.0, "checked by the section's rules (> 0, with the reason)")
    top_k: int = bounded(0, ge=0)
    top_p: float = bounded(1.0, gt=0, le=1)
    advantage: str = registered("grpo", "rl.advantage")  # grpo | drgrpo (no std) | rloo | gae (PPO: a critic)
    clip_low: float = bounded(0.2, ge=0, lt=1, inert_unless=_STEPS)
    clip_high: float = bounded(0.28, ge=0, inert_unless=_STEPS)  # DAPO clip-higher
    ratio_level: str = choice(
        "token",
        RATIO_LEVELS,
        inert_unless=[
            (
                lambda r: ppo_steps(r) > 1,
                "sequence-level ratios equal token-level ones while π = π_old: "
                "set rl.updates_per_batch > 1 or rl.minibatches > 1",
            ),
            (
                lambda r: not (r.ratio_level == "sequence" and r.aggregation != "seq-mean-token-mean"),
                "the sequence ratio is GSPO's only with rl.aggregation='seq-mean-token-mean' (every sequence "
                "weighs the same and its tokens share its ratio); set that aggregation",
            ),
        ],
    )  # token | sequence (GSPO)
    updates_per_batch: int = bounded(1, ge=1)  # PPO epochs over one rollout batch
    minibatches: int = bounded(1, ge=1)  # optimizer steps per epoch (must divide prompts_per_step * group_size)
    aggregation: str = choice("token-mean", AGGREGATIONS)
    # seq-mean-token-sum's constant divisor (Dr. GRPO); 0: rl.max_new_tokens
    loss_norm_tokens: int = bounded(
        0,
        ge=0,
        inert_unless=(
            lambda r: r.aggregation == "seq-mean-token-sum",
            "only rl.aggregation='seq-mean-token-sum' (Dr. GRPO) divides by a constant token count",
        ),
    )
    kl_coef: float = bounded(0.0, ge=0)  # 0: no reference policy is held at all
    kl_estimator: str = registered(
        "k3",
        "rl.kl_estimator",
        inert_unless=[
            _KL,
            (
                lambda r: r.kl_in_reward or r.kl_estimator != "k1",
                f"{_KL_IN_LOSS} k1's gradient β·∇log π has expectation 0 (it adds noise, no pull towards the "
                "reference): use k2 or k3 as a loss term, or k1 paid as reward (rl.kl_in_reward=True)",
            ),
        ],
    )
    entropy_coef: float = bounded(0.0, ge=0)
    # truncation of importance weights π_learner / π_sampler
    is_cap: float = bounded(
        2.0,
        gt=0,
        inert_unless=(
            lambda r: not (r.is_mask == r.is_level and r.is_mask_high <= r.is_cap),
            "rl.is_mask at rl.is_level drops every token (sequence) whose ratio exceeds rl.is_mask_high <= "
            "rl.is_cap, so the truncation never acts: set rl.is_cap below rl.is_mask_high",
        ),
    )
    # --- off-policy corrections (rl/algo/offpolicy.py, rl/algo/losses.py) ---
    # ppo: clipped surrogate | cispo: sg(clip(r, 1 - clip_low, 1 + clip_high))·A·log π (rl.algo.losses)
    loss_type: str = registered(
        "ppo",
        "rl.loss_type",
        inert_unless=(
            lambda r: r.loss_type != "cispo" or ppo_steps(r) > 1,
            "with π = π_old CISPO's gradient −A·∇log π is the clipped surrogate's: "
            "set rl.updates_per_batch > 1 or rl.minibatches > 1",
        ),
    )
    is_level: str = choice("token", IS_LEVELS)  # truncated IS (rl.is_cap) per token | sequence (product of ratios)
    # masked IS: drop tokens (token) or sequences (sequence: product of ratios; geometric: their geometric
    # mean) whose π_learner / π_sampler lies outside [is_mask_low, is_mask_high]
    is_mask: str = choice("off", IS_MASKS)
    is_mask_low: float = bounded(0.5, ge=0, lt=1, inert_unless=_MASK)  # 0: no lower bound
    is_mask_high: float = bounded(2.0, gt=1, inert_unless=_MASK)
    # --- end off-policy corrections ---
    max_staleness: int = bounded(0, ge=0)  # 0: on-policy, synchronous; >= 1: sampling overlaps updates
    # in-flight weight updates (rl/rollout/inflight.py; needs max_staleness >= 1): every N decode steps
    # the sampler switches to the newest published weights, sequences in flight kept; 0: off
    inflight_update_every: int = bounded(0, ge=0)
    # dynamic sampling: resample groups whose rewards are all equal
    filter_groups: bool = flag(
        False,
        inert_unless=(
            lambda r: r.group_size >= 2,
            "a group of one sample never has differing rewards: dynamic sampling would drop every group",
        ),
    )
    max_resample_rounds: int = bounded(
        2, ge=0, inert_unless=(lambda r: r.filter_groups, "resampling needs rl.filter_groups=True")
    )
    # learner row length S: 0 a power of two; N a multiple of N (less padding, more shapes)
    seq_bucket: int = bounded(0, ge=0)
    format_penalty: float = bounded(
        0.0,
        ge=0,
        inert_unless=[
            (
                lambda r: set(domain_weights(r)) != {"repo_fix"},
                "rl.domains is repo_fix only, whose verdicts always have format_ok (a state check decides, "
                "not the answer's form)",
            ),
            _SHAPES_VERIFIER,
        ],
    )
    overlong_buffer: int = bounded(0, ge=0, inert_unless=_SHAPES_VERIFIER)  # DAPO overlong ramp (tokens)
    verifier_workers: int = bounded(4, ge=1)
    verifier_delay: float = bounded(
        0.0,
        ge=0,
        inert_unless=(
            lambda r: r.env == "single",
            "multi-turn episodes (rl.env='tool', 'screen') are scored inside their environment steps; the delay "
            "applies to single-turn verification only",
        ),
    )  # benchmarks only: extra host seconds per verified response
    # PPO with a critic (advantage="gae") and a learned reward (RLHF)
    critic: str = free("shared", "checked by the section's rules (rl.algo.critic)", inert_unless=_GAE)
    gamma: float = bounded(1.0, ge=0, le=1, inert_unless=_GAE)
    lam: float = bounded(0.95, ge=0, le=1, inert_unless=_GAE)  # GAE discount and trace decay
    value_coef: float = bounded(0.5, ge=0, inert_unless=_GAE)  # weight of the critic's loss in the learner's loss
    # PPO value clipping around the rollout's values (0: unclipped)
    value_clip: float = bounded(
        0.2,
        ge=0,
        inert_unless=[
            _GAE,
            (
                lambda r: ppo_steps(r) > 1,
                "with one optimizer step per batch the critic's values are the rollout's (V = V_old), so the "
                "clip around them never acts: set rl.updates_per_batch > 1 or rl.minibatches > 1",
            ),
        ],
    )
    # a reward_model run dir ("@reward_model": the pipeline's stage) or ""
    reward_model: str = free("", "a run folder or '@stage', opened when the run starts (rl.algo.reward_model)")
    # reward = verifier_weight · verifier + reward_model_weight · RM score
    reward_model_weight: float = bounded(1.0, ge=0, inert_unless=[_RM, _RM_ALONE_SCALE])
    verifier_weight: float = bounded(
        1.0,
        ge=0,
        inert_unless=(
            lambda r: not (r.advantage == "grpo" and not r.reward_model),
            f"without rl.reward_model the verifier reward is the whole reward, {_GRPO_SCALE}",
        ),
    )
    reward_model_normalize: bool = flag(True, inert_unless=[_RM, _RM_ALONE_SCALE])  # RM scores by running mean/std
    # an unfinished response's training reward (no end of turn: cut by max_new_tokens or max_turns),
    # learned or verified: "min" (the batch's lowest), "none" (as scored) or a number
    truncated_reward: str = parsed("min", parse_truncated_reward)
    # pay rl.kl_coef · KL per token as reward instead of a loss term
    kl_in_reward: bool = flag(
        False,
        inert_unless=[
            (lambda r: r.kl_coef > 0, "no KL to pay without rl.kl_coef > 0"),
            (
                lambda r: not (r.kl_in_reward and r.kl_estimator != "k1"),
                "paid as reward, the penalty is differentiated through the score function only, which is "
                "∇KL(π‖π_ref) for k1 alone (k2's mean is not the KL; k3's own gradient does not vanish): set "
                "rl.kl_estimator='k1'",
            ),
        ],
    )
    # --- rl.placement: which devices sample ---
    # colocated: sampler and learner on every device | split: the last rl.sampler_devices devices
    # sample (their own mesh), the others learn | disaggregated: separate process groups, one command
    # each with rl.role = learner | sampler (rl/rollout/remote.py)
    placement: str = choice("colocated", PLACEMENTS)
    sampler_devices: int = bounded(0, ge=0)
    role: str = choice("none", ROLES)
    lease_timeout_s: float = bounded(60.0, gt=0)  # disaggregated: a sampler silent this long loses its leases
    steps: int = bounded(0, ge=0)  # rollout batches, replacing train.steps when non-zero
    lr: float = bounded(0.0, ge=0)  # replacing optim.lr when non-zero
    gate: str = gate_field()  # as for the other stages
    # the own keys of registered entries (config.registry): rl.options.<entry>.<key>
    options: Mapping[str, Section] = options()

    def check_rules(self) -> None:
        """Sampling draws distinct samples; a baseline has a group; the minibatches split the batch;
        rewards exist; placement keys agree."""
        if not self.temperature > 0:
            raise UserError(
                f"rl.temperature={self.temperature}: RL samples groups from the policy; expected > 0 "
                "(0 is greedy: every sample of a group would be the same)",
                key="rl.temperature",
            )
        if self.advantage == "gae" and self.critic not in CRITICS:
            extra = (
                " (a separate value model is not implemented: its own train state, optimizer and checkpoint items)"
                if self.critic == "separate"
                else ""
            )
            raise UserError(f"rl.critic={self.critic!r}: expected one of {CRITICS}{extra}", key="rl.critic")
        if self.advantage != "gae" and self.group_size < 2:
            raise UserError(
                f"rl.group_size={self.group_size}: a group-relative baseline needs at least 2 samples",
                key="rl.group_size",
            )
        rows = self.prompts_per_step * self.group_size
        if rows % self.minibatches:
            raise UserError(
                f"rl.minibatches={self.minibatches} must divide the sequences per batch, rl.prompts_per_step × "
                f"rl.group_size = {rows}",
                key="rl.minibatches",
            )
        if self.filter_groups and self.max_staleness > 0:
            raise UserError(
                "rl.filter_groups needs rl.max_staleness=0 (dynamic sampling decides on verified rewards "
                "before the next generation)",
                key="rl.filter_groups",
            )
        if not self.reward_model and not self.verifier_weight:
            raise UserError(
                "rl.verifier_weight=0 without rl.reward_model: there is no reward left", key="rl.verifier_weight"
            )
        if self.reward_model and self.filter_groups:
            raise UserError(
                f"rl.filter_groups with rl.reward_model={self.reward_model!r}: dynamic sampling filters on "
                "verifier rewards before the learned reward is scored; set rl.filter_groups=False",
                key="rl.filter_groups",
            )
        check_placement(self.placement, self.sampler_devices, self.role)


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


_CONTINUOUS = (lambda s: s.continuous_batching, "it cannot take effect without sampling.continuous_batching")


@section
class SamplingConfig(Section):
    """`sampling`: the rlvr stage's sampler (rollouts and held-out evals); `max_context` bounds every
    sampler call of a run. Which stages read which keys: `RunConfig.check_rules`."""

    KEY = "sampling"
    # none | int8 (w8a16) | int4 (w4a16): weights quantised from the learner's at each publish
    quantize: str = choice("none", QUANT_MODES)
    # learner (serve the learner's ZeRO-3 arrays) | tensor (a decode-layout copy made at each publish)
    layout: str = choice("learner", SAMPLING_LAYOUTS)
    # > 0: speculative decoding, k tokens drafted per round (same distribution, policy log-probs)
    speculative_k: int = bounded(0, ge=0)
    # the draft: the policy's first n layers + its final norm and head
    draft_layers: int = bounded(
        1, ge=1, inert_unless=(lambda s: s.speculative_k > 0, "no draft without sampling.speculative_k > 0")
    )
    prefix_cache: int = bounded(0, ge=0)  # > 0: keep prompt-prefix KV across sampler calls, bound in tokens
    continuous_batching: bool = flag(False)  # rollouts through continuously refilled decode slots
    num_slots: int = bounded(16, ge=1, inert_unless=_CONTINUOUS)  # decode slots (at most one call's samples)
    refill_batch: int = bounded(4, ge=1, inert_unless=_CONTINUOUS)  # free slots refilled this many at a time
    # longest prompt + new tokens any sampler call (rollouts, evals, long-context evals, tools) may need;
    # 0: the context the model was trained and configured for (core/lineage.py `configured_context`);
    # N: up to N tokens, explicitly (e.g. to measure past the trained length)
    max_context: int = bounded(0, ge=0)

    def check_rules(self) -> None:
        """Speculative decoding, the prefix cache and continuous batching exclude each other; the
        refill fits the slots."""
        if self.prefix_cache and self.speculative_k:
            raise UserError(
                f"sampling.prefix_cache={self.prefix_cache}: not supported with sampling.speculative_k="
                f"{self.speculative_k} (set one of them to 0)",
                key="sampling.prefix_cache",
            )
        if self.prefix_cache and self.continuous_batching:
            raise UserError(
                f"sampling.prefix_cache={self.prefix_cache}: not supported with sampling.continuous_batching "
                "(the continuous engine prefills every prompt whole); turn one of them off",
                key="sampling.prefix_cache",
            )
        if self.continuous_batching and self.speculative_k:
            raise UserError(
                f"sampling.continuous_batching with sampling.speculative_k={self.speculative_k}: speculative "
                "decoding runs in static batches only; turn one of them off",
                key="sampling.continuous_batching",
            )
        if not 1 <= self.refill_batch <= self.num_slots:
            raise UserError(
                f"sampling.refill_batch={self.refill_batch}: expected 1..sampling.num_slots ({self.num_slots})",
                key="sampling.refill_batch",
            )


@section
class RejectionConfig(Section):
    """`rejection`: the rejection_sampling stage (verified samples of the policy → SFT data). Prompts
    are RL training tasks (rl.domains, rl.train_files); sampling uses rl.max_new_tokens, top_k, top_p."""

    KEY = "rejection"
    STAGE = "rejection_sampling"
    prompts: int = bounded(256, ge=1)  # distinct training prompts, split over the domains by their weights
    samples_per_prompt: int = bounded(8, ge=1)  # N candidates sampled per prompt
    keep_per_prompt: int = bounded(1, ge=1)  # at most this many kept per prompt: the best by score, then shortest
    min_score: float = parsed(1.0, finite)  # a candidate passes when its reward >= this (and it has a verdict)
    max_tokens: int = bounded(0, ge=0)  # length filter: drop passing responses longer than this; 0: off
    temperature: float = bounded(1.0, ge=0)
    output: str = free("", "the SFT JSONL written (local or gs://); '' = {workdir}/sft.jsonl")
    # also write {output}.mixed.jsonl (sft.train_files, then the kept records); the next sft stage of a
    # pipeline trains on it instead of the kept records alone
    mix_original: bool = flag(False)
    gate: str = gate_field()  # e.g. "rejection/yield>=0.2" (stages/rejection_sampling.py lists the metrics)

    def check_rules(self) -> None:
        """A prompt keeps at most its candidates; greedy candidates are one; records go to JSONL."""
        if self.keep_per_prompt > self.samples_per_prompt:
            raise UserError(
                f"rejection.keep_per_prompt={self.keep_per_prompt}: at most rejection.samples_per_prompt="
                f"{self.samples_per_prompt} candidates exist per prompt",
                key="rejection.keep_per_prompt",
            )
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise UserError(
                f"rejection.temperature=0 (greedy) makes all rejection.samples_per_prompt="
                f"{self.samples_per_prompt} samples of a prompt the same: use samples_per_prompt=1 or a "
                "temperature > 0",
                key="rejection.temperature",
            )
        if self.output and not self.output.endswith(".jsonl"):
            raise UserError(
                f"rejection.output={self.output!r}: expected a .jsonl path (local or gs://), or '' for "
                "{workdir}/sft.jsonl",
                key="rejection.output",
            )


@section
class AlertsConfig(Section):
    """`alerts`: run health rules (posttrain/core/alerts.py); 0 = rule off."""

    KEY = "alerts"
    on: str = choice("warn", ALERT_MODES)  # off | warn (log, event row, progress bar) | stop (raise AlertStop)
    reward_drift: float = bounded(6.0, ge=0)  # |batch mean reward − running mean| / running std above this
    entropy_collapse: float = bounded(0.01, ge=0)  # rl/entropy (nats/token) below this
    kl_blowup: float = bounded(1.0, ge=0)  # rl/kl above this
    response_len_explosion: float = bounded(3.0, ge=0)  # mean response length above this × its running mean
    clip_saturation: float = bounded(0.5, ge=0)  # rl/clip_frac_low + rl/clip_frac_high above this
    nonfinite: bool = flag(True)  # any NaN/inf metric
    verifier_error_rate: float = bounded(0.1, ge=0)  # rl/verifier_errors / rl/responses above this
    throughput_stall: float = bounded(0.2, ge=0)  # tokens/s below this × its running mean
