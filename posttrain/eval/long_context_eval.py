"""Run the long-context problems (`posttrain.eval.long_context`) through the greedy sampler over a
grid of length x depth: accuracy per cell as JSONL, one heat map per kind, and the means
`long_ctx_needle` / `long_ctx_multihop` (usable as stage gates).

Configured by `eval.long_context.*` (lengths "" switches it off); reachable from SFT (evaluated
with the stage's other metrics) and from `tools/long_context_eval.py --run R`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from posttrain import storage
from posttrain.core.lineage import check_need
from posttrain.data.tokenizer import Tokenizer
from posttrain.eval.long_context import KINDS, generate_problem, is_correct
from posttrain.sampling.generate import generate
from posttrain.sampling.rules import SamplingParams

KEY = "eval.long_context"
# prompts per sampler call: a cell grid of 3 depths x 50 problems at 1024 tokens in one call held
# ~10 GB of attention scores on CPU (killed for memory); greedy answers do not depend on the split
CALL_PROMPTS = 16


def parse_grid(lc) -> dict:
    """`eval.long_context` → {lengths, depths, kinds} lists, or ValueError naming the key."""
    try:
        lengths = [int(x) for x in lc.lengths.split(",") if x.strip()]
        depths = [float(x) for x in lc.depths.split(",") if x.strip()]
    except ValueError:
        raise ValueError(
            f"{KEY}.lengths={lc.lengths!r} / depths={lc.depths!r}: expected comma-separated "
            "integers / fractions, e.g. '256,1024' and '0,0.5,1'"
        ) from None
    kinds = [k.strip() for k in lc.kinds.split(",") if k.strip()]
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"{KEY}.lengths={lc.lengths!r}: expected positive token counts, e.g. '256,1024'")
    if not depths or not all(0.0 <= d <= 1.0 for d in depths):
        raise ValueError(f"{KEY}.depths={lc.depths!r}: expected fractions in [0, 1], e.g. '0,0.5,1'")
    if not kinds or any(k not in KINDS for k in kinds):
        raise ValueError(f"{KEY}.kinds={lc.kinds!r}: expected a comma-separated subset of {list(KINDS)}")
    if lc.samples < 1 or lc.hops < 1 or lc.max_new_tokens < 1:
        raise ValueError(
            f"{KEY}.samples={lc.samples}, hops={lc.hops}, max_new_tokens={lc.max_new_tokens}: each must be >= 1"
        )
    return {"lengths": lengths, "depths": depths, "kinds": kinds}


def chat_prompt(tok: Tokenizer, text: str) -> list[int]:
    """`text` as the user turn of a chat, ready for the assistant's reply."""
    return list(tok.encode_chat([{"role": "user", "content": text}], add_generation_prompt=True)[0])


def evaluate(model: nnx.Module, tok: Tokenizer, lc, *, step: int | None = None, max_context: int = 0) -> list[dict]:
    """Accuracy of greedy answers per (kind, length, depth) cell: rows {kind, length, depth,
    accuracy, correct, n, prompt_tokens (mean), example (one answer and completion), step}.
    `length` counts the whole context the model reads: chat prompt and `max_new_tokens` answer, so
    a model trained at L tokens is evaluated within them at length L. `max_context` (> 0): the
    sampler refuses past it (`sampling.max_context`, resolved by `core.lineage.max_context`)."""
    grid = parse_grid(lc)
    check_need(max(grid["lengths"]), max_context, f"{KEY}.lengths={lc.lengths!r}")
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    sampling = SamplingParams(
        temperature=0.0, max_new_tokens=lc.max_new_tokens, stop_ids=tuple(tok.stop_ids), max_context=max_context
    )
    overhead = len(chat_prompt(tok, "")) + lc.max_new_tokens
    count = lambda s: len(tok.encode(s))
    rows = []
    for kind in grid["kinds"]:
        for length in grid["lengths"]:
            cells = [(d, i) for d in grid["depths"] for i in range(lc.samples)]
            problems = [
                generate_problem(
                    kind, length - overhead, d, index=i, seed=lc.seed, split="eval", hops=lc.hops, count=count
                )
                for d, i in cells
            ]
            prompts = [chat_prompt(tok, p.prompt) for p in problems]
            texts = []
            for at in range(0, len(prompts), CALL_PROMPTS):  # bounded memory: [rows, heads, L, L] scores at L
                chunk = prompts[at : at + CALL_PROMPTS]
                out = generate(graphdef, params, rest, chunk, sampling, jax.random.key(0), pad_id=tok.pad_id)
                texts += [tok.decode(out.completion(j)) for j in range(len(chunk))]
            ok = [is_correct(t, p.answer) for t, p in zip(texts, problems)]
            for d in grid["depths"]:
                idx = [j for j, (dd, _) in enumerate(cells) if dd == d]
                rows.append(
                    {
                        "kind": kind,
                        "length": length,
                        "depth": d,
                        "correct": int(sum(ok[j] for j in idx)),
                        "n": len(idx),
                        "accuracy": float(np.mean([ok[j] for j in idx])),
                        "prompt_tokens": float(np.mean([len(prompts[j]) for j in idx])),
                        "example": {"answer": problems[idx[0]].answer, "completion": texts[idx[0]]},
                        **({"step": int(step)} if step is not None else {}),
                    }
                )
    return rows


