"""LaTeX math to sympy: the parser the answer checker's workers compare expressions with.

reward.py decides most answers without it (exact text, exact rationals); what is left, such as
"\\frac{\\sqrt{3}}{2}" against "sqrt(3)/2", becomes a sympy expression here and is compared in a worker
process that a hard timeout can kill. Model text never reaches eval, exec or sympify: this is a
recursive descent over whitelisted tokens that builds sympy objects directly and refuses any number
too large to build (10^{10^{10}}, (10^8)!, a sum of a million terms), so a hostile answer costs a
ValueError, not the machine. Grammar, one method per rule:

    sum     := product (("+" | "-") product)*
    product := signed (("*" | "/" | \\cdot | \\times | \\div) signed | power)*      (2x, 3\\sqrt{13}: implicit)
    signed  := ("+" | "-") signed | power
    power   := atom "!"* ("^" signed)?
    atom    := number | "(" sum ")" | "[" sum "]" | "{" sum "}" | "|" sum "|" | letter | command

A command is \\frac, \\sqrt, \\binom, \\pi, \\infty, \\sum, \\prod, a Greek letter or a function (\\sin ...).
The module needs no sympy itself: the worker that imports sympy hands it in, so importing reward.py
(and this file) stays cheap.
"""

import re

MAX_POWER_BITS = 100_000  # refuse to build a power with more bits than this: 10^{10^{10}} stays unbuilt
MAX_FACTORIAL = 10_000  # 2006! is fine, (10^8)! is refused
MAX_SUM_TERMS = 1_000  # \sum_{k=1}^{100} k^2 is added up term by term (nested sums share this); no symbolic bounds

TOKEN_RE = re.compile(r"\s*(\d+\.?\d*|\.\d+|\\[a-zA-Z]+|[a-zA-Z]|[-+*/^!(){}\[\]|_]|\S)")
FUNCTIONS = {
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "cot": "cot",
    "sec": "sec",
    "csc": "csc",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "ln": "log",
    "log": "log",
    "exp": "exp",
}  # LaTeX -> sympy name
BARE_WORD_RE = re.compile(rf"(?<![\\a-zA-Z])({'|'.join([*FUNCTIONS, 'sqrt', 'pi'])})(?![a-zA-Z])")  # sin x = \sin x
GREEK = set(
    "alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa lambda mu nu xi rho "
    "sigma tau phi varphi chi psi omega Gamma Delta Theta Lambda Xi Sigma Phi Psi Omega".split()
)
BRACKETS = {"(": ")", "[": "]", "{": "}"}
COMMANDS = {
    "\\frac": "fraction",
    "\\sqrt": "root",
    "\\binom": "binomial",
    "\\pi": "pi",
    "\\infty": "infinity",
    "\\sum": "big_sum",
    "\\prod": "big_product",
}  # a command -> the method that reads it
ATOM_STARTS = {*BRACKETS, *COMMANDS, *("\\" + name for name in [*FUNCTIONS, *GREEK])}


def parse(text: str, sp):
    """The sympy expression of a LaTeX or plain-math text; sp is the sympy module. Raises ValueError on
    anything outside the grammar or too large to build."""
    return Parser(text, sp).parse()


