"""Math answer checking for RLVR: extract a final answer, normalize it, compare it, in bounded time.

The reward is GRPO's only teacher, so every checker error becomes training signal: a false negative
hides a correct answer, a false positive teaches the policy to game the checker, a hang stalls the run.

  1. extract_answer: the last \\boxed{}, an "Answer:" line, "#### n", a bare answer, else the last number;
  2. normalize: one spelling for LaTeX and plain answers (\\dfrac, \\frac12, units, 1,000, degrees, %, $...$);
  3. structure: tuples keep order, sets and "a, b" lists do not, intervals keep their open/closed
     ends, matrices compare elementwise, equations up to a nonzero factor, inequalities up to flipping;
  4. leaves: exact text, then exact rationals in pure Python (plain numbers never start sympy), then
     sympy in a persistent worker process that is killed on a hard timeout.

Model text never reaches eval, exec or sympify: a recursive-descent parser builds sympy objects from
whitelisted tokens and refuses numbers too large to build. Workers are processes, so the timeout
works from any thread (signal.alarm only works in the main one).
"""

import atexit
import json
import math
import re
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

TIMEOUT_S = 2.0  # per symbolic comparison; a worker that takes longer is killed and the answer is wrong
REL_TOL = 1e-9  # numbers closer than this (relative) are equal: 0.333333333333 = 1/3, but 5 != 5.001
MAX_ANSWER_CHARS = 2000  # longer answers are compared as exact strings only
MAX_POWER_BITS = 100_000  # refuse to build a power with more bits than this: 10^{10^{10}} stays unbuilt
MAX_FACTORIAL = 10_000  # 2006! is fine, (10^8)! is refused
WORKER_MEMORY_BYTES = 2 << 30  # a runaway expression hits MemoryError in its worker, not the machine
TAIL_CHARS = 4000  # fallback extraction (last number / math segment) only looks at the end of a text
ANSWER_FORMATS = ("boxed", "answer")  # the formats has_format checks, named as the templates that ask for them


# ----------------------------------------------------------------------------- extraction

_BOX_RE = re.compile(r"\\(?:boxed|fbox)\s*")
_BOX_TOKEN_RE = re.compile(r"[^\s$]+")  # the argument of "\boxed 5"
_BETWEEN_BOXES_RE = re.compile(r"[\s,;$]*(?:and|or)?[\s,;$]*")
_ANSWER_LINE_RE = re.compile(r"^[ \t>*_#]*(?:final )?answer[ \t*_]*:(.*)$", re.I | re.M)
_NUMBER_IN_TEXT_RE = re.compile(r"(?:(?<![\w)\]}])-)?(?<![\d.])(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:/\d+)?")
_MATH_SEGMENT_RE = re.compile(r"(?<!\\)\$\$(.+?)(?<!\\)\$\$|(?<!\\)\$(.+?)(?<!\\)\$|\\\((.+?)\\\)|\\\[(.+?)\\\]", re.S)
_LATEX_WORD_RE = re.compile(r"\\[a-zA-Z]+(?:\s*\{[^{}]*\})?")  # commands and \text{...}: not prose


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


def _is_prose(text: str) -> bool:
    """Two or more words outside LaTeX commands: a sentence, not an answer ("Evelyn", "5 cm" are answers)."""
    return len(re.findall(r"[A-Za-z]{2,}", _LATEX_WORD_RE.sub(" ", text))) >= 2


def _last_math_or_number(text: str) -> str | None:
    """The last $...$ segment if nothing numeric follows it, else the last number."""
    text = text[-TAIL_CHARS:]
    numbers, segments = list(_NUMBER_IN_TEXT_RE.finditer(text)), list(_MATH_SEGMENT_RE.finditer(text))
    if segments and (not numbers or numbers[-1].end() <= segments[-1].end()):
        return next(g for g in segments[-1].groups() if g is not None).strip()
    return numbers[-1].group() if numbers else None


