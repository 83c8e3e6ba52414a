"""Math answer checking for RLVR: extract a final answer, normalize it, compare it, in bounded time.

The reward is GRPO's only teacher, so every checker error becomes training signal: a false negative
hides a correct answer, a false positive teaches the policy to game the checker, a hang stalls the run.

  0. split_thinking: only what follows the last </think> is graded; a thought that never closes has no answer
     (a truncated thought earns nothing for an answer it wrote while thinking);
  1. extract_answer: the last \\boxed{} (with the boxes just before it that "and", ";" or \\quad join) or the
     last answer phrase ("The final answer is", "Answer:", a few other languages), whichever comes later;
     "#### n"; a bare answer; else the last number. A reference that is a whole solution is read the same way;
  2. normalize: one spelling for LaTeX and plain answers (\\dfrac, \\frac12, units, 1,000, 1 000, 4 4/9, %, $...$);
  3. structure: tuples keep order, sets and "a, b" lists do not (a repeated element is one answer), intervals
     keep their open/closed ends and equal inequality chains on a name, matrices compare elementwise,
     labels drop ("x = 5", "(p, q) = (3, 2)", "|AB| = 1"), equations compare up to a nonzero factor;
  4. leaves: exact text, then exact rationals in pure Python (plain numbers never start sympy), then sympy in
     a persistent worker process that is killed on a hard timeout. Exact values compare exactly, however
     large; only a decimal of 4 or more significant digits stands for a rounded value (0.3333 = 1/3).

Model text never reaches eval, exec or sympify: latex.py's recursive-descent parser builds sympy objects
from whitelisted tokens and refuses numbers too large to build. Workers are processes, so the timeout
works from any thread (signal.alarm only works in the main one). `python reward.py PRED GOLD` shows
the verdict and both sides as extracted and normalized. Code problems are sandbox.py's: scoring.verdicts
grades a step that mixes the two, each row by its task.
"""

import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from decimal import Decimal
from fractions import Fraction
from pathlib import Path

from data.templates import TEMPLATES, THINK_CLOSE, split_thinking  # the thought is the template's
from grading import latex, pool

TIMEOUT_S = 2.0  # per symbolic comparison; a worker that takes longer is killed and the answer is wrong
REL_TOL = 1e-12  # irrational constants this close (relative, at 40 digits) are equal: simplify may miss it
MIN_SIGNIFICANT_DIGITS = 4  # a decimal stands for a rounded value only with this many digits: 3.142 ~ pi, 3.14 not
MAX_ANSWER_CHARS = 2000  # longer answers are compared as exact strings only
MAX_NESTING = 50  # so are answers with brackets nested deeper than this
MAX_NUMBER_DIGITS = 30_000  # longer numbers (about latex.MAX_POWER_BITS) compare as canonical text, still exactly
WORKER_MEMORY_BYTES = 2 << 30  # a runaway expression hits MemoryError in its worker, not the machine
TAIL_CHARS = 4000  # fallback extraction (last number / math segment) only looks at the end of a text
ANSWER_FORMATS = ("boxed", "answer")  # the formats has_format checks, named as the templates that ask for them

