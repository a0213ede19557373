"""The training sections: `train`, `optim`, `checkpoint`, `data`, `lora`, the per-stage sections
(`sft`, `reward_model`, `dpo`), `eval` and `pipeline`, with their defaults and the values they take."""

from __future__ import annotations

from posttrain.config.fields import Section, bounded, choice, default, flag, free, nested, parsed, section
from posttrain.config.syntax import gate_syntax, parse_ints, parse_renames, parse_steps

OPTIMIZERS = ("adamw", "adafactor")  # core.optim
MOMENT_DTYPES = ("", "float32", "bfloat16")  # core.optim; "": the parameters' dtype
# Keys one optimizer reads and the other does not (core.optim.make_optimizer): a value other than
# the default is refused under the other optimizer rather than ignored.
OPTIMIZER_ONLY = {"adamw": ("b1", "b2", "eps", "moment_dtype"), "adafactor": ("factored_min_dim",)}
ON_ERROR = ("raise", "skip")  # data.sources
SYNTHETIC_DATA = ("", "arithmetic", "long_context")  # stages.data_files
DPO_LOSSES = ("sigmoid", "ipo")  # stages.losses
ALERT_MODES = ("off", "warn", "stop")  # core.alerts.MODES
LORA_TARGETS = (
    *("q", "k", "v", "o", "gate", "up", "down", "w_gate", "w_up", "w_down"),  # the decoder's projections
    *("proj", "patch", "wq", "wk", "wv", "wo", "fc1", "fc2", "proj1", "proj2"),  # the image encoders' (models.lora)
)
FILES_WHY = "JSONL files or globs (local or gs://), 'synthetic:' to generate; checked at start-up (stages.data_files)"


def gate_field(default: str = "") -> str:
    """A stage's gate: conditions on its metrics (`config.syntax.parse_gate`), all of which must hold."""
    return parsed(default, gate_syntax)


@section
class TrainConfig(Section):
    """`train`: the training loop."""

    KEY = "train"
    steps: int = bounded(300, ge=1)
    batch_size: int = bounded(16, ge=1)
    seq_len: int = bounded(64, ge=1)
    log_every: int = bounded(10, ge=1)
    eval_every: int = bounded(0, ge=0)
    eval_first: bool = flag(False)  # also evaluate before the first update (step 0): the "before" of a recipe
    progress: bool = flag(True)
    # staged context: "256:20,1024" = 256 tokens for 20 steps, then train.seq_len
    seq_len_schedule: str = free(
        "", "read with train.seq_len and the stage's steps when it starts (data.schedule.parse_seq_len_schedule)"
    )
    # Non-finite loss or gradient norm: the update is skipped (counted as nonfinite_skipped); the run
    # stops when more than this many updates in a row were skipped (0: at the first).
    max_nonfinite_steps: int = bounded(10, ge=0)


@section
class OptimConfig(Section):
    """`optim`: the optimizer and its learning-rate schedule."""

    KEY = "optim"
    name: str = choice("adamw", OPTIMIZERS)  # adafactor: factored second moments, no first: ~(rows+cols) a matrix
    lr: float = bounded(3e-3, gt=0)
    min_lr_ratio: float = bounded(0.1, ge=0, le=1)
    warmup_steps: int = bounded(20, ge=0)
    weight_decay: float = bounded(0.01, ge=0)
    grad_clip: float = bounded(1.0, ge=0)
    b1: float = bounded(0.9, ge=0, lt=1)
    b2: float = bounded(0.95, ge=0, lt=1)
    eps: float = bounded(1e-8, gt=0)  # adamw only
    moment_dtype: str = choice("", MOMENT_DTYPES)  # adamw only: first-moment dtype, "" = the params' dtype
    # adafactor only: factor a matrix's second moment when its 2 largest dims are >= this
    factored_min_dim: int = bounded(128, ge=1)

    def check_rules(self) -> None:
        """A key only the other optimizer reads keeps its default."""
        fields = {f.name: f for f in self.__dataclass_fields__.values()}
        for owner, keys in OPTIMIZER_ONLY.items():
            for key in keys if self.name != owner else ():
                value, value_default = getattr(self, key), default(fields[key])
                if value != value_default:
                    self.refuse(
                        key,
                        f" applies to {self.KEY}.name={owner!r} only; "
                        f"{self.KEY}.name={self.name!r} does not read it (leave it {value_default!r})",
                    )


@section
class CheckpointConfig(Section):
    """`checkpoint`: how often and how many."""

    KEY = "checkpoint"
    every: int = bounded(100, ge=0)
    keep: int = bounded(3, ge=1)
    async_save: bool = flag(True)


@section
class DataConfig(Section):
    """`data`: tokenizer, record handling and generated data."""

    KEY = "data"
    task: str = choice("arithmetic", ("arithmetic",))  # stage lm: the built-in task
    # "byte" or a folder with tokenizer.json (local, gs://)
    tokenizer: str = free("byte", "'byte' or a folder, opened when the run starts (data.tokenizer.load_tokenizer)")
    on_error: str = choice("raise", ON_ERROR)  # raise | skip (bad records counted as data/skipped)
    packing: bool = flag(True)  # SFT: pack conversations into rows with segment ids
    truncate: bool = flag(False)  # SFT: cut over-long examples (counted) instead of erroring
    fields: str = parsed("", parse_renames)  # record field renames, e.g. "prompt=question,response=answer"
    synthetic: str = choice("", SYNTHETIC_DATA)  # generate the stage's train/eval files if missing
    synthetic_size: int = bounded(2000, ge=1)  # records per generated train file (eval files get a quarter)
    synthetic_max_value: int = bounded(99, ge=1)  # operands 0..max (RL arithmetic tasks use the same range)
    synthetic_error_rate: float = bounded(0.0, ge=0, le=1)  # SFT: fraction of worked answers that are off by one
    # arithmetic preference pairs: the rejected response keeps the working and states another answer
    # ("answer": a consistency preference) or works the sum out wrong ("working": an arithmetic one)
    synthetic_rejected: str = choice(
        "answer",
        ("answer", "working"),
        inert_unless=(lambda d: d.synthetic == "arithmetic", "data.synthetic is not 'arithmetic'"),
    )
    # long_context: shortest generated prompt (0: 64 for recall alone, else 160)
    synthetic_min_length: int = bounded(0, ge=0)
    # long_context: up to this many recall facts per 64 tokens (0: 1 + len/64)
    synthetic_recall_density: float = bounded(0.0, ge=0)