def _clean(candidate: str) -> str | None:
    candidate = candidate.strip().strip("*").strip()
    if _is_prose(candidate):  # "Answer: the total is $42$." -> 42
        return _last_math_or_number(candidate)
    return candidate.rstrip(".").strip() or None


def extract_answer(text: str) -> str | None:
    """The final answer of a completion, or None when it has none."""
    if boxes := _outer_boxes(text):
        first = len(boxes) - 1  # "\boxed{2} and \boxed{3}" answers a "find all" question
        while first > 0 and _BETWEEN_BOXES_RE.fullmatch(text[boxes[first - 1][1] : boxes[first][0]]):
            first -= 1
        return ", ".join(content.strip() for _, _, content in boxes[first:])
    if lines := _ANSWER_LINE_RE.findall(text):
        return _clean(lines[-1])
    if (hashes := text.rfind("####")) >= 0:
        return _clean(text[hashes + 4 :].split("\n", 1)[0])
    if len(text) <= 200 and "\n" not in text.strip() and not _is_prose(text):
        return _clean(text)  # a bare answer: "\frac{1}{2}", "x = 5", "17 + 25 = 42."
    return _last_math_or_number(text)


# ----------------------------------------------------------------------------- normalization

_UNICODE = {"−": "-", "–": "-", "×": "\\times ", "·": "\\cdot ", "÷": "\\div ", "π": "\\pi ", "∞": "\\infty ",
            "≤": "\\le ", "≥": "\\ge ", "°": "^\\circ", "√": "\\sqrt", "∪": "\\cup "}
_SPACING_RE = re.compile(r"\\\\|\\[,;:! ]|\\q?quad|\\(?:left|right|[bB]igg?)(?![a-zA-Z])\.?|\\displaystyle|~")
# a trailing \text{...} after a number is a unit, however short: 1.5\text{ m}, 15\mbox{ cm}^2
_TEXT_UNIT_RE = re.compile(r"(?<=[\d}])\s*\\(?:text|textrm|mbox|mathrm)\s*\{[^{}]*\}(?:\s*\^\s*\{?\d\}?)?$")
_TEXT_RE = re.compile(r"\\(?:text|textbf|textit|textrm|mathrm|mathbf|mathit|mbox|operatorname)\s*\{([^{}]*)\}")
_REWRITES = [(re.compile(pattern), template) for pattern, template in [  # applied in order
    (r"\\[dtc]frac", r"\\frac"),
    (r"\\(?:leqslant|leq|le)(?![a-zA-Z])|<=", r"\\le "),
    (r"\\(?:geqslant|geq|ge)(?![a-zA-Z])|>=", r"\\ge "),
    (r"\\lt(?![a-zA-Z])", "<"),
    (r"\\gt(?![a-zA-Z])", ">"),
    (r"\^\s*\{?\s*\\circ\s*\}?|\\circ|\\degree", ""),  # degrees: 90^\circ = 90
    (r"\\?%", ""),  # percent: 25\% = 25
    (r"\s+(?:and|or)\s+", ", "),  # "2 and 3" lists
    (r"^[A-Za-z]\s*\\in\s*", ""),  # x \in [-2, 7]
    # LaTeX's one-token arguments: \frac12, \frac 34, \frac9{19}, \frac{270}7, \sqrt3
    (r"\\frac\s*([^\s{\\])\s*([^\s{\\])", r"\\frac{\1}{\2}"),
    (r"\\frac\s*([^\s{\\])\s*\{", r"\\frac{\1}{"),
    (r"\\frac\s*(\{[^{}]*\})\s*([^\s{\\])", r"\\frac\1{\2}"),
    (r"\\sqrt\s*([^\s{\\\[])", r"\\sqrt{\1}"),
]]
_UNIT_RE = re.compile(r"(?<=[\d}])\s+[A-Za-z]{2,}\.?(?:\s*\^\{?\d\}?)?$")  # 5 cents, 15 cm^2, 10 dollars
_MIXED_RE = re.compile(r"(-?)(\d+)\s*\\frac\{(\d+)\}\{(\d+)\}")  # 1\frac{4}{5} = 9/5
_THOUSANDS_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")  # only a whole answer: (100,200) is a tuple
_BASE_RE = re.compile(r"(\d+)_\{?(\d{1,2})\}?")  # 52_8: the digits are the answer
_CHOICE_RE = re.compile(r"\(([A-Ea-e])\)")


