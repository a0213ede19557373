"""Math verifier: extract the final answer from a response and compare its value to the reference.

Extraction (after dropping `<think>...</think>` blocks: reasoning is not an answer) tries, in
order: the last `\\boxed{...}` (or `\\fbox`), the last `#### x` line, the last "the answer is x" /
"final answer: x", and (optionally) the last number in the text.

Rules: a value, not a text (issue 25). A policy is paid for the final answer it commits to, never for
restating the question or hedging:
- Several different answers of the chosen kind (`\\boxed{84}\\boxed{85}`, two "the answer is"
  with different values, "the answer is 84, 85", "84 or 85") score 0; an empty `\\boxed{}` is an
  answer (an empty one) and scores 0 without falling back to the text.
- Digits must be ASCII: fullwidth or other unicode digits (`８５`) are refused.
- When the reference is a plain number (integer, decimal, fraction, percent: arithmetic, GSM8K,
  numeric MATH answers) the answer must be a number: `85`, `-0`, `+5`, `1,000`, `1e3`,
  `1.5\\times10^{3}` (mantissa in [1, 10)), `85.0`, `$85`, `85 apples`, `85\\text{ cm}`, `90^\\circ`,
  `x = 85`, a fraction in lowest terms (`3/4`, `\\frac{3}{4}`, `\\dfrac{-3}{4}`), a percent (either
  reading: `50%` matches 50 and 0.5). Anything with an operation left to perform is refused
  without a symbolic check: `37+48`, `6*7`, `(37+48)`, `85=85`, `x=37+48`, `2^{10}`, `10^3`,
  `\\sqrt{4}`, `6/4` against 3/2 (not in lowest terms), `\\frac{4}{2}`, `0.1+0.2`.
  Decimals match to the reference's own precision (`reference_tolerance`).
- When the reference is a constant in closed form (`\\sqrt{8}`, `2\\pi`, `\\frac{\\sqrt{3}}{2}`),
  the answer must be a closed form with no free operation (`answer_form.free_operation`: no sum or
  product of two numbers, no like terms, no root or power that evaluates to a rational, fractions in
  lowest terms, no equation, no symbol or construct outside the grammar such as `\\log`); then
  the symbolic check decides equality (`2\\sqrt{2}` and `\\sqrt{8}` are both right).
- Other references (expressions in variables, sets, intervals, text) keep the symbolic check
  through `math-verify` (sympy): `(x+1)^2` equals `x^2+2x+1`.
The accept/refuse table is tests/data/math_answer_forms.json. Symbolic checks run in a worker
process with a real timeout on any thread (`symbolic.SymbolicChecker`); inputs that would surely
hang (towers like `2^{10^{10}}`) are refused by a cheap guard first. A check that fails or times
out is reported in `Verdict.error` (and counted, logged), never passed off as a wrong answer.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import re
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from posttrain.config.registry import VERIFIERS
from posttrain.data.examples import field_text
from posttrain.rl.verifiers.answer_form import free_operation, is_constant
from posttrain.rl.verifiers.base import Verdict, VerifierEntry
from posttrain.rl.verifiers.symbolic import SymbolicChecker, SymbolicCheckError

SOURCES = ("boxed", "hash", "answer_is", "last_number")
_NUMBER = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"^{_NUMBER}$", re.ASCII)
_FRAC_RE = re.compile(rf"^([-+]?)\\[dt]?frac\{{({_NUMBER})\}}\{{({_NUMBER})\}}$", re.ASCII)
_SLASH_RE = re.compile(rf"^({_NUMBER})/({_NUMBER})$", re.ASCII)
_SCI_RE = re.compile(r"^([-+]?\d(?:\.\d+)?)\s*(?:\\times|\\cdot|\*)\s*10\s*\^\s*\{?([-+]?\d+)\}?$", re.ASCII)
_WITH_UNITS_RE = re.compile(rf"^({_NUMBER}(?:/{_NUMBER})?)\s*[A-Za-z][A-Za-z .]*$", re.ASCII)
_LIST_TAIL_RE = re.compile(r"\d\s*(?:[,;]|\bor\b|\band\b)?\s*$")
_THINK_RE = re.compile(r"<think>.*?(?:</think>|$)", re.DOTALL | re.IGNORECASE)
_HEDGE_RE = re.compile(r"^\s*\S+?\s*(?:,\s+|\s+or\s+|\s+and\s+)(?:or\s+)?[-+$]*(?:\d|\\(?:[dt]?frac|sqrt|pi)\b)")
_FIND_NUMBERS = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+(?:\.\d+)?)?|-?\.\d+")
_HASH_RE = re.compile(r"####\s*([^\n]+)")
_ANSWER_IS_RE = re.compile(r"(?:final answer|the answer)(?:\s+is|\s*:)\s*:?\s*([^\n]+)", re.IGNORECASE)
_UNIT_WRAP_RE = re.compile(r"\\(?:text|mbox|mathrm|textbf)\{([^{}]*)\}")
_SYMBOLIC_MAX_CHARS = 256
_MAX_EXPONENT = 400  # decimal exponents beyond this are no answer (and would be slow to build)
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


def _all_boxed(response: str) -> list[str]:
    """Contents of every \\boxed{...} / \\fbox{...} (balanced braces), in order."""
    out = []
    for m in re.finditer(r"\\(?:boxed|fbox)", response):
        rest = response[m.end() :].lstrip()
        if not rest.startswith("{"):
            match = re.match(r"[^\s$]+", rest)
            out += [match.group(0)] if match else []
            continue
        depth = 0
        for i, ch in enumerate(rest):
            depth += {"{": 1, "}": -1}.get(ch, 0)
            if depth == 0:
                out.append(rest[1:i])
                break
    return out


def _boxed(response: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...}, or None."""
    found = _all_boxed(response)
    return found[-1] if found else None