def _no_dropout(value: float) -> None:
    if value:
        raise ValueError(
            "not supported (adapters are merged into the weights, so there is no adapter activation to drop); "
            "set it to 0"
        )


@section
class LoraConfig(Section):
    """`lora`: low-rank adapters (off at rank 0)."""

    KEY = "lora"
    rank: int = bounded(0, ge=0)  # 0: full fine-tuning; > 0: train only low-rank adapters
    alpha: float = bounded(16.0, gt=0)  # adapters scaled by alpha / rank
    # decoder: any of q k v o gate up down w_gate w_up w_down; images (models/lora.py): proj
    # (encoder=linear), patch wq wk wv wo fc1 fc2 proj1 proj2 (encoder=vit); q never hits the tower
    targets: tuple[str, ...] = free(("q", "k", "v", "o"), "names checked against the model (models.lora)")
    dropout: float = parsed(0.0, _no_dropout)  # not supported (adapters are merged into the weights)


@section
class StageConfig(Section):
    """A training stage's section (`sft`, `reward_model`, `dpo`, `rl`): its data, its gate, and its
    `steps` / `lr`, which replace train.steps / optim.lr when non-zero."""

    train_files: str = free("", FILES_WHY)
    eval_files: str = free("", FILES_WHY)
    steps: int = bounded(0, ge=0)
    lr: float = bounded(0.0, ge=0)
    gate: str = gate_field()  # e.g. "eval/loss<1.5": must hold before a pipeline moves on


@section
class SFTConfig(StageConfig):
    """`sft`: supervised fine-tuning."""

    KEY = "sft"
    sample_tokens: int = bounded(48, ge=0)  # greedy samples of a few eval prompts at each eval (0: off)


@section
class RewardModelConfig(StageConfig):
    """`reward_model`: a reward model trained on preference pairs."""

    KEY = "reward_model"


@section
class DPOConfig(StageConfig):
    """`dpo`: direct preference optimisation."""

    KEY = "dpo"
    beta: float = bounded(0.1, gt=0)
    loss_type: str = choice("sigmoid", DPO_LOSSES)
    label_smoothing: float = bounded(0.0, ge=0, lt=0.5)


@section
class LongContextConfig(Section):
    """`eval.long_context`: needle / multi-hop retrieval problems (eval/long_context_eval.py)."""

    KEY = "eval.long_context"
    # prompt lengths in tokens, e.g. "256,1024"; "" = off. SFT evaluates it
    lengths: str = parsed("", parse_ints)
    # where the facts sit (0 = start of the context, 1 = end); the grid is checked by eval.long_context_eval
    depths: str = free("0,0.25,0.5,0.75,1", "fractions read with the grid (eval.long_context_eval.parse_grid)")
    kinds: str = free("needle,multihop", "problem kinds read with the grid (eval.long_context_eval.parse_grid)")
    samples: int = bounded(4, ge=1)  # problems per (kind, length, depth) cell
    hops: int = bounded(2, ge=1)  # facts chained in a multi-hop problem
    max_new_tokens: int = bounded(8, ge=1)
    seed: int = bounded(0, ge=0)  # problems come from the eval name space, disjoint from training's


LM_EVAL = "lm_eval:"  # an eval.suites entry naming an lm-eval task (lm_eval:posttrain_gsm8k)
_LM_EVAL = (lambda e: LM_EVAL in e.suites, "only lm-eval suites (eval.suites=lm_eval:<task>) take it")


@section
class EvalConfig(Section):
    """`eval`: the eval stage (checkpoints, suites, pass@k) and the long-context evals."""

    KEY = "eval"
    long_context: LongContextConfig = nested(LongContextConfig)
    # a run dir / checkpoints dir; "" = init_from (in a pipeline: the previous stage)
    checkpoint: str = free("", "a run or checkpoint folder, opened when the stage starts")
    steps: str = parsed("latest", parse_steps)  # latest | all | "100,200": which checkpoints of that run
    # arithmetic, gsm8k, humaneval, name=path.jsonl (rl.eval_files records) and/or lm_eval:<task>
    suites: str = free("arithmetic", "suite names and files, checked at start-up (rl.tasks.suites.parse_suites)")
    size: int = bounded(128, ge=1)  # problems per built-in suite; documents per lm-eval task (its limit)
    lm_eval_batch_size: int = bounded(16, ge=1, inert_unless=_LM_EVAL)  # lm-eval requests per forward or sampler call
    samples: int = bounded(4, ge=1)  # samples per problem (mean sampled accuracy, pass@k)
    pass_k: str = parsed("1,4", parse_ints)  # pass@k reported for each k (each <= samples)
    gate: str = gate_field()


@section
class PipelineConfig(Section):
    """`pipeline`: the stages a pipeline runs, in order."""

    KEY = "pipeline"
    stages: tuple[str, ...] = free(("sft", "dpo"), "stage names, checked against the stage table by RunConfig")


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
