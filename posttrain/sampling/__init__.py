"""The sampler: KV-cached prefill and decode in one jitted loop, sampling rules, groups and
continuous batching, on the learner's own sharded weights."""

from posttrain.sampling.continuous import ContinuousBatcher
from posttrain.sampling.engine import STOP_REASONS
from posttrain.sampling.generate import Samples, SlotConfig, generate
from posttrain.sampling.rules import SamplingParams, policy_logprobs, sample_token, sampling_logprobs

__all__ = [
    "STOP_REASONS",
    "ContinuousBatcher",
    "SamplingParams",
    "Samples",
    "SlotConfig",
    "generate",
    "policy_logprobs",
    "sample_token",
    "sampling_logprobs",
]
