"""Pipeline [sft, dpo] on generated arithmetic data: DPO starts from (and references) the SFT result.

Each stage runs in runs/pipeline_tiny/{0_sft,1_dpo} and must pass its gate before the next starts.
"""

from configs.dpo_tiny import get_config as dpo_config


def get_config():
    cfg = dpo_config()
    cfg.stage = "pipeline"
    cfg.workdir = "runs/pipeline_tiny"
    cfg.pipeline.stages = ("sft", "dpo")
    return cfg
