"""Find the final answer a response commits to: every answer marker, in order, with its text.

After dropping the reasoning (`strip_think`: `<think>...</think>` blocks, an unclosed one to the
end, and everything before a closing tag that has no opening one, as DeepSeek-R1's template
writes) and GSM8K's calculator annotations (`<<48/2=24>>`, arithmetic only), the markers of a
final answer are `\\boxed{...}` / `\\fbox{...}` (`boxed`), a `####` that does not open a markdown
heading (`hash`; `#### Step 1: ...`, a word after it, is a heading) and "the answer is", "final answer:",
"answer =", or a "Final Answer" heading followed by its line (`answer_is`). Each marker's claim
runs to the end of its sentence (a box's claim is its content; the rest of its sentence is its
`tail`). The committed answer is the last marker's; every marker must agree with it (the caller
checks). Text after the last claim that hedges with a number ("Wait, maybe it's 84.") withdraws
the commitment. A response with no marker may be read by its last sentence that holds a number
(`last_number`, optional).
"""

from __future__ import annotations

import dataclasses
import re

from posttrain.rl.verifiers.answer_tokens import Token, normalize, tokenize, word
from posttrain.rl.verifiers.answer_words import CHANGERS

SOURCES = ("boxed", "hash", "answer_is", "last_number")
MAX_MARKERS = 32
MAX_BOX = 1000
MAX_CLAUSE = 600
_BOX = re.compile(r"\\(?:boxed|fbox)(?![A-Za-z])")
_BLANKS = re.compile(r"[ \t]*")
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)
_BARE_BOX = re.compile(r"[^\s$]{0,100}")
_CALCULATOR = re.compile(r"<<[0-9+\-*/().,=%^ ]{1,200}>>")  # GSM8K's calculator annotations: <<48/2=24>>
# Every pattern run over the whole response starts with a literal (a fast scan) and cannot backtrack
# across it; the text is lower-cased once for the answer phrases.
_HASH = re.compile(r"####(?<!#####)(?!#)(?![ \t]*(?:\*\*|__)?[ \t]*[^\W\d_]{2})")  # a word: a markdown heading
_PHRASE = re.compile(
    r"answer(?:[ \t]{1,3}to[ \t]{1,3}(?:the|this)[ \t]{1,3}(?:question|problem))?(?:[ \t]{0,3}(?:\*\*|__))?"
    r"[ \t]{0,3}(?:(?:is|would[ \t]{1,3}be|will[ \t]{1,3}be|should[ \t]{1,3}be)\b|[:=])"
)
_HEADING_PHRASE = re.compile(r"final[ \t]{1,3}answer(?:[ \t]{0,8}(?:\*\*|__|:|#)){0,4}[ \t]{0,8}\n")
_FINAL_BEFORE = re.compile(r"final[ \t]{1,3}$")
_EPILOGUE_SPLIT = re.compile(r"[.!?](?:\s+|$)|\n+")
_DIGIT = re.compile(r"[0-9]")
_EPILOGUE_WORDS = sorted(CHANGERS | {"could", "may", "think", "believe", "seems", "but", "also"}, key=len, reverse=True)
_EPILOGUE_HEDGE = re.compile(
    r"(?<![\w'])(?:"
    + "|".join(re.escape(w) for w in _EPILOGUE_WORDS if w[0].isalpha())
    + r")(?![\w'])|n't\b|\?|\\pm|\\approx"
)
_ABBREVIATIONS = frozenset({"approx", "ca", "vs", "etc", "e.g", "i.e", "eg", "ie", "cf", "resp", "no"})


@dataclasses.dataclass(frozen=True)
class Claim:
    """A stated final answer: which marker (`source`), its text (a box's content, or the sentence
    after "the answer is" / "####"), its tokens, and for a box the tokens of the rest of its
    sentence (`tail`). `end` is where the claim's sentence ends in the stripped response."""

    source: str
    text: str
    tokens: list[Token]
    tail: list[Token]
    start: int
    end: int
    offset: int = 0  # where `text` starts in the stripped response (token offsets count from there too)
    lead: list[Token] = dataclasses.field(default_factory=list)  # a box's last words before it


@dataclasses.dataclass(frozen=True)
class Extraction:
    """The claims of a response in order (the last is the committed one), or why the response
    commits to no answer at all (`refusal`)."""

    claims: list[Claim]
    refusal: str | None = None
    text: str = ""  # the response as read (reasoning dropped, normalized): claim offsets index it