def strip_think(response: str) -> str:
    """The response without its `<think>...</think>` blocks (an unclosed one runs to the end)."""
    return _THINK_RE.sub(" ", response)


def _clip_sentence(text: str) -> str:
    """First clause of a free-text answer: "18 because ..." -> "18"."""
    text = re.split(r"\.\s|,\s|;|\s(?:because|since|so|which)\s", text + " ", maxsplit=1)[0]
    return text.strip().strip("*").rstrip(".").strip()


def extract_answer(response: str, *, last_number_fallback: bool = True) -> Extracted | None:
    """Final answer of a response (think blocks dropped), trying boxed, ####, "the answer is",
    then the last number. An empty box is an empty answer (no fallback to the text)."""
    response = strip_think(response)
    boxed = _boxed(response)
    if boxed is not None:
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


def candidates(response: str, source: str) -> list[str]:
    """Every answer of kind `source` the response states (think blocks dropped): all boxes, all
    #### lines, all "the answer is" clauses (whole, before clipping)."""
    response = strip_think(response)
    if source == "boxed":
        return [b.strip() for b in _all_boxed(response)]
    if source == "hash":
        return [h.strip() for h in _HASH_RE.findall(response)]
    if source == "answer_is":
        return _ANSWER_IS_RE.findall(response)
    return []


def hedged(response: str, found: Extracted) -> str | None:
    """Why the response commits to no single answer (several different boxes, "the answer is
    84, 85"), or None."""
    if found.source == "last_number":
        text = strip_think(response)
        head = text[: text.rfind(found.text)]
        return "a list of numbers" if _LIST_TAIL_RE.search(head) else None
    stated = candidates(response, found.source)
    if found.source == "answer_is":
        if any(_HEDGE_RE.match(c) for c in stated):
            return "several answers in one statement"
        stated = [_clip_sentence(c) for c in stated]
    if len(stated) > 1 and any(not _same_answer(c, stated[-1]) for c in stated[:-1]):
        return f"several different final answers: {', '.join(dict.fromkeys(stated))[:80]!r}"
    return None


def _same_answer(a: str, b: str) -> bool:
    if _clean(a)[0].replace(" ", "") == _clean(b)[0].replace(" ", ""):
        return True
    pa, pb = parse_number(a), parse_number(b)
    return pa is not None and pb is not None and bool(set(pa) & set(pb))


