"""The training sections: `train`, `optim`, `checkpoint`, `data`, `lora`, the per-stage sections
(`sft`, `reward_model`, `dpo`), `eval` and `pipeline`, and the values their enum keys take."""

from __future__ import annotations

from posttrain.config.fields import Section, bounded, choice, section
from posttrain.errors import UserError

OPTIMIZERS = ("adamw", "adafactor")  # core.optim
MOMENT_DTYPES = ("", "float32", "bfloat16")  # core.optim; "": the parameters' dtype
# Keys one optimizer reads and the other does not (core.optim.make_optimizer): a value other than
# the default is refused under the other optimizer rather than ignored.
OPTIMIZER_ONLY = {"adamw": ("b1", "b2", "eps", "moment_dtype"), "adafactor": ("factored_min_dim",)}
ON_ERROR = ("raise", "skip")  # data.sources
SYNTHETIC_DATA = ("", "arithmetic", "long_context")  # stages.data_files
DPO_LOSSES = ("sigmoid", "ipo")  # stages.losses


@section
class TrainConfig(Section):
    """`train`: the training loop."""

    KEY = "train"
    steps: int = bounded(ge=1)
    batch_size: int = bounded(ge=1)
    seq_len: int = bounded(ge=1)
    log_every: int = bounded(ge=1)
    eval_every: int = bounded(ge=0)
    progress: bool
    seq_len_schedule: str
    max_nonfinite_steps: int = bounded(ge=0)


@section
class OptimConfig(Section):
    """`optim`: the optimizer and its learning-rate schedule."""

    KEY = "optim"
    name: str = choice(OPTIMIZERS)
    lr: float = bounded(gt=0)
    min_lr_ratio: float = bounded(ge=0, le=1)
    warmup_steps: int = bounded(ge=0)
    weight_decay: float = bounded(ge=0)
    grad_clip: float = bounded(ge=0)
    b1: float = bounded(ge=0, lt=1)
    b2: float = bounded(ge=0, lt=1)
    eps: float = bounded(gt=0)
    moment_dtype: str = choice(MOMENT_DTYPES)
    factored_min_dim: int = bounded(ge=1)

    def check_rules(self) -> None:
        """A key only the other optimizer reads keeps its default."""
        from posttrain.config.defaults import optim_config

        default = optim_config()
        for owner, keys in OPTIMIZER_ONLY.items():
            for key in keys if self.name != owner else ():
                value = getattr(self, key)
                if value != default[key]:
                    raise UserError(
                        f"config.{self.key}.{key}={value!r} applies to {self.key}.name={owner!r} only; "
                        f"{self.key}.name={self.name!r} does not read it (leave it {default[key]!r})",
                        key=f"{self.key}.{key}",
                    )


@section
class CheckpointConfig(Section):
    """`checkpoint`: how often and how many."""

    KEY = "checkpoint"
    every: int = bounded(ge=0)
    keep: int = bounded(ge=1)
    async_save: bool


@section
class DataConfig(Section):
    """`data`: tokenizer, record handling and generated data."""

    KEY = "data"
    task: str
    tokenizer: str
    on_error: str = choice(ON_ERROR)
    packing: bool
    truncate: bool
    fields: str
    synthetic: str = choice(SYNTHETIC_DATA)
    synthetic_size: int = bounded(ge=1)
    synthetic_max_value: int = bounded(ge=1)
    synthetic_error_rate: float = bounded(ge=0, le=1)
    synthetic_min_length: int = bounded(ge=0)
    synthetic_recall_density: float = bounded(ge=0)


@section
class LoraConfig(Section):
    """`lora`: low-rank adapters (off at rank 0)."""

    KEY = "lora"
    rank: int = bounded(ge=0)
    alpha: float = bounded(gt=0)
    targets: tuple[str, ...]
    dropout: float


@section
class StageConfig(Section):
    """A training stage's section (`sft`, `reward_model`, `dpo`, `rl`): its data, its gate, and its
    `steps` / `lr`, which replace train.steps / optim.lr when non-zero."""

    train_files: str
    eval_files: str
    steps: int = bounded(ge=0)
    lr: float = bounded(ge=0)
    gate: str


@section
class SFTConfig(StageConfig):
    """`sft`: supervised fine-tuning."""

    KEY = "sft"
    sample_tokens: int


@section
class RewardModelConfig(StageConfig):
    """`reward_model`: a reward model trained on preference pairs."""

    KEY = "reward_model"


@section
class DPOConfig(StageConfig):
    """`dpo`: direct preference optimisation."""

    KEY = "dpo"
    beta: float = bounded(gt=0)
    loss_type: str = choice(DPO_LOSSES)
    label_smoothing: float = bounded(ge=0, lt=0.5)


@section
class LongContextConfig(Section):
    """`eval.long_context`: needle / multi-hop retrieval problems."""

    KEY = "eval.long_context"
    lengths: str
    depths: str
    kinds: str
    samples: int
    hops: int
    max_new_tokens: int
    seed: int


@section
class EvalConfig(Section):
    """`eval`: the eval stage (checkpoints, suites, pass@k) and the long-context evals."""

    KEY = "eval"
    long_context: LongContextConfig
    checkpoint: str
    steps: str
    suites: str
    size: int
    samples: int
    pass_k: str
    gate: str


@section
class PipelineConfig(Section):
    """`pipeline`: the stages a pipeline runs, in order."""

    KEY = "pipeline"
    stages: tuple[str, ...]
