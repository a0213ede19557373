"""Greedy accuracy of an HF model folder on arithmetic word problems and GSM8K test questions, through
posttrain's sampler and math verifier, with the folder's chat template; and its decode speed.

    python tools/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf /tmp/smollm2
    python tools/greedy_math_eval.py /tmp/smollm2 [--word_problems 20 --gsm8k 20 --max_new_tokens 256] \
        [--data ../shared/data] [--samples samples.jsonl] [--untimed]

Word problems: addition and subtraction of two numbers up to `--max_value`, drawn from the held-out
("test") split of `data.synthetic` and told in one of a few everyday sentences. GSM8K: the first
questions of the official test file. Each question is followed by the instruction RL tasks use
("Give the final answer as \\boxed{ANSWER}.", or nothing: `--instruction none`); the verifier takes
the boxed answer, else "the answer is", else the last number. Prints one
JSON object: accuracy and boxed-format rate per set, and the decode time per token (batch 1, 64
tokens, after compile) and per step of the evaluation batch.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import numpy as np
from flax import nnx

from posttrain.core.state import abstract_model
from posttrain.data.synthetic import arithmetic_problem, arithmetic_problems, arithmetic_split
from posttrain.data.tokenizer import HFTokenizer
from posttrain.models.decoder import Decoder
from posttrain.models.hf import load_model_state, model_config_from_hf
from posttrain.parallel import DEFAULT_RULES, make_mesh, use_sharding
from posttrain.rl.tasks.domains import MATH_INSTRUCTION, gsm8k_tasks, shared_data_dir
from posttrain.rl.verifiers.math import MathTask, MathVerifier
from posttrain.sampling import SamplingParams, generate

# {a} and {b}: the operands; one template per operation, cycled
ADDITION = [
    "Tom has {a} apples. He buys {b} more apples. How many apples does Tom have now?",
    "A library has {a} books on a shelf and puts {b} more books on it. How many books are on the shelf?",
    "Sara walked {a} metres in the morning and {b} metres in the afternoon. How many metres did she walk?",
    "A farmer has {a} sheep and buys {b} more. How many sheep does the farmer have?",
]
SUBTRACTION = [
    "Tom has {a} apples. He gives {b} apples to his friend. How many apples does Tom have left?",
    "A bus has {a} passengers. At the next stop {b} passengers get off. How many passengers are on the bus?",
    "A baker made {a} cookies and sold {b} of them. How many cookies are left?",
    "There are {a} birds in a tree. {b} birds fly away. How many birds are still in the tree?",
]


def word_problems(n: int, max_value: int = 99, seed: int = 0) -> list[tuple[str, str]]:
    """(question, answer) for `n` distinct held-out arithmetic problems (operands up to `max_value`)
    told in words."""
    available = sum(arithmetic_split(q) == "test" for q in arithmetic_problems(max_value))
    if n > available:
        raise ValueError(f"--word_problems={n}: the held-out split has {available} problems up to {max_value}")
    rng, out, seen = np.random.default_rng(seed), [], set()
    while len(out) < n:
        expr, answer = arithmetic_problem(rng, max_value, split="test")
        if expr in seen:
            continue
        seen.add(expr)
        a, b = (int(x) for x in expr.rstrip("=").replace("-", "+").split("+"))
        templates = ADDITION if "+" in expr else SUBTRACTION
        out.append((templates[len(out) % len(templates)].format(a=a, b=b), answer))
    return out


def gsm8k_problems(n: int, data_dir: str) -> list[tuple[str, str]]:
    """(question, answer) for the first `n` GSM8K test questions."""
    tasks = gsm8k_tasks(data_dir, split="test", limit=n, instruction="")
    return [(t.prompt[0]["content"], t.target.answer) for t in tasks]


def load(folder: str):
    """(graphdef, params, rest, tokenizer) of HF folder `folder` on one device."""
    cfg = model_config_from_hf(folder)
    make = lambda: Decoder(cfg, rngs=nnx.Rngs(0))
    mesh = make_mesh(dict(data=1), jax.devices()[:1])
    with use_sharding(mesh, DEFAULT_RULES):
        params, rest = load_model_state(folder, make, mesh, DEFAULT_RULES, progress=False)
    return nnx.graphdef(abstract_model(make)), params, rest, HFTokenizer.from_dir(folder)


def greedy(model, rows: list[list[int]], new_tokens: int, stop_ids=()) -> tuple[list[list[int]], float]:
    """(greedy completions, seconds) of `rows` in one batch."""
    graphdef, params, rest, tok = model
    sampling = SamplingParams(temperature=0.0, max_new_tokens=new_tokens, stop_ids=tuple(stop_ids))
    start = time.perf_counter()
    samples = generate(graphdef, params, rest, rows, sampling, jax.random.key(0), pad_id=tok.pad_id)
    return [samples.completion(i) for i in range(len(rows))], time.perf_counter() - start


def evaluate(
    model, problems: list[tuple[str, str]], new_tokens: int, instruction: str, timed: bool = True
) -> tuple[dict, list[dict]]:
    """Accuracy and boxed-format rate of greedy answers to `problems` (each followed by
    `instruction`), and one record per answer. `timed`: run the batch twice, timing the second
    (else once: its seconds include compilation)."""
    tok = model[3]
    rows = [
        tok.encode_chat([{"role": "user", "content": q + instruction}], add_generation_prompt=True)[0]
        for q, _ in problems
    ]
    if timed:
        greedy(model, rows, new_tokens, tok.stop_ids)  # compile
    completions, seconds = greedy(model, rows, new_tokens, tok.stop_ids)
    verifier = MathVerifier()
    records = []
    for (question, answer), ids in zip(problems, completions):
        text = tok.decode(ids)
        verdict = verifier.verify(MathTask(answer), text)
        records.append(
            dict(question=question, answer=answer, response=text, correct=verdict.correct, why=verdict.detail)
        )
        records[-1]["format_ok"] = verdict.format_ok
    steps = max(map(len, completions))
    summary = {
        "n": len(problems),
        "accuracy": float(np.mean([r["correct"] for r in records])),
        "boxed_rate": float(np.mean([r["format_ok"] for r in records])),
        "mean_new_tokens": float(np.mean([len(c) for c in completions])),
        "batch_s": seconds,
        "ms_per_step (batch, incl. prefill)": 1e3 * seconds / steps,
    }
    return summary, records


def decode_latency(model, new_tokens: int = 64) -> float:
    """Milliseconds per generated token for one prompt, after compile (prefill included)."""
    tok = model[3]
    row = tok.encode_chat([{"role": "user", "content": "Count from 1 to 100."}], add_generation_prompt=True)[0]
    greedy(model, [row], new_tokens)
    _, seconds = greedy(model, [row], new_tokens)
    return 1e3 * seconds / new_tokens


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="Hugging Face model folder (e.g. from tools/gguf_to_hf.py)")
    p.add_argument("--word_problems", type=int, default=20)
    p.add_argument("--gsm8k", type=int, default=20)
    p.add_argument("--max_value", type=int, default=99, help="word problems: largest operand")
    p.add_argument("--instruction", default="boxed", choices=["boxed", "none"], help="after each question")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--data", default=shared_data_dir(), help="the shared data folder (gsm8k/test.jsonl)")
    p.add_argument("--samples", default="", help="write every question, answer and response here (JSONL)")
    p.add_argument("--untimed", action="store_true", help="run each set once (half the time; no decode timings)")
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    model = load(args.model)
    result, samples = {"model": args.model}, []
    if not args.untimed:
        result["decode_ms_per_token (batch 1)"] = decode_latency(model)
    sets = {"word_problems": word_problems(args.word_problems, args.max_value)}
    if args.gsm8k:
        sets["gsm8k"] = gsm8k_problems(args.gsm8k, args.data)
    instruction = MATH_INSTRUCTION if args.instruction == "boxed" else ""
    result.update(instruction=instruction, max_value=args.max_value)
    for name, problems in sets.items():
        result[name], records = evaluate(model, problems, args.max_new_tokens, instruction, timed=not args.untimed)
        samples += [dict(set=name, **r) for r in records]
    print(json.dumps(result, indent=2))
    if args.samples:
        with open(args.samples, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
