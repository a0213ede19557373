"""Read a claim (`final_answer.Claim`) with the grammar of `answer_grammar`: the number it states,
or the math it states for a reference that is not a number, or why it states neither.

A box is math: its content is one value (`x = ` before it at most) with units and words after it
(`read_strict`), and the rest of its sentence may not change it. A sentence ("The answer is ...",
a `####` line) is prose (`read_prose`): its value is the first one in it, with nothing before it
that bounds or estimates it and nothing after it that joins another value to it; or, when that
does not read, the value after its last link ("the sum of 37 and 48, which is 85", "37 + 48 = 85").
The last sentence of a response without markers is read from its last value (`read_last`).
Anywhere in a claim, a word that negates, hedges, offers an alternative or corrects refuses it.
"""

from __future__ import annotations

import dataclasses
import re
from fractions import Fraction

from posttrain.rl.verifiers.answer_grammar import (
    box_lead_refusal,
    changer,
    is_value_start,
    lead_refusal,
    remainder_refusal,
    sign_is_operator,
    units_end,
    value_at,
)
from posttrain.rl.verifiers.answer_tokens import Token, tokenize, word
from posttrain.rl.verifiers.answer_words import CONNECTIVES, JOINERS, LINKS, OPERATORS
from posttrain.rl.verifiers.final_answer import Claim

