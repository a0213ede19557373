"""The grammar of a final answer: the value of a number as written, and the words that change a
claim, over tokens (`answer_tokens`).

A value (`value_at`) is one sign at most, then an integer or decimal, a fraction (`3/4`,
`\\frac{3}{4}`, `\\frac34`), a mixed number (`2\\frac{1}{2}`, `1 1/2`) or scientific notation
(`1.5\\times10^{3}`, `2.4e3`: mantissa in [1, 10)). Units (`units_end`) are a closed list of unit
words and symbols (`km/h`, `m^2`, `^\\circ`, `%`); a percent is a unit: `50\\%` is the number 50.
Whatever is left must not change the claim (`remainder_refusal`, `lead_refusal`, `changer`):
`CHANGERS` (negations, hedges, alternatives, corrections) anywhere in it; after the value a
magnitude (`MAGNITUDES`: `thousand`, `k`) or `at least` / `at most`, and right after it an
operator, a bound (`REMAINDER_CHANGERS`, `and up`) or another value joined by a list, range or
alternative; right before it (`LEAD_CHANGERS`) a bound or estimate (`more than`, `about`,
`between`, `~`). These are closed lists of words (`answer_words`), by what they do to a claim.
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction

from posttrain.rl.verifiers.answer_tokens import Token, word
from posttrain.rl.verifiers.answer_words import (
    AND_BOUNDS,
    CHANGERS,
    JOINERS,
    LEAD_CHANGERS,
    MAGNITUDES,
    OPERATORS,
    REMAINDER_CHANGERS,
    UNIT_PREFIXES,
    UNIT_WORDS,
)

MAX_EXPONENT = 400  # powers of ten beyond this are no answer (and slow to build)
_FRACS = frozenset({"\\frac", "\\dfrac", "\\tfrac", "\\cfrac"})
_TIMES = frozenset({"\\times", "\\cdot", "*", "x"})


def is_value_start(tokens: list[Token], i: int) -> bool:
    """Whether a value (a number, a fraction, a signed one) may start at tokens[i]."""
    t = tokens[i]
    if t.kind in ("num", "udigit") or (t.kind == "cmd" and t.text in _FRACS):
        return True
    if t.text in ("-", "+") and i + 1 < len(tokens):
        return is_value_start(tokens, i + 1)
    return False


@dataclasses.dataclass(frozen=True)
class Value:
    """A number read from tokens[start:end]: its exact value, or why it is no answer (`refusal`)."""

    value: Fraction | None
    start: int
    end: int
    refusal: str | None = None


def _number(t: Token) -> Fraction | str:
    """The value of a num token (e-notation: mantissa in [1, 10), a bounded exponent)."""
    value = Fraction(t.text.replace(",", ""))
    if t.exp is None:
        return value
    exp = int(t.exp)
    if not 1 <= abs(value) < 10 or exp == 0:
        return "not scientific notation: a product left to multiply"
    if abs(exp) > MAX_EXPONENT:
        return "an exponent too large for an answer"
    return value * Fraction(10) ** exp


def _integer(t: Token | None) -> int | None:
    """An integer num token's value (no decimals, no e-notation), else None."""
    if t is None or t.kind != "num" or t.exp is not None or "." in t.text:
        return None
    return int(t.text.replace(",", ""))


def _frac_args(tokens: list[Token], i: int) -> tuple[int | None, int | None, int, bool] | None:
    """Numerator, denominator (None when not an integer), end index and a minus sign in the
    numerator, for the arguments of a \\frac at tokens[i]: `{n}{d}`, `{-n}{d}` or `34` (\\frac34)."""
    t = tokens[i] if i < len(tokens) else None
    if t is not None and t.kind == "num" and len(t.text) == 2 and t.text.isdigit() and t.exp is None:
        return int(t.text[0]), int(t.text[1]), i + 1, False
    args, negative = [], False
    for _ in range(2):
        if i >= len(tokens) or tokens[i].text != "{":
            return None
        j, sign = i + 1, False
        if j < len(tokens) and tokens[j].text in ("-", "+"):
            sign, j = tokens[j].text == "-", j + 1
        if j + 1 >= len(tokens) or tokens[j + 1].text != "}":
            return None
        if sign and args:  # a sign in the denominator
            return None
        negative |= sign
        args.append(_integer(tokens[j]) if tokens[j].kind == "num" else -1)
        i = j + 2
    if -1 in args:
        return None
    return args[0], args[1], i, negative


