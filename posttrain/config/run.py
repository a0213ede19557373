"""`RunConfig`: the whole run config, typed and checked, built once from the ConfigDict; with the
`distributed`, `mesh` and `sharding` sections."""

from __future__ import annotations

from collections.abc import Mapping

from posttrain.config.fields import KINDS, Section, bounded, check_tree, section
from posttrain.config.model import ModelConfig
from posttrain.config.rl import AlertsConfig, RejectionConfig, RLConfig, SamplingConfig
from posttrain.config.train import (
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


@section
class DistributedConfig(Section):
    """`distributed`: several processes (parallel/distributed.py)."""

    KEY = "distributed"
    coordinator: str
    num_processes: int = bounded(ge=0)
    process_id: int = bounded(ge=-1)
    heartbeat_timeout_s: int = bounded(ge=1)
    initialization_timeout_s: int = bounded(ge=1)


@section
class MeshConfig(Section):
    """`mesh`: devices per mesh axis (-1: the rest)."""

    KEY = "mesh"
    data: int
    fsdp: int
    expert: int
    tensor: int
    sequence: int


@section
class ShardingConfig(Section):
    """`sharding`: logical axis name → comma-separated mesh axes."""

    KEY = "sharding"
    rules: Mapping[str, str]


@section
class RunConfig(Section):
    """The run config: the top-level keys and every section."""

    stage: str
    seed: int = bounded(ge=0)
    workdir: str
    init_from: str
    distributed: DistributedConfig
    mesh: MeshConfig
    sharding: ShardingConfig
    model: ModelConfig
    train: TrainConfig
    compilation_cache: str
    checkpoint: CheckpointConfig
    eval: EvalConfig
    optim: OptimConfig
    data: DataConfig
    sft: SFTConfig
    reward_model: RewardModelConfig
    dpo: DPOConfig
    pipeline: PipelineConfig
    rl: RLConfig
    rejection: RejectionConfig
    alerts: AlertsConfig
    sampling: SamplingConfig
    lora: LoraConfig

    @classmethod
    def from_config(cls, cfg, key: str | None = None) -> RunConfig:
        """The typed, checked run config of ConfigDict `cfg`. The first error reported is the first
        enum key out of its values, else the first key out of its range, else the first cross-field
        rule broken (keys in `base_config`'s order)."""
        for kind in KINDS:
            check_tree(cls, cfg, "", kind)
        return super().from_config(cfg, "")
