"""posttrain against TRL's GRPOTrainer on the same GRPO job, one after the other on this machine.

    python tools/gguf_to_hf.py .../SmolLM2-135M-Instruct.Q4_1.gguf models/smollm2
    python tools/bench_trl.py models/smollm2 [--rounds 3 --updates 4 --prompts 4 --group 8 \
        --max_new_tokens 32 --temperature 1.0 --lr 2e-6 --eval_size 128] [--out bench_trl.json]

The job is `configs/smollm2_grpo.py`'s: arithmetic problems with operands 0..30 from posttrain's
training split, the chat template of the model folder, GRPO advantages (group mean and standard
deviation), the clipped surrogate with clip 0.2 / 0.28 and token-mean aggregation (TRL's "dapo"),
no KL, AdamW (b2 0.95, weight decay 0.01, gradient clip 1.0), a cosine schedule to 0.1 × lr without
warmup, float32. The reward is the math verifier's verdict, 0 for a response cut off at
--max_new_tokens (posttrain's `rl.truncated_reward=min`). Each round runs both, in alternating
order, each in a fresh process: the per-update wall time (the first update, which compiles or
warms up, left out), the peak resident memory of the process and the greedy accuracy of the final
weights on the held-out split (the same `--eval_size` problems for every model, judged by the same
evaluator). Prints and writes one JSON object: per round and per system, and the median
TRL / posttrain ratio of per-update time with its range over rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_VALUE = 30  # configs/smollm2_grpo.py: data.synthetic_max_value


def train_tasks(seed: int, n: int = 2000):
    """The arithmetic training tasks posttrain's rlvr stage draws from (`rl.arithmetic_size`, seed + 1)."""
    from posttrain.rl.tasks.domains import MATH_INSTRUCTION, arithmetic_tasks

    return arithmetic_tasks(n, seed + 1, split="train", instruction=MATH_INSTRUCTION, max_value=MAX_VALUE)


def run_child(argv: list[str], log: str) -> tuple[float, float]:
    """Run `argv` (output to `log`); (wall seconds, peak resident GiB of that process)."""
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        raise RuntimeError(f"{' '.join(argv[:4])} ... failed ({os.waitstatus_to_exitcode(status)}); see {log}")
    return time.perf_counter() - start, usage.ru_maxrss / 2**20


def posttrain_round(args, workdir: str) -> dict:
    """One posttrain run of the job, exported as an HF folder (workdir/hf)."""
    argv = posttrain_command(args, workdir)
    seconds, peak = run_child(argv, f"{workdir}.log")
    rows = [json.loads(line) for line in open(f"{workdir}/metrics.jsonl")]
    update_s = [row["rl/wait_s"] + row["rl/update_s"] for row in rows if "rl/update_s" in row]
    export = [sys.executable, "tools/convert_hf.py", "--run", workdir, "--to_hf", f"{workdir}/hf"]
    run_child(export, f"{workdir}.hf.log")
    return dict(update_s=update_s, process_s=seconds, peak_gib=peak, folder=f"{workdir}/hf")


def trl_round(args, workdir: str) -> dict:
    """One TRL run of the job in a fresh process (`--trl_worker`), saved as an HF folder (workdir/hf)."""
    argv = [sys.executable, os.path.abspath(__file__), args.model, "--trl_worker", workdir]
    argv += [f"--{k}={getattr(args, k)}" for k in ("seed", "updates", "prompts", "group", "max_new_tokens")]
    argv += [f"--temperature={args.temperature}", f"--lr={args.lr}"]
    seconds, peak = run_child(argv, f"{workdir}.log")
    with open(f"{workdir}/steps.json") as f:
        update_s = json.load(f)
    return dict(update_s=update_s, process_s=seconds, peak_gib=peak, folder=f"{workdir}/hf")


def trl_reward(max_new_tokens: int, eos_id: int):
    """TRL's reward function for the job: posttrain's math verdict, 0 for a response cut off at
    `max_new_tokens` without `eos_id` (`rl.truncated_reward=min`, the judged minimum)."""
    from posttrain.rl.verifiers.math import MathTask, MathVerifier

    verifier = MathVerifier()

    def reward(completions, answer, completion_ids, **_):
        out = []
        for completion, target, ids in zip(completions, answer, completion_ids):
            cut = len(ids) >= max_new_tokens and ids[-1] != eos_id
            text = completion[0]["content"] if isinstance(completion, list) else completion
            out.append(0.0 if cut else float(verifier.verify(MathTask(target), text).correct))
        return out

    return reward


def posttrain_command(args, workdir: str) -> list[str]:
    """`python -m posttrain.main` on configs/smollm2_grpo.py with the job's settings."""
    r = "--config.rl."
    return [
        sys.executable, "-m", "posttrain.main", f"--config=configs/smollm2_grpo.py:{args.model}",
        f"--config.workdir={workdir}", f"--config.seed={args.seed}", f"{r}steps={args.updates}",
        f"{r}prompts_per_step={args.prompts}", f"{r}group_size={args.group}",
        f"{r}max_new_tokens={args.max_new_tokens}", f"{r}temperature={args.temperature}", f"{r}lr={args.lr}",
        "--config.optim.warmup_steps=0", f"{r}eval_every=0", f"{r}eval_size=128", f"{r}eval_samples=4",
        f"{r}gate=", f"--config.checkpoint.every={args.updates}", f"--config.model.remat={args.remat}",
    ]  # fmt: skip