_MATH_SPAN = re.compile(r"\$\$(.+?)\$\$|\$(.+?)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.DOTALL)
_OUTER_BOX = re.compile(r"^\s*\\(?:boxed|fbox)\s*\{(.*)\}\s*$", re.DOTALL)
_TRAILING_TEXT = re.compile(r"(?:\s|\\[,;! ]|\\(?:text|mbox|textrm|mathrm)\s*\{[^{}]*\})+$")
_OPEN, _CLOSE = frozenset("{(["), frozenset("})]")


@dataclasses.dataclass(frozen=True)
class Reading:
    """What a claim states: `value` (a number), `text` (as written, or the math for a symbolic
    check), or why it states no answer (`refusal`)."""

    value: Fraction | None
    text: str
    refusal: str | None = None


def _refused(why: str, text: str = "") -> Reading:
    return Reading(None, text, why)


def _text(tokens: list[Token]) -> str:
    return " ".join(t.text for t in tokens)


def _depths(tokens: list[Token]) -> list[int]:
    """Bracket depth of each token (0: outside every brace, parenthesis and bracket)."""
    out, depth = [], 0
    for t in tokens:
        if t.text in _CLOSE:
            depth = max(0, depth - 1)
        out.append(depth)
        if t.text in _OPEN:
            depth += 1
    return out


def _name_end(tokens: list[Token]) -> int:
    """2 when the tokens open with a name and `=` (`x = 85`, `\\theta = ...`), else 0."""
    if len(tokens) > 2 and tokens[1].text == "=":
        first = tokens[0]
        if (first.kind == "word" and len(first.text) == 1) or (first.kind == "cmd" and first.text not in OPERATORS):
            return 2
    return 0


def read_strict(tokens: list[Token], *, strict: bool = True) -> Reading:
    """A value and nothing else but units and words (a box, an answer text, a reference)."""
    if not tokens:
        return _refused("an empty answer")
    i = _name_end(tokens)
    value = value_at(tokens, i, strict=strict) if i < len(tokens) and is_value_start(tokens, i) else None
    if value is None:
        return _refused(f"not a number: {_text(tokens)[:60]!r}", _text(tokens))
    text = _text(tokens[value.start : value.end])
    if value.refusal:
        return _refused(value.refusal, text)
    k = units_end(tokens, value.end)
    why = remainder_refusal(tokens, k, len(tokens)) or _changed(tokens[k:]) or _words_only(tokens[k:])
    return _refused(why, text) if why else Reading(value.value, text)


def _changed(tokens: list[Token]) -> str | None:
    found = changer(tokens)
    return None if found is None else f"{found!r} changes the claim"


def _foreign_digits(tokens: list[Token]) -> str | None:
    return "non-ASCII digits" if any(t.kind == "udigit" for t in tokens) else None


def _words_only(tokens: list[Token]) -> str | None:
    """Why what follows a boxed value is more than words (a unit, a noun): None when it is not."""
    for t in tokens:
        if t.kind != "word" and t.text not in (".", ",", ":"):
            return f"not a number: {t.text!r} after the value"
    return None


def read_prose(tokens: list[Token]) -> Reading:
    """The value a sentence states (module docstring), or why it states none."""
    reading = _read_first(tokens)
    if reading.refusal:
        after_link = _read_after_link(tokens)
        if after_link is not None and after_link.refusal is None:
            reading = after_link
    if reading.refusal is None and (why := _changed(tokens)):
        return _refused(why, reading.text)
    return reading


def _read_first(tokens: list[Token]) -> Reading:
    """The first value outside brackets, nothing before it that bounds it, nothing after it (up
    to a connective: "because", "(", "which") that joins another value to it."""
    depths = _depths(tokens)
    i = next((j for j in range(len(tokens)) if depths[j] == 0 and is_value_start(tokens, j)), None)
    if i is None:
        return _refused(f"no number in {_text(tokens)[:60]!r}")
    if sign_is_operator(tokens, i):
        return _refused(f"{tokens[i - 1].text} {tokens[i].text} ...: an operation left")
    if why := lead_refusal(tokens[:i]):
        return _refused(why)
    value = value_at(tokens, i)
    if value is None:
        return _refused(f"no number in {_text(tokens)[:60]!r}")
    text = _text(tokens[value.start : value.end])
    if value.refusal:
        return _refused(value.refusal, text)
    k = units_end(tokens, value.end)
    cut = next((j for j in range(k, len(tokens)) if depths[j] == 0 and word(tokens[j]) in CONNECTIVES), len(tokens))
    why = remainder_refusal(tokens, k, cut, len(tokens))
    return _refused(why, text) if why else Reading(value.value, text)


def _read_after_link(tokens: list[Token]) -> Reading | None:
    """The value after the last link ("is", "=", "gives") that has one after it; None when none."""
    depths = _depths(tokens)
    last_value = max((j for j in range(len(tokens)) if depths[j] == 0 and is_value_start(tokens, j)), default=-1)
    link = max((j for j in range(last_value) if depths[j] == 0 and word(tokens[j]) in LINKS), default=None)
    return None if link is None else _read_first(tokens[link + 1 :])


def read_last(tokens: list[Token]) -> Reading:
    """The last value of a sentence (a response with no answer marker), or why it is no answer."""
    depths, values, i = _depths(tokens), [], 0
    while i < len(tokens):
        if depths[i] == 0 and not sign_is_operator(tokens, i) and is_value_start(tokens, i):
            value = value_at(tokens, i)
            if value is not None:
                values.append(value)
                i = max(value.end, i + 1)
                continue
        i += 1
    if not values:
        return _refused("no number in the last sentence")
    value = values[-1]
    text = _text(tokens[value.start : value.end])
    if value.refusal:
        return _refused(value.refusal, text)
    link = max((j for j in range(value.start) if depths[j] == 0 and word(tokens[j]) in LINKS), default=-1)
    previous = values[-2].end if len(values) > 1 else 0
    lead = tokens[max(link + 1, previous) : value.start]
    k = units_end(tokens, value.end)
    cut = next((j for j in range(k, len(tokens)) if depths[j] == 0 and word(tokens[j]) in CONNECTIVES), len(tokens))
    listed = len(values) > 1 and previous > link and len(lead) <= 1 and all(word(t) in JOINERS for t in lead)
    why = (
        ("a list of values, not one answer" if listed else None)
        or lead_refusal(lead)
        or remainder_refusal(tokens, k, cut, len(tokens))
        or _changed(tokens)
    )
    return _refused(why, text) if why else Reading(value.value, text)


def read_number(claim: Claim) -> Reading:
    """The number a claim states (its marker says how to read it), or why it states none."""
    if claim.source == "boxed":
        reading = read_strict(claim.tokens)
        why = reading.refusal or box_lead_refusal(claim.lead) or _tail_refusal(claim.tail)
        return _refused(why, reading.text) if why else reading
    if claim.source == "last_number":
        return read_last(claim.tokens)
    return read_prose(claim.tokens)


def _tail_refusal(tail: list[Token]) -> str | None:
    """Why the rest of a box's sentence changes the boxed answer ("\\boxed{85} or more")."""
    depths = _depths(tail)
    cut = next((j for j in range(len(tail)) if depths[j] == 0 and word(tail[j]) in CONNECTIVES), len(tail))
    return remainder_refusal(tail, 0, cut, len(tail)) or _changed(tail)


def read_math(claim: Claim) -> Reading:
    """The math a claim states, for a symbolic check against a reference that is not a number."""
    if claim.source == "boxed":
        why = box_lead_refusal(claim.lead)
        return _refused(why, claim.text) if why else _boxed_math(claim.text, claim.tokens, claim.tail)
    if claim.source == "last_number":
        return read_last(claim.tokens)
    span = _MATH_SPAN.search(claim.text)
    if span is None:
        return _prose_math(claim.tokens)
    body = next(g for g in span.groups() if g is not None)
    lead = [t for t in claim.tokens if t.start - claim.offset < span.start()]
    rest = [t for t in claim.tokens if t.start - claim.offset >= span.end()]
    why = lead_refusal(lead) or _tail_refusal(rest) or _changed(lead)
    if why:
        return _refused(why, body)
    box = _OUTER_BOX.match(body)
    return _boxed_math(box.group(1), tokenize(box.group(1)), []) if box else _math_text(body, tokenize(body))


def _boxed_math(content: str, tokens: list[Token], tail: list[Token]) -> Reading:
    why = _tail_refusal(tail) or _changed(tokens)
    return _refused(why, content) if why else _math_text(content, tokens)


def _math_text(text: str, tokens: list[Token]) -> Reading:
    """The math of an answer without the words that follow it (`10\\pi \\text{ cm}` -> `10\\pi`)."""
    if why := _changed(tokens) or _foreign_digits(tokens):
        return _refused(why, text)
    math = _TRAILING_TEXT.sub("", text).strip()
    return Reading(None, math) if math else _refused("an empty answer")


def _prose_math(tokens: list[Token]) -> Reading:
    """The math of a sentence with no `$...$`: its words up to the first connective."""
    if why := _changed(tokens) or _foreign_digits(tokens):
        return _refused(why)
    depths = _depths(tokens)
    cut = next(
        (
            j
            for j in range(1, len(tokens))
            if depths[j] == 0 and tokens[j].kind == "word" and word(tokens[j]) in CONNECTIVES
        ),
        len(tokens),
    )
    head = tokens[:cut]
    if not head:
        return _refused("an empty answer")
    text = "".join((" " if t.space and n else "") + t.text for n, t in enumerate(head)).rstrip(". ")
    return Reading(None, text)
