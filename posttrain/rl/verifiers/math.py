"""Math verifier: find the final answer a response commits to, read it with a grammar, compare it.

Extraction (`final_answer.py`): the reasoning (`<think>` blocks) is dropped; the answer markers
are boxes, `####` lines and answer phrases ("the answer is", "Final Answer:"); the last marker is
the committed answer and every marker must state the same one, or none counts. Text after it that
hedges with a number ("Wait, maybe it's 84.") withdraws it. With no marker, the last sentence that
holds a number may be read (`last_number_fallback`; it is not the expected format).

Reading (`answer_grammar.py`, `answer_reading.py`): a value, not a text. A policy is paid for the
final answer it commits to, never for restating the question or hedging:
- Against a reference that is a number (integer, decimal, fraction, percent: GSM8K, numeric MATH
  answers) the answer must be a number: one sign at most (`-`, U+2212, an en dash), digits (ASCII:
  `８５` is refused) with thousands separators, a decimal, a fraction in lowest terms (`3/4`,
  `\\frac{3}{4}`, `\\frac34`, `\\frac{-3}{4}`), a mixed number (`2\\frac{1}{2}`, `1 1/2`), scientific
  notation with a mantissa in [1, 10) (`1.5\\times10^{3}`, `2.4e3`), then units from a closed list
  (`km/h`, `m^2`, `^\\circ`, `\\text{ cm}`) and words (`85 apples`). Wrappers carry no meaning:
  `$`, `**`, `\\boxed`, `\\mathbf`, `\\text`, `x = `. Refused: anything with an operation left to
  perform (`37+48`, `2^{10}`, `\\sqrt{4}`, `6/4`, `0\\times10^{5}`, `-\\frac{-1}{2}`), and any word
  that changes the claim: a bound or estimate before the value (`at least`, `more than`, `about`,
  `between`), a magnitude, bound or second value after it (`85 thousand`, `85k`, `85 at most`,
  `85 or 84`, `85, 84`, `80 to 85`), or a negation, hedge, alternative or correction anywhere in
  the claim (`not`, `maybe`, `or`, `wait`, `?`).
- Percent is read one way: `%` is a unit, `50\\%` is the number 50 (of percent), never 0.5. GSM8K
  and MATH write the answer to "what percent ...?" as the number of percent (`50` or `50\\%`), so a
  percent answer matches a percent question's reference and `5000\\%` is not 50.
- Decimals match to the reference's own precision, never a neighbour: the answer must round to
  the reference (|answer - reference| < half a unit in the reference's last digit, strictly, so
  `2.55` is not `2.5`); integer and fraction references are exact.
- Against a constant in closed form (`\\sqrt{8}`, `2\\pi`, `\\frac{\\sqrt{3}}{2}`) the answer must be a
  closed form with no free operation (`answer_form.free_operation`: no sum or product of numbers,
  no like terms, no root or power that evaluates (`\\sqrt{\\pi^2}`), a quotient with no common
  factor (`\\frac{\\pi^2}{\\pi}`), no equation); then the symbolic check decides.
- Other references (expressions, sets, intervals, equations) go to the symbolic check through
  `math-verify` (sympy), after the same guard with variables allowed, an equation only as
  `name = value`, and no quotient with a common factor left to cancel (`\\frac{x^2-1}{x-1}`).
The accept/refuse table is tests/data/math_answer_forms.json; the measured corpora are
`corpora/` (BENCHMARKS: against math-verify alone). Symbolic checks run in a worker process with a
real timeout on any thread (`symbolic.SymbolicChecker`); inputs that would surely hang are refused
by a cheap guard first. A check that fails or times out, or an exception inside this verifier, is
reported in `Verdict.error` (and counted, logged); anything the response itself gets wrong is a 0.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from collections.abc import Mapping, Sequence
from fractions import Fraction
from typing import Any

from posttrain.config.registry import VERIFIERS
from posttrain.data.examples import field_text
from posttrain.rl.verifiers.answer_form import free_operation, is_constant, parse
from posttrain.rl.verifiers.answer_reading import Reading, read_math, read_number, read_strict
from posttrain.rl.verifiers.answer_tokens import normalize, tokenize, word
from posttrain.rl.verifiers.answer_words import CONNECTIVES
from posttrain.rl.verifiers.base import Verdict, VerifierEntry
from posttrain.rl.verifiers.final_answer import SOURCES, Claim, box_spans, find_claims, strip_think
from posttrain.rl.verifiers.symbolic import SymbolicChecker, SymbolicCheckError

__all__ = ["SOURCES", "Extracted", "MathTask", "MathVerifier", "answers_equal", "extract_answer", "strip_think"]
_SYMBOLIC_MAX_CHARS = 256
MAX_SYMBOLIC_CLAIMS = 8  # different answers a response may state (all equal) when each needs sympy
_GREEK = "|".join("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta lambda mu nu xi rho sigma".split())
_GREEK += "|tau|phi|varphi|chi|psi|omega"
_NAME = re.compile(rf"^\s*(?:[A-Za-z]|\\(?:{_GREEK}))(?:_\{{?\w+\}}?)?(?:\([^()=]*\))?\s*$")  # x, \theta, a_1, f(x)
_SAME_TEXT_JUNK = re.compile(r"\s|\$|\\left|\\right|\\[,;!]|\\displaystyle|\.$")
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
    """The committed answer of a response and the marker that states it (one of SOURCES)."""

    text: str
    source: str


def extract_answer(response: str, *, last_number_fallback: bool = True) -> Extracted | None:
    """The committed final answer of a response (the last marker's claim), or None."""
    claims = find_claims(response, last_number_fallback=last_number_fallback).claims
    if not claims:
        return None
    last = claims[-1]
    if last.source == "last_number":  # the value as written, not the whole sentence
        reading = read_number(last)
        return Extracted(last.text if reading.refusal else reading.text.replace(" ", ""), last.source)
    if last.source == "answer_is":  # the sentence up to its first connective ("42 because 6*7": "42")
        cut = next((t.start for t in last.tokens[1:] if word(t) in CONNECTIVES and t.kind == "word"), None)
        text = last.text if cut is None else last.text[: cut - last.offset]
        return Extracted(text.strip().strip("*").rstrip(".").strip(), last.source)
    return Extracted(last.text, last.source)


def _all_boxed(response: str) -> list[str]:
    """Contents of every outermost \\boxed{...} / \\fbox{...}, in order (none if one is left open)."""
    spans = box_spans(response)
    return [] if isinstance(spans, str) else [response[s[1] : s[2]] for s in spans]


def parse_number(text: str, *, strict: bool = False) -> list[Fraction] | None:
    """The value of a plain number ("1,234.5", "$18", "3/4", "\\frac{3}{4}", "12 apples", "50\\%" is
    50), as a one-element list; None when `text` is not a number. `strict` (an answer): fractions
    in lowest terms, no operation left (module docstring)."""
    reading = read_strict(tokenize(normalize(text)), strict=strict)
    return None if reading.refusal else [reading.value]


def reference_tolerance(ref: str) -> Fraction:
    """Half a unit in the last digit the reference writes ("3.14" -> 0.005, "1.5e3" -> 50): an
    answer strictly within it rounds to the reference. Integers and fractions are exact (0)."""
    tokens = tokenize(normalize(ref))
    nums = [i for i, t in enumerate(tokens) if t.kind == "num"]
    if not nums or any(t.text in ("/", "\\frac", "\\dfrac", "\\tfrac") for t in tokens):
        return Fraction(0)
    first = tokens[nums[0]]
    decimals = len(first.text.split(".")[1]) if "." in first.text else 0
    exponent = int(first.exp) if first.exp else 0
    if len(nums) >= 3 and tokens[nums[1]].text == "10":  # 1.5 \times 10^{3}
        exponent = int(tokens[nums[2]].text) * (-1 if tokens[nums[2] - 1].text == "-" else 1)
    if not decimals and not exponent:
        return Fraction(0)
    return Fraction(1, 2) * Fraction(10) ** (exponent - decimals)


def numbers_equal(answer: Fraction, ref: str) -> bool:
    """The answer's value equals the reference's, to the reference's own precision (strictly)."""
    value = parse_number(ref)[0]
    tolerance = reference_tolerance(ref)
    return answer == value if tolerance == 0 else abs(answer - value) < tolerance


def _same_text(pred: str, ref: str) -> bool:
    def clean(s: str) -> str:
        return _SAME_TEXT_JUNK.sub("", s).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")

    return clean(pred) == clean(ref)


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


def symbolic_equal(pred: str, ref: str, checker: SymbolicChecker | None = None, *, reduced: bool = False) -> bool:
    """Equivalence through math-verify (sympy): expressions, sets, intervals, equations; `reduced`:
    and `pred` has no quotient with a common factor. False for inputs the guard refuses;
    SymbolicCheckError when the check fails or times out."""
    if not (_symbolic_safe(pred) and _symbolic_safe(ref)):
        return False
    return (checker or default_checker()).equal(pred, ref, reduced=reduced)


def _without_name(text: str, ref: str) -> tuple[str, str | None]:
    """`x = 5` -> `5` when the reference is no equation; another equation is refused."""
    if "=" in ref or "=" not in text:
        return text, None
    sides = text.split("=")
    name, value = sides[0], "=".join(sides[1:])
    if len(sides) != 2 or not _NAME.match(name):
        return text, "an equation, not a value"
    letter = name.strip()
    if "(" not in letter and re.search(rf"(?<![A-Za-z\\]){re.escape(letter)}(?![A-Za-z])", value):
        return text, "an equation in its own unknown, not a value"
    return value.strip(), None


def symbolic_refusal(text: str, ref: str) -> tuple[str, str | None]:
    """The math to compare with a reference that is not a plain number, and why it is no answer
    whatever it computes to (an equation, a free operation: module docstring), or None."""
    if _same_text(text, ref):
        return text, None
    text, why = _without_name(text, ref)
    if why:
        return text, why
    clean_ref = _SAME_TEXT_JUNK.sub("", ref)
    if is_constant(clean_ref):
        why = free_operation(text)
        return text, None if why is None else f"not a closed form ({why})"
    if parse(text) is not None and (why := free_operation(text, symbols=True)) is not None:
        return text, f"work left in the answer ({why})"
    return text, None


def answers_equal(pred: str, ref: str, *, symbolic: bool = True, checker: SymbolicChecker | None = None) -> bool:
    """True when the answer text `pred` (what a box would hold) states the reference's value, under
    the rules of the module docstring; may raise SymbolicCheckError (`symbolic_equal`)."""
    claim = Claim("boxed", pred.strip(), tokenize(normalize(pred)), [], 0, len(pred))
    return _judge(claim, ref, parse_number(ref) is not None, symbolic, checker)[0]


def refusal(pred: str, ref: str) -> str | None:
    """Why the answer text `pred` cannot be the reference's value whatever it computes to, or None."""
    claim = Claim("boxed", pred.strip(), tokenize(normalize(pred)), [], 0, len(pred))
    if parse_number(ref) is not None:
        return read_number(claim).refusal
    reading = read_math(claim)
    return reading.refusal or symbolic_refusal(reading.text, ref)[1]


def _judge(
    claim: Claim, ref: str, numeric: bool, symbolic: bool, checker: SymbolicChecker | None
) -> tuple[bool, str | None]:
    """(equal, why refused) for one claim against the reference."""
    if numeric:
        reading: Reading = read_number(claim)
        if reading.refusal:
            return False, reading.refusal
        return numbers_equal(reading.value, ref), None
    reading = read_math(claim)
    if reading.refusal:
        return False, reading.refusal
    text, why = symbolic_refusal(reading.text, ref)
    if why:
        return False, why
    return _same_text(text, ref) or (symbolic and symbolic_equal(text, ref, checker, reduced=True)), None


@dataclasses.dataclass
class MathVerifier:
    """Verifier for MathTask: correct = 1 when every answer marker of the response states the
    reference's value (module docstring); format_ok when the committed answer came from one of
    `format_sources` (not the bare last number). A symbolic check may take `symbolic_timeout`
    seconds (in this verifier's worker process); one that fails or times out gives a Verdict with
    `error` set, counted in `errors`."""

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
        found = find_claims(response, last_number_fallback=self.last_number_fallback)
        if not found.claims:
            return Verdict(0.0, False, f"refused: {found.refusal}" if found.refusal else "no answer found")
        last = found.claims[-1]
        format_ok = last.source in self.format_sources
        if not last.text:  # an empty box is no answer in the expected format
            return Verdict(0.0, False, f"{last.source}: empty answer")
        head = f"{last.source}: {_shown(last)!r}"
        if found.refusal:
            return Verdict(0.0, format_ok, f"{head} refused: {found.refusal}")
        try:
            numeric = parse_number(task.answer) is not None
            claims = _distinct(found.claims[::-1])
            if not numeric and len(claims) > MAX_SYMBOLIC_CLAIMS:  # each is a symbolic check
                return Verdict(0.0, format_ok, f"{head} refused: {len(claims)} different answers")
            for claim in claims:
                ok, why = _judge(claim, task.answer, numeric, self.symbolic, self._checker)
                if not ok:
                    other = "" if claim is last else f" (another marker, {claim.source}: {_shown(claim)!r})"
                    reason = f"refused: {why}" if why else f"!= {task.answer[:80]!r}"
                    return Verdict(0.0, format_ok, f"{head}{other} {reason}")
        except Exception as e:  # a failed or timed-out check is no verdict: reported, counted, logged
            error = str(e) if isinstance(e, SymbolicCheckError) else f"{type(e).__name__}: {e}"
            with self._errors_lock:
                self.errors += 1
                count = self.errors
            logger.warning("math verifier error %d: %s", count, error)
            return Verdict(0.0, format_ok, f"{head} not checked", error=error)
        return Verdict(1.0, format_ok, f"{head} == {task.answer[:80]!r}")

    def verify_many(self, tasks: Sequence[MathTask], responses: Sequence[str]) -> list[Verdict]:
        """Verdicts for many responses (sequential: each is microseconds to milliseconds)."""
        if len(tasks) != len(responses):
            raise ValueError(f"{len(tasks)} tasks but {len(responses)} responses")
        return [self.verify(t, r) for t, r in zip(tasks, responses)]


def _shown(claim: Claim) -> str:
    """A claim as a detail shows it: at most 80 characters."""
    return claim.text[:80]


def _distinct(claims: list[Claim]) -> list[Claim]:
    """Claims with distinct (source, text, tail), first occurrences kept: each is judged once."""
    seen, out = set(), []
    for c in claims:
        key = (c.source, c.text, " ".join(t.text for t in c.tail))
        if key not in seen:
            seen.add(key)
            out.append(c)
    return out


VERIFIERS.register("math", VerifierEntry(MathTask, MathVerifier, lambda record: MathTask(field_text(record, "answer"))))
