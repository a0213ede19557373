"""The run configuration. `base_config()` (defaults.py): every key with its default, the one
ml-collections ConfigDict a run starts from. `RunConfig.from_config(cfg)` (run.py): its typed,
frozen sections, each checking its values when built. The allowed values of each enum key are
defined here once; the modules that implement them import them. Imports no jax.
"""

from posttrain.config.defaults import base_config, model_config, optim_config, with_stage_overrides
from posttrain.config.fields import Section
from posttrain.config.model import (
                                    ATTENTION_KERNELS,
                                    CONTEXT_PARALLEL,
                                    DISPATCHES,
                                    DTYPES,
                                    MOE_ROUTERS,
                                    REMAT_MODES,
                                    ROPE_SCALINGS,
                                    ModelConfig,
                                    MoEConfig,
                                    RopeScalingConfig,
)
from posttrain.config.rl import (
                                    ADVANTAGE_METHODS,
                                    AGGREGATIONS,
                                    ALERT_MODES,
                                    ENVS,
                                    KL_ESTIMATORS,
                                    QUANT_MODES,
                                    RATIO_LEVELS,
                                    SAMPLING_LAYOUTS,
                                    AlertsConfig,
                                    CurriculumConfig,
                                    RejectionConfig,
                                    RLConfig,
                                    SamplingConfig,
)
from posttrain.config.run import DistributedConfig, MeshConfig, RunConfig, ShardingConfig
from posttrain.config.train import (
                                    DPO_LOSSES,
                                    MOMENT_DTYPES,
                                    ON_ERROR,
                                    OPTIMIZER_ONLY,
                                    OPTIMIZERS,
                                    SYNTHETIC_DATA,
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

__all__ = [
    "base_config", "model_config", "optim_config", "with_stage_overrides",
    "Section", "RunConfig", "ModelConfig", "MoEConfig", "RopeScalingConfig", "TrainConfig", "OptimConfig",
    "CheckpointConfig", "DataConfig", "LoraConfig", "StageConfig", "SFTConfig", "RewardModelConfig", "DPOConfig",
    "EvalConfig", "LongContextConfig", "PipelineConfig", "RLConfig", "CurriculumConfig", "SamplingConfig",
    "RejectionConfig", "AlertsConfig", "DistributedConfig", "MeshConfig", "ShardingConfig",
    "ATTENTION_KERNELS", "ROPE_SCALINGS", "CONTEXT_PARALLEL", "REMAT_MODES", "DTYPES", "MOE_ROUTERS", "DISPATCHES",
    "OPTIMIZERS", "MOMENT_DTYPES", "OPTIMIZER_ONLY", "ON_ERROR", "SYNTHETIC_DATA", "DPO_LOSSES",
    "ENVS", "ADVANTAGE_METHODS", "AGGREGATIONS", "KL_ESTIMATORS", "RATIO_LEVELS", "QUANT_MODES", "SAMPLING_LAYOUTS",
    "ALERT_MODES",
]
