"""`rl.curriculum`: the task scheduler's pass-rate bands and retirement (rl/tasks/scheduler.py)."""

from __future__ import annotations

from posttrain.config.fields import Section, bounded, parsed, section
from posttrain.config.syntax import parse_ints, parse_weights
from posttrain.errors import UserError


@section
class CurriculumConfig(Section):
    """`rl.curriculum`: the task scheduler's pass-rate bands and retirement (rl/tasks/scheduler.py)."""

    KEY = "rl.curriculum"
    STAGE = "rlvr"
    # e.g. "new:1,hard:0.5,medium:4,easy:0.2": draw a band by weight, then a task in it
    band_weights: str = parsed("", parse_weights)
    hard_below: float = bounded(0.2, ge=0, le=1)  # pass rate < this: band "hard"
    easy_above: float = bounded(0.8, ge=0, le=1)  # pass rate > this: band "easy" (else "medium")
    min_attempts: int = bounded(1, ge=1)  # samples before a task leaves band "new"
    window: int = bounded(0, ge=0)  # pass rate over a task's last n samples (0: all of them)
    retire_above: float = bounded(-1.0, le=1)  # >= 0: retire (never draw again) tasks whose pass rate is >= this
    retire_below: float = bounded(-1.0, le=1)  # >= 0: retire tasks whose pass rate is < this (too hard)
    retire_after: int = bounded(16, ge=1)  # samples of a task before it may retire
    pass_threshold: float = bounded(0.5, ge=0, le=1)  # a sample passes when its reward >= this
    # reasoning-gym domains (rl.domains=rg:<dataset>): their tasks are drawn at these levels of the
    # dataset's curriculum ("0,1,2", an equal share each, labelled level<n>: per-level metrics, and the
    # bands above steer draws towards the levels the policy half solves); "": the generator's defaults
    rg_levels: str = parsed("", parse_ints)

    def check_rules(self) -> None:
        """Bands in order; no key set that the rest leaves without effect."""
        if not self.hard_below <= self.easy_above:
            raise UserError(
                f"rl.curriculum: expected 0 <= hard_below ({self.hard_below}) <= easy_above ({self.easy_above}) "
                f"<= 1 and pass_threshold ({self.pass_threshold}) in [0, 1]",
                key="rl.curriculum.hard_below",
            )
        levels = parse_ints(self.rg_levels)
        if any(level < 0 for level in levels) or len(set(levels)) != len(levels):
            raise UserError(
                f"rl.curriculum.rg_levels={self.rg_levels!r}: expected distinct levels >= 0",
                key="rl.curriculum.rg_levels",
            )
        weighted = bool(self.band_weights.strip())
        retiring = self.retire_above >= 0 or self.retire_below >= 0
        defaults = CurriculumConfig.__dataclass_fields__
        active = {
            "hard_below": weighted,
            "easy_above": weighted,
            "min_attempts": weighted or retiring,
            "window": weighted or retiring,
            "retire_after": retiring,
        }
        for key, takes_effect in active.items():
            if getattr(self, key) != defaults[key].default and not takes_effect:
                why = (
                    "only retirement uses it: set rl.curriculum.retire_above or retire_below >= 0"
                    if key == "retire_after"
                    else "it places tasks in bands, and bands steer nothing without rl.curriculum.band_weights"
                    + (
                        ""
                        if key in ("hard_below", "easy_above")
                        else " or retirement (retire_above / retire_below >= 0)"
                    )
                )
                raise UserError(
                    f"rl.curriculum.{key}={getattr(self, key)!r} cannot take effect: {why}", key=f"rl.curriculum.{key}"
                )
