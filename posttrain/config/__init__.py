"""The run configuration: `RunConfig` (run.py), one frozen tree of typed sections whose fields carry
their defaults, checks and rules (`fields.py`); the stage table (`stages.py`); the registries that
extension points fill (`registry.py`); the small languages some values are written in (`syntax.py`).

A run is built from ml-collections on the command line (`command_line.py`: `base_config()` is the
ConfigDict of the defaults that config files start from, `run_config(cfg)` its RunConfig) or in
Python (`RunConfig(stage="sft").replace({"sft.steps": 100})`). Imports no jax.
"""

from posttrain.config.fields import Section
from posttrain.config.model import (
    ATTENTION_KERNELS,
    CONTEXT_PARALLEL,
    DISPATCHES,
    DTYPES,
    MOE_ROUTERS,
    REMAT_MODES,
    ROPE_SCALINGS,
    ROUTING_REPLAY,
    VISION_ENCODERS,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
    VisionConfig,
)
from posttrain.config.rl import (
    AGGREGATIONS,
    CRITICS,
    IS_LEVELS,
    IS_MASKS,
    PLACEMENTS,
    RATIO_LEVELS,
    ROLES,
    CurriculumConfig,
    RLConfig,
)
from posttrain.config.run import DEFAULT_RULES, DistributedConfig, MeshConfig, RunConfig, ShardingConfig
from posttrain.config.sampling import QUANT_MODES, SAMPLING_LAYOUTS, RejectionConfig, SamplingConfig
from posttrain.config.train import (
    ALERT_MODES,
    DPO_LOSSES,
    MOMENT_DTYPES,
    ON_ERROR,
    OPTIMIZER_ONLY,
    OPTIMIZERS,
    SYNTHETIC_DATA,
    AlertsConfig,
    CheckpointConfig,
    DataConfig,
    DPOConfig,
    EvalConfig,
    LongContextConfig,
    LoraConfig,
    OptimConfig,
    PipelineConfig,
    RewardModelConfig,
    SFTConfig,
    StageConfig,
    TrainConfig,
)

_COMMAND_LINE = ("base_config", "model_config", "optim_config", "run_config")


def __getattr__(name: str):
    """`base_config` & co. from `command_line` on first use, so that importing the typed config does
    not import ml-collections."""
    if name in _COMMAND_LINE:
        from posttrain.config import command_line

        return getattr(command_line, name)
    raise AttributeError(f"module 'posttrain.config' has no attribute {name!r}")


__all__ = [
    *_COMMAND_LINE,
    "Section",
    "RunConfig",
    "ModelConfig",
    "MoEConfig",
    "RopeScalingConfig",
    "VisionConfig",
    "TrainConfig",
    "OptimConfig",
    "CheckpointConfig",
    "DataConfig",
    "LoraConfig",
    "StageConfig",
    "SFTConfig",
    "RewardModelConfig",
    "DPOConfig",
    "EvalConfig",
    "LongContextConfig",
    "PipelineConfig",
    "RLConfig",
    "CurriculumConfig",
    "SamplingConfig",
    "RejectionConfig",
    "AlertsConfig",
    "DistributedConfig",
    "MeshConfig",
    "ShardingConfig",
    "DEFAULT_RULES",
    "ATTENTION_KERNELS",
    "ROPE_SCALINGS",
    "CONTEXT_PARALLEL",
    "REMAT_MODES",
    "DTYPES",
    "MOE_ROUTERS",
    "DISPATCHES",
    "ROUTING_REPLAY",
    "VISION_ENCODERS",
    "OPTIMIZERS",
    "MOMENT_DTYPES",
    "OPTIMIZER_ONLY",
    "ON_ERROR",
    "SYNTHETIC_DATA",
    "DPO_LOSSES",
    "AGGREGATIONS",
    "RATIO_LEVELS",
    "IS_LEVELS",
    "IS_MASKS",
    "CRITICS",
    "PLACEMENTS",
    "ROLES",
    "QUANT_MODES",
    "SAMPLING_LAYOUTS",
    "ALERT_MODES",
]
