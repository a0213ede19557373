"""The language-model train step: masked next-token cross-entropy (+ MoE aux terms), AdamW update."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.models import lora
from posttrain.train.state import TrainState, lora_scale

def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over tokens where mask is set, and that token count.

    logits: [B, S, V] (float32); targets, mask: [B, S].
    """
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    n = mask.sum()
    return (ce * mask).sum() / jnp.maximum(n, 1.0), n


def lm_loss(model: nnx.Module, batch: dict, moe_cfg, *, update_bias: bool = True) -> tuple[jax.Array, dict]:
    """Next-token loss plus weighted MoE load-balancing and z losses; returns (loss, metrics)."""
    logits, aux = model(batch["inputs"], batch["positions"], batch["segment_ids"], update_bias=update_bias)
    ce, ntok = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    metrics = {"ce": ce, "tokens": ntok}
    loss = ce
    if aux:
        loss = loss + moe_cfg.aux_loss_coef * aux["moe/aux_loss"] + moe_cfg.z_loss_coef * aux["moe/z_loss"]
        metrics.update({k: v for k, v in aux.items() if k != "moe/load"})
        metrics["moe/load"] = aux["moe/load"].mean(axis=0)     # [num_experts], averaged over layers
    metrics["loss"] = loss
    return loss, metrics


def make_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, loss_fn,
                    schedule: optax.Schedule | None = None, lora_cfg=None):
    """A pure `(state, batch, *extra) -> (state, metrics)` for `jax.jit`.

    loss_fn(model, batch, *extra) -> (loss, metrics). Non-trainable model variables the forward
    pass updates (router biases for aux-loss-free balancing) are carried into the new state;
    they are not trained by the gradient. Under LoRA the gradient reaches only the adapters.
    """
    def wrapped(params, frozen, rest, batch, *extra):
        weights = params if frozen is None else lora.merge(frozen, params, lora_scale(lora_cfg))
        # copies: `rest` is not differentiated, so its Variables would be the caller's, created
        # outside this trace, and the forward pass's router-bias update could not write them
        model = nnx.merge(graphdef, weights, rest, copy=True)
        loss, metrics = loss_fn(model, batch, *extra)
        _, _, new_rest = nnx.split(model, nnx.Param, ...)
        return loss, (metrics, new_rest)

    def train_step(state: TrainState, batch: dict, *extra) -> tuple[TrainState, dict]:
        grad_fn = jax.value_and_grad(wrapped, has_aux=True)
        (_, (metrics, rest)), grads = grad_fn(state.params, state.frozen, state.rest, batch, *extra)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        return state.replace(step=state.step + 1, params=params, rest=rest, opt_state=opt_state), metrics

    return train_step
