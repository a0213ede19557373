"""`RunConfig`: the whole run config, typed, frozen and checked; with the `distributed`, `mesh` and
`sharding` sections and the rules that span sections (which stage reads which key)."""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.config import stages as stage_table
from posttrain.config.fields import Section, bounded, default, free, nested, own_fields, parsed, section
from posttrain.config.model import ModelConfig
from posttrain.config.rl import RLConfig
from posttrain.config.sampling import RejectionConfig, SamplingConfig
from posttrain.config.train import (
    AlertsConfig,
    CheckpointConfig,
    DataConfig,
    DPOConfig,
    EvalConfig,
    LoraConfig,
    OptimConfig,
    PipelineConfig,
    RewardModelConfig,
    SFTConfig,
    TrainConfig,
)
from posttrain.errors import UserError

# The default logical-axis → mesh-axes rules (`sharding.rules`; parallel/sharding.py applies them).
DEFAULT_RULES: dict[str, tuple[str, ...]] = {
    "batch": ("data", "fsdp", "expert"),
    "length": ("sequence",),
    "embed": ("fsdp",),
    "heads": ("tensor",),
    "kv_heads": ("tensor",),
    "mlp": ("tensor",),
    "vocab": ("tensor",),
    "experts": ("expert",),
    "expert_mlp": ("tensor",),
    "head_dim": (),
    "layers": (),
    # Activations have names of their own (as in MaxText), so that the weights' layout (e.g.
    # ZeRO-3: embed over fsdp) and the activations' (e.g. embed whole, or over tensor) change
    # independently. `batch` / `length` remain the layout of input batches.
    "activation_batch": ("data", "fsdp", "expert"),
    "activation_length": ("sequence",),
    "activation_embed": (),
    "activation_heads": ("tensor",),
    "activation_kv_heads": ("tensor",),
    "activation_mlp": ("tensor",),
    "activation_vocab": ("tensor",),
    # The vocab dim of the embedding table as the token lookup reads it: () gathers the table and
    # looks tokens up locally (training); the `vocab` axes look each token up in its shard and sum
    # (the decode layout, `decode_rules`: no table gather per token).
    "vocab_lookup": (),
}
MESH_AXES = ("data", "fsdp", "expert", "tensor", "sequence")


@section
class DistributedConfig(Section):
    """`distributed`: several processes (parallel/distributed.py)."""

    KEY = "distributed"
    # "host:port" of process 0; "" = $JAX_COORDINATOR_ADDRESS, a TPU pod / SLURM, or one process
    coordinator: str = free("", "an address, dialled when the run starts (parallel.distributed)")
    num_processes: int = bounded(0, ge=0)  # with coordinator: how many processes in all
    process_id: int = bounded(-1, ge=-1)  # with coordinator: this process (0 .. num_processes-1)
    # a process silent this long is declared dead: the others stop, naming it
    heartbeat_timeout_s: int = bounded(30, ge=1)
    initialization_timeout_s: int = bounded(300, ge=1)  # how long processes wait for each other at start


def _axis_size(size: int) -> None:
    if size < 1 and size != -1:
        raise ValueError("expected a device count >= 1, or -1 for the devices the other axes leave")


@section
class MeshConfig(Section):
    """`mesh`: devices per mesh axis (-1: the rest)."""

    KEY = "mesh"
    data: int = parsed(-1, _axis_size)
    fsdp: int = parsed(1, _axis_size)
    expert: int = parsed(1, _axis_size)
    tensor: int = parsed(1, _axis_size)
    sequence: int = parsed(1, _axis_size)

    def check_rules(self) -> None:
        """At most one axis is "the rest"."""
        rest = [a for a in MESH_AXES if getattr(self, a) == -1]
        if len(rest) > 1:
            raise UserError(f"config.mesh: at most one axis may be -1, got {rest}", key=f"mesh.{rest[1]}")