def _fraction(n: int | None, d: int | None, strict: bool) -> Fraction | str:
    """n/d as a value; `strict` (an answer, not a reference): integers in lowest terms, d > 1."""
    if n is None or d is None:
        return "a division left to perform" if strict else "not a fraction"
    if d == 0:
        return "a division by zero"
    if strict and (d < 2 or math.gcd(n, d) != 1):
        return "a fraction not in lowest terms" if d > 1 else "a division left to perform"
    return Fraction(n, d)


def value_at(tokens: list[Token], i: int, *, strict: bool = True) -> Value | None:
    """The value that starts at tokens[i] (one sign at most), or None when none starts there.
    `strict` for an answer: fractions in lowest terms, no double sign; a reference may be `6/4`."""
    j, sign, signs = i, 1, 0
    while j < len(tokens) and tokens[j].text in ("-", "+"):
        sign, signs, j = (-sign if tokens[j].text == "-" else sign), signs + 1, j + 1
    if j >= len(tokens):
        return None
    t = tokens[j]
    if t.kind == "udigit":
        return Value(None, i, j + 1, "non-ASCII digits")
    if signs > 1:
        return Value(None, i, j + 1, "a double sign")
    if t.kind == "cmd" and t.text in _FRACS:
        return _read_frac(tokens, i, j + 1, sign, strict)
    if t.kind != "num":
        return None
    number = _number(t)
    if isinstance(number, str):
        return Value(None, i, j + 1, number)
    k = j + 1
    after = tokens[k] if k < len(tokens) else None
    if after is not None and after.kind == "cmd" and after.text in _FRACS and _integer(t) is not None:
        return _read_mixed(tokens, i, k, sign, number, strict)
    if after is not None and after.kind == "num" and after.space and _peek(tokens, k + 1) == "/":
        return _read_mixed(tokens, i, k, sign, number, strict)
    if after is not None and after.text == "/" and _peek_kind(tokens, k + 1) == "num":
        return _read_slash(tokens, i, j, k, sign, strict)
    if after is not None and word(after) in _TIMES:
        sci = _read_scientific(tokens, i, k, sign, number)
        if sci is not None:
            return sci
    return Value(sign * number, i, k)


def _peek(tokens: list[Token], i: int) -> str | None:
    return tokens[i].text if i < len(tokens) else None


def _peek_kind(tokens: list[Token], i: int) -> str | None:
    return tokens[i].kind if i < len(tokens) else None


def _read_frac(tokens: list[Token], i: int, k: int, sign: int, strict: bool) -> Value:
    args = _frac_args(tokens, k)
    if args is None:
        return Value(None, i, k, "a fraction of other than integers")
    n, d, end, negative = args
    if negative and sign < 0 and strict:
        return Value(None, i, end, "a double negation")
    value = _fraction(n, d, strict)
    if isinstance(value, str):
        return Value(None, i, end, value)
    return Value(sign * (-value if negative else value), i, end)


def _read_mixed(tokens: list[Token], i: int, k: int, sign: int, whole: Fraction, strict: bool) -> Value:
    """A whole number and a proper fraction: `2\\frac{1}{2}`, `1 1/2`."""
    if tokens[k].kind == "cmd":
        args = _frac_args(tokens, k + 1)
        if args is None or args[3]:
            return Value(None, i, k + 1, "a fraction of other than integers")
        n, d, end, _ = args
    else:
        n, d, end = _integer(tokens[k]), _integer(tokens[k + 2]) if k + 2 < len(tokens) else None, k + 3
    if whole.denominator != 1 or n is None or d is None or not 0 < n < d:
        return Value(None, i, end, "not a mixed number")
    part = _fraction(n, d, strict)
    if isinstance(part, str):
        return Value(None, i, end, part)
    return Value(sign * (whole + part), i, end)


