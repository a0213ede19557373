"""Sampling rules: temperature, top-k, top-p (nucleus) and greedy, as pure functions of logits."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from posttrain.errors import UserError
from posttrain.models.logprobs import token_logprobs


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample completions. Hashable: it is a static argument of the compiled sampler.

    temperature 0 is greedy (argmax); top_k 0 and top_p 1 switch those filters off. Generation
    stops at any of `stop_ids` (the stop token is part of the completion) or after
    `max_new_tokens`. `num_samples` completions are drawn per prompt (a GRPO group).
    `speculative_k` > 0 decodes speculatively (`sampling.speculative`): the same distribution,
    k tokens drafted per round by the policy's first `draft_layers` layers. `record_routing`: also
    return the experts every MoE layer chose for each prompt and generated token (static batches
    only; `model.moe.routing_replay = sampler` replays them in the learner).
    k tokens drafted per round by the policy's first `draft_layers` layers. `max_context` > 0:
    the longest prompt + max_new_tokens a call may ask for (`sampling.max_context`, resolved by
    `core.lineage.max_context`; 0 = unchecked); not part of the compiled program (no compare).
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 64
    stop_ids: tuple[int, ...] = ()
    num_samples: int = 1
    speculative_k: int = 0  # > 0: speculative decoding, k draft tokens per round (`sampling.speculative`)
    draft_layers: int = 1  # the draft: the policy's first n layers + its final norm and head
    record_routing: bool = False  # return each token's experts per MoE layer (`Samples.routing`)
    max_context: int = dataclasses.field(default=0, compare=False)  # checked before compiling, not compiled

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"SamplingParams.temperature={self.temperature}: expected >= 0 (0 = greedy)")
        if self.top_k < 0:
            raise ValueError(f"SamplingParams.top_k={self.top_k}: expected >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p={self.top_p}: expected a value in (0, 1]")
        if self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams.max_new_tokens={self.max_new_tokens}: expected >= 1")
        if self.num_samples < 1:
            raise ValueError(f"SamplingParams.num_samples={self.num_samples}: expected >= 1")
        if self.max_context < 0:
            raise ValueError(f"SamplingParams.max_context={self.max_context}: expected >= 0 (0 = unchecked)")
        if self.speculative_k < 0 or self.draft_layers < 1:
            raise ValueError(
                f"SamplingParams.speculative_k={self.speculative_k}, draft_layers={self.draft_layers}: "
                "expected speculative_k >= 0 (0 = off) and draft_layers >= 1"
            )
        object.__setattr__(self, "stop_ids", tuple(sorted({int(i) for i in self.stop_ids})))

    @property
    def greedy(self) -> bool:
        """Whether sampling is argmax (temperature 0)."""
        return self.temperature == 0

    def check_context(self, prompt_lengths, new_tokens) -> None:
        """Refuse a request past `max_context` (when > 0): a prompt of `prompt_lengths[i]` tokens
        with up to `new_tokens[i]` new ones needs that many positions, and a model sampled past the
        context it was trained for degrades silently. UserError naming `sampling.max_context`."""
        if not self.max_context:
            return
        need = [int(p) + int(n) for p, n in zip(prompt_lengths, new_tokens)]
        if need and (longest := max(need)) > self.max_context:
            i = need.index(longest)
            raise UserError(
                f"sampling.max_context={self.max_context}: a request needs {longest} positions (prompt of "
                f"{int(prompt_lengths[i])} tokens + max_new_tokens {int(new_tokens[i])}), past the context "
                f"the model is trained and configured for ({self.max_context}); shorten the prompts or "
                f"max_new_tokens, or set --config.sampling.max_context={longest} (or more) to sample past it "
                "explicitly",
                key="sampling.max_context",
            )


def sampling_logprobs(logits: jax.Array, params: SamplingParams) -> jax.Array:
    """Log-probabilities of the distribution actually sampled: logits [..., V] → [..., V] float32.

    Applied in the Hugging Face order: temperature, then top-k (ties with the k-th value are kept),
    then top-p (the smallest set of most likely tokens whose mass reaches top_p, including the one
    that crosses it). Tokens filtered out get -inf. Greedy puts all mass on the argmax.
    """
    logits = logits.astype(jnp.float32)
    vocab = logits.shape[-1]
    if params.top_k > vocab:
        raise ValueError(f"SamplingParams.top_k={params.top_k}: larger than the vocabulary ({vocab})")
    if params.greedy:
        best = jax.nn.one_hot(jnp.argmax(logits, axis=-1), vocab, dtype=bool)
        return jnp.where(best, 0.0, -jnp.inf)
    logits = logits / params.temperature
    if params.top_k:
        kth = jax.lax.top_k(logits, params.top_k)[0][..., -1:]
        logits = jnp.where(logits >= kth, logits, -jnp.inf)
    if params.top_p < 1:
        probs = jax.nn.softmax(logits, axis=-1)
        desc = -jnp.sort(-probs, axis=-1)
        mass_before = jnp.cumsum(desc, axis=-1) - desc
        # the smallest kept probability: the last sorted one whose preceding mass is < top_p
        floor = jnp.min(jnp.where(mass_before < params.top_p, desc, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(probs >= floor, logits, -jnp.inf)
    return jax.nn.log_softmax(logits, axis=-1)


def policy_logprobs(logits: jax.Array, targets: jax.Array, params: SamplingParams) -> jax.Array:
    """log-prob of each target under the distribution the sampler draws from, differentiable in
    the logits: logits [B, S, V], targets [B, S] → [B, S] float32.

    What the RL learner optimises: log softmax(logits / T) renormalised over the tokens top-k /
    top-p keep (`sampling_logprobs`). Which tokens are kept is a choice, not a function to
    differentiate (it carries no gradient), and the target is always kept: a token the sampler
    drew was in its set, and after an update it keeps a finite log-prob. Greedy decoding (T = 0)
    has no log-probs to learn from and is refused.
    """
    return token_logprobs(_support_logits(logits, targets, params), targets)


def support_logprobs(logits: jax.Array, targets: jax.Array, params: SamplingParams) -> jax.Array:
    """The full distribution `policy_logprobs` normalises over: logits [B, S, V] → [B, S, V]
    float32 log-probs, −inf off the sampled support (top-k / top-p, plus the target). What the
    RL learner's entropy is taken over."""
    return jax.nn.log_softmax(_support_logits(logits, targets, params), axis=-1)