def normalize(answer: str) -> str:
    """One canonical spelling of an answer (LaTeX or plain); structure is kept, values are not computed."""
    s = answer.strip()
    for old, new in _UNICODE.items():
        s = s.replace(old, new)
    if boxes := _outer_boxes(s):  # a reference may arrive as $\boxed{...}$
        s = boxes[-1][2]
    s = s.replace("\\$", "").replace("$", "").strip()
    s = re.sub(r"^\\[(\[]|\\[)\]]$", "", s)
    s = re.sub(r",\\!\s*", ",", s).replace("{,}", ",")  # 11,\! 111 and 1{,}000 are one number
    s = _SPACING_RE.sub(lambda m: m.group() if m.group() == "\\\\" else " ", s)  # keep matrix row breaks
    s = _TEXT_RE.sub(r" \1 ", _TEXT_UNIT_RE.sub("", s))
    for pattern, template in _REWRITES:
        s = pattern.sub(template, s)
    s = re.sub(r"\s+", " ", s).strip().rstrip(".").strip()
    for _ in range(3):
        s = _UNIT_RE.sub("", s)
    if (m := _MIXED_RE.fullmatch(s)) and int(m[4]) != 0:
        value = int(m[2]) + Fraction(int(m[3]), int(m[4]))
        s = f"{m[1]}{value.numerator}/{value.denominator}"
    if _THOUSANDS_RE.fullmatch(s):
        s = s.replace(",", "")
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
_OPENERS, _CLOSERS = {"(", "[", "{", "\\{"}, {")", "]", "}", "\\}"}
_RELATIONS = {"=", "<", ">", "\\le", "\\ge"}
_MATRIX_RE = re.compile(r"\\begin\{[pbvBV]?matrix\}(.*)\\end\{[pbvBV]?matrix\}", re.S)
_VARIABLE_RE = re.compile(r"[A-Za-z](?:_\{?\w+\}?)?(?:\(.*\))?|\\[a-zA-Z]+")  # x, a_1, f(3), \theta


def _names_a_value(lhs: str) -> bool:
    """The left side of "x = 5", "f(3) = 5" or "17 + 25 = 42": the answer is the right side."""
    return bool(_VARIABLE_RE.fullmatch(lhs)) or not re.search(r"[A-Za-z]", re.sub(r"\\[a-zA-Z]+", "", lhs))


def _split_top(s: str, separators: set[str]) -> tuple[list[str], list[str]]:
    """Split s at separators outside any brackets; returns (parts, separators found)."""
    parts, found, depth, start = [], [], 0, 0
    for m in _SCAN_RE.finditer(s):
        depth += (m.group() in _OPENERS) - (m.group() in _CLOSERS)
        if depth == 0 and m.group() in separators:  # no separator is a bracket
            parts.append(s[start : m.start()].strip())
            found.append(m.group())
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
    """Items of an unordered list; "1 \\pm \\sqrt{5}" contributes both roots."""
    return tuple(_structure(p) for part in _split_top(s, {","})[0] for p in _expand_pm(part))


