"""The reward model: the decoder with a scalar value head (trained by `posttrain/stages/reward_model.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.models.decoder import Decoder
from posttrain.models.layers import dtype_of, param


def last_token_index(positions: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """[B, S] → [B]: where each row's last real token is, in whatever order the tokens are laid out
    (zig-zag context parallelism permutes them): the token of the last segment (largest segment
    id) with the largest position; 0 for a row of padding. Never a count of real tokens, which is
    an index only in the natural, right-padded order."""
    last_segment = segment_ids.max(axis=1, keepdims=True)
    candidate = (segment_ids == last_segment) & (segment_ids != 0)
    return jnp.argmax(jnp.where(candidate, positions, -1), axis=1)


class HeadedDecoder(Decoder):
    """The decoder with a scalar head over its hidden states (`value_head` [D]): a reward model's,
    a critic's."""

    def __init__(self, cfg, *, rngs: nnx.Rngs):
        super().__init__(cfg, rngs=rngs)
        self.value_head = param(
            rngs,
            jax.nn.initializers.normal(cfg.embed_dim**-0.5),
            (cfg.embed_dim,),
            ("embed",),
            dtype_of(cfg.param_dtype),
        )


class RewardModel(HeadedDecoder):
    """The decoder with a scalar value head read at each row's last real token."""

    def reward(self, tokens, positions, segment_ids) -> tuple[jax.Array, dict]:
        """[B, S] rows (segment id 0 = padding), in any token order → rewards [B] (float32), MoE
        aux. The head reads the last real token's hidden state (`last_token_index`)."""
        hidden, aux = self.hidden_states(tokens, positions, segment_ids, update_bias=True)
        last = last_token_index(positions, segment_ids)
        h = jnp.take_along_axis(hidden, last[:, None, None], axis=1)[:, 0]
        return (h.astype(jnp.float32) @ self.value_head[...].astype(jnp.float32)), aux
