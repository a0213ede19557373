"""Stage `reward_model`: the decoder with a scalar head, trained with the Bradley–Terry loss on preference pairs."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.core.init import init_model_from
from posttrain.core.loop import Result, TrainSpec, train
from posttrain.core.step import moe_penalty
from posttrain.models.decoder import Decoder
from posttrain.models.reward import RewardModel
from posttrain.parallel import mesh_and_rules
from posttrain.stages.common import (
    PREFERENCE_AXES,
    data_kw,
    make_evaluator,
    preference_data,
    require_files,
    stage_tokenizer,
)
from posttrain.stages.data_files import resolve_data_files
from posttrain.stages.losses import bradley_terry_loss


def both_sides(batch: dict, key: str) -> jax.Array:
    """Chosen rows then rejected rows: one forward pass for the pair."""
    return jnp.concatenate([batch[f"chosen_{key}"], batch[f"rejected_{key}"]], axis=0)


def reward_model_loss(model: RewardModel, batch: dict, moe_cfg) -> tuple[jax.Array, dict]:
    """Bradley–Terry loss on a batch of preference pairs."""
    rewards, aux = model.reward(
        both_sides(batch, "inputs"), both_sides(batch, "positions"), both_sides(batch, "segment_ids")
    )
    chosen, rejected = jnp.split(rewards, 2)
    loss, metrics = bradley_terry_loss(chosen, rejected)
    loss = loss + moe_penalty(aux, moe_cfg)
    return loss, {**metrics, "loss": loss}


def run(cfg) -> Result:
    """Reward model: decoder + scalar head trained with the Bradley–Terry loss on preference pairs."""
    cfg = cfg.for_stage("reward_model")
    if cfg.eval.long_context.lengths:
        raise ValueError(
            f"eval.long_context.lengths={cfg.eval.long_context.lengths!r}: a reward model does not "
            "generate; evaluate long context in the sft or dpo stage"
        )
    cfg = resolve_data_files(cfg, "reward_model", "preference")
    tok, kw = stage_tokenizer(cfg), data_kw(cfg)
    make = lambda: RewardModel(cfg.model, rngs=nnx.Rngs(cfg.seed))
    loss = functools.partial(reward_model_loss, moe_cfg=cfg.model.moe)
    eval_fn = None
    if cfg.reward_model.eval_files:

        def metric(model, batch):
            _, m = loss(model, batch)
            return {k.removeprefix("rm/"): v for k, v in m.items() if k.startswith("rm/")}, batch[
                "chosen_inputs"
            ].shape[0]

        eval_fn = make_evaluator(metric, preference_data(cfg, cfg.reward_model.eval_files, eval=True, tok=tok, kw=kw))
    batches = preference_data(
        cfg, require_files(cfg.reward_model.train_files, "reward_model.train_files"), eval=False, tok=tok, kw=kw
    )
    decoder = lambda: Decoder(cfg.model, rngs=nnx.Rngs(cfg.seed))
    return train(
        cfg,
        TrainSpec(
            "reward_model",
            make,
            loss,
            batches,
            batch_axes=PREFERENCE_AXES,
            eval_fn=eval_fn,
            init_model=init_model_from(cfg.init_from, decoder, *mesh_and_rules(cfg)),
        ),
    )
