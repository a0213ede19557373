"""Math verifier: extract the final answer from a response and compare it to the reference.

Extraction tries, in order: the last `\\boxed{...}` (or `\\fbox`), the last `#### x` line,
the last "the answer is x" / "final answer: x", and (optionally) the last number in the text.
Comparison is numeric first (commas, currency and percent signs, units, fractions, LaTeX
`\\frac`, decimals within a tolerance), then symbolic through `math-verify` (sympy) for
expressions, sets and intervals. Symbolic checks run in a worker process with a real timeout
on any thread (`symbolic.SymbolicChecker`); inputs that would surely hang (towers like
`2^{10^{10}}`) are refused by a cheap guard first. A check that fails or times out is reported
in `Verdict.error` (and counted, logged), never passed off as a wrong answer.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from posttrain.rl.verifiers.base import Verdict
from posttrain.rl.verifiers.symbolic import SymbolicChecker, SymbolicCheckError

SOURCES = ("boxed", "hash", "answer_is", "last_number")
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$")
_FRAC_RE = re.compile(rf"^([-+]?)\\[dt]?frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}$")
_SLASH_RE = re.compile(rf"^({_NUMBER})/({_NUMBER})$")
_WITH_UNITS_RE = re.compile(rf"^({_NUMBER}(?:/{_NUMBER})?)\s*[A-Za-z][A-Za-z .]*$")
_FIND_NUMBERS = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")
_HASH_RE = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS_RE = re.compile(r"(?:final answer|the answer)(?:\s+is|\s*:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_UNIT_WRAP_RE = re.compile(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}")
_SYMBOLIC_MAX_CHARS = 256
logger = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class MathTask:
    """A problem with a reference final answer (any text `answers_equal` understands)."""

    answer: str

    @classmethod
    def from_gsm8k(cls, row: Mapping[str, Any]) -> MathTask:
        """Task from a GSM8K record: the reference answer follows the last `#### `."""
        answer = row.get("answer")
        if not isinstance(answer, str) or "####" not in answer:
            raise ValueError(f"GSM8K record has no '#### answer' in its answer field: {str(answer)[:80]!r}")
        return cls(answer=answer.rsplit("####", 1)[1].strip())


@dataclasses.dataclass(frozen=True)
class Extracted:
    """An answer found in a response and the pattern that found it (one of SOURCES)."""

    text: str
    source: str


def _boxed(response: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (balanced braces), or None."""
    start, macro = max((response.rfind(m), m) for m in ("\\boxed", "\\fbox"))
    if start < 0:
        return None
    rest = response[start + len(macro) :].lstrip()
    if not rest.startswith("{"):
        match = re.match(r"[^\s$]+", rest)
        return match.group(0) if match else None
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"{": 1, "}": -1}.get(ch, 0)
        if depth == 0:
            return rest[1:i]
    return None


def _clip_sentence(text: str) -> str:
    """First clause of a free-text answer: "18 because ..." -> "18"."""
    text = re.split(r"\.\s|,\s|;|\s(?:because|since|so|which)\s", text + " ", maxsplit=1)[0]
    return text.strip().strip("*").rstrip(".").strip()


def extract_answer(response: str, *, last_number_fallback: bool = True) -> Extracted | None:
    """Final answer of a response, trying boxed, ####, "the answer is", then the last number."""
    boxed = _boxed(response)
    if boxed is not None and boxed.strip():
        return Extracted(boxed.strip(), "boxed")
    if found := _HASH_RE.findall(response):
        return Extracted(found[-1].strip(), "hash")
    if found := _ANSWER_IS_RE.findall(response):
        clipped = _clip_sentence(found[-1])
        if clipped:
            return Extracted(clipped, "answer_is")
    if last_number_fallback and (numbers := _FIND_NUMBERS.findall(response)):
        return Extracted(numbers[-1].rstrip("."), "last_number")
    return None


