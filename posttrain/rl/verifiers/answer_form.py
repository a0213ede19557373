"""Closed forms: is a numeric answer written as a value, or as a computation left to perform?

A small parser for the LaTeX / ASCII arithmetic that final answers use (numbers, `\\pi`,
`\\sqrt{..}`, `\\sqrt[n]{..}`, `\\frac{..}{..}`, `+ - * / ^ ! =`, `\\times`, `\\cdot`, `\\div`,
parentheses, implicit products); anything else (a letter, another macro) is a symbol. `free_operation`
names the first operation that is left to perform ("37+48", "6*7", "2^{10}", "\\sqrt{4}",
"\\frac{6}{4}", "\\sqrt{2}+\\sqrt{2}", "85=85"); a closed form such as `2\\sqrt{2}`, `\\sqrt{8}`,
`\\frac{1+\\sqrt{5}}{2}` or `\\frac{\\pi}{2}` has none. The rules are in `math.py`'s docstring.
"""

from __future__ import annotations

import math
import re
from fractions import Fraction

_TOKEN = re.compile(r"\s*(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+|\\[A-Za-z]+|[A-Za-z]|.)", re.ASCII)
_FRACS = ("\\frac", "\\dfrac", "\\tfrac")
_TIMES = ("*", "\\times", "\\cdot")
_OPEN = {"(": ")", "{": "}", "[": "]"}
MAX_CHARS = 1000


class _Free(Exception):
    """An operation left to perform (the message says which)."""


class _Unparsed(Exception):
    """Text outside the grammar."""


class _Parser:
    """Recursive descent: eq > sum > product > unary minus > power > factorial > atom.
    Nodes are tuples: ("num", Fraction, text), ("sym", name), ("pi",), ("neg", x), ("sum", [x]),
    ("prod", [x]), ("div", n, d, how), ("pow", b, e), ("root", n, x), ("fact", x), ("eq", [x])."""

    def __init__(self, text: str) -> None:
        self.tokens = [t for t in _TOKEN.findall(text) if t.strip()]
        self.i = 0

    def peek(self) -> str | None:
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        tok = self.peek()
        if tok is None or (expected is not None and tok != expected):
            raise _Unparsed(f"expected {expected!r}, got {tok!r}")
        self.i += 1
        return tok

    def parse(self) -> tuple:
        node = self.equation()
        if self.peek() is not None:
            raise _Unparsed(f"unexpected {self.peek()!r}")
        return node

    def equation(self) -> tuple:
        sides = [self.sum()]
        while self.peek() == "=":
            self.take()
            sides.append(self.sum())
        return sides[0] if len(sides) == 1 else ("eq", sides)

    def sum(self) -> tuple:
        terms = [self.product()]
        while self.peek() in ("+", "-"):
            op = self.take()
            term = self.product()
            terms.append(("neg", term) if op == "-" else term)
        return terms[0] if len(terms) == 1 else ("sum", terms)

    def product(self) -> tuple:
        factors = [self.unary()]
        while True:
            tok = self.peek()
            if tok in _TIMES:
                self.take()
                factors.append(self.unary())
            elif tok in ("/", "\\div"):
                self.take()
                right = self.unary()
                left = factors.pop() if len(factors) == 1 else ("prod", factors)
                factors = [("div", left, right, "div" if tok == "\\div" else "slash")]
            elif tok is not None and (tok in _OPEN or tok[0].isalnum() or tok[0] == "." or tok.startswith("\\")):
                factors.append(self.power())  # implicit product: 2\sqrt{2}, 3\pi
            else:
                break
        return factors[0] if len(factors) == 1 else ("prod", factors)

    def unary(self) -> tuple:
        if self.peek() in ("-", "+"):
            sign = self.take()
            inner = self.unary()
            return ("neg", inner) if sign == "-" else inner
        return self.power()

    def power(self) -> tuple:
        base = self.postfix()
        if self.peek() == "^":
            self.take()
            return ("pow", base, self.unary() if self.peek() in ("-", "+") else self.postfix())
        return base

    def postfix(self) -> tuple:
        node = self.atom()
        while self.peek() == "!":
            self.take()
            node = ("fact", node)
        return node

    def group(self) -> tuple:
        """A {...} argument, or a single token (\\frac12)."""
        if self.peek() == "{":
            self.take()
            node = self.equation()
            self.take("}")
            return node
        return self.atom()

    def atom(self) -> tuple:
        tok = self.take()
        if tok in _OPEN:
            node = self.equation()
            self.take(_OPEN[tok])
            return node
        if tok[0].isdigit() or tok[0] == ".":
            return ("num", Fraction(tok), tok)
        if tok in _FRACS:
            if self.peek() not in (None, "{") and self.peek()[0].isdigit() and len(self.peek()) == 2:
                digits = self.take()  # \frac12
                return ("div", ("num", Fraction(digits[0]), digits[0]), ("num", Fraction(digits[1]), digits[1]), "frac")
            return ("div", self.group(), self.group(), "frac")
        if tok == "\\sqrt":
            index = 2
            if self.peek() == "[":
                self.take()
                index_tok = self.take()
                self.take("]")
                if not index_tok.isdigit() or not 2 <= int(index_tok) <= 64:
                    raise _Unparsed(f"root index {index_tok!r}")
                index = int(index_tok)
            return ("root", index, self.group())
        if tok == "\\pi":
            return ("pi",)
        if tok[0].isalpha() or tok.startswith("\\"):
            return ("sym", tok)
        raise _Unparsed(f"unexpected {tok!r}")


