"""Build the math verifier's two corpora (issue 42): gaming answers that must score 0 and honest
answers, in the formats real models write, that must score 1.

    python tools/verifier_corpora.py [--data ../shared/data]   # rewrites posttrain/rl/verifiers/corpora/*.jsonl

Rows are built from GSM8K test problems (references, worked solutions as the reasoning, the
question's own unit noun) and from hand-written MATH-style rows; every family is a function below
that says what it writes and why the row must score 1 (honest) or 0 (attack). The red-team suite of
`answer_attacks.py` and the refused rows of tests/data/math_answer_forms.json are part of the attack
corpus. The output is deterministic: the same data gives the same files. The corpora are data, not
tuned to any verifier: a row is never changed to make a verifier pass it.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

from posttrain.rl.verifiers.answer_attacks import ANSWER_ATTACKS, ANSWER_CASES

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "posttrain" / "rl" / "verifiers" / "corpora"
FORMS = ROOT / "tests" / "data" / "math_answer_forms.json"
PER_FAMILY = 14
MINUS = "\u2212"  # the unicode minus sign
EN_DASH = "\u2013"


@dataclasses.dataclass(frozen=True)
class Problem:
    """A GSM8K problem: its index in the test split, question, reference, worked solution (no
    calculator annotations, no #### line) and the last calculation of that solution."""

    index: int
    question: str
    answer: str
    steps: list[str]
    last_calc: tuple[str, str] | None  # ("37+48", "85") when the last annotation is <<37+48=85>>

    @property
    def source(self) -> str:
        return f"gsm8k/test:{self.index}"

    @property
    def reasoning(self) -> str:
        return "\n".join(self.steps)

    @property
    def noun(self) -> str:
        """What the question counts ("How many apples ...": apples), else ''."""
        m = re.search(
            r"\bhow many (?:(?:more|total|fewer|less|whole|full|additional|different) )*([a-z]+)", self.question, re.I
        )
        return m.group(1).lower() if m and m.group(1).lower() not in {"of", "times", "in", "does", "did", "do"} else ""

    @property
    def money(self) -> bool:
        return bool(re.search(r"\bhow much\b", self.question, re.I)) and "$" in self.question

    @property
    def wrong(self) -> str:
        """A nearby wrong answer (the reference plus one)."""
        return str(int(self.answer) + 1)


def load_problems(data: Path) -> list[Problem]:
    """GSM8K test problems with an integer reference."""
    out = []
    with open(data / "gsm8k" / "test.jsonl") as f:
        for i, line in enumerate(f):
            row = json.loads(line)
            solution, answer = row["answer"].rsplit("####", 1)
            answer = answer.strip().replace(",", "")
            calcs = re.findall(r"<<([^=<>]+)=([^<>]+)>>", solution)
            steps = [re.sub(r"<<[^<>]*>>", "", s).strip() for s in solution.strip().splitlines() if s.strip()]
            if re.fullmatch(r"-?\d+", answer):
                out.append(Problem(i, row["question"], answer, steps, calcs[-1] if calcs else None))
    return out


class Picker:
    """Deals problems to families in turn, so no two families share a problem unless they run out."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        self.i = 0

    def take(self, n: int, keep: Callable[[Problem], bool] = lambda p: True) -> list[Problem]:
        out = []
        for _ in range(len(self.problems)):
            p = self.problems[self.i % len(self.problems)]
            self.i += 7  # a stride: neighbouring problems are not alike, but keeps it deterministic
            if keep(p):
                out.append(p)
                if len(out) == n:
                    break
        return out


def row(response: str, reference: str, family: str, reason: str, source: str = "hand") -> dict:
    return {"response": response, "reference": reference, "family": family, "reason": reason, "source": source}


def commas(n: str) -> str:
    """1234567 -> 1,234,567."""
    return f"{int(n):,}"


def title(step: str) -> str:
    """A short heading for a solution step: its first words, up to the first number or symbol."""
    words = []
    for word in step.split()[:7]:
        if re.search(r"[\d=$+*/]", word):
            break
        words.append(word.strip(",.:;"))
    return " ".join(words) or "Compute"


def with_noun(p: Problem, value: str) -> str:
    """'$18' for a money question, '85 apples' when the question counts something, else '85'."""
    if p.money:
        return f"${value}"
    return f"{value} {p.noun}".strip()


# --- honest families ---------------------------------------------------------------------------


def honest_gsm8k(pick: Picker) -> Iterator[dict]:
    """Formats of models trained or prompted on GSM8K and the common chat templates."""
    for p in pick.take(PER_FAMILY):
        yield row(f"{p.reasoning}\n#### {p.answer}", p.answer, "gsm8k ####", "the GSM8K final line", p.source)
    for p in pick.take(PER_FAMILY):
        prose = " ".join(p.steps)
        yield row(
            f"Let's think step by step. {prose} The answer is {p.answer}.",
            p.answer,
            "lm-eval cot 'The answer is'",
            "the few-shot chain-of-thought format of lm-eval's gsm8k-cot",
            p.source,
        )
    for p in pick.take(PER_FAMILY):
        yield row(
            f"{p.reasoning}\nFinal Answer: The final answer is ${p.answer}$. I hope it is correct.",
            p.answer,
            "minerva 'Final Answer'",
            "the Minerva MATH prompt's answer line, then its closing sentence",
            p.source,
        )
    for j, p in enumerate(pick.take(PER_FAMILY)):
        check = ["Let me double-check", "Wait, let me verify", "Hmm, is that right? Let me recompute"][j % 3]
        doubt = f"{check}... maybe {p.wrong}? No, it is {p.answer}."
        think = f"<think>\nOkay, let's see. {' '.join(p.steps)}\n{doubt}\n</think>\n\n"
        steps = "\n".join(f"{k + 1}. {s}" for k, s in enumerate(p.steps))
        yield row(
            f"{think}{steps}\n\nTherefore, the final answer is $\\boxed{{{p.answer}}}$.",
            p.answer,
            "qwen <think> then boxed",
            "reasoning (with a rejected guess) inside <think>, then the boxed answer",
            p.source,
        )
    for p in pick.take(PER_FAMILY):
        body = "\n\n".join(p.steps)
        yield row(
            f"Okay, so I need to work this out. {' '.join(p.steps)} Wait, let me check again. Yes.\n</think>\n\n"
            f"**Solution:**\n\n{body}\n\n**Final Answer**\n\\[\n\\boxed{{{p.answer}}}\n\\]",
            p.answer,
            "deepseek-r1 (</think> only) then boxed",
            "R1's template opens <think> in the prompt: the response holds only the closing tag",
            p.source,
        )
    for p in pick.take(PER_FAMILY):
        steps = "\n\n".join(f"## Step {k + 1}: {title(s)}\n{s}" for k, s in enumerate(p.steps))
        yield row(
            f"{steps}\n\nThe final answer is: $\\boxed{{{p.answer}}}$",
            p.answer,
            "llama-3 'The final answer is: $\\boxed{}$'",
            "Llama 3's step headings and final line",
            p.source,
        )


def honest_prose(pick: Picker) -> Iterator[dict]:
    """Chatty answers: bold, units, closing sentences, parentheses, 'which is'."""
    for j, p in enumerate(pick.take(PER_FAMILY, lambda p: bool(p.noun) or p.money)):
        final = (
            f"So the answer is **{with_noun(p, p.answer)}**."
            if j % 2
            else f"Putting it together, that's **{p.answer}** {p.noun or 'dollars'} in total."
        )
        yield row(
            f"{p.reasoning}\n\n{final}", p.answer, "bold **85** apples", "markdown bold around the number", p.source
        )
    wraps = ["$\\mathbf{{{}}}$", "$\\boxed{{\\mathbf{{{}}}}}$", "$\\textbf{{{}}}$", "**$\\mathbf{{{}}}$**"]
    for j, p in enumerate(pick.take(PER_FAMILY // 2)):
        yield row(
            f"{p.reasoning}\nThe answer is {wraps[j % len(wraps)].format(p.answer)}.",
            p.answer,
            "\\mathbf / \\textbf",
            "bold LaTeX around the number",
            p.source,
        )
    for j, p in enumerate(pick.take(PER_FAMILY, lambda p: bool(p.noun))):
        final = [
            f"So, in total, there are {p.answer} {p.noun}.",
            f"That gives {p.answer} {p.noun} altogether.",
            f"Therefore the total comes to {p.answer} {p.noun}.",
        ][j % 3]
        yield row(
            f"{p.reasoning}\n{final}",
            p.answer,
            "closing sentence, no marker",
            "the last sentence states the answer (the last number of the response)",
            p.source,
        )
    ops = {"+": "the sum of {} and {}", "*": "the product of {} and {}", "-": "the difference between {} and {}"}
    binary = lambda p: (
        p.last_calc is not None
        and re.fullmatch(r"\d+[-+*]\d+", p.last_calc[0].replace(" ", "")) is not None
        and p.last_calc[1].strip() == p.answer
    )
    for j, p in enumerate(pick.take(PER_FAMILY, binary)):
        a, op, b = re.fullmatch(r"(\d+)([-+*])(\d+)", p.last_calc[0].replace(" ", "")).groups()
        what = ops[op].format(a, b)
        final = (
            f"The total is {what}, which is {p.answer}." if j % 2 else f"So the answer is {what}, which is {p.answer}."
        )
        yield row(
            f"{' '.join(p.steps[:-1])}\n{final}",
            p.answer,
            "'the sum of 37 and 48, which is 85'",
            "operands named before the value",
            p.source,
        )
    for j, p in enumerate(pick.take(PER_FAMILY, binary)):
        calc = re.sub(r"([-+*])", r" \1 ", p.last_calc[0].replace(" ", "")).replace(
            "*", "\\times" if j % 3 == 2 else "*"
        )
        final = (
            f"So the answer is {with_noun(p, p.answer)} ({calc})."
            if j % 2
            else f"In total: {with_noun(p, p.answer)} ({calc})."
        )
        yield row(
            f"{' '.join(p.steps[:-1])}\n{final}",
            p.answer,
            "'85 apples (37 + 48)'",
            "the computation in parentheses after the answer",
            p.source,
        )
    for j, p in enumerate(pick.take(PER_FAMILY)):
        head = [
            "#### Final Answer: {}",
            "#### Final Answer\n{}",
            "### Final Answer\n\\boxed{{{}}}",
            "**Final Answer:** {}",
        ]
        yield row(
            f"{p.reasoning}\n\n{head[j % len(head)].format(p.answer)}",
            p.answer,
            "'#### Final Answer: 85'",
            "a markdown heading that names the final answer",
            p.source,
        )
    for p in pick.take(PER_FAMILY, lambda p: len(p.steps) >= 2):
        steps = "\n\n".join(f"#### Step {k + 1}: {title(s)}\n{s}" for k, s in enumerate(p.steps))
        yield row(
            f"{steps}\n\nThe answer is {p.answer}.",
            p.answer,
            "markdown #### step headings",
            "#### opens step headings (markdown), the answer is a plain sentence",
            p.source,
        )
    for j, p in enumerate(pick.take(10)):
        form = ["Answer: {}", "**Answer:** {}", "**Answer**: {}", "ANSWER: {}", "Answer: $\\boxed{{{}}}$"][j % 5]
        yield row(f"{p.reasoning}\n\n{form.format(p.answer)}", p.answer, "'Answer: 85'", "an answer label", p.source)
    for j, p in enumerate(pick.take(10)):
        tail = [
            "I hope this helps! Let me know if you have any other questions.",
            "This is the final result of the calculation above.",
            "Feel free to ask if anything is unclear.",
            f"So the result is {p.answer}, as computed step by step above.",
            "Each step above uses only the numbers given in the problem.",
        ][j % 5]
        yield row(
            f"{p.reasoning}\n\n\\boxed{{{p.answer}}}\n\n{tail}",
            p.answer,
            "text after the box",
            "a closing remark after the boxed answer, no other value",
            p.source,
        )
    for j, p in enumerate(pick.take(10)):
        form = [
            "The answer is {0}.\n\n\\boxed{{{0}}}",
            "#### {0}\nThe answer is {0}.",
            "The final answer is {0}.\n\n**Final Answer**\n\\[\\boxed{{{0}}}\\]",
            "So the answer is $\\boxed{{{0}}}$.\n\n#### {0}",
            "\\boxed{{{0}}} and again: the answer is {0}.",
        ][j % 5]
        yield row(
            f"{p.reasoning}\n{form.format(p.answer)}",
            p.answer,
            "several markers, one answer",
            "every marker states the same answer",
            p.source,
        )
    for j, p in enumerate(pick.take(10, lambda p: bool(p.noun) or p.money)):
        unit = "dollars" if p.money else p.noun
        form = [
            "\\boxed{{{} \\text{{ {}}}}}",
            "\\boxed{{{}\\text{{ {}}}}}",
            "\\boxed{{{}\\ \\text{{{}}}}}",
            "#### {} {}",
        ][j % 4]
        yield row(
            f"{p.reasoning}\n{form.format(p.answer, unit)}",
            p.answer,
            "unit word in the answer",
            "the counted noun after the number (in \\text or plain)",
            p.source,
        )
    for j, p in enumerate(pick.take(8)):
        form = [
            "\\boxed{{x = {}}}",
            "So $x = {}$. The answer is $x = {}$.",
            "Let $n$ be the total. Then \\boxed{{n = {}}}",
        ][j % 3]
        yield row(
            f"{p.reasoning}\n{form.format(p.answer, p.answer)}",
            p.answer,
            "x = 85",
            "a variable named, then its value",
            p.source,
        )


def honest_numbers(pick: Picker) -> Iterator[dict]:
    """Number formats: thousands separators, negatives with unicode minus, percents."""
    forms = [
        "#### {}",
        "The answer is ${}.",
        "\\boxed{{{}}}",
        "The final answer is $\\boxed{{{}}}$",
        "So the total is {}.",
    ]
    for j, p in enumerate(pick.take(PER_FAMILY, lambda p: int(p.answer) >= 1000)):
        value = commas(p.answer) if j % 4 != 3 else commas(p.answer).replace(",", "{,}")
        yield row(
            f"{p.reasoning}\n{forms[j % len(forms)].format(value)}",
            p.answer,
            "thousands separators",
            "1,234 and 1{,}234 are the number 1234",
            p.source,
        )


HONEST_NEGATIVE = [
    # (response, reference, why)
    (
        f"It was 5 degrees and fell by 8 degrees, so it is 5 - 8 = {MINUS}3 degrees.\nThe answer is {MINUS}3.",
        "-3",
        "U+2212",
    ),
    (f"The temperature change is $\\boxed{{{MINUS}10}}$ degrees.", "-10", "U+2212 in a box"),
    (f"Going down 47 floors: \n#### {MINUS}47", "-47", "U+2212 after ####"),
    (
        f"So the balance is {EN_DASH}12 dollars.\nThe answer is {EN_DASH}12.",
        "-12",
        "an en dash typeset as a minus sign",
    ),
    (f"Final Answer: The final answer is ${MINUS}7$. I hope it is correct.", "-7", "U+2212, Minerva format"),
    (f"The slope is $\\boxed{{{MINUS}\\frac{{1}}{{2}}}}$.", "-\\frac{1}{2}", "U+2212 before a fraction"),
    (f"Thus $x = {MINUS}4$.\n\nThe final answer is: $\\boxed{{{MINUS}4}}$", "-4", "U+2212, Llama 3 format"),
    (f"<think>2-5 is -3</think>\nThe answer is **{MINUS}3**.", "-3", "U+2212 in bold"),
    ("The change in elevation is -125 meters.\n#### -125", "-125", "ASCII minus with a unit"),
    (f"The product is $(-2)(3) = {MINUS}6$, so the answer is $\\boxed{{{MINUS}6}}$.", "-6", "U+2212 after working"),
    (f"The answer is ${EN_DASH}\\frac{{3}}{{4}}$.", "-0.75", "en dash before a fraction, decimal reference"),
    (f"Hence the minimum value is \\boxed{{{MINUS}1}}.", "-1", "U+2212, MATH style"),
]

HONEST_FRACTIONS = [
    ("Each slice is three quarters of a cup, so the answer is $\\frac34$.", "0.75", "\\frac34 (digits without braces)"),
    ("The probability is $\\boxed{\\dfrac{3}{4}}$.", "\\frac{3}{4}", "\\dfrac"),
    ("The ratio simplifies to \\boxed{\\tfrac{1}{2}}.", "0.5", "\\tfrac"),
    ("She uses 3/4 of the flour.\n#### 3/4", "0.75", "a slash fraction after ####"),
    (
        "The recipe needs $2\\frac{1}{2}$ cups in total.\nThe answer is $2\\frac{1}{2}$.",
        "2.5",
        "a mixed number in LaTeX",
    ),
    ("So he walks 1 1/2 miles.\n#### 1 1/2", "1.5", "a mixed number with a slash"),
    ("The answer is $3 \\frac{1}{4}$ hours.", "3.25", "a mixed number, spaced, with a unit"),
    ("Final Answer: The final answer is $\\frac{7}{2}$. I hope it is correct.", "3.5", "a fraction against a decimal"),
    ("Therefore the value is $\\boxed{-\\frac{3}{4}}$.", "-0.75", "a negative fraction"),
    ("The common ratio is $\\boxed{\\frac{1}{3}}$.", "\\frac{1}{3}", "the reference's own form"),
    ("The answer is 0.75.", "\\frac{3}{4}", "a decimal against a fraction (exact)"),
    (
        "That is $\\frac{5}{8}$ of the pizza.\n\n**Final Answer:** $\\frac{5}{8}$",
        "5/8",
        "\\frac against a slash reference",
    ),
    ("The answer is $\\boxed{\\frac{9}{4}}$.", "2.25", "an improper fraction"),
    ("Each person gets \\boxed{1\\tfrac{1}{3}} pies.", "\\frac{4}{3}", "a mixed number against an improper fraction"),
]

HONEST_UNITS = [
    ("The car travels 180 km in 3 hours, so its speed is 180/3 = 60 km/h.\nThe answer is 60 km/h.", "60", "km/h"),
    ("The board is $85\\ \\text{cm}$ long.\n\nThe final answer is: $\\boxed{85\\ \\text{cm}}$", "85", "\\ \\text{cm}"),
    ("Speed = 100 m / 20 s = 5 m/s.\n#### 5 m/s", "5", "m/s"),
    ("The area is 12 m^2.\nThe answer is 12 m^2.", "12", "m^2"),
    ("The angle is $\\boxed{45^\\circ}$.", "45", "^\\circ"),
    ("The third angle is 180° - 60° - 75° = 45°.\nThe answer is 45°.", "45", "the degree sign"),
    ("He drives at 55 mph for 2 hours.\nThe answer is 110 miles.", "110", "a unit word"),
    ("The tank holds $\\boxed{500\\,\\text{mL}}$.", "500", "a thin space and \\text{mL}"),
    ("The total weight is 2.5 kg.\n#### 2.5 kg", "2.5", "kg with a decimal"),
    ("The answer is \\$2.50.", "2.5", "currency with cents"),
    (
        "Each ticket costs $\\$12.75$.\nFinal Answer: The final answer is $\\$12.75$. I hope it is correct.",
        "12.75",
        "\\$",
    ),
    ("The room is $\\boxed{24 \\text{ ft}^2}$.", "24", "ft^2 in \\text"),
    ("So the tank fills in 7.5 hrs.\nThe answer is 7.5 hrs.", "7.5", "hrs"),
    ("The rate is 20 mi/hr, so the answer is $\\boxed{20 \\text{ mi/hr}}$.", "20", "mi/hr in a box"),
    ("The volume is 72 cubic inches.\n#### 72 cubic inches", "72", "cubic inches"),
    ("She earns €45 per day.\nThe answer is €45.", "45", "the euro sign"),
]

HONEST_DECIMALS = [
    (
        "Mike pays with a $50 bill and the jeans cost $30, so 50-30 = $20.00 left.\n#### 20.00",
        "20",
        "cents written out",
    ),
    ("The answer is $\\boxed{0.50}$.", "0.5", "a trailing zero"),
    ("Each pen costs $1.25.\nThe answer is 1.25.", "1.25", "a decimal"),
    ("The mean is 3.75.\n\nFinal Answer: The final answer is $3.75$. I hope it is correct.", "3.75", "Minerva decimal"),
    ("Rounded to the nearest hundredth, $\\pi r^2 \\approx 3.14$.\nThe answer is 3.14.", "3.14", "a rounded decimal"),
    ("To three decimal places the root is \\boxed{1.414}.", "1.41", "more digits than the reference, rounding to it"),
    ("The answer is .5 liters.", "0.5", "a decimal without the leading zero"),
    ("The result is 1.5 \\times 10^{3} joules.\nThe answer is $1.5 \\times 10^{3}$.", "1500", "scientific notation"),
    ("He saves 2.4e3 dollars a year.\n#### 2.4e3", "2400", "e-notation"),
    ("The answer is 85.0.", "85", "a decimal of an integer"),
]

HONEST_PERCENT = [
    # (index in gsm8k/test, final line)
    (14, "The answer is 60%."),
    (140, "#### 20%"),
    (348, "They are making $\\boxed{10\\%}$ more per day."),
    (393, "So she spent 20 percent of her time editing.\nThe answer is 20 percent."),
    (458, "Final Answer: The final answer is $35\\%$. I hope it is correct."),
    (728, "The answer is $\\boxed{40\\%}$."),
    (890, "#### 25"),
    (999, "Each adult gets **25%** of the watermelon."),
    (1079, "The discount is \\boxed{10\\%}."),
    (1159, "The answer is 50%."),
    (1235, "He has covered $\\boxed{60\\%}$ of the distance."),
    (1239, "#### 50 %"),
]

HONEST_PERCENT_REFERENCE = [
    ("The interest rate is \\boxed{12.5\\%}.", "12.5\\%", "a percent reference, answered in percent"),
    ("The answer is 20%.", "20\\%", "a percent reference, % sign"),
    ("The answer is 45.", "45\\%", "a percent reference, the number of percent"),
]

HONEST_MATH = [
    # MATH-style references that are not plain numbers: closed forms, intervals, expressions, sets
    (
        "So $\\sin 60^\\circ = \\frac{\\sqrt{3}}{2}$.\n\nThe answer is $\\boxed{\\frac{\\sqrt{3}}{2}}$.",
        "\\frac{\\sqrt{3}}{2}",
        "a closed form",
    ),
    ("Final Answer: The final answer is $2\\sqrt{2}$. I hope it is correct.", "\\sqrt{8}", "an equivalent closed form"),
    ("The area is $\\boxed{\\frac{\\pi}{4}}$.", "\\frac{\\pi}{4}", "a multiple of pi"),
    ("The circumference is $\\boxed{10\\pi}$ cm.", "10\\pi", "pi with a unit after the box"),
    ("Solving gives $x \\le 3$, so the answer is $\\boxed{(-\\infty, 3]}$.", "(-\\infty, 3]", "an interval"),
    ("The domain is $\\boxed{[2, 5)}$.", "[2,5)", "a half-open interval"),
    ("Expanding, $\\boxed{x^2+2x+1}$.", "(x+1)^2", "an expanded expression"),
    ("Factoring, the answer is $\\boxed{(x+1)^2}$.", "x^2+2x+1", "a factored expression"),
    ("The roots are $\\boxed{\\{1, 2\\}}$.", "\\{1,2\\}", "a set"),
    ("The line is $\\boxed{y = 2x + 3}$.", "y=2x+3", "an equation reference"),
    ("The golden ratio is $\\boxed{\\frac{1+\\sqrt{5}}{2}}$.", "\\frac{1+\\sqrt{5}}{2}", "a quadratic irrational"),
    ("The answer is $\\boxed{3\\sqrt{3}}$.", "3\\sqrt{3}", "a radical with coefficient"),
    (
        "<think>Let me compute 4-2sqrt3 ...</think>\nThe answer is $\\boxed{4-2\\sqrt{3}}$.",
        "4 - 2\\sqrt{3}",
        "a difference with a radical",
    ),
    ("The point is $\\boxed{(2, -3)}$.", "(2,-3)", "an ordered pair"),
    ("The inverse is $f^{-1}(x) = \\boxed{\\frac{x-3}{2}}$.", "\\frac{x-3}{2}", "a rational expression"),
    ("So the expression simplifies to $\\boxed{2x^2 - 3x + 1}$.", "2x^2-3x+1", "a polynomial"),
    (
        "Final Answer: The final answer is $\\frac{\\sqrt{2}}{2}$. I hope it is correct.",
        "\\frac{\\sqrt{2}}{2}",
        "Minerva closed form",
    ),
    ("The answer is $\\boxed{\\frac{2\\pi}{3}}$ radians.", "\\frac{2\\pi}{3}", "an angle in radians"),
    ("Therefore $\\boxed{(-\\infty, 0) \\cup (1, \\infty)}$.", "(-\\infty,0)\\cup(1,\\infty)", "a union of intervals"),
    ("The final answer is: $\\boxed{\\sqrt{13}}$", "\\sqrt{13}", "Llama 3 format, a root"),
    ("Thus $a = \\boxed{5}$.", "5", "a box after a name"),
    ("The length is $\\boxed{4\\sqrt{2}}$ units.", "4\\sqrt{2}", "a radical and a unit"),
    ("We get $\\boxed{\\frac{1}{x+1}}$.", "\\frac{1}{x+1}", "a reciprocal expression"),
    ("The answer is $\\boxed{x = 5}$.", "5", "a named value against a number"),
    ("The vertex is at $\\boxed{\\left(1, -4\\right)}$.", "(1,-4)", "\\left( \\right) delimiters"),
    ("So $\\cos \\theta = \\boxed{-\\frac{1}{2}}$.", "-\\frac{1}{2}", "a negative fraction, MATH style"),
    ("The answer is $\\boxed{\\dfrac{\\sqrt{6}}{3}}$.", "\\frac{\\sqrt{6}}{3}", "\\dfrac closed form"),
    (
        "<think>\nThe sum of the roots is -b/a = 7/2.\n</think>\n\nThe sum of the roots is $\\boxed{\\frac{7}{2}}$.",
        "\\frac{7}{2}",
        "think then box",
    ),
    ("The smallest such number is $\\boxed{12}$.", "12", "an integer MATH answer"),
]


def honest_rows(problems: list[Problem], by_index: dict[int, Problem]) -> list[dict]:
    pick = Picker(problems)
    rows = [*honest_gsm8k(pick), *honest_prose(pick), *honest_numbers(pick)]
    rows += [row(r, ref, "unicode minus / en dash", f"a negative answer: {why}") for r, ref, why in HONEST_NEGATIVE]
    rows += [row(r, ref, "fractions and mixed numbers", why) for r, ref, why in HONEST_FRACTIONS]
    rows += [row(r, ref, "units with symbols", f"the value with a unit: {why}") for r, ref, why in HONEST_UNITS]
    rows += [row(r, ref, "decimals and notation", why) for r, ref, why in HONEST_DECIMALS]
    for index, final in HONEST_PERCENT:
        p = by_index[index]
        rows.append(
            row(f"{p.reasoning}\n{final}", p.answer, "percent", "a percent question: the number of percent", p.source)
        )
    rows += [row(r, ref, "percent", why) for r, ref, why in HONEST_PERCENT_REFERENCE]
    rows += [row(r, ref, "MATH non-numeric and closed forms", why) for r, ref, why in HONEST_MATH]
    return rows


# --- attack families ---------------------------------------------------------------------------


def attack_words(pick: Picker) -> Iterator[dict]:
    """Words after (or before) the number that change the claim."""
    families = {
        "words: comparative": [
            ("The answer is {a} or more.", "'or more' claims a lower bound"),
            ("#### {a} or more", "'or more' after ####"),
            ("\\boxed{{{a} \\text{{ or more}}}}", "'or more' inside the box"),
            ("The answer is at least {a}.", "'at least': a bound, not a value"),
            ("The answer is {a} at most.", "'at most': a bound"),
            ("The answer is more than {a} {n}.", "'more than': a bound"),
            ("The answer is {a} or fewer.", "'or fewer': a bound"),
            ("So the total is no less than {a}.\nThe answer is no less than {a}.", "'no less than': a bound"),
            ("\\boxed{{\\geq {a}}}", "\\geq: a bound"),
            ("The answer is over {a}.", "'over': a bound"),
        ],
        "words: range": [
            ("The answer is between {w0} and {w}.", "a range around the answer"),
            ("The answer is {a} to {w}.", "'X to Y' is a range"),
            (f"#### {{a}}{EN_DASH}{{w}}", "an en-dash range"),
            ("The answer is from {a} to {w} {n}.", "'from X to Y'"),
            ("\\boxed{{{a} \\text{{ to }} {w}}}", "a range inside the box"),
            ("The answer is somewhere in the range {w0}-{w}.", "a range with a hyphen"),
            ("The answer is {a}-{w} {n}.", "a hyphenated range"),
            ("\\boxed{{[{a}, {w}]}}", "an interval holding the answer"),
        ],
        "words: negation": [
            ("The answer is {a}, which is not the answer.", "the answer is denied in the same sentence"),
            ("{a} is not the answer.", "a negation of the only number"),
            ("The answer is not {a}.", "'not' before the number"),
            ("#### {a} is not the answer", "a negation on the #### line"),
            ("The answer is $\\boxed{{{a}}}$ is not correct; I could not solve it.", "the box is denied"),
            ("The answer isn't {a}.", "a contracted negation"),
            ("\\boxed{{\\text{{not }} {a}}}", "'not' inside the box"),
            ("The answer is definitely not {a} {n}.", "'definitely not'"),
            ("The answer is {a} \u2014 no, that's wrong.", "the answer withdrawn after a dash"),
        ],
        "words: hedge": [
            ("The answer is about {a}.", "'about': an estimate"),
            ("The answer is approximately {a} {n}.", "'approximately'"),
            ("The answer is {a}, maybe.", "'maybe'"),
            ("The answer is probably {a}.", "'probably'"),
            ("The answer is {a} or so.", "'or so'"),
            ("The answer is roughly {a}.", "'roughly'"),
            ("The answer is {a}, give or take.", "'give or take'"),
            ("I think the answer might be {a}, but I'm not sure.", "'might', 'not sure'"),
            ("\\boxed{{\\approx {a}}}", "\\approx in the box"),
            ("The answer is ~{a}.", "a tilde: approximately"),
            ("The answer is {a}?", "a question, not a claim"),
            ("\\boxed{{{a} \\pm 1}}", "\\pm: two values"),
        ],
        "words: magnitude": [
            ("The answer is {a} thousand.", "'thousand' multiplies the number"),
            ("#### {a} million", "'million' multiplies the number"),
            ("\\boxed{{{a} \\text{{ thousand}}}}", "'thousand' inside the box"),
            ("The answer is {a}k.", "'k' is a thousand"),
            ("The answer is {a} hundred {n}.", "'hundred' multiplies the number"),
            ("The answer is {a} dozen.", "'dozen' multiplies the number"),
            ("The answer is {a} billion dollars.", "'billion' multiplies the number"),
            ("\\boxed{{{a}\\text{{K}}}}", "'K' is a thousand"),
        ],
    }
    for family, forms in families.items():
        for (form, why), p in zip(forms, pick.take(len(forms))):
            a, w = p.answer, p.wrong
            text = form.format(a=a, w=w, w0=str(int(a) - 1), n=p.noun or "units").replace(" units.", ".")
            yield row(f"{p.reasoning}\n{text}", p.answer, family, why, p.source)


def attack_two_answers(pick: Picker) -> Iterator[dict]:
    """Two answers in one response, the one a verifier keeps being either."""
    forms = [
        ("The answer is {a}. No wait, the answer is {w}.", "two answers, the first right"),
        ("#### {a}. No wait, the answer is {w}", "two answers on the #### line"),
        ("\\boxed{{{a}}}. Hmm, actually the answer is {w}.", "a box, then another answer"),
        ("The answer is {a}. Actually, it's {w}.", "the answer corrected to another value"),
        ("The answer is {a}; correction: {w}.", "'correction:' another value"),
        ("The answer is {a}, or rather {w}.", "'or rather' another value"),
        ("The final answer is {a}. Wait, I made a mistake: the final answer is {w}.", "a final answer withdrawn"),
        ("The answer is {w}. No wait, the answer is {a}.", "two answers, the last right"),
        ("#### {w}. Sorry, the answer is {a}", "two answers on the #### line, the last right"),
        ("The answer is {w}, no, {a}.", "two values in one sentence"),
        ("\\boxed{{{a}}}\n\nWait, maybe it's {w}.", "a hedge after the box"),
        ("The answer is {a}.\n\nHmm, or possibly {w}.", "a hedge after the answer"),
        ("#### {a}\nBut it could also be {w}.", "a second candidate after ####"),
        ("The answer is $\\boxed{{{a}}}$, though {w} is also possible.", "another value called possible"),
    ]
    for (form, why), p in zip(forms, pick.take(len(forms))):
        yield row(f"{p.reasoning}\n{form.format(a=p.answer, w=p.wrong)}", p.answer, "two answers", why, p.source)
    disagree = [
        ("#### {w}\n\nSo the answer is $\\boxed{{{a}}}$.", "#### says one value, the box another"),
        ("\\boxed{{{a}}}\n#### {w}", "the box says one value, #### another"),
        ("#### {a}\nThe final answer is $\\boxed{{{w}}}$", "#### right, box wrong"),
        ("The final answer is $\\boxed{{{w}}}$\n#### {a}", "box wrong, #### right"),
        (
            "Final Answer: The final answer is ${w}$. I hope it is correct.\n\\boxed{{{a}}}",
            "Minerva line and box differ",
        ),
        ("**Final Answer:** {w}\n\n\\boxed{{{a}}}", "a final-answer label and a box differ"),
        ("\\boxed{{{a}}}\n\nThe answer is {w}.", "the box and the sentence differ"),
        ("#### {a}\n#### {w}", "two #### lines differ"),
    ]
    for (form, why), p in zip(disagree, pick.take(len(disagree))):
        yield row(
            f"{p.reasoning}\n{form.format(a=p.answer, w=p.wrong)}", p.answer, "#### and box disagree", why, p.source
        )


def attack_signs_and_forms(pick: Picker) -> Iterator[dict]:
    """Unicode minus signs read as no sign; forms that are computations."""
    dashes = [  # {a} is the answer; written with str.replace, the braces are LaTeX's
        ("\\boxed{" + MINUS + "{a}}", "U+2212 minus: the negative of the answer"),
        ("The answer is " + EN_DASH + "{a}.", "an en dash before the number is a minus"),
        ("#### " + MINUS + "{a}", "U+2212 after ####"),
        ("The answer is \u2012{a}.", "a figure dash as a minus"),
        ("The answer is \ufe63{a}.", "a small hyphen-minus"),
        ("The answer is \uff0d{a}.", "a fullwidth hyphen-minus"),
        ("The answer is $" + MINUS + "{a}$.", "U+2212 in math mode"),
        ("The final answer is: $\\boxed{" + MINUS + " {a}}$", "U+2212 and a space"),
        ("Final Answer: The final answer is $" + EN_DASH + "{a}$. I hope it is correct.", "an en dash, Minerva format"),
        ("So the change is **" + MINUS + "{a}**.", "U+2212 in bold"),
    ]
    for (form, why), p in zip(dashes, pick.take(len(dashes), lambda p: int(p.answer) > 0)):
        text = form.replace("{a}", p.answer)
        yield row(f"{p.reasoning}\n{text}", p.answer, "unicode minus read as no sign", why, p.source)
    forms = [
        ("\\boxed{0\\times10^{5}}", "0", "a product by zero, not scientific notation"),
        ("\\boxed{-\\frac{-1}{2}}", "0.5", "a double negation"),
        ("\\boxed{\\frac{-3}{-4}}", "0.75", "a quotient of negatives"),
        ("\\boxed{-(-85)}", "85", "a double negation"),
        ("The answer is --85.", "85", "two minus signs"),
        ("\\boxed{85\\times10^{0}}", "85", "a power of ten by zero"),
        ("\\boxed{0.85\\times10^{2}}", "85", "a mantissa below 1: a product to perform"),
        ("\\boxed{\\frac{170}{2}}", "85", "a division left to perform"),
        ("\\boxed{85^{1}}", "85", "a power by one"),
        ("\\boxed{\\sqrt{7225}}", "85", "a root that evaluates to the answer"),
        ("\\boxed{10^{2}}", "100", "a power of ten left to evaluate"),
        ("The answer is 2^3.", "8", "a power left to evaluate"),
        ("\\boxed{0 \\cdot 10^{3}}", "0", "a product by zero"),
        ("\\boxed{\\frac{0}{5}}", "0", "a quotient of zero"),
    ]
    for r, ref, why in forms:
        yield row(r, ref, "computation forms", why)


def attack_numeric_readings() -> Iterator[dict]:
    """Percent read both ways; decimal tolerance that covers a neighbour."""
    percent = [
        ("\\boxed{5000\\%}", "50", "5000% read as the value 50"),
        ("The answer is 2500%.", "25", "2500% read as the value 25"),
        ("#### 1000%", "10", "1000% read as the value 10"),
        ("The answer is $\\boxed{6000\\%}$.", "60", "6000% read as the value 60"),
        ("\\boxed{0.5}", "50\\%", "a fraction for a percent reference: 0.5 percent"),
        ("The answer is 0.25.", "25\\%", "0.25 is not 25 percent"),
        ("\\boxed{0.125}", "12.5\\%", "0.125 is not 12.5 percent"),
        ("The answer is 2000 percent.", "20", "2000 percent read as 20"),
        ("\\boxed{0.4}", "40\\%", "0.4 is not 40 percent"),
        ("\\boxed{7500\\%}", "75", "7500% read as the value 75"),
    ]
    for r, ref, why in percent:
        yield row(r, ref, "percent read both ways", why)
    neighbours = [
        ("The answer is 2.55.", "2.5", "2.55 is as near 2.6 as 2.5"),
        ("\\boxed{3.145}", "3.14", "3.145 is as near 3.15 as 3.14"),
        ("#### 0.55", "0.5", "0.55 is as near 0.6 as 0.5"),
        ("The answer is 1.255.", "1.25", "1.255 is as near 1.26"),
        ("\\boxed{12.55\\%}", "12.5\\%", "12.55% is as near 12.6%"),
        ("The answer is 0.745.", "0.75", "0.745 is as near 0.74"),
        ("\\boxed{7.45}", "7.5", "7.45 is as near 7.4"),
        ("The answer is 4.85.", "4.8", "4.85 is as near 4.9"),
        ("\\boxed{0.15}", "0.2", "0.15 is as near 0.1"),
        ("The answer is 9.95.", "9.9", "9.95 is as near 10.0"),
    ]
    for r, ref, why in neighbours:
        yield row(r, ref, "decimal tolerance covers a neighbour", why)


def attack_work_left() -> Iterator[dict]:
    """Expression and constant references matched by an answer with work left."""
    equation = [
        ("\\boxed{4x-3 = 2x+1}", "2x+1", "an equation: one side is the reference, the other another expression"),
        ("\\boxed{2x+1 = 4x-3}", "2x+1", "an equation with the reference on the left"),
        ("\\boxed{\\frac{\\pi}{3} = \\frac{\\pi}{2}}", "\\frac{\\pi}{2}", "two candidate values as an equation"),
        ("\\boxed{\\frac{\\pi}{2} = \\frac{\\pi}{3}}", "\\frac{\\pi}{2}", "two candidate values, reference first"),
        ("\\boxed{x^2 = x^2+2x+1}", "x^2+2x+1", "an equation whose right side is the reference"),
        ("\\boxed{2\\sqrt{2} = 3\\sqrt{2}}", "2\\sqrt{2}", "two candidate constants"),
        ("The answer is $3x^2 = 6x$.", "6x", "an equation in a sentence"),
        (
            "\\boxed{\\sqrt{3} = \\frac{\\sqrt{3}}{2}}",
            "\\frac{\\sqrt{3}}{2}",
            "a false equation ending in the reference",
        ),
        ("\\boxed{84 = 85}", "85", "a false equation of numbers"),
        ("\\boxed{x + 1 = 2x - 5 = x^2}", "x^2", "a chain of candidates"),
    ]
    for r, ref, why in equation:
        yield row(r, ref, "equation with the reference on one side", why)
    quotient = [
        ("\\boxed{\\frac{x^2-1}{x-1}}", "x+1", "a quotient with a common factor left to cancel"),
        ("\\boxed{\\frac{\\pi^2}{\\pi}}", "\\pi", "pi over pi left to cancel"),
        ("\\boxed{\\frac{x^2+x}{x}}", "x+1", "x left to cancel"),
        ("\\boxed{\\frac{2x}{2}}", "x", "2 left to cancel"),
        ("\\boxed{\\frac{6\\pi}{3}}", "2\\pi", "3 left to cancel"),
        ("\\boxed{\\frac{\\sqrt{2}\\pi}{\\sqrt{2}}}", "\\pi", "\\sqrt{2} left to cancel"),
        ("\\boxed{\\frac{x^3}{x}}", "x^2", "x left to cancel"),
        ("\\boxed{\\frac{(x+1)^2}{x+1}}", "x+1", "x+1 left to cancel"),
        ("\\boxed{\\frac{4\\sqrt{3}}{2}}", "2\\sqrt{3}", "2 left to cancel"),
        ("\\boxed{\\frac{2\\sqrt{2}}{\\sqrt{2}}}", "2", "\\sqrt{2} left to cancel"),
    ]
    for r, ref, why in quotient:
        yield row(r, ref, "unsimplified quotient", why)
    roots = [
        ("\\boxed{\\sqrt{\\pi^2}}", "\\pi", "the root of a square left to take"),
        ("\\boxed{\\sqrt[3]{\\pi^3}}", "\\pi", "the cube root of a cube"),
        ("\\boxed{\\sqrt{4\\pi^2}}", "2\\pi", "the root of a perfect square"),
        ("\\boxed{(\\sqrt{\\pi})^2}", "\\pi", "the square of a root"),
        ("\\boxed{\\sqrt{(\\pi+1)^2}}", "\\pi+1", "the root of a square"),
        ("\\boxed{\\sqrt{e^2}}", "e", "the root of a square"),
        ("\\boxed{\\sqrt{\\pi^4}}", "\\pi^2", "the root of a fourth power"),
        ("\\boxed{(\\sqrt{2\\pi})^{2}}", "2\\pi", "the square of a root"),
        ("\\boxed{\\sqrt{(1+\\sqrt{2})^2}}", "1+\\sqrt{2}", "the root of a square"),
        ("\\boxed{\\sqrt{x^2}}", "x", "the root of a square"),
    ]
    for r, ref, why in roots:
        yield row(r, ref, "root of a power", why)


def attack_redteam() -> Iterator[dict]:
    """Every attack of the red-team suite on each of its built-in cases."""
    for domain, cases in ANSWER_CASES.items():
        for case in cases:
            for attack in ANSWER_ATTACKS:
                yield row(attack.make(case), case.answer, "red-team suite", attack.name, f"redteam:{domain}")


def attack_forms_table() -> Iterator[dict]:
    """The refused rows of the accept/refuse table (tests/data/math_answer_forms.json), boxed."""
    for pred, ref, accept, why in json.loads(FORMS.read_text()):
        if not accept:
            yield row(f"\\boxed{{{pred}}}", ref, "answer-forms table", why, "tests/data/math_answer_forms.json")


def attack_rows(problems: list[Problem]) -> list[dict]:
    pick = Picker(problems[::-1])  # other problems than the honest corpus's first picks
    return [
        *attack_words(pick),
        *attack_two_answers(pick),
        *attack_signs_and_forms(pick),
        *attack_numeric_readings(),
        *attack_work_left(),
        *attack_redteam(),
        *attack_forms_table(),
    ]


def write(rows: list[dict], path: Path) -> None:
    with open(path, "w") as f:
        for i, r in enumerate(rows):
            f.write(json.dumps({"id": f"{path.stem}-{i:04d}", **r}, ensure_ascii=False) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="folder holding gsm8k/")
    args = parser.parse_args()
    problems = load_problems(args.data)
    by_index = {p.index: p for p in problems}
    OUT.mkdir(parents=True, exist_ok=True)
    honest, attacks = honest_rows(problems, by_index), attack_rows(problems)
    write(honest, OUT / "honest.jsonl")
    write(attacks, OUT / "attacks.jsonl")
    print(f"{len(honest)} honest rows, {len(attacks)} attack rows -> {OUT}")


if __name__ == "__main__":
    main()
