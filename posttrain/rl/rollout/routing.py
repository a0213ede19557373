"""MoE routing replay (`model.moe.routing_replay`): the experts the sampler chose for every token
travel with the rollout to the learner, which routes each token to those experts instead of its own
top-k choice.

Why: the sampler and the learner compute the same policy with different numerics (quantised sampler
weights, bfloat16, another layout, a KV cache instead of a full forward). Near a tie in the router
that flips a token's experts, and the learner then trains a different sub-network from the one
that produced the token; its log-probs, importance ratios and gradients are off by more than the
numerics alone. Replaying the choice makes learner and sampler agree on routing exactly.

What is replayed is the choice only: the gate weights are the learner's own router probabilities
(softmax) or scores (sigmoid) of the replayed experts, renormalised as the model does
(`norm_topk_prob`, `routed_scaling`; `models.moe.router.route`), so the router keeps its gradient
(R3 / verl-style replay). The reference model of a KL term routes on its own (its routing is part
of the reference policy); the proximal and current policy replay.

Recorded by the static sampler (`SamplingParams.record_routing`): prefill records the prompt's
experts, each decode step those of the token it feeds. The continuous, speculative and prefix-cache
samplers and multi-turn episodes do not record them; the run config refuses those combinations
(`RunConfig._check_routing_replay`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from posttrain.config import ROUTING_REPLAY

__all__ = ["ROUTING_REPLAY", "trajectory_routing", "batch_routing"]


def trajectory_routing(samples, i: int, traj) -> np.ndarray:
    """Sample i's recorded experts placed at the tokens of its trajectory: [len(tokens), layers, k]
    int32, the prompt's from prefill, then the generated tokens' (`Samples.routing`)."""
    prompt, generated = samples.prompt_routing[i], samples.routing[i]
    new = len(traj.tokens) - traj.prompt_len
    if traj.prompt_len > len(prompt) or new > len(generated):
        raise ValueError(
            f"sample {i}: a trajectory of {traj.prompt_len} prompt and {new} generated tokens, routing "
            f"recorded for {len(prompt)} and {len(generated)}"
        )
    return np.concatenate([prompt[: traj.prompt_len], generated[:new]]).astype(np.int32)


def batch_routing(routing: Sequence[np.ndarray], num_rows: int, length: int) -> np.ndarray:
    """The learner batch's `routing` [num_rows, length, layers, k] int32 from each trajectory's
    (`trajectory_routing`): row i's inputs are tokens[:-1], so it takes routing[:-1]; padding
    (positions and rows) routes to expert 0, any valid expert: those tokens are masked out."""
    layers_k = routing[0].shape[1:]
    out = np.zeros((num_rows, length, *layers_k), np.int32)
    for i, r in enumerate(routing):
        out[i, : len(r) - 1] = r[:-1]
    return out