def _support_logits(logits: jax.Array, targets: jax.Array, params: SamplingParams) -> jax.Array:
    """logits / T with the tokens top-k / top-p drop set to −inf (the choice carries no gradient;
    the target is always kept)."""
    if params.greedy:
        raise ValueError(
            "policy_logprobs: temperature 0 (greedy) puts all mass on one token; a policy "
            "gradient needs a sampled distribution (temperature > 0)"
        )
    logits = logits.astype(jnp.float32)
    scaled = logits / params.temperature
    if params.top_k or params.top_p < 1:
        kept = jax.lax.stop_gradient(sampling_logprobs(logits, params)) > -jnp.inf
        kept = kept | jax.nn.one_hot(targets, logits.shape[-1], dtype=bool)
        scaled = jnp.where(kept, scaled, -jnp.inf)
    return scaled


def sample_token(key: jax.Array, logits: jax.Array, params: SamplingParams) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Draw one token from logits [V] → (token, policy log-prob, sampling log-prob), scalars.

    The policy log-prob is log softmax(logits)[token] before temperature and filters: the untempered
    policy (`models.logprobs.token_logprobs`). The sampling log-prob is under the
    distribution drawn from (`sampling_logprobs`); the two differ unless temperature is 1 with no
    filters.
    """
    logits = logits.astype(jnp.float32)
    sampled = sampling_logprobs(logits, params)
    token = jnp.argmax(sampled) if params.greedy else jax.random.categorical(key, sampled)
    policy = token_logprobs(logits[None, None], token[None, None])[0, 0]
    return token, policy, sampled[token]