def _read_slash(tokens: list[Token], i: int, j: int, k: int, sign: int, strict: bool) -> Value:
    """`3/4`; a sign after the slash is a division left to perform."""
    value = _fraction(_integer(tokens[j]), _integer(tokens[k + 1]), strict)
    if isinstance(value, str):
        return Value(None, i, k + 2, value)
    return Value(sign * value, i, k + 2)


def _read_scientific(tokens: list[Token], i: int, k: int, sign: int, mantissa: Fraction) -> Value | None:
    """`1.5\\times10^{3}`: None when no `10^` follows the times sign (then it is an operator)."""
    if _peek(tokens, k + 1) != "10" or _peek(tokens, k + 2) != "^":
        return None
    j, exp_sign = k + 3, 1
    braced = _peek(tokens, j) == "{"
    j += braced
    if _peek(tokens, j) in ("-", "+"):
        exp_sign, j = (-1 if tokens[j].text == "-" else 1), j + 1
    exponent = _integer(tokens[j]) if j < len(tokens) else None
    end = j + 1 + (braced and _peek(tokens, j + 1) == "}")
    if exponent is None or (braced and tokens[end - 1].text != "}"):
        return Value(None, i, end, "a power of ten left to evaluate")
    if not 1 <= abs(mantissa) < 10 or exponent == 0:
        return Value(None, i, end, "not scientific notation: a product left to multiply")
    if exponent > MAX_EXPONENT:
        return Value(None, i, end, "an exponent too large for an answer")
    return Value(sign * mantissa * Fraction(10) ** (exp_sign * exponent), i, end)


def units_end(tokens: list[Token], k: int) -> int:
    """Index after the units that follow a value at tokens[k:] (none: k). Units: percent, degrees,
    cents, a unit word (`UNIT_WORDS`, with a power and `/` or `per` another), currency names."""
    while k < len(tokens):
        t, w = tokens[k], word(tokens[k])
        if w in ("%", "°", "¢", "\\circ", "\\degree", "percent"):
            k += 1
        elif w == "per" and word(_at(tokens, k + 1)) in ("cent", "centum"):
            k += 2
        elif w == "^" and word(_at(tokens, k + 1)) == "\\circ":
            k += 2
        elif w == "^" and _peek(tokens, k + 1) == "{" and word(_at(tokens, k + 2)) == "\\circ":
            k += 3 + (_peek(tokens, k + 3) == "}")
        elif t.kind == "word" and (w in UNIT_WORDS or w in UNIT_PREFIXES) and w not in MAGNITUDES:
            k = _power_end(tokens, k + 1)
        elif w in ("/", "per") and word(_at(tokens, k + 1)) in UNIT_WORDS and k > 0:
            k = _power_end(tokens, k + 2)
        else:
            break
    return k


def _at(tokens: list[Token], i: int) -> Token | None:
    return tokens[i] if i < len(tokens) else None


def _power_end(tokens: list[Token], k: int) -> int:
    """After a unit: `^2`, `^{2}`, `^3` (square and cubic units)."""
    if _peek(tokens, k) != "^":
        return k
    if _peek(tokens, k + 1) in ("2", "3"):
        return k + 2
    if _peek(tokens, k + 1) == "{" and _peek(tokens, k + 2) in ("2", "3") and _peek(tokens, k + 3) == "}":
        return k + 4
    return k


def changer(tokens: list[Token]) -> str | None:
    """The first word or sign in `tokens` that changes a claim anywhere (`CHANGERS`, a negation
    like "isn't"), or None."""
    for t in tokens:
        w = word(t)
        if w in CHANGERS or (t.kind == "word" and (w.endswith("n't") or w.endswith("nt") and w[:-2] in _NT)):
            return t.text
    return None


