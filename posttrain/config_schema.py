"""Start-up validation of a run's config: every enum, range and cross-field rule, checked before
anything compiles, each error a `UserError` naming the key (`posttrain.config` has the keys and
defaults; this module what values they may take).

The checks that live with the code they guard (gate syntax: `eval.gates.validate_gates`, the `rl.*`
rules: `rl.checks.check_rl_config`, alert rules, eval suites) are called from here, once, for the
stages the run will reach, so a pipeline's last stage is checked before its first one trains.

Precedence where two keys set one thing (`<stage>.steps` / `train.steps`, `<stage>.lr` /
`optim.lr`): the stage's key wins when it is non-zero, unless the generic key was given on the
command line and the stage's key was not: a command-line value is never silently replaced by a
value from the config file (`apply_command_line_precedence`).
"""

from __future__ import annotations

import logging
import re

from posttrain.errors import UserError
from posttrain.stages import registry

STAGE_SECTIONS = {s.name: s.section for s in registry.STAGES if s.own_steps}
# generic key → the per-stage keys that replace it when non-zero (posttrain.config.with_stage_overrides)
OVERRIDDEN_BY_STAGE = {"train.steps": [f"{s}.steps" for s in STAGE_SECTIONS.values()],
                       "optim.lr": [f"{s}.lr" for s in STAGE_SECTIONS.values()]}

# key → (lower bound, inclusive?, upper bound, inclusive?); None: unbounded
RANGES: dict[str, tuple] = {
    "seed": (0, True, None, False),
    "train.steps": (1, True, None, False), "train.batch_size": (1, True, None, False),
    "train.seq_len": (1, True, None, False), "train.log_every": (1, True, None, False),
    "train.eval_every": (0, True, None, False), "train.max_nonfinite_steps": (0, True, None, False),
    "optim.lr": (0, False, None, False), "optim.min_lr_ratio": (0, True, 1, True),
    "optim.warmup_steps": (0, True, None, False), "optim.weight_decay": (0, True, None, False),
    "optim.b1": (0, True, 1, False), "optim.b2": (0, True, 1, False), "optim.eps": (0, False, None, False),
    "optim.grad_clip": (0, True, None, False),
    "optim.factored_min_dim": (1, True, None, False),
    "checkpoint.every": (0, True, None, False), "checkpoint.keep": (1, True, None, False),
    **{f"{s}.steps": (0, True, None, False) for s in STAGE_SECTIONS.values()},
    **{f"{s}.lr": (0, True, None, False) for s in STAGE_SECTIONS.values()},
    "dpo.beta": (0, False, None, False), "dpo.label_smoothing": (0, True, 0.5, False),
    "data.synthetic_size": (1, True, None, False), "data.synthetic_max_value": (1, True, None, False),
    "data.synthetic_error_rate": (0, True, 1, True),
    **{f"model.{k}": (1, True, None, False) for k in ("vocab_size", "embed_dim", "num_layers", "num_heads",
                                                       "num_kv_heads", "head_dim", "mlp_dim")},
    "model.moe.num_experts": (0, True, None, False), "model.moe.top_k": (1, True, None, False),
    "model.moe.capacity_factor": (0, True, None, False),
    "lora.rank": (0, True, None, False), "lora.alpha": (0, False, None, False),
    "rl.group_size": (1, True, None, False), "rl.max_new_tokens": (1, True, None, False),
    "rl.eval_every": (0, True, None, False), "rl.top_k": (0, True, None, False), "rl.top_p": (0, False, 1, True),
    "rl.kl_coef": (0, True, None, False), "rl.entropy_coef": (0, True, None, False),
    "rl.verifier_workers": (1, True, None, False),
    "rl.max_turns": (1, True, None, False), "rl.tool_timeout_s": (0, False, None, False),
    "rl.episode_cohorts": (1, True, None, False),
    "rl.invalid_tool_call_penalty": (0, True, None, False),
    "rl.redundant_tool_call_penalty": (0, True, None, False),
    "sampling.num_slots": (1, True, None, False), "sampling.refill_batch": (1, True, None, False),
    **{f"rejection.{k}": (1, True, None, False) for k in ("prompts", "samples_per_prompt", "keep_per_prompt")},
    "rejection.max_tokens": (0, True, None, False), "rejection.temperature": (0, True, None, False),
    "sampling.prefix_cache": (0, True, None, False),
    "distributed.num_processes": (0, True, None, False), "distributed.process_id": (-1, True, None, False),
    "distributed.heartbeat_timeout_s": (1, True, None, False),
    "distributed.initialization_timeout_s": (1, True, None, False),
}


