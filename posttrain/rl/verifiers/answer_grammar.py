"""The grammar of a final answer: tokens, the value of a number as written, and the words that
change a claim.

A claim is read from tokens (`tokenize`): numbers (ASCII digits, thousands separators, decimals,
e-notation), words, LaTeX commands and symbols; the wrappers that carry no meaning (`$`, `**`,
`\\boxed{}`, `\\mathbf{}`, `\\text{}`, `\\left`, spacing) are dropped and unicode signs are mapped to
their ASCII or LaTeX form (U+2212 and the en dash are minus signs, `×` is `\\times`, `½` is
`\\frac{1}{2}`). A value (`value_at`) is one sign at most, then an integer or decimal, a fraction
(`3/4`, `\\frac{3}{4}`, `\\frac34`), a mixed number (`2\\frac{1}{2}`, `1 1/2`) or scientific notation
(`1.5\\times10^{3}`, `2.4e3`: mantissa in [1, 10)). Units (`units_end`) are a closed list of unit
words and symbols (`km/h`, `m^2`, `^\\circ`, `%`); a percent is a unit: `50\\%` is the number 50.
Whatever is left must not change the claim (`remainder_refusal`, `lead_refusal`, `changer`):
`CHANGERS` (negations, hedges, alternatives, corrections) anywhere in it; after the value a
magnitude (`MAGNITUDES`: `thousand`, `k`) or `at least` / `at most`, and right after it an
operator, a bound (`REMAINDER_CHANGERS`, `and up`) or another value joined by a list, range or
alternative; right before it (`LEAD_CHANGERS`) a bound or estimate (`more than`, `about`,
`between`, `~`). These are closed lists of words, by what they do to a claim.
"""

from __future__ import annotations

import dataclasses
import math
import re
from fractions import Fraction

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
_DROP_CMDS = frozenset(
    {"\\displaystyle", "\\textstyle", "\\left", "\\right", "\\big", "\\Big", "\\bigl", "\\bigr", "\\Bigl"}
    | {"\\Bigr", "\\quad", "\\qquad", "\\limits", "\\hfill", "\\mathord"}
)
_DROP_ESC = frozenset({"\\,", "\\;", "\\:", "\\!", "\\ ", "\\(", "\\)", "\\[", "\\]", "\\\n", "\\\t", "\\$"})
_DROP_SYMS = frozenset({"$", "$$", "**", "__", "`", "€", "£", "¥", "\u200b"})
WRAPPERS = frozenset(
    {"\\boxed", "\\fbox", "\\mathbf", "\\textbf", "\\text", "\\textrm", "\\mathrm", "\\mbox", "\\mathit"}
    | {"\\textit", "\\emph", "\\mathsf", "\\textsf", "\\bm", "\\boldsymbol", "\\underline", "\\textnormal"}
)
_VULGAR = {"½": (1, 2), "⅓": (1, 3), "⅔": (2, 3), "¼": (1, 4), "¾": (3, 4), "⅕": (1, 5), "⅖": (2, 5), "⅗": (3, 5)}
_VULGAR |= {"⅘": (4, 5), "⅙": (1, 6), "⅚": (5, 6), "⅛": (1, 8), "⅜": (3, 8), "⅝": (5, 8), "⅞": (7, 8)}
_REPLACE = {
    **dict.fromkeys("\u2212\u2013\u2012\ufe63\uff0d\u2010\u2011", "-"),
    "×": " \\times ",
    "·": " \\cdot ",
    "÷": " \\div ",
    "≈": " \\approx ",
    "≤": " \\leq ",
    "≥": " \\geq ",
    "±": " \\pm ",
    "∓": " \\mp ",
    "²": "^2",
    "³": "^3",
    "’": "'",
    **{k: f"\\frac{{{a}}}{{{b}}}" for k, (a, b) in _VULGAR.items()},
}
_TOKEN = re.compile(
    r"(?P<num>[0-9]{1,3}(?:,[0-9]{3})+(?:\.[0-9]+)?|[0-9]+(?:\.[0-9]+)?|\.[0-9]+)(?:[eE](?P<exp>[-+]?[0-9]+))?"
    r"|(?P<udigit>\d)"
    r"|(?P<cmd>\\[A-Za-z]+)"
    r"|(?P<esc>\\.)"
    r"|(?P<word>[^\W\d_]+(?:'[^\W\d_]+)*)"
    r"|(?P<ws>\s+)"
    r"|(?P<sym>\*\*|__|\$\$|\S)",
    re.DOTALL,
)
_THIN_THOUSANDS = re.compile(r"(?<=[0-9])(?:\\,|\\ |\{,\}|\\!)(?=[0-9]{3}(?![0-9]))")