# ----------------------------------------------------------------------------- extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_BOX_TOKEN_RE = re.compile(r"[^\s$]+")  # the argument of "\boxed 5"
# what may stand between two boxes of one answer list: "\boxed{2} \quad \text{and} \quad x = \boxed{3}"
_CONNECTOR_RE = re.compile(
    r"(?:[\s,;:.$~]|\\[,;:! ]|\\q?quad|\\(?:text|textnormal|mathrm)\s*\{\s*(?:and|or)\s*\}|"
    r"\b(?:and|or|und|oder|et|ou|y|o)\b|和|或|[A-Za-z](?:_\{?\w+\}?)?\s*=|\\[()\[\]])*"
)
_ANSWER_LINE_RE = re.compile(r"^[ \t>*_#]*(?:final )?answer[ \t*_]*:(.*)$", re.I | re.M)  # the DAPO format
# "The final answer is X", "Answer: X", "Answer \[ X \]", and the same in a few other languages
_ANSWER_PHRASE_RE = re.compile(
    r"(?:(?:final\s+)?answer\**(?:\s+is\b|\s*[:：])|answer(?=\s*(?:\$|\\\[|\\\())|"
    r"(?:respuesta|soluci[oó]n)(?:\s+\w+)?\s+es\b|(?:réponse|solution)(?:\s+\w+)?\s+est\b|resposta(?:\s+\w+)?\s+é|"
    r"risposta(?:\s+\w+)?\s+è|(?:antwort|lösung)\s+(?:\w+\s+)?(?:ist|lautet)\b|ответ\s*(?:[:：]|—|-)|"
    r"答案(?:是|为|為|[:：])|答えは|답은?\s*[:：]?)[ \t*_:：]*",
    re.I,
)
_ANSWER_WORDS = (
    "answer",
    "respuesta",
    "soluci",
    "réponse",
    "solution",
    "resposta",
    "risposta",
    "antwort",
    "lösung",
    "ответ",
    "答案",
    "答え",
    "답",
)
_MATH_START_RE = re.compile(r"\$\$(.+?)\$\$|\\\[(.+?)\\\]|\$((?:\\\$|[^$\n])+?)(?<!\\)\$|\\\(([^\n]+?)\\\)", re.S)
_SENTENCE_END_RE = re.compile(r"(?<!\.)\.(?=\s|$)|\n|<\|")
_NUMBER_IN_TEXT_RE = re.compile(
    r"(?:(?<![\w)\]}])-)?(?<![\d.,])(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)"
    r"(?:\.\d+|,\d{1,2}(?!\d))?(?:/\d+)?"
)  # 1,234.5 and 2,74 (a decimal comma)
_MATH_SEGMENT_RE = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$(.+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_LATEX_WORD_RE = re.compile(r"\\[a-zA-Z]+(?:\s*\{[^{}]*\})?")  # commands and \text{...}: not prose
_CJK_RE = re.compile(r"[\u3040-\u30ff\u4e00-\u9fff\uac00-\ud7af]")


def _brace_pairs(text: str) -> dict[int, int]:
    """Index of every matched "{" -> its "}". One linear pass, so 10,000 unbalanced braces are cheap."""
    pairs, stack = {}, []
    for m in re.finditer(r"\\.|[{}]", text):
        if m.group() == "{":
            stack.append(m.start())
        elif m.group() == "}" and stack:
            pairs[stack.pop()] = m.start()
    return pairs


def _outer_boxes(text: str) -> list[tuple[int, int, str]]:
    """(start, end, content) of each outermost brace-matched \\boxed{...} or \\fbox{...}."""
    pairs, boxes = None, []
    for m in _BOX_RE.finditer(text):
        if boxes and m.start() < boxes[-1][1]:
            continue  # nested inside the previous box
        if text.startswith("{", m.end()):
            pairs = _brace_pairs(text) if pairs is None else pairs
            if m.end() in pairs:
                boxes.append((m.start(), pairs[m.end()] + 1, text[m.end() + 1 : pairs[m.end()]]))
        elif arg := _BOX_TOKEN_RE.match(text, m.end()):
            boxes.append((m.start(), arg.end(), arg.group()))
    return boxes


def _last_box_list(text: str, boxes: list[tuple[int, int, str]]) -> str:
    """The last box, with the boxes before it that only connectors separate: "\\boxed{-2} and \\boxed{1}"."""
    first = len(boxes) - 1
    while first > 0 and _CONNECTOR_RE.fullmatch(text[boxes[first - 1][1] : boxes[first][0]]):
        first -= 1
    contents = [content.strip() for _, _, content in boxes[first:]]
    return ", ".join(dict.fromkeys(c for c in contents if c))  # a repeated box is one answer


def _is_prose(text: str) -> bool:
    """Two or more words outside LaTeX commands and labels: a sentence, not an answer ("Evelyn", "5 cm" and
    "AB = 4, CD = 5" are answers)."""
    words = re.findall(r"[^\W\d_]{2,}\b(?!\s*=)", _LATEX_WORD_RE.sub(" ", text))
    return bool(_CJK_RE.search(text)) or len(words) >= 2


def _last_math_or_number(text: str) -> str | None:
    """The last $...$ segment if nothing numeric follows it, else the last number (whole, however long)."""
    offset = max(0, len(text) - TAIL_CHARS)
    tail = text[offset:]
    numbers, segments = list(_NUMBER_IN_TEXT_RE.finditer(tail)), list(_MATH_SEGMENT_RE.finditer(tail))
    if segments and (not numbers or numbers[-1].end() <= segments[-1].end()):
        return next(g for g in segments[-1].groups() if g is not None).strip()
    if not numbers:
        return None
    if numbers[-1].start() == 0 and offset:  # the tail may start inside this number: read it from its start
        start = len(text[:offset].rstrip("0123456789.,"))
        start -= text[start - 1 : start] == "-"
        whole = _NUMBER_IN_TEXT_RE.search(text, start)
        if whole and whole.end() == offset + numbers[-1].end():
            return whole.group()
    return numbers[-1].group()


def _clean(candidate: str) -> str | None:
    candidate = re.sub(r'^\\?["“«]|\\?["”»]$', "", candidate.strip().strip("*").strip()).strip()  # "$12$"
    if _is_prose(candidate):  # "Answer: the total is $42$." -> 42
        return _last_math_or_number(candidate)
    return re.sub(r"(?<!\.)[.,]$", "", candidate).strip() or None


def _phrase_answer(text: str, start: int) -> str | None:
    """The answer stated right after an answer phrase: a math segment, else the rest of its sentence."""
    if m := _MATH_START_RE.match(text, start):
        return next(g for g in m.groups() if g is not None).strip() or None
    end = start + 500  # a sentence; the window ends at a space, so a long number is never cut in two
    end = re.compile(r"\S*").match(text, end).end() if end < len(text) else end
    return _clean(_SENTENCE_END_RE.split(text[start:end], 1)[0])


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it has none. The last box (with the boxes just
    before it that connectors like "and" separate) or the last answer phrase, whichever comes later."""
    boxes, phrase, offset = _outer_boxes(text), None, max(0, len(text) - TAIL_CHARS)
    if any(word in text[offset:].lower() for word in _ANSWER_WORDS):  # a plain search is 10x faster than the regex
        for phrase in _ANSWER_PHRASE_RE.finditer(text, offset):
            pass
    if phrase and phrase.start() >= max(boxes[-1][1] if boxes else 0, text.rfind("####")):
        if answer := _phrase_answer(text, phrase.end()):
            return answer
    if boxes:
        return _last_box_list(text, boxes) or None
    if (hashes := text.rfind("####")) >= 0:
        return _clean(text[hashes + 4 :].split("\n", 1)[0])
    if len(text) <= 200 and "\n" not in text.strip() and not _is_prose(text):
        return _clean(text)  # a bare answer: "\frac{1}{2}", "x = 5", "17 + 25 = 42."
    return _last_math_or_number(text)


# ----------------------------------------------------------------------------- normalization

_UNICODE = {
    "−": "-",
    "–": "-",
    "×": "\\times ",
    "·": "\\cdot ",
    "÷": "\\div ",
    "π": "\\pi ",
    "∞": "\\infty ",
    "≤": "\\le ",
    "≥": "\\ge ",
    "≠": "\\ne ",
    "≈": "\\approx ",
    "°": "^\\circ",
    "√": "\\sqrt",
    "∪": "\\cup ",
    "²": "^2",
    "³": "^3",
    "€": "",
    "£": "",
    "：": ":",
}
# "\\frac" written with an escaped backslash (JSON twice encoded) is \frac, not a row break and "frac"
_DOUBLED_RE = re.compile(r"\\\\(?=(?:left|right|[dtc]?frac|sqrt|pi|cdot|times|text|boxed|infty)(?![a-zA-Z]))")
_SPACING_RE = re.compile(r"\\\\|\\[,;:! ]|\\q?quad|\\(?:left|right|[bB]igg?)(?![a-zA-Z])\.?|\\displaystyle|~")
_TEXT_CMD = r"\\(?:text|textnormal|textrm|textbf|textit|textsf|mathrm|mathbf|mathit|mathsf|mbox|operatorname)\s*"
# a trailing \text{...} after a number is a unit, however short: 1.5\text{ m}, 15\mbox{ cm}^2
_TEXT_UNIT_RE = re.compile(rf"(?<=[\d}}])\s*{_TEXT_CMD}\{{[^{{}}]*\}}(?:\s*\^\s*\{{?\d\}}?)?$")
_TEXT_RE = re.compile(rf"{_TEXT_CMD}\{{([^{{}}]*)\}}")
_REWRITES = [
    (re.compile(pattern), template)
    for pattern, template in [  # applied in order
        (r"\\[dtc]frac", r"\\frac"),
        (r"\\(?:leqslant|leq|le)(?![a-zA-Z])|<=", r"\\le "),
        (r"\\(?:geqslant|geq|ge)(?![a-zA-Z])|>=", r"\\ge "),
        (r"\\(?:neq|ne)(?![a-zA-Z])|!=", r"\\ne "),
        (r"\\(?:varnothing|emptyset)(?![a-zA-Z])|^\\\{\s*\\\}$", r"\\emptyset"),
        (r"^(?:[A-Za-z]\s*\\in\s*)?\\mathbb\s*\{?R\}?$|^\\R$", r"(-\\infty, \\infty)"),  # x \in \mathbb{R}
        (r"\\lt(?![a-zA-Z])", "<"),
        (r"\\gt(?![a-zA-Z])", ">"),
        (r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree", ""),  # degrees: 90^\circ = 90
        (r"\\?%", ""),  # percent: 25\% = 25
        (r"\s+(?:and|or)\s+", ", "),  # "2 and 3" lists
        (r",\s*(?=,)", ""),  # "19, 46, \text{ and } 82": the comma before "and" leaves no empty item
        (r"^[A-Za-z]\s*\\in\s*", ""),  # x \in [-2, 7]
        # LaTeX's one-token arguments: \frac12, \frac 34, \frac9{19}, \frac{270}7, \sqrt3
        (r"\\frac\s*([^\s{\\])\s*([^\s{\\])", r"\\frac{\1}{\2}"),
        (r"\\frac\s*([^\s{\\])\s*\{", r"\\frac{\1}{"),
        (r"\\frac\s*(\{[^{}]*\})\s*([^\s{\\])", r"\\frac\1{\2}"),
        (r"\\sqrt\s*([^\s{\\\[])", r"\\sqrt{\1}"),
    ]
]
_UNIT_RE = re.compile(r"(?<=[\d}])\s+[^\W\d_]{2,}\.?(?:\s*\^\{?\d\}?)?$")  # 5 cents, 15 cm^2, 64 square feet
_MIXED_RE = re.compile(
    r"([-+]?)(\d{1,99})\s*\\frac\{(\d{1,99})\}\{(\d{1,99})\}|"
    r"([-+]?)(\d{1,99}) (\d{1,99})/(\d{1,99})"
)  # 1\frac{4}{5}, 4 4/9
_THOUSANDS_RE = re.compile(r"-?[1-9]\d{0,2}(?:(?:,\d{3})+|(?: \d{3})+)(?:\.\d+)?")  # 7,425,000 and 1 000 (not 0,111)
_BASE_RE = re.compile(r"(\d+)_\{?(\d{1,2})\}?")  # 52_8: the digits are the answer
_CHOICE_RE = re.compile(r"\(([A-Ea-e])\)")


def normalize(answer: str) -> str:
    """One canonical spelling of an answer (LaTeX or plain); structure is kept, values are not computed."""
    s = _DOUBLED_RE.sub(r"\\", answer.strip())
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    if boxes := _outer_boxes(s):  # a reference may arrive as $\boxed{...}$
        s = boxes[-1][2]
    s = s.replace("\\$", "").replace("$", "").strip()
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s)
    s = re.sub(r",\\!\s*", ",", s).replace("{,}", ",").replace("{ , }", ",")  # 11,\! 111 and 1{,}000: one number
    s = _SPACING_RE.sub(lambda m: m.group() if m.group() == "\\\\" else " ", s)  # keep matrix row breaks
    s = _TEXT_RE.sub(r" \1 ", _TEXT_UNIT_RE.sub("", s))
    for pattern, template in _REWRITES:
        s = pattern.sub(template, s)
    s = re.sub(r"(?<!\.)[.,]$", "", re.sub(r"\s+", " ", s).strip()).strip()  # "1, 2, ..." keeps its ellipsis
    for _ in range(3):
        s = _UNIT_RE.sub("", s)
    if (m := _MIXED_RE.fullmatch(s)) and int(m[4] or m[8]) != 0:
        value = int(m[2] or m[6]) + Fraction(int(m[3] or m[7]), int(m[4] or m[8]))
        s = f"{'-' if (m[1] or m[5]) == '-' else ''}{value.numerator}/{value.denominator}"
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "").replace(" ", "")
    if (m := _BASE_RE.fullmatch(s)) and all(int(d) < int(m[2]) for d in m[1]):
        s = m[1]
    return m[1].upper() if (m := _CHOICE_RE.fullmatch(s)) else s


# ----------------------------------------------------------------------------- structure


@dataclass(frozen=True)
class Node:
    """A parsed answer. kind: expr | text | rel | seq | set | matrix.
    expr/text: items = (string,); rel: items = (lhs, rhs) strings, ends = "=", "<" or "\\le";
    seq: items = nodes, ends = brackets like "(]"; set: items = nodes; matrix: items = rows of nodes."""

    kind: str
    items: tuple
    ends: str = ""


_SCAN_RE = re.compile(r"\\[a-zA-Z]+|\\.|\s+|.", re.S)
# the tokens of _SCAN_RE that _split_top needs: commands, escapes, brackets and the one-character separators
_SPLIT_RE = re.compile(r"\\[a-zA-Z]+|\\.|[()\[\]{},;=<>]", re.S)
_OPENERS, _CLOSERS = {"(", "[", "{", "\\{"}, {")", "]", "}", "\\}"}
_RELATIONS = {"=", "<", ">", "\\le", "\\ge", "\\ne"}
_FLIPPED = {">": "<", "\\ge": "\\le"}  # a > b is b < a
_MATRIX_RE = re.compile(r"\\begin\{([pbvBV]?matrix|array)\}(?:\{[^{}]*\})?(.*)\\end\{\1\}", re.S)
_NAME = r"(?:[A-Za-z]{1,3}|\\[a-zA-Z]+)(?:_\{?\w+\}?)?'*(?:\([^()=]*\))?"  # x, AB, a_1, f(3), f'(x), \theta
# what may label an answer: x = 5, |AB| = 1, \angle ABC = 30, (p, q) = (3, 2), S_{MBCN}:S = 7:32
_LABEL_RE = re.compile(
    rf"{_NAME}|\|{_NAME}\||m?\\angle\s*{_NAME}|\(\s*{_NAME}(?:\s*,\s*{_NAME})+\s*\)|"
    rf"{_NAME}(?:\s*:\s*{_NAME})+"
)
_FUNCTION_NAME_RE = re.compile(r"y|[a-zA-Z]\([a-z]\)")  # y = 2x + 3 and f(x) = 2x + 3 state one function


def _has_letters(s: str) -> bool:
    return bool(re.search(r"[A-Za-z]", re.sub(r"\\[a-zA-Z]+", "", s)))


def _names_a_value(lhs: str, rhs: str) -> bool:
    """Whether "lhs = rhs" states the answer rhs: "x = 5", "(p,q) = (3,2)", "17 + 25 = 42" do;
    "7 = 11a + c" does not (a number equal to an expression is an equation, not a computation)."""
    return bool(_LABEL_RE.fullmatch(lhs)) or not (_has_letters(lhs) or _has_letters(rhs))


def _split_top(s: str, separators: set[str]) -> tuple[list[str], list[str]]:
    """Split s at separators outside any brackets; returns (parts, separators found). A separator is a LaTeX
    command or one of , ; = < >: the scan reads _SCAN_RE's tokens but steps over every one that is neither
    a bracket nor such a separator (runs of digits and letters are most of a long answer)."""
    parts, found, depth, start = [], [], 0, 0
    for m in _SPLIT_RE.finditer(s):
        token = m.group()
        depth += (token in _OPENERS) - (token in _CLOSERS)
        if depth == 0 and token in separators:  # no separator is a bracket
            parts.append(s[start : m.start()].strip())
            found.append(token)
            start = m.end()
    return parts + [s[start:].strip()], found


def _enclosed(s: str) -> bool:
    """True when the first bracket of s closes at its last character ("(a+5)(b+2)" is not enclosed)."""
    depth = 0
    for m in _SCAN_RE.finditer(s):
        depth += (m.group() in _OPENERS) - (m.group() in _CLOSERS)
        if depth == 0:
            return m.end() == len(s)
    return False


def _expand_pm(s: str) -> list[str]:
    if "\\pm" not in s and "\\mp" not in s:
        return [s]
    return [s.replace("\\pm", "+").replace("\\mp", "-"), s.replace("\\pm", "-").replace("\\mp", "+")]


def _list_items(s: str) -> tuple[Node, ...]:
    """Items of an unordered list ("," or ";" between them); "1 \\pm \\sqrt{5}" contributes both roots."""
    return tuple(_structure(p) for part in _split_top(s, {",", ";"})[0] if part for p in _expand_pm(part))


def _before_approx(parts: list[str]) -> str:
    """ "x = 1/3 \\approx 0.33" and "\\sqrt{2} \\approx 1.41" answer the exact value; "x \\approx 0.33" answers 0.33."""
    first = parts[0]
    return f"{first} = {parts[-1]}" if _LABEL_RE.fullmatch(first) else first


def _chain_interval(parts: list[str], ops: list[str]) -> Node | None:
    """ "-2 \\le x < 7" (or "7 > x \\ge -2") as the interval [-2, 7) when x is a name and the bounds constants."""
    if all(op in _FLIPPED for op in ops):
        parts, ops = parts[::-1], [_FLIPPED[op] for op in ops[::-1]]
    if (
        not all(op in ("<", "\\le") for op in ops)
        or not _LABEL_RE.fullmatch(parts[1])
        or _has_letters(parts[0] + parts[2])
    ):
        return None
    ends = ("(" if ops[0] == "<" else "[") + (")" if ops[1] == "<" else "]")
    return Node("seq", (_structure(parts[0]), _structure(parts[2])), ends)


def _structure(s: str) -> Node:
    s = s.strip()
    if s[:1] in "([" and _enclosed(s) and _MATRIX_RE.fullmatch(s[1:-1].strip()):
        s = s[1:-1].strip()  # \left[\begin{array}{cc}...\end{array}\right], (\begin{pmatrix}...\end{pmatrix})
    if m := _MATRIX_RE.fullmatch(s):
        rows = [row for row in m[2].split("\\\\") if row.strip()]
        return Node("matrix", tuple(tuple(_structure(cell) for cell in row.split("&")) for row in rows))
    if len(parts := _split_top(s, {"\\approx"})[0]) > 1:
        return _structure(_before_approx(parts))
    if len(unions := _split_top(s, {"\\cup"})[0]) > 1:
        return Node("set", tuple(_structure(part) for part in unions))
    if s[:2] == "\\{" and _enclosed(s):
        return Node("set", _list_items(s[2:-2]))
    if s[:1] == "{" and _enclosed(s):  # a set written without its backslashes
        return Node("set", _list_items(s[1:-1]))
    if s[:1] in "([" and s[-1:] in ")]" and _enclosed(s):
        items, commas = _split_top(s[1:-1], {","})
        if commas:  # "(3)" is just a parenthesized number
            return Node("seq", tuple(_structure(item) for item in items), s[0] + s[-1])
    if re.fullmatch(r"-?\d+,\d+", s):  # "1,22": a list, or 1.22 written with a decimal comma
        return Node("set", _list_items(s), s.replace(",", "."))
    if _split_top(s, {",", ";"})[1]:
        return Node("set", _list_items(s))  # MATH: "enter all solutions, separated by commas"
    parts, relations = _split_top(s, _RELATIONS)
    if relations == ["="] * len(relations) and relations:  # chains "x = 2 + 3 = 5" keep their ends
        return Node("rel", (parts[0], parts[-1]), "=")
    if len(relations) == 1:
        (lhs, rhs), op = parts, relations[0]
        return Node("rel", (rhs, lhs), _FLIPPED[op]) if op in _FLIPPED else Node("rel", (lhs, rhs), op)
    if len(relations) == 2 and (interval := _chain_interval(parts, relations)):
        return interval
    if relations:
        return Node("text", (s,))  # other compound relations compare as written
    if len(variants := _expand_pm(s)) > 1:
        return Node("set", tuple(Node("expr", (v,)) for v in variants))
    if re.fullmatch(r"[A-Za-z]{2,}(?: [A-Za-z]+)*", s):
        return Node("text", (s.lower(),))
    return Node("expr", (s,))


def _as_interval(rel: Node) -> Node | None:
    """ "x \\ge 2" as [2, \\infty), "x < 3" as (-\\infty, 3): a one-sided bound on a name."""
    (lo, hi), closed = rel.items, rel.ends == "\\le"
    if rel.ends not in ("<", "\\le"):
        return None
    if _LABEL_RE.fullmatch(hi) and not _has_letters(lo):
        return Node("seq", (_structure(lo), Node("expr", ("\\infty",))), ("[" if closed else "(") + ")")
    if _LABEL_RE.fullmatch(lo) and not _has_letters(hi):
        return Node("seq", (Node("expr", ("-\\infty",)), _structure(hi)), "(" + ("]" if closed else ")"))
    return None


def _coerce(a: Node, b: Node) -> Node:
    """Bridge spellings of one answer: "x = 5" vs "5", "x \\ge 2" vs [2, \\infty), a column vector vs a
    tuple, {5} vs 5, "1,22" vs 1.22, {1, 3} written for (1, 3)."""
    if a.kind == "rel" and b.kind != "rel" and a.ends == "=" and _names_a_value(*a.items):
        return _structure(a.items[1])
    if a.kind == "rel" and b.kind == "seq" and len(b.items) == 2 and (interval := _as_interval(a)):
        return interval
    if a.kind == "rel" and a.ends == "\\ne" and b.kind == "set" and _LABEL_RE.fullmatch(a.items[0]):
        point, infinity = _structure(a.items[1]), Node("expr", ("\\infty",))  # x \ne 2: (-\infty, 2) \cup (2, \infty)
        below = Node("seq", (Node("expr", ("-\\infty",)), point), "()")
        return Node("set", (below, Node("seq", (point, infinity), "()")))
    if a.kind == "matrix" and b.kind == "seq" and (len(a.items) == 1 or all(len(r) == 1 for r in a.items)):
        return Node("seq", tuple(x for row in a.items for x in row), "()")
    if a.kind == "set" and a.ends and b.kind == "expr" and "." in b.items[0] and _DECIMAL_RE.fullmatch(b.items[0]):
        return Node("expr", (a.ends,))
    if a.kind == "set" and b.kind == "seq" and b.ends == "()":
        return Node("seq", a.items, "()")
    if a.kind == "set" and b.kind != "set" and len(set(a.items)) == 1:
        return a.items[0]
    return a


def _equal(a: Node, b: Node, judge) -> bool:
    """Structural equality; leaves (expr, rel) are decided by judge."""
    a, b = _coerce(a, b), _coerce(b, a)
    if a.kind != b.kind:
        return {a.kind, b.kind} <= {"expr", "text"} and _squash(a.items[0]).lower() == _squash(b.items[0]).lower()
    if a.kind == "text":
        return a.items == b.items
    if a.kind == "expr":
        return judge.expr(a.items[0], b.items[0])
    if a.kind == "rel":
        if (
            a.ends == "="
            and a.items[0] != b.items[0]
            and all(_FUNCTION_NAME_RE.fullmatch(_squash(n.items[0])) for n in (a, b))
        ):
            return _equal(_structure(a.items[1]), _structure(b.items[1]), judge)  # y = 2x vs f(x) = 2x
        return a.ends == b.ends and judge.relation(a.ends, a.items, b.items)
    if a.kind == "set":
        return _same_set(a.items, b.items, judge)
    if a.ends != b.ends or len(a.items) != len(b.items):
        return False
    if a.kind == "matrix":
        return all(_equal(Node("seq", x), Node("seq", y), judge) for x, y in zip(a.items, b.items))
    return all(_equal(x, y, judge) for x, y in zip(a.items, b.items))


def _same_set(xs: tuple, ys: tuple, judge) -> bool:
    """Every element on each side equals one on the other: a repeated element is not another answer."""
    return all(any(_equal(x, y, judge) for y in ys) for x in xs) and all(
        any(_equal(x, y, judge) for x in xs) for y in ys
    )


# ----------------------------------------------------------------------------- leaf comparison

_DECIMAL_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d{1,4})?")  # 2.5e-3 too
_POINT_DECIMAL_RE = re.compile(r"[-+]?(\d*)\.(\d+)")
_FRACTION_RE = re.compile(r"([-+]?)(?:\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))")


def _squash(s: str) -> str:
    return s.replace(" ", "")


def _int(digits: str) -> int | None:
    """The integer a digit string writes, through Decimal: int(str) refuses more than 4,300 digits. None
    past MAX_NUMBER_DIGITS, where building it would take longer than comparing the text."""
    return int(Decimal(digits)) if len(digits) <= MAX_NUMBER_DIGITS else None


def _rational(s: str) -> Fraction | None:
    """Exact value of a plain number ("004", ".35625", "-\\frac{3}{8}", "14/3"), else None."""
    s = _squash(s)
    if _DECIMAL_RE.fullmatch(s):
        return Fraction(Decimal(s)) if len(s) <= MAX_NUMBER_DIGITS else None
    if m := _FRACTION_RE.fullmatch(s):
        numerator, denominator = _int(m[2] or m[4]), _int(m[3] or m[5])
        if numerator is None or not denominator:
            return None
        value = Fraction(numerator, denominator)
        return -value if m[1] == "-" else value
    return None


def _literal(s: str) -> str | None:
    """A number literal's canonical text (sign, no leading or trailing zeros): "-0012.50" -> "-12.5", "\\frac{06}{4}"
    -> "6/4", else None. Numbers too long to compute compare by it, exactly for integers and decimals."""
    s = _squash(s)
    if m := _FRACTION_RE.fullmatch(s):
        numerator, denominator = _literal(m[2] or m[4]), _literal(m[3] or m[5])
        return f"{'-' if m[1] == '-' else ''}{numerator}/{denominator}"
    if not (m := re.fullmatch(r"([-+]?)(\d*)(?:\.(\d*))?", s)) or not (m[2] or m[3]):
        return None
    whole, decimals = m[2].lstrip("0"), (m[3] or "").rstrip("0")
    if not whole and not decimals:
        return "0"
    return f"{'-' if m[1] == '-' else ''}{whole or '0'}{'.' + decimals if decimals else ''}"


def _rounding_tolerance(x: str, y: str) -> Fraction:
    """How far apart the values of x and y may be, given how they were written. Integers, fractions and
    short decimals are exact (0); a decimal with MIN_SIGNIFICANT_DIGITS or more may be a rounded value,
    so half a unit of its last place (0.3333 is 1/3, 0.3334 is not); of two such decimals the coarser counts."""
    places = []
    for s in (x, y):
        if (m := _POINT_DECIMAL_RE.fullmatch(_squash(s))) and len((m[1] + m[2]).lstrip("0")) >= MIN_SIGNIFICANT_DIGITS:
            places.append(len(m[2]))
    return Fraction(1, 2 * 10 ** min(places)) if places else Fraction(0)


class _FastJudge:
    """Pure-Python leaf comparison: exact text, then rationals. Notes when it cannot decide."""

    def __init__(self) -> None:
        self.undecided = False

    def fast_expr(self, x: str, y: str) -> bool | None:
        if _squash(x) == _squash(y):
            return True
        qx, qy = _rational(x), _rational(y)
        if qx is None or qy is None:
            if max(len(x), len(y)) > MAX_NUMBER_DIGITS and (lx := _literal(x)) and (ly := _literal(y)):
                return lx == ly
            return None
        return abs(qx - qy) <= _rounding_tolerance(x, y)

    def expr(self, x: str, y: str) -> bool:
        verdict = self.fast_expr(x, y)
        self.undecided |= verdict is None
        return bool(verdict)

    def relation(self, op: str, a: tuple, b: tuple) -> bool:
        same = [_squash(s) for s in a] == [_squash(s) for s in b]
        self.undecided |= not same
        return same


class _SympyJudge(_FastJudge):
    """Adds sympy: exact comparison of rationals, numeric comparison of other constants, simplify(a - b) == 0
    otherwise. Runs in workers only."""

    def __init__(self, rel_tol: float) -> None:
        import sympy

        super().__init__()
        self.sp, self.rel_tol = sympy, rel_tol

    def parse(self, s: str):
        if len(s) > MAX_ANSWER_CHARS:
            raise ValueError("answer too long to parse")
        return latex.parse(s, self.sp)

    def expr(self, x: str, y: str) -> bool:
        if (verdict := self.fast_expr(x, y)) is not None:
            return verdict
        sp, a, b = self.sp, self.parse(x), self.parse(y)
        if a.has(sp.zoo, sp.nan) or b.has(sp.zoo, sp.nan):  # 1/0 is not an answer, and 1/0 == 2/0 in sympy
            return False
        tolerance = sp.Rational(_rounding_tolerance(x, y))
        if a.is_Rational and b.is_Rational:  # 2006! + 1 vs 2006!: exact values compare exactly
            return bool(abs(a - b) <= tolerance)
        if not (a.free_symbols or b.free_symbols):
            va, vb = sp.N(a, 40), sp.N(b, 40)
            if va.is_finite and vb.is_finite and (tolerance or self.rel_tol):
                return bool(abs(va - vb) <= max(tolerance, self.rel_tol * max(abs(va), abs(vb))))
        if a == b:
            return True
        if self.differ_somewhere(a, b):  # most wrong answers end here, before the slow simplify
            return False
        return sp.simplify(a - b) == 0 or self.equal_for_positive(a, b)

    def values(self, expr) -> list | None:
        """expr at two fixed points with positive coordinates, or None where it is not a finite number there."""
        symbols = sorted(expr.free_symbols, key=str)
        values = [
            self.sp.N(expr.subs({s: start + 0.1 * i for i, s in enumerate(symbols)}), 20)
            for start in (0.6180339887, 1.2599210498)
        ]
        return values if all(v.is_number and v.is_finite for v in values) else None

    def differ_somewhere(self, a, b) -> bool:
        """a and b take clearly different values at a point where both are finite: they are not equal."""
        va, vb = self.values(a), self.values(b)
        return (
            va is not None
            and vb is not None
            and any(bool(abs(x - y) > 1e-8 * max(1, abs(x), abs(y))) for x, y in zip(va, vb))
        )

    def equal_for_positive(self, a, b) -> bool:
        """Equality when the letters are positive, the usual reading of an answer's unknowns: sqrt(1/n) is
        1/sqrt(n) then. |x| would equal x too, so answers with absolute values are not compared this way;
        nor are those without roots or logarithms, where positivity changes nothing."""
        sp, symbols = self.sp, a.free_symbols | b.free_symbols
        if (
            not symbols
            or a.has(sp.Abs)
            or b.has(sp.Abs)
            or not any(e.has(sp.log) or any(not p.exp.is_integer for p in e.atoms(sp.Pow)) for e in (a, b))
        ):
            return False
        positive = {s: sp.Symbol(s.name, positive=True) for s in symbols}
        return sp.simplify(a.subs(positive) - b.subs(positive)) == 0

    def relation(self, op: str, a: tuple, b: tuple) -> bool:
        if super().relation(op, a, b):
            return True
        da, db = self.parse(a[0]) - self.parse(a[1]), self.parse(b[0]) - self.parse(b[1])
        zero_a, zero_b = self.sp.simplify(da) == 0, self.sp.simplify(db) == 0
        if zero_a or zero_b:
            return zero_a and zero_b
        if (values := self.values(da / db)) and bool(abs(values[0] - values[1]) > 1e-8 * max(1, *map(abs, values))):
            return False  # the ratio is not constant
        ratio = self.sp.simplify(da / db)  # same solution set: lhs - rhs agree up to a constant factor
        if ratio.free_symbols or not ratio.is_finite or ratio.is_zero is not False:
            return False
        return op in ("=", "\\ne") or ratio.is_positive is True  # an inequality may only scale by a positive factor


# ----------------------------------------------------------------------------- worker processes


def _launch() -> pool.Launch:
    code = "import sys; sys.path.insert(0, sys.argv[1]); import reward; reward._serve()"
    return pool.Launch([sys.executable, "-c", code, str(Path(__file__).resolve().parent)])


def _serve() -> None:
    """Worker loop: one JSON job [answer, reference, rel_tol, timeout] per frame, b"1" or b"0" per reply."""
    import resource
    import signal

    import sympy  # noqa: F401  (imported before "ready", so job deadlines do not pay for it)

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))

    def check(frame: bytes) -> bytes:
        answer, reference, rel_tol, timeout = json.loads(frame)
        signal.alarm(math.ceil(timeout) + 2)  # SIGALRM's default action ends us if the parent died mid-job
        try:
            ok = bool(_equal(_structure(answer), _structure(reference), _SympyJudge(rel_tol)))
        except Exception:  # parse errors, RecursionError, MemoryError: a wrong answer, never a crash
            ok = False
        signal.alarm(0)
        return b"1" if ok else b"0"

    pool.serve(check)


# Persistent sympy workers; one past its deadline is killed and replaced, so a hang costs one timeout.
_POOL = pool.Pool(_launch, quiet=True)


def _check_slow(jobs: list[tuple[str, str]], workers: int, timeout: float, rel_tol: float) -> list[bool]:
    """The sympy verdict of each (answer, reference) pair; a pair past its timeout is wrong."""
    frames = [json.dumps([*job, rel_tol, timeout]).encode() for job in jobs]
    return [reply == b"1" for reply in _POOL.map(frames, [timeout] * len(jobs), workers)]


# ----------------------------------------------------------------------------- public API


def _reference_answer(reference: str) -> str:
    """A reference is usually a bare answer; from a boxed one or a full solution, its final answer
    (every box of the last answer list, so "\\boxed{1}, \\boxed{2}" keeps both)."""
    if (
        _outer_boxes(reference)
        or _ANSWER_PHRASE_RE.search(reference)
        or (("\n" in reference.strip() or len(reference) > 40) and _is_prose(reference))
    ):
        return extract_answer(reference) or reference
    return reference


def _nesting(s: str) -> int:
    """How deep brackets nest in s."""
    depth = deepest = 0
    for char in s:
        depth += (char in "([{") - (char in ")]}")
        deepest = max(deepest, depth)
    return deepest


_PLAIN_NUMBER_RE = re.compile(r"-?(?:\d+(?:\.\d+)?|\.\d+)")


# an arithmetic expression: digits, points, operations and brackets, nothing else ("7+6", "2^{10}", "(3+4)\\times5");
# one character or command per repetition, so a long run of digits cannot make the match backtrack
_ARITHMETIC_RE = re.compile(r"(?:[\d.\-+*/^!()\[\]{}]|\\times|\\cdot|\\div|\\frac)+")
_OPERATION_RE = re.compile(r"[-+*/^!]|\\times|\\cdot|\\div|\\frac")
_NUMBER_RE = re.compile(r"\d+(?:\.\d+)?|\.\d+")


def _after_last_equals(s: str) -> str:
    """What follows the last "=" outside brackets: the value an equation states ("7 + 6 = 13" -> "13")."""
    return _split_top(s, {"="})[0][-1]


def _unevaluated(s: str) -> list[str] | None:
    """The numbers of an arithmetic expression that still holds an operation ("7 + 6", "2^{10}", "12/4",
    "5!"), else None: a number, a fraction in lowest terms, anything with a letter or a function."""
    s = _squash(_after_last_equals(s))
    if not _ARITHMETIC_RE.fullmatch(s) or not _OPERATION_RE.search(s.lstrip("+-")):
        return None
    if m := _FRACTION_RE.fullmatch(s):  # 3/4 is a value; 12/4 still has a division to carry out
        numerator, denominator = _int(m[2] or m[4]), _int(m[3] or m[5])
        if numerator is not None and denominator and denominator > 1 and math.gcd(numerator, denominator) == 1:
            return None
    return _NUMBER_RE.findall(s)


def restates_problem(answer: str, reference: str, problem: str) -> bool:
    """Whether a normalized answer restates the problem's arithmetic instead of carrying it out: an
    unevaluated expression over the problem's own numbers (and 0 and 1, which change nothing), against
    a reference that is a value. "7 + 6" to "What is 7 + 6?" is no answer, though it equals 13; "10 + 3"
    would be (it is work the problem did not show), and so is "2^{10}" when the reference is "2^{10}"."""
    numbers = _unevaluated(answer)
    if numbers is None or _unevaluated(reference) is not None:
        return False
    own = {Decimal(n) for n in _NUMBER_RE.findall(re.sub(r"(?<=\d),(?=\d{3}(?!\d))", "", problem))}
    return all(Decimal(n) in own | {Decimal(0), Decimal(1)} for n in numbers)


def answer_of(completion: str, template: str | None = None) -> str | None:
    """The completion's final answer as graded, normalized ("\\dfrac12" -> "\\frac{1}{2}"; with the equation
    template, what follows the last "="), or None when it has none: what Maj@k votes on."""
    answer = extract_answer(completion)
    normalized = None if answer is None else normalize(answer)
    if normalized and template == "equation":
        normalized = _after_last_equals(normalized)
    return normalized or None


def _grade_fast(
    completion: str, reference: str, problem: str | None = None, template: str | None = None
) -> bool | tuple[str, str]:
    """The verdict where exact text or rationals decide, else the normalized (answer, reference) for sympy."""
    answer = extract_answer(completion)
    if answer is not None and template == "equation":  # the template's answer: "2 + 3 = 5" states 5
        answer = _after_last_equals(normalize(answer)) or None
    if answer is None:
        return False
    reference = _reference_answer(reference)
    if _PLAIN_NUMBER_RE.fullmatch(answer) and _PLAIN_NUMBER_RE.fullmatch(reference):  # GSM8K, AIME: skip the rest
        return bool(_FastJudge().fast_expr(answer, reference))
    if max(len(answer), len(reference)) > MAX_ANSWER_CHARS:  # no real answer is this long
        return answer.strip() == reference.strip()
    a, r = normalize(answer), normalize(reference)
    if not a or not r or (problem is not None and restates_problem(a, r, problem)):
        return False
    if max(_nesting(a), _nesting(r)) > MAX_NESTING:  # each level rescans the text: cost grows with depth^2
        return a == r
    judge = _FastJudge()
    try:
        ok = _equal(_structure(a), _structure(r), judge)
    except RecursionError:  # brackets nested hundreds deep: not an answer
        return False
    return (a, r) if not ok and judge.undecided else ok


def grade(
    answer_text: str,
    reference: str,
    *,
    problem: str | None = None,
    template: str | None = None,
    timeout: float = TIMEOUT_S,
    rel_tol: float = REL_TOL,
) -> bool:
    """True when the final answer in answer_text (a completion or a bare answer) equals reference; with the
    problem, an answer that restates it is wrong (see reward). Never raises on model output; finishes
    within about `timeout` seconds."""
    problems = None if problem is None else [problem]
    return (
        reward(
            [answer_text],
            [reference],
            problems=problems,
            template=template,
            workers=1,
            timeout=timeout,
            rel_tol=rel_tol,
        )[0]
        == 1.0
    )


def has_format(completion: str, answer_format: str | None) -> bool:
    """Whether the completion states its answer as asked: "boxed" (a closed \\boxed{}), "answer"
    (a non-empty "Answer:" line, the DAPO template), or None (either)."""
    boxed = bool(_outer_boxes(completion))
    answer_line = any(line.strip() for line in _ANSWER_LINE_RE.findall(completion))
    return {"boxed": boxed, "answer": answer_line, None: boxed or answer_line}[answer_format]


def reward(
    completions: list[str],
    references: list[str],
    *,
    problems: list[str | None] | None = None,
    template: str | None = None,
    format_weight: float = 0.0,
    answer_format: str | None = None,
    open_thought: bool = False,
    workers: int = 2,
    timeout: float = TIMEOUT_S,
    rel_tol: float = REL_TOL,
) -> list[float]:
    """Per completion: 1.0 if its answer is correct else 0.0, plus format_weight if has_format(...).
    Only what follows the last </think> is read, and a completion whose thought never closes (open_thought:
    the prompt opened it) earns 0, format bonus included (split_thinking).

    problems (the question each completion answers) make an answer that restates its question's arithmetic
    wrong ("7 + 6" to "What is 7 + 6?", see restates_problem): without them an echo earns full reward.
    template "equation" grades what follows the last "=" of the answer, as that template asks.
    The format term is separate from correctness (a correct answer in the wrong format still earns 1.0),
    so format_weight = 0 gives the pure verifiable reward. Symbolic checks run in `workers` processes;
    rel_tol only applies to constants that are not both rational (sqrt(2) + sqrt(3) vs sqrt(5 + 2 sqrt(6)))."""
    if len(completions) != len(references):
        raise ValueError(f"completions and references differ in length: {len(completions)} vs {len(references)}")
    if problems is not None and len(problems) != len(completions):
        raise ValueError(f"completions and problems differ in length: {len(completions)} vs {len(problems)}")
    if answer_format is not None and answer_format not in ANSWER_FORMATS:
        raise ValueError(f"answer_format must be None or one of {ANSWER_FORMATS}, got {answer_format!r}")
    if workers < 1 or timeout <= 0 or rel_tol < 0 or format_weight < 0:
        raise ValueError(
            f"need workers >= 1, timeout > 0, rel_tol >= 0, format_weight >= 0; got "
            f"workers={workers}, timeout={timeout}, rel_tol={rel_tol}, format_weight={format_weight}"
        )
    for name, texts in (("completions", completions), ("references", references), ("problems", problems or [])):
        for i, text in enumerate(texts):
            if not isinstance(text, str) and not (name == "problems" and text is None):  # a row without one
                raise ValueError(f"{name}[{i}] is {type(text).__name__}, expected str")
    answers = [split_thinking(c, open_thought).answer for c in completions]  # None: a thought never closed
    return _math_reward(
        answers,
        references,
        problems or [None] * len(completions),
        template,
        format_weight,
        answer_format,
        workers,
        timeout,
        rel_tol,
    )


def _math_reward(
    answers: list[str | None],
    references: list[str],
    problems: list[str | None],
    template: str | None,
    format_weight: float,
    answer_format: str | None,
    workers: int,
    timeout: float,
    rel_tol: float,
) -> list[float]:
    correct = [
        a is not None and _guarded(_grade_fast, a, r, p, template) for a, r, p in zip(answers, references, problems)
    ]
    if slow := [i for i, verdict in enumerate(correct) if isinstance(verdict, tuple)]:  # only these need sympy
        for i, verdict in zip(slow, _check_slow([correct[i] for i in slow], workers, timeout, rel_tol)):
            correct[i] = verdict
    return [
        float(ok) + (format_weight * has_format(a, answer_format) if format_weight and a is not None else 0.0)
        for ok, a in zip(correct, answers)
    ]


def _guarded(grade_one, completion: str, *args):
    """grade_one's verdict; an exception (a checker bug) is a wrong answer and a warning naming the text."""
    try:
        return grade_one(completion, *args)
    except Exception as error:  # noqa: BLE001 - one sample must never end a run
        warnings.warn(
            f"reward: the checker failed on {completion[:80]!r} ({type(error).__name__}: {error}); graded wrong",
            stacklevel=3,
        )
        return False


