"""The sampler's sections: `sampling` (the rlvr stage's sampler; `max_context` bounds every sampler
call) and `rejection` (the rejection_sampling stage), with their defaults and checks."""

from __future__ import annotations

from posttrain.config.fields import Section, bounded, choice, flag, free, parsed, section
from posttrain.config.syntax import finite
from posttrain.config.train import gate_field
from posttrain.errors import UserError

QUANT_MODES = ("none", "int8", "int4")  # models.quant
SAMPLING_LAYOUTS = ("learner", "tensor")  # sampling.layout


_CONTINUOUS = (lambda s: s.continuous_batching, "it cannot take effect without sampling.continuous_batching")


@section
class SamplingConfig(Section):
    """`sampling`: the rlvr stage's sampler (rollouts and held-out evals); `max_context` bounds every
    sampler call of a run. Which stages read which keys: `RunConfig.check_rules`."""

    KEY = "sampling"
    # none | int8 (w8a16) | int4 (w4a16): weights quantised from the learner's at each publish
    quantize: str = choice("none", QUANT_MODES)
    # learner (serve the learner's ZeRO-3 arrays) | tensor (a decode-layout copy made at each publish)
    layout: str = choice("learner", SAMPLING_LAYOUTS)
    # > 0: speculative decoding, k tokens drafted per round (same distribution, policy log-probs)
    speculative_k: int = bounded(0, ge=0)
    # the draft: the policy's first n layers + its final norm and head
    draft_layers: int = bounded(
        1, ge=1, inert_unless=(lambda s: s.speculative_k > 0, "no draft without sampling.speculative_k > 0")
    )
    prefix_cache: int = bounded(0, ge=0)  # > 0: keep prompt-prefix KV across sampler calls, bound in tokens
    continuous_batching: bool = flag(False)  # rollouts through continuously refilled decode slots
    num_slots: int = bounded(16, ge=1, inert_unless=_CONTINUOUS)  # decode slots (at most one call's samples)
    refill_batch: int = bounded(4, ge=1, inert_unless=_CONTINUOUS)  # free slots refilled this many at a time
    # longest prompt + new tokens any sampler call (rollouts, evals, long-context evals, tools) may need;
    # 0: the context the model was trained and configured for (core/lineage.py `configured_context`);
    # N: up to N tokens, explicitly (e.g. to measure past the trained length)
    max_context: int = bounded(0, ge=0)

    def check_rules(self) -> None:
        """Speculative decoding, the prefix cache and continuous batching exclude each other; the
        refill fits the slots."""
        if self.prefix_cache and self.speculative_k:
            raise UserError(
                f"sampling.prefix_cache={self.prefix_cache}: not supported with sampling.speculative_k="
                f"{self.speculative_k} (set one of them to 0)",
                key="sampling.prefix_cache",
            )
        if self.prefix_cache and self.continuous_batching:
            raise UserError(
                f"sampling.prefix_cache={self.prefix_cache}: not supported with sampling.continuous_batching "
                "(the continuous engine prefills every prompt whole); turn one of them off",
                key="sampling.prefix_cache",
            )
        if self.continuous_batching and self.speculative_k:
            raise UserError(
                f"sampling.continuous_batching with sampling.speculative_k={self.speculative_k}: speculative "
                "decoding runs in static batches only; turn one of them off",
                key="sampling.continuous_batching",
            )
        if not 1 <= self.refill_batch <= self.num_slots:
            raise UserError(
                f"sampling.refill_batch={self.refill_batch}: expected 1..sampling.num_slots ({self.num_slots})",
                key="sampling.refill_batch",
            )


@section
class RejectionConfig(Section):
    """`rejection`: the rejection_sampling stage (verified samples of the policy → SFT data). Prompts
    are RL training tasks (rl.domains, rl.train_files); sampling uses rl.max_new_tokens, top_k, top_p."""

    KEY = "rejection"
    STAGE = "rejection_sampling"
    prompts: int = bounded(256, ge=1)  # distinct training prompts, split over the domains by their weights
    samples_per_prompt: int = bounded(8, ge=1)  # N candidates sampled per prompt
    keep_per_prompt: int = bounded(1, ge=1)  # at most this many kept per prompt: the best by score, then shortest
    min_score: float = parsed(1.0, finite)  # a candidate passes when its reward >= this (and it has a verdict)
    max_tokens: int = bounded(0, ge=0)  # length filter: drop passing responses longer than this; 0: off
    temperature: float = bounded(1.0, ge=0)
    output: str = free("", "the SFT JSONL written (local or gs://); '' = {workdir}/sft.jsonl")
    # also write {output}.mixed.jsonl (sft.train_files, then the kept records); the next sft stage of a
    # pipeline trains on it instead of the kept records alone
    mix_original: bool = flag(False)
    gate: str = gate_field()  # e.g. "rejection/yield>=0.2" (stages/rejection_sampling.py lists the metrics)

    def check_rules(self) -> None:
        """A prompt keeps at most its candidates; greedy candidates are one; records go to JSONL."""
        if self.keep_per_prompt > self.samples_per_prompt:
            raise UserError(
                f"rejection.keep_per_prompt={self.keep_per_prompt}: at most rejection.samples_per_prompt="
                f"{self.samples_per_prompt} candidates exist per prompt",
                key="rejection.keep_per_prompt",
            )
        if self.temperature == 0 and self.samples_per_prompt > 1:
            raise UserError(
                f"rejection.temperature=0 (greedy) makes all rejection.samples_per_prompt="
                f"{self.samples_per_prompt} samples of a prompt the same: use samples_per_prompt=1 or a "
                "temperature > 0",
                key="rejection.temperature",
            )
        if self.output and not self.output.endswith(".jsonl"):
            raise UserError(
                f"rejection.output={self.output!r}: expected a .jsonl path (local or gs://), or '' for "
                "{workdir}/sft.jsonl",
                key="rejection.output",
            )