def _structure(s: str) -> Node:
    s = s.strip()
    if m := _MATRIX_RE.fullmatch(s):
        rows = [row for row in m[1].split("\\\\") if row.strip()]
        return Node("matrix", tuple(tuple(_structure(cell) for cell in row.split("&")) for row in rows))
    if len(unions := _split_top(s, {"\\cup"})[0]) > 1:
        return Node("set", tuple(_structure(part) for part in unions))
    if s.startswith("\\{") and _enclosed(s):
        return Node("set", _list_items(s[2:-2]))
    if s[:1] in "([" and s[-1:] in ")]" and _enclosed(s):
        items, commas = _split_top(s[1:-1], {","})
        if commas:  # "(3)" is just a parenthesized number
            return Node("seq", tuple(_structure(item) for item in items), s[0] + s[-1])
    if _split_top(s, {","})[1]:
        return Node("set", _list_items(s))  # MATH: "enter all solutions, separated by commas"
    parts, relations = _split_top(s, _RELATIONS)
    if relations == ["="] * len(relations) and relations:  # chains "x = 2 + 3 = 5" keep their ends
        return Node("rel", (parts[0], parts[-1]), "=")
    if len(relations) == 1:
        (lhs, rhs), op = parts, relations[0]
        flipped = {">": "<", "\\ge": "\\le"}  # a > b is b < a
        return Node("rel", (rhs, lhs), flipped[op]) if op in flipped else Node("rel", (lhs, rhs), op)
    if relations:
        return Node("text", (s,))  # compound inequalities compare as written
    if len(variants := _expand_pm(s)) > 1:
        return Node("set", tuple(Node("expr", (v,)) for v in variants))
    if re.fullmatch(r"[A-Za-z]{2,}(?: [A-Za-z]+)*", s):
        return Node("text", (s.lower(),))
    return Node("expr", (s,))


def _coerce(a: Node, b: Node) -> Node:
    """Bridge spellings of one answer: "x = 5" vs "5", a column vector vs a tuple, {5} vs 5."""
    if a.kind == "rel" and b.kind != "rel" and a.ends == "=" and _names_a_value(a.items[0]):
        return _structure(a.items[1])
    if a.kind == "matrix" and b.kind == "seq" and (len(a.items) == 1 or all(len(r) == 1 for r in a.items)):
        return Node("seq", tuple(x for row in a.items for x in row), "()")
    if a.kind == "set" and b.kind != "set" and len(a.items) == 1:
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
        return a.ends == b.ends and judge.relation(a.ends, a.items, b.items)
    if a.kind == "set":
        return _same_multiset(a.items, b.items, judge)
    if a.ends != b.ends or len(a.items) != len(b.items):
        return False
    if a.kind == "matrix":
        return all(_equal(Node("seq", x), Node("seq", y), judge) for x, y in zip(a.items, b.items))
    return all(_equal(x, y, judge) for x, y in zip(a.items, b.items))


def _same_multiset(xs: tuple, ys: tuple, judge) -> bool:
    if len(xs) != len(ys):
        return False
    unused = list(ys)
    for x in xs:  # greedy matching is exact because equality is transitive
        hit = next((k for k, y in enumerate(unused) if _equal(x, y, judge)), None)
        if hit is None:
            return False
        del unused[hit]
    return True


# ----------------------------------------------------------------------------- leaf comparison

_DECIMAL_RE = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)")
_FRACTION_RE = re.compile(r"([-+]?)(?:\\frac\{(\d+)\}\{(\d+)\}|(\d+)/(\d+))")


def _squash(s: str) -> str:
    return s.replace(" ", "")


def _rational(s: str) -> Fraction | None:
    """Exact value of a plain number ("004", ".35625", "-\\frac{3}{8}", "14/3"), else None."""
    s = _squash(s)
    if _DECIMAL_RE.fullmatch(s):
        return Fraction(s)
    if (m := _FRACTION_RE.fullmatch(s)) and int(m[3] or m[5]) != 0:
        value = Fraction(int(m[2] or m[4]), int(m[3] or m[5]))
        return -value if m[1] == "-" else value
    return None


