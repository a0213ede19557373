"""Staged context extension: the sequence length of each training step (`train.seq_len_schedule`).

    "256:20,1024"      256 tokens for steps 0..19, then 1024 until train.steps
    "128:10,512:30,2048"

Each entry but the last is `length:steps`; the last is the length the run ends at and must equal
`train.seq_len` (the length evaluation uses). The schedule is a pure function of the step, so a
resumed run knows its stage from the checkpoint's step alone.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
from collections.abc import Callable, Iterator

KEY = "train.seq_len_schedule"


@dataclasses.dataclass(frozen=True)
class SeqLenSchedule:
    """Stage i trains at lengths[i] from step starts[i] (starts[0] = 0) until the next start."""

    lengths: tuple[int, ...]
    starts: tuple[int, ...]

    def stage_at(self, step: int) -> int:
        """The index of the stage that step `step` belongs to."""
        return bisect.bisect_right(self.starts, step) - 1

    def length_at(self, step: int) -> int:
        """The sequence length of step `step`."""
        return self.lengths[self.stage_at(step)]

    @property
    def max_length(self) -> int:
        return max(self.lengths)


def parse_seq_len_schedule(text: str, seq_len: int, steps: int) -> SeqLenSchedule:
    """`train.seq_len_schedule` → SeqLenSchedule; "" is one stage at `seq_len`. Raises ValueError
    naming the key for malformed text, non-positive numbers, a last length other than
    `train.seq_len`, or stages that `train.steps` never reaches."""
    if not text.strip():
        return SeqLenSchedule((seq_len,), (0,))

    def bad(why: str) -> ValueError:
        return ValueError(f"{KEY}={text!r}: {why}; expected 'length:steps,...,length', e.g. '256:20,1024'")

    lengths, starts, at = [], [], 0
    entries = [e.strip() for e in text.split(",")]
    for i, entry in enumerate(entries):
        last = i == len(entries) - 1
        parts = entry.split(":")
        if len(parts) != (1 if last else 2):
            raise bad(
                f"entry {entry!r} should be {'length (the last runs to train.steps)' if last else 'length:steps'}"
            )
        try:
            numbers = [int(p) for p in parts]
        except ValueError:
            raise bad(f"entry {entry!r} is not integers") from None
        if min(numbers) <= 0:
            raise bad(f"entry {entry!r}: lengths and step counts must be positive")
        lengths.append(numbers[0])
        starts.append(at)
        at += numbers[1] if not last else 0
    if any(b < a for a, b in zip(lengths, lengths[1:])):
        raise bad(f"lengths {lengths} decrease; stages may only extend the context")
    if lengths[-1] != seq_len:
        raise bad(
            f"the last length {lengths[-1]} must equal train.seq_len={seq_len} (the length the run ends at "
            "and evaluates with)"
        )
    if starts[-1] >= steps:
        raise bad(f"the stages before the last take {starts[-1]} steps but train.steps={steps}")
    return SeqLenSchedule(tuple(lengths), tuple(starts))


class ScheduledBatches:
    """The batch of each step under a `SeqLenSchedule`: at a stage boundary the data continues from
    the same read position, re-packed to the new length (`make(length)` builds an iterator at a
    length; it must offer `continue_from(previous)`). With one stage it is just `single`.

    The state adds the stage whose iterator saved it, so a run resumed anywhere, before, at or
    after a boundary, reads exactly the batches of the uninterrupted run.
    """

    def __init__(
        self, schedule: SeqLenSchedule, single: Iterator, make: Callable[[int], Iterator] | None, stage_name: str
    ):
        self.schedule, self._make = schedule, make
        self.staged = len(schedule.lengths) > 1
        if self.staged and make is None:
            raise ValueError(
                f"{KEY}: stage {stage_name!r} cannot change its sequence length during a run "
                "(supported by stages lm and sft)"
            )
        self.stage = 0
        self.batches = make(schedule.lengths[0]) if self.staged else single

    def at(self, step: int) -> dict:
        """The batch for step `step` (steps come in order), switching stage first when it starts."""
        i = self.schedule.stage_at(step)
        if i != self.stage:
            logging.info(
                "step %d: sequence length %d → %d (%s)",
                step,
                self.schedule.lengths[self.stage],
                self.schedule.lengths[i],
                KEY,
            )
            new = self._make(self.schedule.lengths[i])
            new.continue_from(self.batches)
            self.batches, self.stage = new, i
        return next(self.batches)

    @property
    def length(self) -> int:
        """The current stage's sequence length."""
        return self.schedule.lengths[self.stage]

    def get_state(self) -> dict:
        state = self.batches.get_state() if hasattr(self.batches, "get_state") else {}
        return {**state, "seq_len_stage": self.stage} if self.staged else state

    def set_state(self, state: dict) -> None:
        state = dict(state)
        i = state.pop("seq_len_stage", 0)
        if self.staged and i != self.stage:
            self.batches, self.stage = self._make(self.schedule.lengths[i]), i
        if hasattr(self.batches, "set_state"):
            self.batches.set_state(state)
