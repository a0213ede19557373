"""Optimizer: AdamW with linear warmup + cosine decay and global-norm gradient clipping."""

from __future__ import annotations

import jax
import optax


def lr_schedule(cfg, total_steps: int) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1), end_value=cfg.lr * cfg.min_lr_ratio)


def make_optimizer(cfg, total_steps: int) -> optax.GradientTransformation:
    """AdamW (no decay on vectors: norms, biases) behind global-norm clipping; `cfg` = config.optim."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    return optax.chain(
        optax.clip_by_global_norm(cfg.grad_clip) if cfg.grad_clip > 0 else optax.identity(),
        optax.adamw(lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                    weight_decay=cfg.weight_decay, mask=decay_mask),
    )