def summarize(rows: Sequence[dict]) -> dict[str, float]:
    """`long_ctx_<kind>` (mean accuracy over the grid) and `long_ctx_<kind>/len<L>` (over depths)."""
    out = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        mine = [r for r in rows if r["kind"] == kind]
        out[f"long_ctx_{kind}"] = float(np.mean([r["accuracy"] for r in mine]))
        for length in dict.fromkeys(r["length"] for r in mine):
            out[f"long_ctx_{kind}/len{length}"] = float(np.mean([r["accuracy"] for r in mine if r["length"] == length]))
    return out


def wilson_interval(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval (95% at z=1.96) of an accuracy of `correct` in `n`: honest at 0
    and at n, where the normal approximation collapses to a point."""
    if n <= 0:
        return 0.0, 1.0
    p, d = correct / n, 1 + z * z / n
    centre, half = (p + z * z / (2 * n)) / d, z * np.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / d
    return float(max(0.0, centre - half)), float(min(1.0, centre + half))


def accuracy_by_length(rows: Sequence[dict], kind: str) -> dict[int, tuple[int, int]]:
    """{length: (correct, n)} of `kind`, pooled over depths (the newest step's rows)."""
    last = max((r.get("step", -1) for r in rows), default=-1)
    out: dict[int, tuple[int, int]] = {}
    for r in rows:
        if r["kind"] == kind and r.get("step", -1) == last:
            c, n = out.get(r["length"], (0, 0))
            out[r["length"]] = (c + r["correct"], n + r["n"])
    return dict(sorted(out.items()))


def effective_context(rows: Sequence[dict], kind: str, threshold: float = 0.9) -> int:
    """The longest measured length up to which `kind`'s accuracy (pooled over depths) stays >=
    `threshold` at every measured length; 0 when the shortest already falls below it. Issue 28's
    "effective context": nominal context is not usable context."""
    best = 0
    for length, (c, n) in accuracy_by_length(rows, kind).items():
        if n == 0 or c / n < threshold:
            break
        best = length
    return best


def write_rows(rows: Sequence[dict], path: str) -> None:
    """Append `rows` to the JSONL file `path` (local or URL)."""
    if not storage.is_url(path):
        storage.makedirs(os.path.dirname(os.path.abspath(path)))
    storage.append_text(path, "".join(json.dumps(r) + "\n" for r in rows))


def plot_heatmaps(rows: Sequence[dict], out: str, title: str = "") -> str:
    """One length x depth accuracy heat map per kind (the newest step's rows) to PNG `out`."""
    from posttrain.core.plot import png_bytes

    storage.write_bytes(out, png_bytes(heatmap_figure(rows, title)))
    return out


def heatmap_figure(rows: Sequence[dict], title: str = ""):
    """The figure of `plot_heatmaps` (the run report embeds it too)."""
    from posttrain.core.plot import plt  # matplotlib (Agg) only when plotting

    last = max((r.get("step", -1) for r in rows), default=-1)
    rows = [r for r in rows if r.get("step", -1) == last]
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    fig, axes = plt.subplots(1, len(kinds), figsize=(4.5 * len(kinds), 3.6), squeeze=False)
    for ax, kind in zip(axes[0], kinds):
        mine = [r for r in rows if r["kind"] == kind]
        lengths, depths = sorted({r["length"] for r in mine}), sorted({r["depth"] for r in mine})
        grid = np.full((len(depths), len(lengths)), np.nan)
        for r in mine:
            grid[depths.index(r["depth"]), lengths.index(r["length"])] = r["accuracy"]
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="viridis", origin="upper", aspect="auto")
        for (i, j), v in np.ndenumerate(grid):
            ax.text(j, i, f"{v:.2f}", ha="center", va="center", color="w" if v < 0.6 else "k", fontsize=8)
        ax.set_xticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_yticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel("depth")
        ax.set_title(f"long_ctx_{kind} = {np.nanmean(grid):.2f}")
        fig.colorbar(im, ax=ax, fraction=0.046)
    fig.suptitle(title + (f" (step {last})" if last >= 0 else ""), fontsize=9)
    return fig


def make_long_context_eval(lc, workdir: str, tok: Tokenizer, max_context: int = 0):
    """eval hook for a stage: `fn(model, step)` → `long_ctx_*` metrics over the grid of `lc` (the
    `eval.long_context` section); each call appends its rows to `{workdir}/long_context.jsonl` and
    redraws `{workdir}/long_context.png`. None when `lc.lengths` is empty. A grid past
    `max_context` (> 0, see `evaluate`) is refused here, at start-up."""
    if not lc.lengths:
        return None
    lengths = parse_grid(lc)["lengths"]  # fail at start-up, not at the first evaluation
    check_need(max(lengths), max_context, f"{KEY}.lengths={lc.lengths!r}")
    jsonl, png = storage.join(workdir, "long_context.jsonl"), storage.join(workdir, "long_context.png")

    def fn(model: nnx.Module, step: int | None = None) -> dict:
        rows = evaluate(model, tok, lc, step=step, max_context=max_context)
        if jax.process_index() == 0:
            write_rows(rows, jsonl)
            plot_heatmaps(rows, png, workdir)
        return summarize(rows)

    return fn
