"""The small languages some config values are written in, read once here: the fields that hold them
declare these as their checks (`fields.parsed`), and the modules that act on the values call the same
functions. Each raises ValueError saying what is wrong (the field adds its key). Imports no jax."""

from __future__ import annotations

import ast
import dataclasses
import math
import operator
import re

OPS = {"<": operator.lt, "<=": operator.le, ">": operator.gt, ">=": operator.ge}
_CONDITION = re.compile(r"^\s*([\w/@.:\-]+)\s*(<=|>=|<|>)\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*$")


@dataclasses.dataclass(frozen=True)
class Condition:
    """`metric op threshold`: one condition of a gate."""

    metric: str
    op: str
    threshold: float

    def __str__(self) -> str:
        return f"{self.metric} {self.op} {self.threshold:g}"


def parse_gate(spec: str, key: str = "gate") -> list[Condition]:
    """ "a>=0.6, b<=0.02" → conditions; a ValueError naming `key` on any malformed part."""
    conditions = []
    for part in spec.split(","):
        if not part.strip():
            if spec.strip():
                raise ValueError(f"{key}={spec!r}: empty condition (a stray comma?)")
            continue
        m = _CONDITION.match(part)
        if not m:
            raise ValueError(
                f"{key}={spec!r}: cannot read {part.strip()!r}; expected 'metric op number' with op "
                f"one of {' '.join(OPS)}, conditions separated by commas, e.g. 'eval/loss<1.5, "
                "regression_drop<=0.02'"
            )
        conditions.append(Condition(m.group(1), m.group(2), float(m.group(3))))
    return conditions


def gate_syntax(spec: str) -> None:
    """A gate's syntax alone (the field check; the stage checks the metrics it names)."""
    for part in spec.split(","):
        if part.strip() and not _CONDITION.match(part):
            raise ValueError(
                f"cannot read {part.strip()!r}; expected 'metric op number' with op one of {' '.join(OPS)}, "
                "conditions separated by commas, e.g. 'eval/loss<1.5, regression_drop<=0.02'"
            )
        if not part.strip() and spec.strip():
            raise ValueError("empty condition (a stray comma?)")


FAMILIES = ("rg",)  # domain families named "<family>:<member>" (rl.domains=rg:chain_sum:2)


def parse_weights(spec: str) -> dict[str, float]:
    """ "arithmetic:2,gsm8k" → {"arithmetic": 2.0, "gsm8k": 1.0} ("" → {}); a family member keeps
    its prefix: "rg:chain_sum:2" → {"rg:chain_sum": 2.0}."""
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, weight = part.partition(":")
        if name.strip() in FAMILIES:
            member, _, weight = weight.partition(":")
            name = f"{name.strip()}:{member.strip()}"
        try:
            out[name.strip()] = float(weight) if weight else 1.0
        except ValueError:
            raise ValueError(f"{part!r} is not name[:weight]") from None
        if not name.strip() or name.endswith(":") or not math.isfinite(out[name.strip()]) or out[name.strip()] < 0:
            raise ValueError(f"{part!r}: expected name[:weight] with a finite weight >= 0")
    return out


def parse_settings(spec: str) -> dict[str, dict[str, object]]:
    """ "chain_sum.max_terms=4; basic_arithmetic.operators=('+', '-')" → {"chain_sum": {"max_terms": 4},
    ...}: `;`-separated `<dataset>.<setting>=<Python literal>` (a bare word is a string)."""
    out: dict[str, dict[str, object]] = {}
    for part in filter(None, (p.strip() for p in str(spec).split(";"))):
        key, eq, value = part.partition("=")
        dataset, dot, setting = key.strip().partition(".")
        if not eq or not dot or not dataset or not setting.isidentifier():
            raise ValueError(f"{part!r} is not <dataset>.<setting>=<value>, e.g. 'chain_sum.max_terms=4'")
        try:
            parsed = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError):
            parsed = value.strip()
        if setting in out.setdefault(dataset, {}):
            raise ValueError(f"{dataset}.{setting} is set twice")
        out[dataset][setting] = parsed
    return out


def parse_renames(spec: str) -> dict[str, str] | None:
    """ "prompt=question,response=answer" → {"prompt": "question", ...} ("" → None)."""
    if not spec:
        return None
    pairs = [kv for kv in spec.split(",") if kv]
    if not all("=" in kv for kv in pairs):
        raise ValueError("expected field renames 'ours=theirs,...', e.g. 'prompt=question,response=answer'")
    return dict(kv.split("=", 1) for kv in pairs)


def parse_ints(spec: str) -> list[int]:
    """ "1,4" → [1, 4]."""
    try:
        return [int(k) for k in str(spec).split(",") if k.strip()]
    except ValueError:
        raise ValueError("expected comma-separated integers, e.g. '1,4'") from None


def parse_steps(spec: str) -> str | list[int]:
    """`eval.steps`: "latest" | "all" | "100,200"."""
    spec = str(spec).strip()
    return spec if spec in ("latest", "all") else parse_ints(spec)


def parse_truncated_reward(value: str) -> str | float:
    """`rl.truncated_reward` → "min", "none" or a finite float."""
    if value in ("min", "none"):
        return value
    try:
        number = float(value)
    except ValueError:
        number = math.nan
    if not math.isfinite(number):
        raise ValueError(
            "expected 'min' (the lowest judged reward of the batch), 'none' (as the reward sources score it) or a "
            "finite number such as '-1'"
        )
    return number


def finite(value: float) -> None:
    """A finite number."""
    if not math.isfinite(value):
        raise ValueError("expected a finite number")