def math_reward(
    completions: list[str],
    answer: list[str | None],
    problem: list[str | None] | None = None,
    template: list[str] | None = None,
    open_thought: list[bool] | None = None,
    task: list[str | None] | None = None,
    **columns,
) -> list[float | None]:
    """The built-in reward of math problems as a reward function (TRL's signature, see scoring.py): per
    completion 1.0 if its final answer, after its thought, equals its row's reference answer (the dataset's
    "answer" column), else 0.0; None on a code problem's row (task "code": sandbox.code_reward grades those).
    The rows' problems (the "problem" column) make an answer that restates its problem wrong, and the
    template that posed them (train.py's template column) says where the answer is (see reward);
    open_thought, a column train.py passes: the prompts opened a thought (split_thinking)."""
    mine = [i for i in range(len(completions)) if not (task and task[i] == "code")]
    values = reward(
        [completions[i] for i in mine],
        [answer[i] for i in mine],
        problems=[problem[i] for i in mine] if problem else None,
        template=template[0] if template else None,
        open_thought=bool(open_thought and open_thought[0]),
    )
    graded: list[float | None] = [None] * len(completions)
    for i, value in zip(mine, values):
        graded[i] = value
    return graded


# ----------------------------------------------------------------------------- command line


def main(argv: list[str]) -> int:
    """python reward.py PRED GOLD [--problem TEXT] [--template NAME]: the verdict, and both sides as extracted
    and as normalized, so that a score of 0 can be traced to the step that lost the answer."""
    import argparse

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):
            self.exit(2, f"reward.py: {message} (see --help)\n")

    parser = Parser(
        usage="python reward.py PRED GOLD [--problem TEXT] [--template NAME]",
        allow_abbrev=False,
        description="Prints the verdict and the extracted and normalized forms of both sides.",
    )
    parser.add_argument("prediction", metavar="PRED", help="a completion or a bare answer")
    parser.add_argument("gold", metavar="GOLD", help="the reference answer")
    parser.add_argument("--problem", help="the question answered: an answer restating its arithmetic is wrong")

    parser.add_argument(
        "--template",
        choices=list(TEMPLATES),
        help="the prompt template of data/templates.py that posed it (equation: the "
        "answer is what follows the last '=')",
    )
    args = parser.parse_args(argv)
    try:
        report(args)
        sys.stdout.flush()  # inside the try: a pipe's reader may be gone already
    except BrokenPipeError:  # `reward.py ... | head -1`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
    return 0


def report(args) -> None:
    """The verdict, then each side as extracted and as normalized."""
    verdict = grade(args.prediction, args.gold, problem=args.problem, template=args.template)
    print(f"verdict: {'correct' if verdict else 'wrong'}")
    answer = split_thinking(args.prediction).answer
    if answer is None:
        print(f"prediction: its thought never closes ({THINK_CLOSE} missing), so it has no answer")
    sides = {"prediction": answer and extract_answer(answer), "reference": _reference_answer(args.gold)}
    normalized = {"prediction": answer and answer_of(answer, args.template), "reference": normalize(sides["reference"])}
    for side, extracted in sides.items():
        print(f"{side}:\n  extracted:  {extracted!r}\n  normalized: {normalized[side]!r}")
    if args.problem is not None and normalized["prediction"] and restates_problem(*normalized.values(), args.problem):
        print("restates the problem: an unevaluated expression over the problem's own numbers is not an answer")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
