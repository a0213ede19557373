"""Token log-probabilities: the one definition the sampler, the learners and DPO share.

It lives below `sampling` and `train`/`rl` (both import it) so that a behaviour log-prob recorded
by the sampler and the learner's log-prob of the same token come from the same formula.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def token_logprobs(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """log p(target) per position, in float32. logits [B, S, V], targets [B, S] → [B, S]."""
    logits = logits.astype(jnp.float32)
    picked = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return picked - jax.nn.logsumexp(logits, axis=-1)