def _clean(text: str) -> tuple[str, bool]:
    """Strip math delimiters, currency, spacing macros and units; report a percent sign."""
    text = text.strip().strip("$").strip()
    text = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", text).strip()
    text = _UNIT_WRAP_RE.sub(lambda m: m.group(1), text)
    for junk in ("\\$", "$", "\\!", "\\,", "\\;", "{,}", "\\left", "\\right", "\\displaystyle"):
        text = text.replace(junk, "")
    text = re.sub(r"^[A-Za-z]\w*\s*=\s*", "", text.strip())  # "x = 5" -> "5"
    text = text.strip().rstrip(".").strip()
    percent = text.endswith("%")
    text = text.rstrip("%").rstrip("\\").strip()
    return text, percent


def _to_fraction(text: str) -> Fraction | None:
    text = text.replace(",", "")
    if not text or text in "+-." or not re.search(r"\d", text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str) -> list[Fraction] | None:
    """Numeric value(s) of an answer: "1,234.5", "$18", "3/4", "\\frac{3}{4}", "12 apples";
    a percent gives both readings ("50%" -> [50, 1/2]). None when not a plain number."""
    text, percent = _clean(text)
    value = None
    if _NUMBER_RE.match(text):
        value = _to_fraction(text)
    elif m := _FRAC_RE.match(text) or _SLASH_RE.match(text):
        groups = m.groups()
        sign, num, den = groups if len(groups) == 3 else ("", *groups)
        n, d = _to_fraction(num), _to_fraction(den)
        value = None if n is None or not d else (-1 if sign == "-" else 1) * n / d
    elif m := _WITH_UNITS_RE.match(text):
        return parse_number(m.group(1) + ("%" if percent else ""))
    if value is None:
        return None
    return [value, value / 100] if percent else [value]


def reference_tolerance(ref: str) -> Fraction:
    """Half a unit in the last digit the reference writes ("3.14" -> 0.005, "1.5e3" -> 50):
    a prediction that rounds to the reference equals it. Integers and fractions are exact (0)."""
    m = re.search(r"\d(?:\.(\d+))?(?:[eE]([-+]?\d+))?\s*$", _clean(ref)[0].replace(",", ""))
    if m is None or not (m.group(1) or m.group(2)):
        return Fraction(0)
    return Fraction(1, 2) * Fraction(10) ** (int(m.group(2) or 0) - len(m.group(1) or ""))


def _symbolic_safe(text: str) -> bool:
    """Refuse inputs that make sympy compute for ever: long text, towers of powers, big
    exponents, factorials of anything but small literals."""
    if len(text) > _SYMBOLIC_MAX_CHARS:
        return False
    for op in re.finditer(r"\^|\*\*", text):
        exponent = _operand(text, op.end())
        after = text[op.end() :].lstrip()[len(exponent) :].lstrip()
        if re.search(r"\^|\*\*|!|\d{6,}", exponent) or after.startswith(("^", "**")):
            return False  # towers like 2^{10^{10}} or 2**2**2**2**2**2
    return not re.search(r"(?<![\d\sA-Za-z])!|\d{4,}\s*!", text)


def _operand(text: str, start: int) -> str:
    """The exponent that starts at text[start]: a balanced {...} or (...) group, else a token."""
    rest = text[start:].lstrip()
    if not rest or rest[0] not in "{(":
        return re.match(r"[^\s+\-*/=,]*", rest).group(0)
    depth = 0
    for i, ch in enumerate(rest):
        depth += 1 if ch in "{(" else -1 if ch in "})" else 0
        if depth == 0:
            return rest[: i + 1]
    return rest


_DEFAULT_CHECKER: SymbolicChecker | None = None
_DEFAULT_LOCK = threading.Lock()