# key → valid values. Written out (not imported from the modules that use them, which import jax and
# flax) so that `check_values` runs before any of that is loaded; `tests/test_cli.py` checks each
# table against its module's.
ENUMS: dict[str, tuple] = {
    "model.attention": ("xla", "blockwise", "cudnn", "splash"),                  # models.attention.ATTENTION_KERNELS
    "model.rope_scaling.type": ("", "linear", "dynamic", "yarn", "llama3"),     # models.attention.ROPE_SCALINGS
    "model.context_parallel": ("all_gather", "ring", "auto"),                   # ops.context_parallel.CONTEXT_PARALLEL
    "model.remat": ("none", "full", "dots"),                                    # models.decoder.REMAT_POLICIES
    "model.moe.router": ("softmax", "sigmoid"), "model.moe.dispatch": ("auto", "ragged", "padded"),
    "model.param_dtype": ("float32", "bfloat16", "float16"), "model.dtype": ("float32", "bfloat16", "float16"),
    "data.on_error": ("raise", "skip"),                                         # data.sources.ON_ERROR
    "data.synthetic": ("", "arithmetic", "long_context"),
    "dpo.loss_type": ("sigmoid", "ipo"),                                        # train.losses.DPO_LOSSES
    "alerts.on": ("off", "warn", "stop"),                                       # eval.alerts.MODES
    "rl.advantage": ("grpo", "drgrpo", "rloo", "gae"),                          # rl.advantages.ADVANTAGE_METHODS
    "rl.aggregation": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),   # rl.losses.AGGREGATIONS
    "rl.kl_estimator": ("k1", "k2", "k3"),                                      # rl.losses.KL_ESTIMATORS
    "rl.ratio_level": ("token", "sequence"),                                    # rl.losses.RATIO_LEVELS
    "sampling.quantize": ("none", "int8", "int4"),                              # models.quant.QUANT_MODES
    "sampling.layout": ("learner", "tensor"),                                   # sampling.layout.SAMPLING_LAYOUTS
    "rl.env": ("single", "tool"),                                               # rl.tasks.ENVS
    "optim.name": ("adamw", "adafactor"),                                       # train.optim.OPTIMIZERS
    "optim.moment_dtype": ("", "float32", "bfloat16"),                          # train.optim.MOMENT_DTYPES
}
# Keys one optimizer reads and the other does not (train.optim.make_optimizer): a value other than
# the default is refused under the other optimizer rather than ignored.
OPTIMIZER_ONLY = {"adamw": ("b1", "b2", "eps", "moment_dtype"), "adafactor": ("factored_min_dim",)}


def get(cfg, key: str):
    """The value at a dotted key."""
    node = cfg
    for part in key.split("."):
        node = node[part]
    return node


def _check_range(key: str, value, bounds: tuple) -> None:
    lo, lo_incl, hi, hi_incl = bounds
    ok = (lo is None or (value >= lo if lo_incl else value > lo)) and (hi is None or (value <= hi if hi_incl else value < hi))
    if not ok:
        want = " and ".join(w for w in (lo is not None and f"{'>=' if lo_incl else '>'} {lo}",
                                          hi is not None and f"{'<=' if hi_incl else '<'} {hi}") if w)
        raise UserError(f"config.{key}={value!r}: expected {want}", key=key)


def _check_optimizer_keys(cfg) -> None:
    from posttrain.config import base_config     # already loaded wherever a cfg exists
    default = base_config().optim
    for owner, keys in OPTIMIZER_ONLY.items():
        for key in keys if cfg.optim.name != owner else ():
            if cfg.optim[key] != default[key]:
                raise UserError(f"config.optim.{key}={cfg.optim[key]!r} applies to optim.name={owner!r} only; "
                                f"optim.name={cfg.optim.name!r} does not read it (leave it {default[key]!r})",
                                key=f"optim.{key}")