class Parser:
    """One text's tokens and a position in them; each grammar rule a method that reads what it names."""

    def __init__(self, text: str | list[str], sp, bindings: dict | None = None, budget: list | None = None) -> None:
        self.sp, self.bindings = sp, bindings or {}  # bindings: the value of a summation index
        self.budget = budget or [MAX_SUM_TERMS]  # terms left to all sums of one answer, nested ones included
        if isinstance(text, str):
            text = TOKEN_RE.findall(BARE_WORD_RE.sub(lambda m: "\\" + m[1], text))
        self.tokens = text
        self.pos = 0

    # -- reading tokens

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

    def starts_atom(self, token: str | None) -> bool:
        """Whether token can begin an atom: then it multiplies what precedes it (2x, (a+5)(b+2))."""
        return token is not None and (token[0].isalnum() or token[0] == "." or token in ATOM_STARTS)

    # -- the grammar

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

    def atom(self):
        token = self.take()
        if token[0].isdigit() or token[0] == ".":
            return self.sp.Rational(token)  # decimals stay exact
        if token in BRACKETS:
            return self.until(BRACKETS[token])
        if token == "|":
            return self.sp.Abs(self.until("|"))
        if token.isalpha():
            return self.symbol(token)
        if token in COMMANDS:
            return getattr(self, COMMANDS[token])()
        if token[1:] in GREEK:
            return self.symbol(token[1:])
        if token[1:] in FUNCTIONS:
            return self.function(token[1:])
        raise ValueError(f"unsupported token {token!r}")

    # -- pieces of the rules

    def until(self, closer: str):
        """A sum, then its closing bracket."""
        value = self.sum()
        self.take(closer)
        return value

    def group(self):
        """A braced argument, or LaTeX's single-token argument."""
        return self.until("}") if self.accept("{") else self.atom()

    def term(self):
        """A factor and the implicit products that follow it: the argument of \\sin 2x or of \\sum."""
        value = self.power()
        while (
            self.starts_atom(self.peek())
            and self.peek()[1:] not in FUNCTIONS
            and self.peek() not in ("\\sum", "\\prod")
        ):
            value = value * self.power()
        return value

    def pow(self, base, exponent):
        """base ** exponent, refusing integer powers too large to compute (sympy would evaluate them)."""
        if exponent.is_Rational and base.is_number and base not in (0, 1, -1):
            bits_per_unit = max(abs(base.p).bit_length(), base.q.bit_length()) if base.is_Rational else 64
            if abs(exponent) * bits_per_unit > MAX_POWER_BITS:
                raise ValueError("power too large to evaluate")
        return base**exponent

    def symbol(self, name: str):
        """A letter: subscripted (a_1, a_{10}), a summation index's value, i and e as the constants."""
        if self.accept("_"):
            subscript = "".join(iter(self.take, "}")) if self.accept("{") else self.take()
            if not subscript.isalnum():
                raise ValueError(f"unsupported subscript {subscript!r}")
            return self.sp.Symbol(f"{name}_{subscript}")
        if name in self.bindings:
            return self.bindings[name]
        return {"i": self.sp.I, "e": self.sp.E}.get(name) or self.sp.Symbol(name)

    def function(self, name: str):
        """\\sin 2x (sin(2x)), \\sin(x), \\sin^2 x, \\log_2 8."""
        exponent = self.group() if self.accept("^") else None
        base = self.group() if name == "log" and self.accept("_") else None
        argument = self.atom() if self.peek() == "(" else self.term()
        value = self.sp.log(argument, base) if base is not None else getattr(self.sp, FUNCTIONS[name])(argument)
        return value if exponent is None else self.pow(value, exponent)

    # -- the commands (COMMANDS)

    def fraction(self):
        return self.group() / self.group()  # operands are read left to right

    def root(self):
        """\\sqrt{x} or \\sqrt[3]{x}."""
        degree = self.until("]") if self.accept("[") else None
        return self.sp.sqrt(self.group()) if degree is None else self.sp.root(self.group(), degree)

    def binomial(self):
        n, k = self.group(), self.group()
        if n.is_number and not (n.is_Integer and abs(n) <= MAX_FACTORIAL):
            raise ValueError("binomial argument out of range")
        return self.sp.binomial(n, k)

    def pi(self):
        return self.sp.pi

    def infinity(self):
        return self.sp.oo

    def big_sum(self):
        return self.sp.Add(*self.big_operator_terms())

    def big_product(self):
        terms = self.big_operator_terms()
        if sum(max(abs(t.p).bit_length(), t.q.bit_length()) for t in terms if t.is_Rational) > MAX_POWER_BITS:
            raise ValueError("product too large to evaluate")
        return self.sp.Mul(*terms)

    def big_operator_terms(self) -> list:
        """The terms of _{k=a}^{b} term, integer bounds: the term is parsed again for each k, so every power
        and factorial in it passes the same size checks as a plain number."""
        self.take("_")
        self.take("{")
        index = self.take()
        if not index.isalpha():
            raise ValueError(f"unsupported summation index {index!r}")
        self.take("=")
        low = self.until("}")
        self.take("^")
        high = self.group()
        if not (low.is_Integer and high.is_Integer and 0 <= high - low < self.budget[0]):
            raise ValueError(f"sum bounds must be integers, at most {MAX_SUM_TERMS} terms in all")
        self.budget[0] -= int(high - low) + 1
        start = self.pos
        self.term()  # finds where the term ends
        tokens = self.tokens[start : self.pos]
        return [
            Parser(tokens, self.sp, {**self.bindings, index: self.sp.Integer(k)}, self.budget).term()
            for k in range(int(low), int(high) + 1)
        ]
