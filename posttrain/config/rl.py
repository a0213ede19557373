"""The RL sections: `rl` (with `rl.curriculum`): their defaults, the values their keys take, and the
rules by which a value that cannot take effect is refused."""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.config.curriculum import CurriculumConfig
from posttrain.config.fields import Section, bounded, choice, flag, free, nested, options, parsed, registered, section
from posttrain.config.syntax import parse_settings, parse_truncated_reward, parse_weights
from posttrain.config.train import gate_field
from posttrain.errors import UserError

ENVS = ("single", "tool", "screen")  # rl.envs: one answer per sample; multi-turn tool / screen episodes
AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")  # rl.algo.losses
RATIO_LEVELS = ("token", "sequence")  # rl.algo.losses
IS_LEVELS = ("token", "sequence")  # rl.algo.offpolicy: truncated IS per token or per sequence
IS_MASKS = ("off", "token", "sequence", "geometric")  # rl.algo.offpolicy: masked IS
CRITICS = ("shared",)  # rl.algo.critic: a value head on the policy's decoder
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
_RG = (
    lambda r: any(name.startswith("rg:") for name in domain_weights(r)),
    "rl.domains names no reasoning-gym domain (rg:<dataset>)",
)
_GAE = (lambda r: r.advantage == "gae", "only the critic (rl.advantage='gae') uses it")
_MULTI_TURN = (lambda r: r.env != "single", "only multi-turn episodes (rl.env='tool' or 'screen') take it")
_TOOL = (lambda r: r.env == "tool", "only multi-turn episodes (rl.env='tool') make tool calls")
_KL = (lambda r: r.kl_coef > 0, "no KL term without rl.kl_coef > 0")
_RM = (lambda r: bool(r.reward_model), "no learned reward without rl.reward_model")
_DISAGGREGATED = (lambda r: r.placement == "disaggregated", "only rl.placement='disaggregated' samplers read it")
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
class RLConfig(Section):
    """`rl`: the rlvr stage: tasks, episodes, sampling, the policy loss, the critic and rewards.

    Keys whose values are names of implementations (`advantage`, `loss_type`, `kl_estimator`,
    `env`, the domains of `domains`) are checked against their registries when the run starts
    (`config.registry.check_registered`): a module may register more."""

    KEY = "rl"
    STAGE = "rlvr"
    # task mixture "name[:weight],...": arithmetic, gsm8k, humaneval, rg:<dataset> (reasoning-gym), the
    # domains of train_files; "": arithmetic, or with train_files their domains alone (names checked
    # against rl.tasks' registry)
    domains: str = parsed("", parse_weights)
    # reasoning-gym generator settings "<dataset>.<setting>=<value>; ...", checked against the dataset's
    # config dataclass when the run starts (rl/tasks/rg_domain.py)
    rg_settings: str = parsed("", parse_settings, inert_unless=_RG)
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
    # generated training problems of arithmetic and of each rg: domain (held-out ones: the test split)
    arithmetic_size: int = bounded(
        2000,
        ge=1,
        inert_unless=(lambda r: _ARITHMETIC(r) or _RG[0](r), "rl.domains has no arithmetic and no rg: domain"),
    )
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
    # learned or verified: "min" (the lowest judged reward of the batch), "none" (as scored) or a number
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
    # disaggregated: a sampler gives up (LearnerUnreachable) after its pulls failed this long in a row
    reconnect_timeout_s: float = bounded(600.0, gt=0, inert_unless=_DISAGGREGATED)
    # disaggregated: a sampler whose work on a lease (generation, verification) has not moved for this
    # long stops beating, so its lease lapses (rl/rollout/liveness.py); above one generation's time
    progress_deadline_s: float = bounded(600.0, gt=0, inert_unless=_DISAGGREGATED)
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
        if self.curriculum.rg_levels and not _RG[0](self):
            raise UserError(
                f"rl.curriculum.rg_levels={self.curriculum.rg_levels!r} cannot take effect: {_RG[1]}",
                key="rl.curriculum.rg_levels",
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
