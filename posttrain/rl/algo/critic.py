"""The PPO critic: a value per generated token, from a head on the policy's own decoder.

`rl.critic = "shared"` puts a scalar value head on the final hidden state of the policy's decoder
(the reward model's head, `models.reward.RewardModel`, read at every position instead of the last):
one forward pass gives logits and values, the head is a parameter of the policy (trained by the
same optimizer, checkpointed and restored with it), and the sampler ignores it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from posttrain.models.reward import HeadedDecoder


def scalar_head(hidden: jax.Array, head: jax.Array) -> jax.Array:
    """hidden [..., D] · head [D] → [...] in float32 (a value or reward per position)."""
    return hidden.astype(jnp.float32) @ head.astype(jnp.float32)


class ValueDecoder(HeadedDecoder):
    """The decoder with a value head (a shared actor-critic): `V(s_t)` at every position t is the
    value of the state after reading tokens[:t + 1], i.e. before the policy emits targets[t]."""

    def logits_and_values(
        self, tokens, positions=None, segment_ids=None, *, update_bias: bool = False, routing=None, patches=None
    ) -> tuple[jax.Array, jax.Array, dict]:
        """tokens [B, S] → (logits [B, S, V] float32, values [B, S] float32, MoE aux); `routing`:
        the experts to replay, `patches`: images (`Decoder.hidden_states`)."""
        hidden, aux = self.hidden_states(
            tokens, positions, segment_ids, update_bias=update_bias, routing=routing, patches=patches
        )
        return self.logits(hidden), scalar_head(hidden, self.value_head[...]), aux