def _clean(text: str) -> tuple[str, bool]:
    """Strip math delimiters, currency, spacing macros and units; report a percent sign."""
    text = text.strip().strip("$").strip()
    text = re.sub(r"^\\\(|\\\)$|^\\\[|\\\]$", "", text).strip()
    text = _UNIT_WRAP_RE.sub(lambda m: m.group(1), text)
    text = re.sub(r"\^\s*\{?\\circ\}?|°", "", text)  # degrees: a unit
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
    exponent = re.search(r"[eE]([-+]?\d+)$", text)
    if exponent and abs(int(exponent.group(1))) > _MAX_EXPONENT:
        return None  # 1e999999999 would take Fraction minutes and gigabytes
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def parse_number(text: str, *, strict: bool = False) -> list[Fraction] | None:
    """Numeric value(s) of an answer: "1,234.5", "$18", "3/4", "\\frac{3}{4}", "12 apples",
    "1.5\\times10^{3}"; a percent gives both readings ("50%" -> [50, 1/2]). None when not a plain
    number. `strict` (for a prediction): a fraction must be of integers in lowest terms with a
    denominator above 1 ("6/4", "4/2" are divisions left to perform: None)."""
    text, percent = _clean(text)
    value = None
    if _NUMBER_RE.match(text):
        value = _to_fraction(text)
    elif m := _FRAC_RE.match(text) or _SLASH_RE.match(text):
        groups = m.groups()
        sign, num, den = groups if len(groups) == 3 else ("", *groups)
        n, d = _to_fraction(num), _to_fraction(den)
        if strict and not (n is not None and d and n.denominator == d.denominator == 1 and _lowest(n, d)):
            return None
        value = None if n is None or not d else (-1 if sign == "-" else 1) * n / d
    elif (m := _SCI_RE.match(text)) and abs(int(m.group(2))) <= _MAX_EXPONENT:
        value = Fraction(m.group(1)) * Fraction(10) ** int(m.group(2))
    elif m := _WITH_UNITS_RE.match(text):
        return parse_number(m.group(1) + ("%" if percent else ""), strict=strict)
    if value is None:
        return None
    return [value, value / 100] if percent else [value]


def _lowest(n: Fraction, d: Fraction) -> bool:
    """n/d (integers) is in lowest terms with a denominator above 1."""
    return d > 1 and math.gcd(int(n), int(d)) == 1


def _non_ascii_digit(text: str) -> bool:
    return any(ch.isdigit() and not ch.isascii() for ch in text)


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
    """True when the predicted answer has the reference's value, under the rules of the module
    docstring: same text; against a plain-number reference, a number (exactly when the reference
    is an integer or fraction, to the reference's own precision when it is a decimal --
    `reference_tolerance`; either reading of a percent) and nothing left to compute; against a
    closed-form constant, a closed form with no free operation that (symbolic=True) is equivalent;
    otherwise (symbolic=True) equivalent expressions (`symbolic_equal` on `checker`, which may
    raise SymbolicCheckError)."""
    return refusal(pred, ref) is None and (_same_text(pred, ref) or _value_equal(pred, ref, symbolic, checker))


def refusal(pred: str, ref: str) -> str | None:
    """Why `pred` cannot be the reference's value whatever it computes to (unicode digits; not a
    number against a number; not a closed form against a constant), or None."""
    if _non_ascii_digit(pred):
        return "non-ASCII digits"
    if _same_text(pred, ref):
        return None
    if parse_number(ref) is not None:
        if parse_number(pred, strict=True) is None:  # "37+48", "6*7", "2^{10}", "85=85", "6/4"
            return f"not a number ({free_operation(_clean(pred)[0]) or 'not in lowest terms'})"
    elif is_constant(_clean(ref)[0]) and (why := free_operation(_clean(pred)[0])) is not None:
        return f"not a closed form ({why})"
    return None


def _same_text(pred: str, ref: str) -> bool:
    return _clean(pred)[0].replace(" ", "") == _clean(ref)[0].replace(" ", "")


def _value_equal(pred: str, ref: str, symbolic: bool, checker: SymbolicChecker | None) -> bool:
    """Equality of an answer that `refusal` let through: numeric against a number, else symbolic."""
    r = parse_number(ref)
    if r is not None:
        p = parse_number(pred, strict=True)
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
        if not found.text:  # an empty box is no answer in the expected format
            return Verdict(0.0, False, f"{found.source}: empty answer")
        try:
            if why := hedged(response, found) or refusal(found.text, task.answer):
                return Verdict(0.0, format_ok, f"{found.source}: {found.text[:80]!r} refused: {why}")
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


VERIFIERS.register("math", VerifierEntry(MathTask, MathVerifier, lambda record: MathTask(field_text(record, "answer"))))