def parse(text: str) -> tuple | None:
    """The expression tree of `text`, or None when it is outside the grammar (or too long, too
    deeply nested, or has a number with a huge exponent: no final answer looks like that)."""
    if len(text) > MAX_CHARS or re.search(r"[eE][-+]?\d{4,}", text):
        return None
    try:
        return _Parser(text).parse()
    except (_Unparsed, ValueError, ZeroDivisionError, RecursionError):
        return None


def has_symbols(node: tuple) -> bool:
    """Whether the tree has a symbol (a variable, an unknown macro) anywhere."""
    if node[0] == "sym":
        return True
    return any(has_symbols(c) for c in _children(node))


def is_constant(text: str) -> bool:
    """True for a number written in closed form without symbols (`\\sqrt{8}`, `2\\pi`, `\\frac{1}{3}`)."""
    node = parse(text)
    return node is not None and not has_symbols(node)


def free_operation(text: str, *, symbols: bool = False) -> str | None:
    """Why `text` is not a closed form of a constant (an operation left to perform, a symbol,
    text outside the grammar), or None when it is one. `symbols`: an expression in variables may
    be a closed form too (`x^2+2x+1`, `\\frac{x-3}{2}`), with the same rules."""
    node = parse(text)
    if node is None:
        return "not a number or closed form"
    if has_symbols(node) and not symbols:
        return "has a symbol"
    try:
        _value(node)
    except _Free as e:
        return str(e)
    return None


def _children(node: tuple) -> list[tuple]:
    kind = node[0]
    if kind in ("sum", "prod", "eq"):
        return list(node[1])
    if kind in ("neg", "fact"):
        return [node[1]]
    if kind in ("div", "pow"):
        return [node[1], node[2]]
    if kind == "root":
        return [node[2]]
    return []


def _root_of(value: Fraction, n: int) -> Fraction | None:
    """The rational n-th root of `value`, or None when it is irrational."""
    if value < 0 and n % 2 == 0:
        return None
    a, b = _int_root(abs(value.numerator), n), _int_root(value.denominator, n)
    return None if a is None or b is None else (-1 if value < 0 else 1) * Fraction(a, b)


def _int_root(x: int, n: int) -> int | None:
    """The integer n-th root of x >= 0, or None when x is no n-th power."""
    if x in (0, 1):
        return x
    guess = round(math.exp(math.log(x) / n))
    return next((r for r in (guess - 1, guess, guess + 1) if r > 0 and r**n == x), None)


def _coefficient(node: tuple) -> Fraction:
    """The rational factor in front of a term (2 in 2\\sqrt{3}, 1 when none)."""
    if node[0] == "neg":
        return _coefficient(node[1])
    if node[0] == "num":
        return node[1]
    if node[0] == "prod":
        return math.prod((f[1] for f in node[1] if f[0] == "num"), start=Fraction(1))
    return Fraction(1)


def _content(node: tuple) -> int:
    """gcd of the integer coefficients of a sum's terms (of a product's coefficient); 1 when any is
    not an integer (no common factor worth cancelling)."""
    terms = node[1] if node[0] == "sum" else [node]
    coefficients = [_coefficient(t) for t in terms]
    if any(c.denominator != 1 for c in coefficients):
        return 1
    return math.gcd(*(int(c) for c in coefficients))


def _key(node: tuple) -> str:
    """A term without its sign and rational coefficient, radicals simplified: like terms
    (`\\sqrt{50}` and `\\sqrt{2}`) have equal keys."""
    if node[0] == "neg":
        return _key(node[1])
    factors = node[1] if node[0] == "prod" else [node]
    return repr([_simplest(f) for f in factors if f[0] != "num"])