def _rules(rules: Mapping[str, str]) -> None:
    for name, axes in rules.items():
        unknown = [a for a in axes.split(",") if a.strip() and a.strip() not in MESH_AXES]
        if unknown:
            raise ValueError(f"logical axis {name!r} maps to {unknown}, not mesh axes ({', '.join(MESH_AXES)})")


@section
class ShardingConfig(Section):
    """`sharding`: logical axis name → comma-separated mesh axes."""

    KEY = "sharding"
    rules: Mapping[str, str] = parsed({k: ",".join(v) for k, v in DEFAULT_RULES.items()}, _rules)


def _stage_name(name: str) -> None:
    if name not in stage_table.BY_NAME:
        raise ValueError(f"valid stages: {', '.join(sorted(stage_table.BY_NAME))}")


# The sampling.* keys each kind of run reads: every stage that samples bounds its calls with
# `max_context`; rejection sampling samples with the continuous-batching keys; the rest configure
# the rlvr stage's sampler.
EVERY_SAMPLING_STAGE = ("max_context",)
REJECTION_SAMPLING_KEYS = ("continuous_batching", "num_slots", "refill_batch")
# (sampling key that stops the sampler recording the experts it chose, when it does)
UNRECORDED = (
    ("sampling.continuous_batching", lambda c: c.sampling.continuous_batching),
    ("sampling.speculative_k", lambda c: c.sampling.speculative_k > 0),
    ("sampling.prefix_cache", lambda c: c.sampling.prefix_cache > 0),
    ("rl.env", lambda c: c.rl.env != "single"),
)