def _cross_field(cfg) -> None:
    _check_optimizer_keys(cfg)
    m = cfg.model
    if m.num_heads % m.num_kv_heads:
        raise UserError(f"config.model.num_kv_heads={m.num_kv_heads} must divide model.num_heads={m.num_heads} "
                        "(grouped-query attention)", key="model.num_kv_heads")
    if m.moe.num_experts and m.moe.top_k > m.moe.num_experts:
        raise UserError(f"config.model.moe.top_k={m.moe.top_k}: expected <= model.moe.num_experts="
                        f"{m.moe.num_experts}", key="model.moe.top_k")


def stages_of(cfg) -> tuple[str, ...]:
    """The stages a run reaches: `pipeline.stages` for a pipeline, else the stage itself."""
    return tuple(cfg.pipeline.stages) if cfg.stage == "pipeline" else (cfg.stage,)


def _as_user_error(e: ValueError) -> UserError:
    """A module check's ValueError ("rl.advantage='foo': ...") as a UserError with its key."""
    m = re.match(r"(?:config\.)?([a-z_]+(?:\.[a-z_0-9]+)+)[=: ]", str(e))
    return UserError(str(e), key=m.group(1) if m else None)


def check_values(cfg) -> None:
    """Raise a UserError naming the first key whose value is out of its enum or range or breaks a
    cross-field rule. Imports nothing heavy: `main.run` calls it first."""
    for key, valid in ENUMS.items():
        if get(cfg, key) not in valid:
            raise UserError(f"config.{key}={get(cfg, key)!r}: expected one of {', '.join(map(repr, valid))}", key=key)
    for key, bounds in RANGES.items():
        _check_range(key, get(cfg, key), bounds)
    _cross_field(cfg)


def check_config(cfg) -> None:
    """`check_values`, then each stage's own start-up checks (data files, gates, rl.*, alerts, eval
    suites) for the stages the run reaches; a UserError naming the key."""
    from posttrain.core.alerts import AlertMonitor
    from posttrain.eval.gates import validate_gates
    from posttrain.stages.data_files import check_stage_files
    check_values(cfg)
    stages = stages_of(cfg)
    check_stage_files(cfg, stages)      # named files exist, "synthetic:" can be generated: every stage, up front
    try:
        validate_gates(cfg, stages)
        from posttrain.rl.checks import check_episode_cohorts, check_sampling_config
        check_sampling_config(cfg, stages)
        check_episode_cohorts(cfg, stages)
        AlertMonitor.from_config(cfg.alerts)
        for stage in registry.STAGES:    # each stage's own checks: a pipeline's last stage before its first trains
            if stage.name in stages and stage.check:
                stage.checker()(cfg)
    except ValueError as e:
        raise _as_user_error(e) from None


def command_line_keys(argv: list[str]) -> set[str]:
    """The keys `--config.a.b=v` / `--config.a.b v` set in `argv`."""
    return {a[len("--config."):].split("=", 1)[0] for a in argv if a.startswith("--config.")}


def apply_command_line_precedence(cfg, cli_keys: set[str]) -> list[str]:
    """A generic key given on the command line (`train.steps`, `optim.lr`) beats a stage key set in
    the file (`rl.steps`, ...): that stage key is cleared (0) so the command-line value takes effect.
    A stage key given on the command line too still wins (the more specific one). Returns what changed."""
    notes = []
    for generic, specifics in OVERRIDDEN_BY_STAGE.items():
        if generic not in cli_keys:
            continue
        for key in specifics:
            if get(cfg, key) and key not in cli_keys:
                section, leaf = key.split(".")
                notes.append(f"{generic}={get(cfg, generic)!r} from the command line replaces {key}={get(cfg, key)!r} "
                             "from the config file")
                cfg[section][leaf] = type(get(cfg, key))(0)
    for note in notes:
        logging.info("config: %s", note)
    return notes
