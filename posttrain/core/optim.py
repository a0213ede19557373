"""Optimizers: AdamW or Adafactor (`optim.name`), with linear warmup + cosine decay, decoupled weight
decay on matrices and global-norm gradient clipping.

Adafactor (`optax.adafactor`, Shazeer & Stern 2018) keeps no first moment and factors the second
moment of each matrix into a row and a column vector, so its state is ~(rows + cols) per matrix
instead of AdamW's 2 x rows x cols: the memory-lean choice for full fine-tuning at pod scale.
Its factored vectors do not have their parameter's shape; `_named_factored` gives each the
parameter's logical axis names minus the reduced dim, so `shardings_for` shards it along the
parameter's remaining axes (a v_row of an expert weight [L, E, D, F] lives over `experts` and
`embed` like the weight does).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain.config import OptimConfig


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=cfg.lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """`cfg.name` (AdamW or Adafactor) behind global-norm clipping; `cfg` = config.optim.

    Both decay matrices only (not norms, biases) by `lr(t) * weight_decay * param` (decoupled,
    as AdamW). Adafactor runs with absolute step sizes (no parameter-scale multiplication), so
    `optim.lr` means about the same for both; its own per-matrix update-RMS clip at 1 stays on.
    """
    name, moment_dtype = cfg.name, cfg.moment_dtype
    schedule = lr_schedule(cfg, total_steps)
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    if name == "adamw":
        tx = optax.adamw(
            schedule,
            b1=cfg.b1,
            b2=cfg.b2,
            eps=cfg.eps,
            weight_decay=cfg.weight_decay,
            mask=decay_mask,
            mu_dtype=jnp.dtype(moment_dtype) if moment_dtype else None,
        )
    else:  # (adafactor keeps no first moment: OptimConfig refuses a moment_dtype with it)
        min_dim, decay = cfg.factored_min_dim, cfg.weight_decay
        tx = with_factored_names(
            optax.adafactor(  # optax's second-moment decay (1 - t^-0.8) and eps
                schedule,
                min_dim_size_to_factor=min_dim,
                multiply_by_parameter_scale=False,
                weight_decay_rate=lambda count: decay * schedule(count),
                weight_decay_mask=decay_mask,
            ),
            min_dim,
        )
    return optax.chain(optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(), tx)


def factored_dims(shape: tuple[int, ...], min_dim: int) -> tuple[int, int] | None:
    """(d1, d0): the dims optax's Adafactor reduces to build v_col and v_row of a `shape` parameter
    (its two largest, picked by np.argsort as optax does), or None when it keeps a full second
    moment (a vector, or the second-largest dim below `min_dim`)."""
    if len(shape) < 2:
        return None
    order = np.argsort(shape)
    if shape[order[-2]] < min_dim:
        return None
    return int(order[-2]), int(order[-1])


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _unbox(tree):
    """`tree` with every nnx Variable replaced by its value."""
    return jax.tree.map(lambda x: x.get_value() if _is_variable(x) else x, tree, is_leaf=_is_variable)


def _named_factored(state, params, min_dim: int):
    """Adafactor's state with each FactoredState statistic boxed in its parameter's Variable type
    carrying the logical names of the dims it keeps ((None,) for the (1,) placeholders)."""

    def names_of(p) -> tuple:
        return tuple(p.get_metadata().get("out_sharding") or (None,) * p.ndim)

    def box(kind):
        def one(p, stat):
            if not _is_variable(p):  # a plain-array parameter: its statistics stay plain (replicated)
                return stat
            names, dims = names_of(p), factored_dims(p.shape, min_dim)
            keep = {
                "v": None if dims else range(p.ndim),
                "v_row": dims and np.delete(range(p.ndim), dims[1]),
                "v_col": dims and np.delete(range(p.ndim), dims[0]),
            }[kind]
            kept = (None,) if keep is None else tuple(names[i] for i in keep)
            want = (1,) if keep is None else tuple(p.shape[i] for i in keep)
            if tuple(stat.shape) != want:  # optax changed its factoring rule: names would be wrong
                raise ValueError(
                    f"adafactor {kind} of a {tuple(p.shape)} parameter has shape {tuple(stat.shape)}, expected {want}"
                )
            return p.replace(stat, out_sharding=kept)

        return one

    def fix(s):
        if not isinstance(s, optax.FactoredState):
            return s
        return s._replace(
            **{k: jax.tree.map(box(k), params, getattr(s, k), is_leaf=_is_variable) for k in ("v_row", "v_col", "v")}
        )

    return jax.tree.map(fix, state, is_leaf=lambda x: isinstance(x, optax.FactoredState))


def with_factored_names(tx: optax.GradientTransformation, min_dim: int) -> optax.GradientTransformation:
    """`tx` (an Adafactor) run on plain arrays, its factored statistics named for sharding.

    nnx Variables carry their logical names as pytree metadata; optax would copy a parameter's
    names onto statistics of another shape. So the inner transform sees unboxed arrays, and its
    state comes back boxed with the right names (`_named_factored`); updates get the grads' boxes.
    """

    def init(params):
        return _named_factored(tx.init(_unbox(params)), params, min_dim)

    def update(updates, state, params=None):
        raw, state = tx.update(_unbox(updates), _unbox(state), _unbox(params))
        boxed = jax.tree.map(lambda g, u: g.replace(u) if _is_variable(g) else u, updates, raw, is_leaf=_is_variable)
        return boxed, _named_factored(state, updates, min_dim)

    return optax.GradientTransformation(init, update)