def trl_worker(args) -> None:
    """TRL's GRPOTrainer on the job; writes the per-update seconds and the final model."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.manual_seed(args.seed)
    tasks = train_tasks(args.seed)
    data = Dataset.from_list([{"prompt": list(t.prompt), "answer": t.target.answer} for t in tasks])
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    reward = trl_reward(args.max_new_tokens, tokenizer.eos_token_id)

    config = GRPOConfig(
        output_dir=args.trl_worker, per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group, gradient_accumulation_steps=1, max_completion_length=args.max_new_tokens,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr, warmup_steps=0,
        lr_scheduler_type="cosine_with_min_lr", lr_scheduler_kwargs={"min_lr_rate": 0.1},
        adam_beta1=0.9, adam_beta2=0.95, adam_epsilon=1e-8, weight_decay=0.01, max_grad_norm=1.0,
        beta=0.0, epsilon=0.2, epsilon_high=0.28, loss_type="dapo", scale_rewards="group",
        num_iterations=1, max_steps=args.updates, logging_steps=1, save_strategy="no", report_to=[],
        use_cpu=True, bf16=False, seed=args.seed, disable_dropout=True,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    times: list[float] = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, *_, **__):
            self.start = time.perf_counter()

        def on_step_end(self, *_, **__):
            times.append(time.perf_counter() - self.start)

    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=data, processing_class=tokenizer,
        callbacks=[StepTimes()],
    )  # fmt: skip
    trainer.train()
    trainer.model.save_pretrained(f"{args.trl_worker}/hf")
    tokenizer.save_pretrained(f"{args.trl_worker}/hf")
    with open(f"{args.trl_worker}/steps.json", "w") as f:
        json.dump(times, f)


def held_out_accuracy(folders: dict[str, str], args) -> dict[str, float]:
    """Greedy accuracy of each model folder on the same held-out problems (tools/greedy_math_eval)."""
    sys.path.insert(0, os.path.join(ROOT, "tools"))
    import greedy_math_eval

    from posttrain.rl.tasks.domains import MATH_INSTRUCTION, arithmetic_tasks

    tasks = arithmetic_tasks(args.eval_size, args.seed + 10_000, instruction="", max_value=MAX_VALUE)
    problems = [(t.prompt[0]["content"], t.target.answer) for t in tasks]
    out = {}
    for name, folder in folders.items():
        summary, _ = greedy_math_eval.evaluate(
            greedy_math_eval.load(folder), problems, args.max_new_tokens, MATH_INSTRUCTION
        )
        out[name] = summary["accuracy"]
    return out


def summarise(rounds: list[dict]) -> dict:
    """Median (and range over rounds) of TRL / posttrain per-update time; peak memory; accuracy."""
    per_update = lambda run: statistics.median(run["update_s"][1:])  # noqa: E731
    ratios = [per_update(r["trl"]) / per_update(r["posttrain"]) for r in rounds]
    out = {"trl_over_posttrain_update_s": dict(median=statistics.median(ratios), low=min(ratios), high=max(ratios))}
    for system in ("posttrain", "trl"):
        out[system] = dict(
            update_s_median=statistics.median(s for r in rounds for s in r[system]["update_s"][1:]),
            peak_gib_max=max(r[system]["peak_gib"] for r in rounds),
            held_out_accuracy=[r["accuracy"][system] for r in rounds],
        )
    return out


ROUNDS = {"posttrain": posttrain_round, "trl": trl_round}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="HF model folder (tools/gguf_to_hf.py)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--updates", type=int, default=4, help="GRPO updates per run (the first is not timed)")
    p.add_argument("--prompts", type=int, default=4, help="prompts (groups) per update")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max_new_tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=2e-6)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval_size", type=int, default=128, help="held-out problems for the accuracy")
    p.add_argument("--remat", default="full", choices=["none", "full", "dots"], help="posttrain's model.remat")
    p.add_argument("--out", default="", help="write the JSON here too")
    p.add_argument("--trl_worker", default="", help=argparse.SUPPRESS)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    if args.updates < 2:
        p.error("--updates must be >= 2: the first update of each run is not timed")
    if args.trl_worker:
        trl_worker(args)
        return 0
    scratch, rounds = tempfile.mkdtemp(prefix="bench_trl_"), []
    for i in range(args.rounds):
        order = ("posttrain", "trl") if i % 2 == 0 else ("trl", "posttrain")
        runs = {name: ROUNDS[name](args, f"{scratch}/{name}{i}") for name in order}
        accuracy = held_out_accuracy({name: run["folder"] for name, run in runs.items()}, args)
        rounds.append({**runs, "order": order, "accuracy": accuracy})
        print(json.dumps({"round": i, **rounds[-1]}), flush=True)
    result = dict(
        settings={k: v for k, v in vars(args).items() if k != "trl_worker"},
        start_accuracy=held_out_accuracy({"start": args.model}, args)["start"],
        rounds=rounds,
        summary=summarise(rounds),
    )
    print(json.dumps(result, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
