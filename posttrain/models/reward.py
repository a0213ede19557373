"""The reward model: the decoder with a scalar value head (trained by `posttrain/stages/reward_model.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.decoder import Decoder
from posttrain.models.layers import dtype_of, param


class RewardModel(Decoder):
    """The decoder with a scalar value head read at each row's last real token."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.value_head = param(
            rngs,
            jax.nn.initializers.normal(cfg.embed_dim**-0.5),
            (cfg.embed_dim,),
            ("embed",),
            dtype_of(cfg.param_dtype),
        )

    def reward(self, tokens, positions, segment_ids) -> tuple[jax.Array, dict]:
        """[B, S] right-padded rows (segment id 0 = padding) → rewards [B] (float32), MoE aux."""
        hidden, aux = self.hidden_states(tokens, positions, segment_ids, update_bias=True)
        last = jnp.maximum((segment_ids != 0).sum(axis=1) - 1, 0)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return (h.astype(jnp.float32) @ self.value_head[...].astype(jnp.float32)), aux
