"""Tokens of a final answer: numbers (ASCII digits, thousands separators, decimals, e-notation),
words, LaTeX commands and symbols, with the wrappers that carry no meaning dropped (`$`, `**`,
`\\boxed{}`, `\\mathbf{}`, `\\text{}`, `\\left`, spacing) and unicode signs mapped to their ASCII or
LaTeX form (U+2212 and the en dash are minus signs, `×` is `\\times`, `½` is `\\frac{1}{2}`).
Linear in the text: one regular expression pass and one pass over the tokens."""

from __future__ import annotations

import dataclasses
import re

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