_NT = frozenset({"isn", "aren", "wasn", "weren", "doesn", "don", "didn", "won", "can", "couldn", "wouldn", "shouldn"})


def remainder_refusal(tokens: list[Token], k: int, end: int, tail_end: int | None = None) -> str | None:
    """Why the tokens after a value and its units change the claim: right after it (tokens[k:end],
    up to a connective) an operator (work left), another value joined to it (a list, a range, an
    alternative) or a bound (`plus`, `and up`); anywhere after it (to `tail_end`) a magnitude
    (`thousand`, `k`) or `at least` / `at most`. None when they do not."""
    if k < end:
        first = tokens[k]
        if first.kind == "sym" and first.text in OPERATORS or first.kind == "cmd" and first.text in OPERATORS:
            return f"{first.text!r} after the value: an operation or a comparison left"
        if is_value_start(tokens, k):
            return "another value after the answer"
    for i in range(k, end):
        w = word(tokens[i])
        if w in REMAINDER_CHANGERS:
            return f"{tokens[i].text!r} after the value changes it"
        if w == "and" and word(_at(tokens, i + 1)) in AND_BOUNDS:
            return f"'and {tokens[i + 1].text}' after the value: a bound"
        if w in JOINERS and i + 1 < end and is_value_start(tokens, i + 1):
            return f"another value after {tokens[i].text!r}: a list, range or alternative"
    for i in range(k, max(end, tail_end or 0)):
        w = word(tokens[i])
        if w in MAGNITUDES and tokens[i].kind == "word":
            return f"{tokens[i].text!r} after the value multiplies it"
        before = [word(tokens[j]) for j in range(max(0, i - 2), i)]
        if w in ("least", "most") and (before[-1:] == ["at"] or before == ["at", "the"]):
            return f"'at {tokens[i].text}' after the value: a bound"
    return None


_BOX_LEAD = frozenset(LEAD_CHANGERS - {"maximum", "minimum", "max", "min", "from", "range", "ranging", "some", "up"})


def box_lead_refusal(tokens: list[Token]) -> str | None:
    """Why the words right before a box bound, estimate or deny it ("at least \\boxed{85}",
    "not \\boxed{85}"), or None."""
    for t in tokens:
        w = word(t)
        if w in _BOX_LEAD or w in CHANGERS or (t.kind == "word" and w.endswith("n't")):
            return f"{t.text!r} before the box changes it"
    return None


def lead_refusal(tokens: list[Token]) -> str | None:
    """Why the words right before a value (tokens) change the claim: a bound, an estimate or a range
    in words anywhere in them ("at least", "about", "between"), a comparison or an operation right
    before the value (`>`, `\\approx`, `+`: a `>` between names, `OUP>ROT 8049`, is no comparison),
    or another value. None when they do not."""
    for i, t in enumerate(tokens):
        if t.kind == "word" and word(t) in LEAD_CHANGERS:
            return f"{t.text!r} before the value: a bound or an estimate, not a value"
        if is_value_start(tokens, i):
            return "another value before the answer"
    last = tokens[-1] if tokens else None
    if last is not None and last.kind != "word" and last.text in LEAD_CHANGERS:
        return f"{last.text!r} before the value: a comparison, not a value"
    if last is not None and last.text in OPERATORS and last.text != "=":
        return f"{last.text!r} before the value: an operation left"
    return None


def sign_is_operator(tokens: list[Token], i: int) -> bool:
    """Whether the `+` / `-` at tokens[i] joins two terms (`37 - 48`, `x + 85`, `(a) - 5`) rather
    than signs a number (`is -85`, `= -3`)."""
    if tokens[i].text not in ("+", "-") or i == 0:
        return False
    before = tokens[i - 1]
    return before.kind == "num" or before.text in (")", "}", "]") or (before.kind == "word" and len(before.text) == 1)