class _FastJudge:
    """Pure-Python leaf comparison: exact text, then exact rationals. Notes when it cannot decide."""

    def __init__(self, rel_tol: float) -> None:
        self.rel_tol = Fraction(str(rel_tol))
        self.undecided = False

    def fast_expr(self, x: str, y: str) -> bool | None:
        if _squash(x) == _squash(y):
            return True
        qx, qy = _rational(x), _rational(y)
        if qx is None or qy is None:
            return None
        return abs(qx - qy) <= self.rel_tol * max(abs(qx), abs(qy))

    def expr(self, x: str, y: str) -> bool:
        verdict = self.fast_expr(x, y)
        self.undecided |= verdict is None
        return bool(verdict)

    def relation(self, op: str, a: tuple, b: tuple) -> bool:
        same = [_squash(s) for s in a] == [_squash(s) for s in b]
        self.undecided |= not same
        return same


class _SympyJudge(_FastJudge):
    """Adds sympy: numeric comparison of constants, simplify(a - b) == 0 otherwise. Runs in workers only."""

    def __init__(self, rel_tol: float) -> None:
        import sympy

        super().__init__(rel_tol)
        self.sp = sympy

    def parse(self, s: str):
        if len(s) > MAX_ANSWER_CHARS:
            raise ValueError("answer too long to parse")
        return _Parser(s, self.sp).parse()

    def expr(self, x: str, y: str) -> bool:
        if (verdict := self.fast_expr(x, y)) is not None:
            return verdict
        sp, a, b = self.sp, self.parse(x), self.parse(y)
        if a.has(sp.zoo, sp.nan) or b.has(sp.zoo, sp.nan):  # 1/0 is not an answer, and 1/0 == 2/0 in sympy
            return False
        if self.rel_tol > 0 and not (a.free_symbols or b.free_symbols):
            va, vb = sp.N(a, 30), sp.N(b, 30)
            if va.is_finite and vb.is_finite:  # 1/2004! vs 1/2006! differ by a factor 4e6: not equal
                return bool(abs(va - vb) <= float(self.rel_tol) * max(abs(va), abs(vb)))
        return a == b or sp.simplify(a - b) == 0

    def relation(self, op: str, a: tuple, b: tuple) -> bool:
        if super().relation(op, a, b):
            return True
        da, db = self.parse(a[0]) - self.parse(a[1]), self.parse(b[0]) - self.parse(b[1])
        zero_a, zero_b = self.sp.simplify(da) == 0, self.sp.simplify(db) == 0
        if zero_a or zero_b:
            return zero_a and zero_b
        ratio = self.sp.simplify(da / db)  # same solution set: lhs - rhs agree up to a constant factor
        if ratio.free_symbols or not ratio.is_finite or ratio.is_zero is not False:
            return False
        return op == "=" or ratio.is_positive is True  # an inequality may only scale by a positive factor


# ----------------------------------------------------------------------------- LaTeX -> sympy

_TOKEN_RE = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\[a-zA-Z]+|[a-zA-Z]|[-+*/^!(){}\[\]|_]|\S)")
_FUNCTIONS = {"sin": "sin", "cos": "cos", "tan": "tan", "cot": "cot", "sec": "sec", "csc": "csc", "arcsin": "asin",
              "arccos": "acos", "arctan": "atan", "ln": "log", "log": "log", "exp": "exp"}  # LaTeX -> sympy name
