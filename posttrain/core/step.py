"""The language-model train step: masked next-token cross-entropy (+ MoE aux terms), AdamW update;
and the bound on steps in flight (`dispatched`) that the training loops keep."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.core.state import TrainState, lora_scale
from posttrain.errors import UserError
from posttrain.models import lora

# Steps dispatched ahead of the oldest one still running. A few hide the host's dispatch on any
# accelerator. Unbounded run-ahead can deadlock XLA:CPU with several devices (simulated meshes):
# jaxlib 0.10's CPU client admits 32 programs in flight per device and takes the slots out of
# order, so a later program can hold the last slot of a device whose share of an earlier program's
# all-reduce has not started; the other devices then wait at the rendezvous until XLA aborts.
MAX_STEPS_AHEAD = 4


def dispatched(results: list, result) -> None:
    """Append the newest step's (device) `result` to `results` and wait for the one dispatched
    `MAX_STEPS_AHEAD` steps before it, so no more steps than that are ever in flight."""
    results.append(result)
    if len(results) > MAX_STEPS_AHEAD:
        jax.block_until_ready(results[-1 - MAX_STEPS_AHEAD])


def moe_penalty(aux: dict, moe_cfg) -> jax.Array:
    """Weighted MoE load-balancing + z losses (0 for a dense model); every stage adds it to its loss."""
    if not aux:
        return jnp.zeros(())
    return moe_cfg.aux_loss_coef * aux["moe/aux_loss"] + moe_cfg.z_loss_coef * aux["moe/z_loss"]


def token_cross_entropy(logits: jax.Array, targets: jax.Array, mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean cross-entropy over tokens where mask is set, and that token count.

    logits: [B, S, V] (float32); targets, mask: [B, S].
    """
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = mask.astype(jnp.float32)
    n = mask.sum()
    return (ce * mask).sum() / jnp.maximum(n, 1.0), n


def lm_loss(model: nnx.Module, batch: dict, moe_cfg, *, update_bias: bool = True) -> tuple[jax.Array, dict]:
    """Next-token loss plus weighted MoE load-balancing and z losses; returns (loss, metrics).
    `batch["patches"]`, when there, are the rows' image patches (`models.vision`)."""
    logits, aux = model(
        batch["inputs"], batch["positions"], batch["segment_ids"], update_bias=update_bias, patches=batch.get("patches")
    )
    ce, ntok = token_cross_entropy(logits, batch["targets"], batch["loss_mask"])
    metrics = {"ce": ce, "tokens": ntok}
    loss = ce + moe_penalty(aux, moe_cfg)
    if aux:
        metrics.update({k: v for k, v in aux.items() if k != "moe/load"})
        metrics["moe/load"] = aux["moe/load"].mean(axis=0)  # [num_experts], averaged over layers
    metrics["loss"] = loss
    return loss, metrics


def nonfinite_counts(counts: dict, finite: jax.Array) -> dict:
    """Updated skip counters: `skipped` (updates skipped so far), `run` (skipped in a row, up to
    now) and `longest` (the longest such run so far, so a check every few steps misses none)."""
    bad = jnp.logical_not(finite).astype(jnp.int32)
    run = (counts["run"] + 1) * bad
    return {"skipped": counts["skipped"] + bad, "run": run, "longest": jnp.maximum(counts["longest"], run)}


class Diverged(UserError):
    """Too many updates in a row had a non-finite loss or gradient norm."""


def check_nonfinite(metrics: dict, max_steps: int, step: int, ckpt=None) -> None:
    """Raise `Diverged` when more than `max_steps` updates in a row were skipped (host side, on
    metrics the loop has already fetched: no extra device sync). Pending saves of `ckpt` are
    finished first, so the run stops with whole checkpoints only."""
    longest = int(metrics.get("nonfinite_longest_run", 0))
    if longest > max_steps:
        if ckpt is not None:
            ckpt.wait()
        raise Diverged(
            f"training diverged: {longest} updates in a row (by step {step}) had a non-finite loss or "
            f"gradient norm and were skipped, more than train.max_nonfinite_steps={max_steps}; the "
            "checkpoints hold the last finite weights. Lower optim.lr, set optim.grad_clip / "
            "optim.warmup_steps, or check the data",
            key="train.max_nonfinite_steps",
        )


def make_train_step(
    graphdef: nnx.GraphDef,
    tx: optax.GradientTransformation,
    loss_fn,
    schedule: optax.Schedule | None = None,
    lora_cfg=None,
):
    """A pure `(state, batch, *extra) -> (state, metrics)` for `jax.jit`.

    loss_fn(model, batch, *extra) -> (loss, metrics). Non-trainable model variables the forward
    pass updates (router biases for aux-loss-free balancing) are carried into the new state;
    they are not trained by the gradient. Under LoRA the gradient reaches only the adapters.

    Divergence guard: when the loss or the gradient norm is not finite the update is skipped
    (params, optimizer state and model variables stay as they were; the step still advances)
    and counted in `state.nonfinite`, reported as the metrics `nonfinite_skipped` and
    `nonfinite_longest_run`. A select inside the step, so no host sync.
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
        (loss, (metrics, rest)), grads = grad_fn(state.params, state.frozen, state.rest, batch, *extra)
        updates, opt_state = tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        metrics["grad_norm"] = optax.tree.norm(grads)
        if schedule is not None:
            metrics["lr"] = schedule(state.step)
        finite = jnp.isfinite(loss) & jnp.isfinite(metrics["grad_norm"])
        params, opt_state, rest = jax.tree.map(
            lambda new, old: jnp.where(finite, new, old),
            (params, opt_state, rest),
            (state.params, state.opt_state, state.rest),
        )
        nonfinite = state.nonfinite
        if nonfinite is not None:
            nonfinite = nonfinite_counts(nonfinite, finite)
            metrics["nonfinite_skipped"] = nonfinite["skipped"]
            metrics["nonfinite_longest_run"] = nonfinite["longest"]
        return state.replace(
            step=state.step + 1, params=params, rest=rest, opt_state=opt_state, nonfinite=nonfinite
        ), metrics

    return train_step