def strip_think(response: str) -> str:
    """The response without its reasoning: `<think>...</think>` blocks dropped, an unclosed block
    runs to the end, and a closing tag with no opening one drops everything before it."""
    low = response.lower()
    pieces, i = [], 0
    o, c = low.find("<think>"), low.find("</think>")
    while True:
        if o != -1 and o < i:  # a search resumes only once passed: every character is scanned once
            o = low.find("<think>", i)
        if c != -1 and c < i:
            c = low.find("</think>", i)
        if c != -1 and (o == -1 or c < o):
            pieces, i = [], c + len("</think>")
            continue
        if o == -1:
            pieces.append(response[i:])
            break
        pieces.append(response[i:o])
        if c == -1:
            break
        i = c + len("</think>")
    return " ".join(pieces)


def _close_brace(text: str, open_at: int) -> int | None:
    """Index of the brace that closes text[open_at] ("{"), looking at most MAX_BOX characters."""
    depth = 0
    for m in _BRACE.finditer(text, open_at, min(len(text), open_at + MAX_BOX)):
        if m.group() == "{":
            depth += 1
        elif m.group() == "}":
            depth -= 1
            if depth == 0:
                return m.start()
    return None


def box_spans(text: str) -> list[tuple[int, int, int, int]] | str:
    """(start, content start, content end, end) of every outermost \\boxed / \\fbox, in order; a
    refusal when a box does not close within MAX_BOX characters or there are too many."""
    out, pos = [], 0
    while (m := _BOX.search(text, pos)) is not None:
        j = _BLANKS.match(text, m.end()).end()
        if j < len(text) and text[j] == "{":
            close = _close_brace(text, j)
            if close is None:
                return "a box left open (or longer than an answer)"
            out.append((m.start(), j + 1, close, close + 1))
            pos = close + 1
        else:  # \boxed 85
            token = _BARE_BOX.match(text, j)
            out.append((m.start(), j, token.end(), token.end()))
            pos = max(token.end(), m.end())
        if len(out) > MAX_MARKERS:
            return f"more than {MAX_MARKERS} boxes"
    return out


def _inside(spans: list[tuple[int, int, int, int]], pos: int) -> bool:
    """Whether `pos` lies inside one of the (sorted, disjoint) box spans."""
    lo, hi = 0, len(spans)
    while lo < hi:
        mid = (lo + hi) // 2
        if spans[mid][3] <= pos:
            lo = mid + 1
        else:
            hi = mid
    return lo < len(spans) and spans[lo][0] <= pos


def text_markers(text: str, boxes: list[tuple[int, int, int, int]]) -> list[tuple[int, int, str]] | str:
    """(start, claim start, source) of the `####` and answer-phrase markers outside boxes, in
    order; a refusal when there are too many."""
    found = []
    for m in _HASH.finditer(text):
        if not _inside(boxes, m.start()):
            found.append((m.start(), m.end(), "hash"))
        if len(found) > MAX_MARKERS:
            return f"more than {MAX_MARKERS} '####' answers"
    low = text.lower()
    for n, m in enumerate(_PHRASE.finditer(low)):
        if n > 4 * MAX_MARKERS:
            return f"more than {MAX_MARKERS} answer statements"
        before = low[m.start() - 1] if m.start() else " "
        if not (before.isalnum() or before in "/_") and not _inside(boxes, m.start()):
            final = _FINAL_BEFORE.search(low, max(0, m.start() - 12), m.start())
            found.append((final.start() if final else m.start(), m.end(), "answer_is"))
    for n, m in enumerate(_HEADING_PHRASE.finditer(low)):  # "Final Answer" then the answer on its line
        if n > MAX_MARKERS:
            return f"more than {MAX_MARKERS} answer statements"
        before = low[m.start() - 1] if m.start() else " "
        if not before.isalnum() and not _inside(boxes, m.start()):
            found.append((m.start(), m.end(), "answer_is"))
    found.sort()
    return [f for n, f in enumerate(found) if n == 0 or f[0] != found[n - 1][0]]  # one marker per start


def sentence_end(tokens: list[Token]) -> int:
    """Index of the token that ends the first sentence (a full stop, a line break, "!") outside
    braces and brackets; len(tokens) when none does. Leading line breaks do not end it."""
    depth, content = 0, False
    for i, t in enumerate(tokens):
        if t.newline and content and depth == 0:
            return i
        if t.text in ("{", "(", "["):
            depth += 1
        elif t.text in ("}", ")", "]"):
            depth = max(0, depth - 1)
        elif depth == 0 and content and t.kind == "sym" and t.text in (".", "!"):
            after = tokens[i + 1] if i + 1 < len(tokens) else None
            factorial = t.text == "!" and not t.space and tokens[i - 1].kind == "num"
            abbreviation = t.text == "." and word(tokens[i - 1]) in _ABBREVIATIONS
            if (after is None or after.space) and not factorial and not abbreviation:
                return i
        content = True
    return len(tokens)