def _simplest(node: tuple) -> tuple:
    """\\sqrt[n]{k} with its n-th power factors taken out (\\sqrt{50} -> \\sqrt{2}); others as they are."""
    if node[0] != "root" or node[2][0] != "num" or node[2][1].denominator != 1 or not 0 < node[2][1] < 10**12:
        return node
    n, k, p = node[1], int(node[2][1]), 2
    while p**n <= k and p < 10**4:
        while k % p**n == 0:
            k //= p**n
        p += 1
    return ("root", n, ("num", Fraction(k), str(k)))


def _bases(node: tuple) -> set[str]:
    """The factors of a product other than numbers, a power counting by its base's factors:
    `\\pi^2` and `\\pi`, `(2\\pi)^2` and `2\\pi`, `(x+1)^2` and `x+1` share one, so their quotient has a
    factor left to cancel."""
    kind = node[0]
    if kind == "neg":
        return _bases(node[1])
    if kind == "prod":
        return set().union(*(_bases(f) for f in node[1]))
    if kind == "pow":
        return _bases(node[1])
    return set() if kind == "num" else {repr(node)}


def _perfect_power(node: tuple, n: int) -> bool:
    """Whether `node` is an n-th power whose root is a closed form (`\\pi^2`, `4\\pi^2`, `(1+\\sqrt{2})^2`
    for n = 2), so that the root of it is work left."""
    factors = node[1] if node[0] == "prod" else [node]
    for f in factors:
        if f[0] == "num":
            if f[1] <= 0 or _root_of(f[1], n) is None:
                return False
        elif f[0] != "pow" or f[2][0] != "num" or f[2][1].denominator != 1 or f[2][1] % n != 0:
            return False
    return True


def _has_root(node: tuple) -> bool:
    return node[0] == "root" or any(_has_root(c) for c in _children(node))


def _value(node: tuple) -> Fraction | None:
    """The exact value of a rational node, None for an irrational one; _Free on an operation left
    to perform."""
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind in ("pi", "sym"):
        return None
    if kind == "eq":
        raise _Free("an equation, not a value")
    if kind == "fact":
        raise _Free("a factorial left to evaluate")
    if kind == "neg":
        if node[1][0] == "neg":
            raise _Free("a double negation")
        inner = _value(node[1])
        return None if inner is None else -inner
    if kind == "sum":
        values = [_value(t) for t in node[1]]
        if sum(v is not None for v in values) >= 2:
            raise _Free("a sum of numbers left to add")
        if 0 in values:
            raise _Free("a sum with 0")
        keys = [_key(t) for t, v in zip(node[1], values) if v is None]
        if len(keys) != len(set(keys)):
            raise _Free("like terms left to collect")
        return None
    if kind == "prod":
        values = [_value(f) for f in node[1]]
        if sum(v is not None for v in values) >= 2:
            raise _Free("a product of numbers left to multiply")
        if any(v in (0, 1, -1) for v in values if v is not None):
            raise _Free("a product by 0 or 1")
        irrational = [repr(f) for f, v in zip(node[1], values) if v is None]
        if len(irrational) != len(set(irrational)) or sum(f[0] == "root" for f in node[1]) >= 2:
            raise _Free("factors left to combine")
        return None
    if kind == "div":
        _, num, den, how = node
        n, d = _value(num), _value(den)
        if d == 0:
            raise _Free("a division by zero")
        literal = num[0] == "num" or (num[0] == "neg" and num[1][0] == "num")
        if n is not None and d is not None:
            if how == "div" or not literal or den[0] != "num" or n.denominator != 1 or d.denominator != 1:
                raise _Free("a division left to perform")
            if d <= 1 or math.gcd(int(n), int(d)) != 1:
                raise _Free("a fraction not in lowest terms")
            return n / d
        if d is not None and (d.denominator != 1 or d <= 1):
            raise _Free("a division left to perform")
        if math.gcd(_content(num), _content(den)) != 1:
            raise _Free("a fraction not in lowest terms")
        if _bases(num) & _bases(den):
            raise _Free("a common factor left to cancel")
        return None
    if kind == "pow":
        _, base, exponent = node
        b, e = _value(base), _value(exponent)
        if e in (0, 1):
            raise _Free("a power by 0 or 1")
        if b is not None and e is not None:
            if e.denominator == 1 or abs(e.numerator) > 64 or _root_of(b**e.numerator, e.denominator) is not None:
                raise _Free("a power left to evaluate")
            return None
        if _has_root(base) and e is not None and e.denominator == 1:
            raise _Free("a power of a root left to evaluate")
        return None
    if kind == "root":
        inner = _value(node[2])
        if inner is not None and _root_of(inner, node[1]) is not None:
            raise _Free("a root left to evaluate")
        if _perfect_power(node[2], node[1]):
            raise _Free("a root of a power left to take")
        return None
    raise _Free(f"unknown {kind}")