_BARE_WORD_RE = re.compile(rf"(?<![\\a-zA-Z])({'|'.join([*_FUNCTIONS, 'sqrt', 'pi'])})(?![a-zA-Z])")  # sin x = \sin x
_GREEK = set("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho "
             "sigma tau phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split())
_BRACKETS = {"(": ")", "[": "]", "{": "}"}
_ATOM_STARTS = {*_BRACKETS, *("\\" + name for name in [*_FUNCTIONS, *_GREEK, "frac", "sqrt", "binom", "pi", "infty"])}


class _Parser:
    """Recursive descent over whitelisted tokens, building sympy objects directly (nothing is evaluated
    as code). Grammar: sum := product (+|- product)*; product := signed ((*|/) signed | implicit power)*;
    signed := (+|-) signed | power; power := atom !* (^ signed)?."""

    def __init__(self, text: str, sp) -> None:
        self.sp = sp
        self.tokens = _TOKEN_RE.findall(_BARE_WORD_RE.sub(lambda m: "\\" + m[1], text))
        self.pos = 0

    def peek(self) -> str | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, expected: str | None = None) -> str:
        token = self.peek()
        if token is None or (expected is not None and token != expected):
            raise ValueError(f"expected {expected or 'a token'}, got {token!r}")
        self.pos += 1
        return token

    def accept(self, token: str) -> bool:
        """Take token if it comes next."""
        found = self.peek() == token
        self.pos += found
        return found

    def starts_atom(self, token: str | None) -> bool:  # implicit multiplication: 2x, 3\sqrt{13}, (a+5)(b+2)
        return token is not None and (token[0].isalnum() or token[0] == "." or token in _ATOM_STARTS)

    def parse(self):
        value = self.sum()
        if self.peek() is not None:
            raise ValueError(f"unexpected {self.peek()!r}")
        return value

    def sum(self):
        value = self.product()
        while self.peek() in ("+", "-"):
            value = value + self.product() if self.take() == "+" else value - self.product()
        return value

    def product(self):
        value = self.signed()
        while True:
            token = self.peek()
            if token in ("*", "\\cdot", "\\times", "/", "\\div"):
                self.take()
                value = value / self.signed() if token in ("/", "\\div") else value * self.signed()
            elif self.starts_atom(token):
                value = value * self.power()
            else:
                return value

    def signed(self):
        if self.peek() in ("+", "-"):
            return -self.signed() if self.take() == "-" else self.signed()
        return self.power()

    def power(self):
        value = self.atom()
        while self.accept("!"):
            if value.is_number and not (value.is_Integer and 0 <= value <= MAX_FACTORIAL):
                raise ValueError("factorial argument out of range")
            value = self.sp.factorial(value)
        return self.pow(value, self.signed()) if self.accept("^") else value

    def pow(self, base, exponent):
        """base ** exponent, refusing integer powers too large to compute (sympy would evaluate them)."""
        if exponent.is_Rational and base.is_number and base not in (0, 1, -1):
            bits_per_unit = max(abs(base.p).bit_length(), base.q.bit_length()) if base.is_Rational else 64
            if abs(exponent) * bits_per_unit > MAX_POWER_BITS:
                raise ValueError("power too large to evaluate")
        return base**exponent

    def until(self, closer: str):
        value = self.sum()
        self.take(closer)
        return value

    def group(self):
        """A braced argument, or LaTeX's single-token argument."""
        return self.until("}") if self.accept("{") else self.atom()

    def atom(self):
        sp, token = self.sp, self.take()
        if token[0].isdigit() or token[0] == ".":
            return sp.Rational(token)  # decimals stay exact
        if token in _BRACKETS:
            return self.until(_BRACKETS[token])
        if token == "|":
            return sp.Abs(self.until("|"))
        if token.isalpha():
            return self.symbol(token)
        if token == "\\frac":
            return self.group() / self.group()  # operands are evaluated left to right
        if token == "\\sqrt":  # \sqrt{x} or \sqrt[3]{x}
            degree = self.until("]") if self.accept("[") else None
            return sp.sqrt(self.group()) if degree is None else sp.root(self.group(), degree)
        if token == "\\binom":
            n, k = self.group(), self.group()
            if n.is_number and not (n.is_Integer and abs(n) <= MAX_FACTORIAL):
                raise ValueError("binomial argument out of range")
            return sp.binomial(n, k)
        if token in ("\\pi", "\\infty"):
            return sp.pi if token == "\\pi" else sp.oo
        if token[1:] in _GREEK:
            return self.symbol(token[1:])
        if token[1:] in _FUNCTIONS:
            return self.function(token[1:])
        raise ValueError(f"unsupported token {token!r}")

    def symbol(self, name: str):
        if self.accept("_"):  # a_1, a_{10}
            subscript = "".join(iter(self.take, "}")) if self.accept("{") else self.take()
            if not subscript.isalnum():
                raise ValueError(f"unsupported subscript {subscript!r}")
            return self.sp.Symbol(f"{name}_{subscript}")
        return self.sp.I if name == "i" else self.sp.Symbol(name)

    def function(self, name: str):
        exponent = self.group() if self.accept("^") else None  # \sin^2 x
        base = self.group() if name == "log" and self.accept("_") else None  # \log_2 8
        if self.peek() == "(":
            argument = self.atom()
        else:  # \sin 2x means sin(2x)
            argument = self.power()
            while self.starts_atom(self.peek()) and self.peek()[1:] not in _FUNCTIONS:
                argument = argument * self.power()
        value = self.sp.log(argument, base) if base is not None else getattr(self.sp, _FUNCTIONS[name])(argument)
        return value if exponent is None else self.pow(value, exponent)