@section
class RunConfig(Section):
    """The run config: the top-level keys and every section. Build it from a config file and the
    command line (`posttrain.config.command_line`), or in Python: `RunConfig(stage="sft")`,
    `RunConfig().replace({"rl.steps": 10, "model.num_layers": 4})`."""

    stage: str = parsed("lm", _stage_name)  # which job main runs
    seed: int = bounded(0, ge=0)
    workdir: str = free("runs/default", "a folder (local or gs://), created and locked when the run starts")
    # another run's checkpoint (workdir or checkpoint dir), or "hf:/hf/folder"
    init_from: str = free("", "a run, checkpoint or 'hf:' folder, opened when the run starts (core.init)")
    distributed: DistributedConfig = nested(DistributedConfig)
    mesh: MeshConfig = nested(MeshConfig)
    sharding: ShardingConfig = nested(ShardingConfig)
    model: ModelConfig = nested(ModelConfig)
    train: TrainConfig = nested(TrainConfig)
    # "auto" ($POSTTRAIN_COMPILATION_CACHE or ~/.cache/posttrain/jax) | "off" | folder
    compilation_cache: str = free("auto", "'auto', 'off' or a folder (core.compile_cache)")
    checkpoint: CheckpointConfig = nested(CheckpointConfig)
    eval: EvalConfig = nested(EvalConfig)
    optim: OptimConfig = nested(OptimConfig)
    data: DataConfig = nested(DataConfig)
    sft: SFTConfig = nested(SFTConfig)
    reward_model: RewardModelConfig = nested(RewardModelConfig)
    dpo: DPOConfig = nested(DPOConfig)
    pipeline: PipelineConfig = nested(PipelineConfig)
    rl: RLConfig = nested(RLConfig)
    rejection: RejectionConfig = nested(RejectionConfig)
    alerts: AlertsConfig = nested(AlertsConfig)
    sampling: SamplingConfig = nested(SamplingConfig)
    lora: LoraConfig = nested(LoraConfig)

    @property
    def stages(self) -> tuple[str, ...]:
        """The stages the run reaches: `pipeline.stages` for a pipeline, else the stage itself."""
        return tuple(self.pipeline.stages) if self.stage == "pipeline" else (self.stage,)

    def section(self, name: str) -> Section:
        """The section of stage `name` (`sft`, `rlvr` → `rl`, ...)."""
        return getattr(self, stage_table.section(name))

    def for_stage(self, name: str) -> RunConfig:
        """The config stage `name` runs with: its `<section>.steps` / `.lr`, when non-zero, in
        train.steps / optim.lr."""
        own = self.section(name)
        changes = {"train.steps": own.steps} if own.steps else {}
        return self.replace({**changes, **({"optim.lr": own.lr} if own.lr else {})}) if changes or own.lr else self

    def check_rules(self) -> None:
        """The rules that span sections whatever the run: the pipeline's stages, the draft."""
        self._check_pipeline()
        s = self.sampling
        if s.draft_layers > self.model.num_layers:
            raise UserError(
                f"sampling.speculative_k={s.speculative_k}, sampling.draft_layers={s.draft_layers}: "
                f"expected speculative_k >= 0 and draft_layers in 1..model.num_layers ({self.model.num_layers})",
                key="sampling.draft_layers",
            )
        if s.prefix_cache and self.distributed.num_processes > 1:
            raise UserError(
                f"sampling.prefix_cache={s.prefix_cache}: runs in a single process for now "
                f"(distributed.num_processes={self.distributed.num_processes})",
                key="sampling.prefix_cache",
            )

    def check_stages(self) -> RunConfig:
        """The rules of the stages this run reaches (checked when a run starts, not on the configs
        a pipeline derives for its stages): the rlvr and rejection_sampling stages' sections, and
        which stages read the sampling keys and routing replay. Returns self."""
        if "rlvr" in self.stages:
            self._check_rlvr()
        if "rejection_sampling" in self.stages:
            self._check_rejection()
        self._check_sampling()
        self._check_eval_first()
        self._check_synthetic_rejected()
        return self

    def _check_synthetic_rejected(self) -> None:
        pairs = [s for s in self.stages if stage_table.BY_NAME[s].records == "preference"]
        if self.data.synthetic_rejected != "answer" and not pairs:
            raise UserError(
                f"config.data.synthetic_rejected={self.data.synthetic_rejected!r} cannot take effect: no stage of "
                f"this run ({', '.join(self.stages)}) trains on preference pairs (reward_model, dpo)",
                key="data.synthetic_rejected",
            )

    def _check_eval_first(self) -> None:
        evaluated = [s for s in self.stages if stage_table.BY_NAME[s].records and self.section(s).eval_files]
        if self.train.eval_first and not evaluated:
            raise UserError(
                f"train.eval_first=True: no stage of this run ({', '.join(self.stages)}) evaluates in the "
                "training loop; give an sft, reward_model or dpo stage its <section>.eval_files (rlvr "
                "evaluates at step 0 already with rl.eval_every > 0)",
                key="train.eval_first",
            )

    def _check_pipeline(self) -> None:
        if self.stage != "pipeline":
            return
        unknown = [s for s in self.pipeline.stages if s not in stage_table.PIPELINE_STAGES]
        if unknown:
            raise UserError(
                f"pipeline.stages: unknown {unknown}; valid: {sorted(stage_table.PIPELINE_STAGES)}",
                key="pipeline.stages",
            )

    def _check_rlvr(self) -> None:
        for part in (self.rl.curriculum, self.rl):
            part.check_inert()
            part.check_rules()
        r = self.rl
        if r.advantage == "gae" and self.lora.rank > 0:
            raise UserError(
                f"rl.advantage='gae' with lora.rank={self.lora.rank}: the shared critic's value head "
                "is not a LoRA target and would never train; use full fine-tuning (lora.rank=0)",
                key="lora.rank",
            )
        if "," in self.train.seq_len_schedule:
            raise UserError(
                f"train.seq_len_schedule={self.train.seq_len_schedule!r}: the RL stage samples at one "
                "length (rl.max_new_tokens); staged context applies to sft and lm only",
                key="train.seq_len_schedule",
            )
        if self.eval.long_context.lengths:
            raise UserError(
                f"eval.long_context.lengths={self.eval.long_context.lengths!r}: the RL stage does not run "
                "the long-context evals; evaluate its checkpoint with tools/long_context_eval.py",
                key="eval.long_context.lengths",
            )
        if r.top_k >= self.model.vocab_size:
            raise UserError(
                f"rl.top_k={r.top_k} >= model.vocab_size={self.model.vocab_size}: it would keep every token "
                "(top_k=0 switches the filter off)",
                key="rl.top_k",
            )

    def _check_rejection(self) -> None:
        r = self.rejection
        r.check_inert()
        r.check_rules()
        if r.max_tokens >= self.rl.max_new_tokens:
            raise UserError(
                f"rejection.max_tokens={r.max_tokens} cannot take effect: no passing response is longer "
                f"than rl.max_new_tokens={self.rl.max_new_tokens} − 1 (the sampler's budget); lower it or "
                "use 0 (off)",
                key="rejection.max_tokens",
            )
        if r.mix_original and not self.sft.train_files:
            raise UserError(
                "rejection.mix_original=True mixes in sft.train_files, which is empty: set it, or mix_original=False",
                key="rejection.mix_original",
            )
        if self.rl.env != "single":
            raise UserError(
                f"rl.env={self.rl.env!r}: stage rejection_sampling samples one answer per prompt "
                "(single-turn); multi-turn tool episodes are not supported there: use rl.env='single'",
                key="rl.env",
            )
        if self.lora.rank:
            raise UserError(
                "stage rejection_sampling with lora.rank > 0: sampling adapter checkpoints is not "
                "supported; sample with the merged model (lora.rank=0)",
                key="lora.rank",
            )

    def _check_sampling(self) -> None:
        s, stages = self.sampling, self.stages
        self._check_routing_replay()
        if "rlvr" in stages:
            s.check_inert()
            return
        sampling = [st.name for st in stage_table.STAGES if st.samples]
        if s.max_context and not set(stages) & set(sampling):
            raise UserError(
                f"sampling.max_context={s.max_context}: no stage of this run ({', '.join(stages)}) samples; "
                f"it bounds the sampler calls of {', '.join(sampling)}",
                key="sampling.max_context",
            )
        allowed = (*REJECTION_SAMPLING_KEYS, *EVERY_SAMPLING_STAGE) if "rejection_sampling" in stages else ()
        changed = [f.name for f in own_fields(SamplingConfig) if getattr(s, f.name) != default(f)]
        changed = [k for k in changed if k not in (*allowed, *EVERY_SAMPLING_STAGE)]
        if changed and allowed:
            raise UserError(
                f"sampling.{changed[0]}={getattr(s, changed[0])!r}: of the sampling.* keys, the rejection_sampling "
                f"stage takes only {', '.join(REJECTION_SAMPLING_KEYS)}",
                key=f"sampling.{changed[0]}",
            )
        if changed:
            raise UserError(
                f"sampling.{changed[0]}={getattr(s, changed[0])!r}: the sampling.* keys configure the rlvr "
                f"stage's sampler, and this run ({', '.join(stages)}) has no rlvr stage",
                key=f"sampling.{changed[0]}",
            )
        s.check_inert()

    def _check_routing_replay(self) -> None:
        value = self.model.moe.routing_replay
        if value == "off":
            return
        if "rlvr" not in self.stages:
            raise UserError(
                f"model.moe.routing_replay={value!r} cannot take effect: only the rlvr stage's learner replays "
                f"the sampler's routing, and this run ({', '.join(self.stages)}) has no rlvr stage",
                key="model.moe.routing_replay",
            )
        for key, conflicts in UNRECORDED:
            if conflicts(self):
                section, leaf = key.split(".")
                raise UserError(
                    f"model.moe.routing_replay={value!r} with {key}={getattr(getattr(self, section), leaf)!r}: "
                    "that sampler does not record the experts it chose (only the static sampler of single-turn "
                    f"rollouts does); set {key} back to its default or routing_replay='off'",
                    key="model.moe.routing_replay",
                )
