"""Stage `sft`: next-token loss on the response tokens of packed conversations, on the shared loop."""

from __future__ import annotations

import functools

from flax import nnx

from posttrain.core.init import init_model_from
from posttrain.core.loop import Result, TrainSpec, train
from posttrain.core.step import lm_loss, token_cross_entropy
from posttrain.data.images import ImageSpec
from posttrain.data.pipeline import sft_batches
from posttrain.eval.long_context_eval import make_long_context_eval
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules
from posttrain.stages.common import (
    combine_evals,
    data_kw,
    finite_batches,
    make_evaluator,
    make_sampler_log,
    require_files,
    run_max_context,
    stage_tokenizer,
)
from posttrain.stages.data_files import resolve_data_files


def run(cfg) -> Result:
    """Supervised fine-tuning: next-token loss on response tokens of packed conversations."""
    cfg = cfg.for_stage("sft")
    tok = stage_tokenizer(cfg)
    cfg = resolve_data_files(cfg, "sft", "sft", tok)
    kw = data_kw(cfg)
    images = ImageSpec.from_config(cfg.model.vision)  # None: text only
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    train_files = require_files(cfg.sft.train_files, "sft.train_files")
    batches_for = lambda seq_len: sft_batches(
        train_files,
        tok,
        batch_size=cfg.train.batch_size,
        seq_len=seq_len,
        seed=cfg.seed,
        packing=cfg.data.packing,
        truncate=cfg.data.truncate,
        final_seq_len=cfg.train.seq_len,
        images=images,
        **kw,
    )
    eval_fn = None
    if cfg.sft.eval_files:

        def metric(model, batch):
            logits, _ = model(batch["inputs"], batch["positions"], batch["segment_ids"], patches=batch.get("patches"))
            ce, n = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
            return {"loss": ce}, n

        eval_fn = make_evaluator(
            metric,
            finite_batches(
                lambda: sft_batches(
                    cfg.sft.eval_files,
                    tok,
                    batch_size=cfg.train.batch_size,
                    seq_len=cfg.train.seq_len,
                    seed=0,
                    packing=cfg.data.packing,
                    truncate=cfg.data.truncate,
                    shuffle=False,
                    epochs=1,
                    images=images,
                    **kw,
                )
            ),
        )
    eval_fn = combine_evals(
        eval_fn, make_long_context_eval(cfg.eval.long_context, cfg.workdir, tok, run_max_context(cfg))
    )
    sample_fn = make_sampler_log(cfg, tok, cfg.sft.eval_files) if cfg.sft.eval_files and cfg.sft.sample_tokens else None
    stage = TrainSpec(
        "sft",
        make,
        functools.partial(lm_loss, moe_cfg=cfg.model.moe),
        batches_for(cfg.train.seq_len),
        batches_for=batches_for,
        eval_fn=eval_fn,
        sample_fn=sample_fn,
        init_model=init_model_from(cfg.init_from, make, *mesh_and_rules(cfg)),
    )
    return train(cfg, stage)