@dataclasses.dataclass(frozen=True)
class Token:
    """One token: kind (num, udigit, cmd, esc, word, sym), its text, its offset in the text it was
    read from, whether whitespace (and a line break) came before it; `exp` for e-notation."""

    kind: str
    text: str
    start: int
    space: bool = False
    newline: bool = False
    exp: str | None = None


def normalize(text: str) -> str:
    """Unicode signs and symbols to their ASCII / LaTeX form, thin-space thousands to commas.
    Offsets change only where a symbol became a command (never inside the ASCII text)."""
    for symbol, replacement in _REPLACE.items():  # str.replace per symbol: str.translate is slow on many
        if symbol in text:
            text = text.replace(symbol, replacement)
    return _THIN_THOUSANDS.sub(",", text)


def tokenize(text: str, *, offset: int = 0) -> list[Token]:
    """Tokens of `text` (already normalized), wrappers and spacing dropped. Linear in the length."""
    raw, space, newline = [], False, False
    for m in _TOKEN.finditer(text):
        kind = m.lastgroup if m.lastgroup != "exp" else "num"
        if kind == "ws":
            space, newline = True, newline or "\n" in m.group()
            continue
        body = m.group("num") if kind == "num" else m.group()
        raw.append(Token(kind, body, m.start() + offset, space, newline, m.group("exp") if kind == "num" else None))
        space = newline = False
    return _unwrap(raw)


def _unwrap(tokens: list[Token]) -> list[Token]:
    """Drop the tokens that carry no meaning: math delimiters, bold, spacing, `\\left`, and
    wrapper commands with the braces of their argument (`\\mathbf{85}` -> `85`)."""
    out, braces = [], []  # braces: for each open "{", whether it is a wrapper's (dropped)
    wrapper_next = False
    for t in tokens:
        if t.kind == "cmd" and t.text in WRAPPERS:
            wrapper_next = True
            continue
        if t.text == "{" and t.kind == "sym":
            braces.append(wrapper_next)
            wrapper_next = False
            if braces[-1]:
                continue
        else:
            wrapper_next = False
            if t.text == "}" and t.kind == "sym" and braces and braces.pop():
                continue
        if (t.kind == "cmd" and t.text in _DROP_CMDS) or (t.kind == "esc" and t.text in _DROP_ESC):
            continue
        if t.kind == "sym" and t.text in _DROP_SYMS:
            continue
        if t.kind == "esc" and t.text == "\\%":
            t = dataclasses.replace(t, kind="sym", text="%")
        out.append(t)
    return out


def word(t: Token | None) -> str:
    """The token's text, lower-cased for words (how the word lists compare)."""
    return "" if t is None else t.text.lower() if t.kind == "word" else t.text


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
    """Why the words right before a value (tokens) change the claim: a bound, an estimate, a range
    ("at least", "about", "between"), an operation, or another value. None when they do not."""
    for i, t in enumerate(tokens):
        w = word(t)
        if w in LEAD_CHANGERS:
            return f"{t.text!r} before the value: a bound or an estimate, not a value"
        if t.text in OPERATORS and t.text not in ("=",) and not (t.text in "-+" and i == len(tokens) - 1):
            return f"{t.text!r} before the value: an operation left"
        if is_value_start(tokens, i):
            return "another value before the answer"
    return None
