"""Long-context evaluation of a run's checkpoint: needle retrieval and multi-hop reasoning over a
length x depth grid, greedy answers checked exactly.

    python tools/long_context_eval.py --run runs/long_context_tiny [--step 40] \
        [--lengths 256,1024] [--depths 0,0.5,1] [--samples 8] [--out DIR] [--max_context 1024]

Settings default to the run's `eval.long_context.*` (its config.json); the flags override them.
Writes DIR/long_context.jsonl (appended, one row per kind x length x depth, with the step) and
DIR/long_context.png (heat maps); prints per length the accuracy pooled over depths with its 95%
interval, each kind's effective context (the longest length up to which it stays >= 90%), and the
rows' means (`long_ctx_needle`, `long_ctx_multihop`).
DIR defaults to the run folder. Lengths past the checkpoint's trained and configured context
(its lineage: what it was trained at up to that step) are refused unless --max_context (or the
run's sampling.max_context) allows them: e.g. a 256-token checkpoint measured at 1024 tokens.
"""

from __future__ import annotations

import json
import logging

from absl import app, flags

flags.DEFINE_string("run", None, "posttrain run folder (workdir) to evaluate.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest).")
flags.DEFINE_string("out", "", "Output folder (default: the run folder).")
for _name, _kind in (
    ("lengths", "string"),
    ("depths", "string"),
    ("kinds", "string"),
    ("samples", "integer"),
    ("hops", "integer"),
    ("max_new_tokens", "integer"),
    ("seed", "integer"),
):
    getattr(flags, f"DEFINE_{_kind}")(_name, None, f"Overrides eval.long_context.{_name}.")
flags.DEFINE_integer(
    "max_context",
    None,
    "Overrides sampling.max_context: evaluate up to this many tokens, past the checkpoint's trained context.",
)
FLAGS = flags.FLAGS


def load_model(cfg, step: int | None):
    """The run's model at checkpoint `step` (newest when None), on the run's mesh."""
    from flax import nnx

    from posttrain.core.init import load_model_state
    from posttrain.core.state import abstract_model
    from posttrain.models.decoder import Decoder
    from posttrain.parallel import make_mesh, parse_rules, use_sharding

    if cfg.lora.rank > 0:
        raise app.UsageError(
            f"{cfg.workdir}: a LoRA run; export it with tools/convert_hf.py (adapters merged) and evaluate that"
        )
    mesh, rules = make_mesh(cfg.mesh.to_dict()), parse_rules(cfg.sharding.rules)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    with use_sharding(mesh, rules):
        params, rest, step = load_model_state(cfg.workdir, make, mesh, rules, step=step)
    return nnx.merge(nnx.graphdef(abstract_model(make)), params, rest), step, (mesh, rules)


def main(argv: list[str]) -> None:
    del argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    for noisy in ("absl", "jax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from posttrain import storage
    from posttrain.core import lineage
    from posttrain.core.hf_convert import read_run_config
    from posttrain.data.tokenizer import load_tokenizer
    from posttrain.eval.long_context_eval import (
        accuracy_by_length,
        effective_context,
        evaluate,
        plot_heatmaps,
        summarize,
        wilson_interval,
        write_rows,
    )
    from posttrain.parallel import use_sharding

    cfg = read_run_config(FLAGS.run)
    names = ("lengths", "depths", "kinds", "samples", "hops", "max_new_tokens", "seed")
    changes = {f"eval.long_context.{n}": getattr(FLAGS, n) for n in names if getattr(FLAGS, n) is not None}
    if FLAGS.max_context is not None:
        changes["sampling.max_context"] = FLAGS.max_context
    cfg = cfg.replace(changes)
    lc = cfg.eval.long_context
    if not lc.lengths:
        raise app.UsageError("no lengths: give --lengths (e.g. 256,1024) or set eval.long_context.lengths")
    model, step, (mesh, rules) = load_model(cfg, FLAGS.step)
    # sampling.max_context: what this checkpoint was trained for (its lineage) unless set
    limit = lineage.max_context(cfg, lineage.of_run(FLAGS.run, step=step))
    with use_sharding(mesh, rules):
        rows = evaluate(model, load_tokenizer(cfg.data.tokenizer), lc, step=step, max_context=limit)
    out = FLAGS.out or FLAGS.run
    storage.makedirs(out)
    write_rows(rows, storage.join(out, "long_context.jsonl"))
    png = plot_heatmaps(rows, storage.join(out, "long_context.png"), FLAGS.run)
    for kind in dict.fromkeys(r["kind"] for r in rows):  # pooled over depths, 95% Wilson interval
        for length, (c, n) in accuracy_by_length(rows, kind).items():
            lo, hi = wilson_interval(c, n)
            print(f"{kind} {length}: {c}/{n} = {c / n:.2f} [{lo:.2f}, {hi:.2f}]")
        print(f"{kind} effective context (>= 90%): {effective_context(rows, kind)}")
    print(json.dumps({"step": step, **summarize(rows), "plot": png}, indent=2))


if __name__ == "__main__":
    app.run(main)