# ----------------------------------------------------------------------------- worker processes

_WORKER_CMD = [sys.executable, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import reward; reward._serve()",
               str(Path(__file__).resolve().parent)]


def _serve() -> None:
    """Worker loop: one JSON job [answer, reference, rel_tol, timeout] per stdin line, "1"/"0" per stdout line."""
    import resource
    import signal

    import sympy  # noqa: F401  (imported before "ready", so job deadlines do not pay for it)

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    out, sys.stdout = sys.stdout, sys.stderr  # nothing printed by sympy can corrupt the protocol
    print("ready", file=out, flush=True)
    for line in sys.stdin:
        answer, reference, rel_tol, timeout = json.loads(line)
        signal.alarm(math.ceil(timeout) + 2)  # SIGALRM's default action ends us if the parent died mid-job
        try:
            ok = _equal(_structure(answer), _structure(reference), _SympyJudge(rel_tol))
        except Exception:  # parse errors, RecursionError, MemoryError: a wrong answer, never a crash
            ok = False
        signal.alarm(0)
        print(int(ok), file=out, flush=True)


class _WorkerPool:
    """Persistent sympy workers; one past its deadline is killed and replaced, so a hang costs one timeout."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []
        self.lock = threading.Lock()

    def _spawn(self, n: int) -> list[subprocess.Popen]:
        new = [subprocess.Popen(_WORKER_CMD, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.DEVNULL, text=True, bufsize=1) for _ in range(n)]
        for proc in new:  # wait for all, so start-up overlaps
            if proc.stdout.readline().strip() != "ready":
                raise RuntimeError("reward worker failed to start (is sympy installed?)")
        self.procs += new
        return new

    def _replace(self, proc: subprocess.Popen) -> subprocess.Popen:
        proc.kill()
        proc.wait()
        self.procs.remove(proc)
        return self._spawn(1)[0]

    def run(self, jobs: list[tuple[str, str]], workers: int, timeout: float, rel_tol: float) -> list[bool]:
        results = [False] * len(jobs)
        with self.lock:
            self._spawn(max(0, workers - len(self.procs)))
            idle = [p if p.poll() is None else self._replace(p) for p in self.procs[:workers]]
            busy: dict[subprocess.Popen, tuple[int, float]] = {}  # proc -> (job index, deadline)
            todo = list(range(len(jobs)))[::-1]
            while todo or busy:
                while todo and idle:
                    proc, i = idle.pop(), todo.pop()
                    try:
                        proc.stdin.write(json.dumps([*jobs[i], rel_tol, timeout]) + "\n")
                        proc.stdin.flush()
                    except BrokenPipeError:  # it died while idle: this job stays wrong, the worker is replaced
                        idle.append(self._replace(proc))
                        continue
                    busy[proc] = (i, time.monotonic() + timeout)
                if not busy:  # every job so far met a dead worker; the replacements take the rest
                    continue
                wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                ready, _, _ = select.select([p.stdout for p in busy], [], [], wait)
                now = time.monotonic()
                for proc, (i, deadline) in list(busy.items()):
                    line = proc.stdout.readline() if proc.stdout in ready else None
                    if line is None and now < deadline:
                        continue  # still working
                    del busy[proc]
                    results[i] = (line or "").strip() == "1"  # None: out of time
                    idle.append(proc if line else self._replace(proc))  # "": it died
        return results

    def close(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()
        self.procs.clear()


_POOL = _WorkerPool()
atexit.register(_POOL.close)


# ----------------------------------------------------------------------------- public API

def _grade_fast(completion: str, reference: str, rel_tol: float) -> bool | tuple[str, str]:
    """The verdict where exact text or rationals decide, else the normalized (answer, reference) for sympy."""
    answer = extract_answer(completion)
    if answer is None:
        return False
    if max(len(answer), len(reference)) > MAX_ANSWER_CHARS:  # no real answer is this long
        return answer.strip() == reference.strip()
    a, r = normalize(answer), normalize(reference)
    if not a or not r:
        return False
    judge = _FastJudge(rel_tol)
    try:
        ok = _equal(_structure(a), _structure(r), judge)
    except RecursionError:  # brackets nested hundreds deep: not an answer
        return False
    return (a, r) if not ok and judge.undecided else ok


def grade(answer_text: str, reference: str, *, timeout: float = TIMEOUT_S, rel_tol: float = REL_TOL) -> bool:
    """True when the final answer in answer_text (a completion or a bare answer) equals reference.
    Never raises on model output; finishes within about `timeout` seconds."""
    return reward([answer_text], [reference], workers=1, timeout=timeout, rel_tol=rel_tol)[0] == 1.0


def has_format(completion: str, answer_format: str | None) -> bool:
    """Whether the completion states its answer as asked: "boxed" (a closed \\boxed{}), "answer"
    (a non-empty "Answer:" line, the DAPO template), or None (either)."""
    boxed = bool(_outer_boxes(completion))
    answer_line = any(line.strip() for line in _ANSWER_LINE_RE.findall(completion))
    return {"boxed": boxed, "answer": answer_line, None: boxed or answer_line}[answer_format]


def reward(completions: list[str], references: list[str], *, format_weight: float = 0.0,
           answer_format: str | None = None, workers: int = 2, timeout: float = TIMEOUT_S,
           rel_tol: float = REL_TOL) -> list[float]:
    """Per completion: 1.0 if its answer is correct else 0.0, plus format_weight if has_format(...).
    The format term is separate from correctness (a correct answer in the wrong format still earns 1.0),
    so format_weight = 0 gives the pure verifiable reward. Symbolic checks run in `workers` processes."""
    if len(completions) != len(references):
        raise ValueError(f"completions and references differ in length: {len(completions)} vs {len(references)}")
    if answer_format not in (None, "boxed", "answer"):
        raise ValueError(f"answer_format must be None, 'boxed' or 'answer', got {answer_format!r}")
    if workers < 1 or timeout <= 0 or rel_tol < 0 or format_weight < 0:
        raise ValueError(f"need workers >= 1, timeout > 0, rel_tol >= 0, format_weight >= 0; got "
                         f"workers={workers}, timeout={timeout}, rel_tol={rel_tol}, format_weight={format_weight}")
    for name, texts in (("completions", completions), ("references", references)):
        for i, text in enumerate(texts):
            if not isinstance(text, str):
                raise ValueError(f"{name}[{i}] is {type(text).__name__}, expected str")
    correct = [_grade_fast(c, r, rel_tol) for c, r in zip(completions, references)]
    if slow := [i for i, verdict in enumerate(correct) if isinstance(verdict, tuple)]:  # only these need sympy
        for i, verdict in zip(slow, _POOL.run([correct[i] for i in slow], workers, timeout, rel_tol)):
            correct[i] = verdict
    return [float(ok) + (format_weight * has_format(c, answer_format) if format_weight else 0.0)
            for ok, c in zip(correct, completions)]
