"""Stage `dpo`: DPO against a frozen reference (the starting weights), computed in the same step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.core.init import load_model_state
from posttrain.core.loop import Result, TrainSpec, train
from posttrain.core.state import abstract_model, init_model_state
from posttrain.core.step import moe_penalty
from posttrain.eval.long_context_eval import make_long_context_eval
from posttrain.models.decoder import Decoder
from posttrain.parallel import mesh_and_rules, use_sharding
from posttrain.stages.common import (
    PREFERENCE_AXES,
    combine_evals,
    data_kw,
    make_evaluator,
    preference_data,
    require_files,
    run_max_context,
    stage_tokenizer,
)
from posttrain.stages.data_files import resolve_data_files
from posttrain.stages.losses import dpo_loss, sequence_logprobs
from posttrain.stages.reward_model import both_sides


def pair_logprobs(model: Decoder, batch: dict, *, update_bias: bool) -> tuple[jax.Array, jax.Array, dict]:
    """Summed response log-probs [B] of chosen and rejected responses, and the MoE aux."""
    logits, aux = model(
        both_sides(batch, "inputs"),
        both_sides(batch, "positions"),
        both_sides(batch, "segment_ids"),
        update_bias=update_bias,
    )
    logp = sequence_logprobs(logits, both_sides(batch, "targets"), both_sides(batch, "loss_mask"))
    chosen, rejected = jnp.split(logp, 2)
    return chosen, rejected, aux


def dpo_stage_loss(
    model: Decoder, batch: dict, ref_params, ref_rest, *, graphdef, dpo_cfg, moe_cfg
) -> tuple[jax.Array, dict]:
    """DPO against the frozen reference (the starting weights), computed in the same step."""
    ref = nnx.merge(graphdef, jax.lax.stop_gradient(ref_params), ref_rest)
    ref_chosen, ref_rejected, _ = pair_logprobs(ref, batch, update_bias=False)
    chosen, rejected, aux = pair_logprobs(model, batch, update_bias=True)
    loss, metrics = dpo_loss(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta=dpo_cfg.beta,
        loss_type=dpo_cfg.loss_type,
        label_smoothing=dpo_cfg.label_smoothing,
    )
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


def run(cfg) -> Result:
    """DPO from `init_from` (or the seed's initial weights); the reference is that starting point."""
    cfg = cfg.for_stage("dpo")
    cfg = resolve_data_files(cfg, "dpo", "preference")
    tok, kw = stage_tokenizer(cfg), data_kw(cfg)
    make = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    mesh, rules = mesh_and_rules(cfg)
    with use_sharding(mesh, rules):
        if cfg.init_from:
            ref_params, ref_rest, _ = load_model_state(cfg.init_from, make, mesh, rules)
        else:
            ref_params, ref_rest = init_model_state(make, mesh, rules)
    graphdef = nnx.graphdef(abstract_model(make))
    loss = functools.partial(dpo_stage_loss, graphdef=graphdef, dpo_cfg=cfg.dpo, moe_cfg=cfg.model.moe)
    eval_fn = None
    if cfg.dpo.eval_files:

        def metric(model, batch):
            _, m = loss(model, batch, ref_params, ref_rest)
            return {k.removeprefix("dpo/"): v for k, v in m.items() if k.startswith("dpo/")}, batch[
                "chosen_inputs"
            ].shape[0]

        eval_fn = make_evaluator(metric, preference_data(cfg, cfg.dpo.eval_files, eval=True, tok=tok, kw=kw))
    eval_fn = combine_evals(
        eval_fn, make_long_context_eval(cfg.eval.long_context, cfg.workdir, tok, run_max_context(cfg))
    )
    batches = preference_data(cfg, require_files(cfg.dpo.train_files, "dpo.train_files"), eval=False, tok=tok, kw=kw)
    # The policy starts as a copy of the reference (the step donates the policy's buffers).
    start = lambda params, rest: jax.tree.map(jnp.copy, (ref_params, ref_rest))
    stage = TrainSpec(
        "dpo",
        make,
        loss,
        batches,
        batch_axes=PREFERENCE_AXES,
        extra=(ref_params, ref_rest),
        eval_fn=eval_fn,
        init_model=start,
    )
    return train(cfg, stage)