def _claim(text: str, source: str, start: int, claim_start: int, limit: int) -> Claim:
    """The claim of an answer phrase or `####` line: its sentence, read up to `limit`."""
    tokens = tokenize(text[claim_start:limit], offset=claim_start)
    end = sentence_end(tokens)
    stop = tokens[end].start if end < len(tokens) else limit
    body = text[claim_start:stop]
    offset = claim_start + len(body) - len(body.lstrip())
    return Claim(source, body.strip(), tokens[:end], [], start, stop, offset)


def _box_claim(text: str, span: tuple[int, int, int, int], limit: int, previous: int) -> Claim:
    """The claim of a box: its content; the rest of its sentence is the tail, the two words before
    it in its sentence (after `previous`, where the claim before it ended) its lead."""
    start, content_start, content_end, end = span
    window = text[max(previous, start - 80) : start]
    before = tokenize(window[window.rfind("\n") + 1 :])
    since = max((i + 1 for i, t in enumerate(before) if t.text in (".", "!")), default=0)
    lead = before[since:][-2:]
    after = tokenize(text[end:limit], offset=end)
    cut = sentence_end(after)
    stop = after[cut].start if cut < len(after) else limit
    content = text[content_start:content_end]
    offset = content_start + len(content) - len(content.lstrip())
    tokens = tokenize(content, offset=content_start)
    return Claim("boxed", content.strip(), tokens, after[:cut], start, stop, offset, lead)


def find_claims(response: str, *, last_number_fallback: bool = True, any_text: bool = False) -> Extraction:
    """Every final-answer claim of a response, in order (module docstring). `any_text`: an answer
    phrase counts whatever it states (a label), not only a number or math."""
    text = _CALCULATOR.sub("", normalize(strip_think(response)))
    boxes = box_spans(text)
    if isinstance(boxes, str):
        return Extraction([], boxes, text)
    markers = text_markers(text, boxes)
    if isinstance(markers, str):
        return Extraction([], markers, text)
    starts = sorted([(s[0], s[0], "boxed", s) for s in boxes] + [(*m, None) for m in markers], key=lambda s: s[:2])
    claims = []
    for n, (start, claim_start, source, span) in enumerate(starts):
        limit = starts[n + 1][0] if n + 1 < len(starts) else len(text)
        if span is not None:
            previous = claims[-1].end if claims else 0
            claims.append(_box_claim(text, span, min(limit, span[3] + MAX_CLAUSE), previous))
            continue
        claim = _claim(text, source, start, claim_start, min(limit, claim_start + MAX_CLAUSE))
        if claim.tokens if any_text else _states_something(claim):
            claims.append(claim)
    if len(claims) > MAX_MARKERS:
        return Extraction([], f"more than {MAX_MARKERS} final answers", text)
    if claims:
        return Extraction(claims, epilogue_refusal(text[claims[-1].end :]), text)
    if last_number_fallback and (claim := last_sentence_claim(text)) is not None:
        return Extraction([claim], None, text)
    return Extraction([], None, text)


def _states_something(claim: Claim) -> bool:
    """Whether an answer phrase states an answer: a number, math, or a value-like token; "the
    answer is correct" or "the answer is as follows" do not (they introduce or comment)."""
    return any(t.kind in ("num", "udigit", "cmd") or t.text in ("(", "[", "\\{", "-") for t in claim.tokens)


def epilogue_refusal(text: str) -> str | None:
    """Why the text after the last claim withdraws it: a sentence that names a number and hedges,
    corrects or negates ("Wait, maybe it's 84."). None when it does not."""
    pos, low = 0, text.lower()
    for m in _EPILOGUE_SPLIT.finditer(text):
        if (why := _hedged_sentence(low, pos, m.start())) is not None:
            return why
        pos = m.end()
    return _hedged_sentence(low, pos, len(text))


def _hedged_sentence(low: str, start: int, end: int) -> str | None:
    if _DIGIT.search(low, start, end) is None or _EPILOGUE_HEDGE.search(low, start, end) is None:
        return None
    return f"a hedge after the final answer: {low[start:end].strip()[:80]!r}"


def last_sentence_claim(text: str) -> Claim | None:
    """The last sentence that holds an ASCII digit, as a `last_number` claim (read from its end)."""
    pos = max(text.rfind(d) for d in "0123456789")
    if pos < 0:
        return None
    start = max(text.rfind(sep, 0, pos) for sep in (". ", ".\n", "\n", "? ", "! ", ": ")) + 1
    start = max(start, pos - MAX_CLAUSE // 2)
    ends = [e for e in (text.find(sep, pos) for sep in (". ", ".\n", "\n")) if e != -1]
    stop = min([*ends, len(text), pos + MAX_CLAUSE])
    body = text[start:stop]
    offset = start + len(body) - len(body.lstrip())
    return Claim("last_number", body.strip(), tokenize(body, offset=start), [], start, stop, offset)