def default_checker() -> SymbolicChecker:
    """The process-wide symbolic checker (5 s timeout) for callers that bring none."""
    global _DEFAULT_CHECKER
    with _DEFAULT_LOCK:
        if _DEFAULT_CHECKER is None:
            _DEFAULT_CHECKER = SymbolicChecker(timeout=5.0)
        return _DEFAULT_CHECKER


def symbolic_equal(pred: str, ref: str, checker: SymbolicChecker | None = None) -> bool:
    """Equivalence through math-verify (sympy): expressions, sets, intervals, equations. False
    for inputs the guard refuses; SymbolicCheckError when the check fails or times out."""
    if not (_symbolic_safe(pred) and _symbolic_safe(ref)):
        return False
    return (checker or default_checker()).equal(pred, ref)


def answers_equal(pred: str, ref: str, *, symbolic: bool = True, checker: SymbolicChecker | None = None) -> bool:
    """True when the predicted answer equals the reference: same text, same number (exactly
    when the reference is an integer or fraction, to the reference's own precision when it is
    a decimal -- `reference_tolerance`; either reading of a percent), or (symbolic=True) equivalent
    expressions (`symbolic_equal` on `checker`, which may raise SymbolicCheckError)."""
    if _clean(pred)[0].replace(" ", "") == _clean(ref)[0].replace(" ", ""):
        return True
    p, r = parse_number(pred), parse_number(ref)
    if p is not None and r is not None:
        tol = reference_tolerance(ref)  # readings of a percent reference scale with their value
        return any(abs(a - b) <= tol * (b / r[0] if r[0] else 1) for a in p for b in r)
    return symbolic and symbolic_equal(pred, ref, checker)


@dataclasses.dataclass
class MathVerifier:
    """Verifier for MathTask: correct = 1 when the extracted answer equals the reference;
    format_ok when the answer came from one of `format_sources` (not the bare last number).
    A symbolic check may take `symbolic_timeout` seconds (in this verifier's worker process);
    one that fails or times out gives a Verdict with `error` set, counted in `errors`."""

    last_number_fallback: bool = True
    format_sources: tuple[str, ...] = ("boxed", "hash", "answer_is")
    symbolic: bool = True
    symbolic_timeout: float = 5.0
    errors: int = dataclasses.field(default=0, init=False, compare=False)

    def __post_init__(self) -> None:
        unknown = set(self.format_sources) - set(SOURCES)
        if unknown:
            raise ValueError(f"MathVerifier.format_sources has unknown {sorted(unknown)}; valid: {SOURCES}")
        self._checker = SymbolicChecker(self.symbolic_timeout)
        self._errors_lock = threading.Lock()

    def verify(self, task: MathTask, response: str) -> Verdict:
        """Verdict for one response."""
        found = extract_answer(response, last_number_fallback=self.last_number_fallback)
        if found is None:
            return Verdict(0.0, False, "no answer found")
        format_ok = found.source in self.format_sources
        try:
            ok = answers_equal(found.text, task.answer, symbolic=self.symbolic, checker=self._checker)
        except Exception as e:  # a failed or timed-out check is no verdict: reported, counted, logged
            error = str(e) if isinstance(e, SymbolicCheckError) else f"{type(e).__name__}: {e}"
            with self._errors_lock:
                self.errors += 1
                count = self.errors
            logger.warning("math verifier error %d: %s", count, error)
            return Verdict(0.0, format_ok, f"{found.source}: {found.text[:80]!r} not checked", error=error)
        return Verdict(
            float(ok), format_ok, f"{found.source}: {found.text[:80]!r} {'==' if ok else '!='} {task.answer[:80]!r}"
        )

    def verify_many(self, tasks: Sequence[MathTask], responses: Sequence[str]) -> list[Verdict]:
        """Verdicts for many responses (sequential: each is microseconds to milliseconds)."""
        if len(tasks) != len(responses):
            raise ValueError(f"{len(tasks)} tasks but {len(responses)} responses")
        return [self.verify(t, r) for t, r in zip(tasks, responses)]
