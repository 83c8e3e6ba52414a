"""Arithmetic problems for the offline demo: small, exactly gradable, and generated here.

A 135M instruct model answers single-digit sums and times tables correctly only some of the time,
which is the regime where GRPO has something to learn: groups with mixed rewards. Two-digit sums
are the hard kind it almost never gets right. A two-digit number plus or minus a one-digit one
(add21, sub21) sits in between: about 6% right at first, the harder task of research/study.py.

Every problem belongs to the "train" or the "test" split by a hash of the problem itself, so the
held-out set is fixed whatever the seed, the kinds or the number of problems asked for, and no
training problem is ever evaluated. A sum and its commuted twin (7 + 5, 5 + 7) share a split, so
the held-out set never contains a problem whose mirror image was trained on.

Each problem carries a worked solution, the equation it asks for written out ("7 + 5 = 12"), so the
offline demo can run the supervised stage (sft.py) before GRPO: templates.render_solution ends it in
the answer format of whichever template is trained on.
"""

import operator
import random
import zlib
from typing import Iterator, Sequence

QUESTION = "What is {a} {op} {b}?"  # the one place the problems' wording lives
SOLUTION = "{a} {op} {b} = {result}"
OPERATORS = {"+": operator.add, "-": operator.sub, "×": operator.mul}
COMMUTATIVE = {"+", "×"}

# kind -> (operator, operand pairs)
KINDS: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "add1": ("+", [(a, b) for a in range(10) for b in range(10)]),
    "sub1": ("-", [(a + b, b) for a in range(10) for b in range(10)]),  # answers 0..9
    "times": ("×", [(a, b) for a in range(1, 10) for b in range(1, 10)]),
    "add2": ("+", [(a, b) for a in range(10, 100) for b in range(10, 100)]),
    "add21": ("+", [(a, b) for a in range(10, 100) for b in range(1, 10)]),  # two-digit plus one-digit
    "sub21": ("-", [(a, b) for a in range(10, 100) for b in range(1, 10)]),  # two-digit minus one-digit
}
DEFAULT_KINDS = ("add1", "sub1", "times")
TWO_DIGIT_KINDS = ("add21", "sub21")  # the study's task: the 135M model starts near 6%
TEST_PERCENT = 20  # share of each kind's problems held out


def split_of(kind: str, a: int, b: int) -> str:
    """'train' or 'test' for one problem, decided by the problem alone."""
    op = KINDS[kind][0]
    if op in COMMUTATIVE:
        a, b = min(a, b), max(a, b)
    # crc32, not hash(): Python salts str hashes per process, and the split must never move
    return "test" if zlib.crc32(f"{kind}:{a}{op}{b}".encode()) % 100 < TEST_PERCENT else "train"


def problems_of(kind: str, split: str) -> list[dict]:
    """All problems of one kind in one split, in a fixed order."""
    op, pairs = KINDS[kind]
    return [
        {
            "problem": QUESTION.format(a=a, op=op, b=b),
            "answer": str(OPERATORS[op](a, b)),
            "kind": kind,
            "solution": SOLUTION.format(a=a, op=op, b=b, result=OPERATORS[op](a, b)),
        }
        for a, b in pairs
        if split_of(kind, a, b) == split
    ]


def _shuffled(pool: list[dict], rng: random.Random, repeat: bool) -> Iterator[dict]:
    while pool:
        order = pool[:]
        rng.shuffle(order)
        yield from order
        if not repeat:
            return


def arithmetic_problems(
    split: str = "train", kinds: Sequence[str] = DEFAULT_KINDS, n: int | None = None, seed: int = 0
) -> list[dict]:
    """Problems {"problem", "answer", "kind", "solution"} of the given kinds, deterministic in (split, kinds, n,
    seed).

    Kinds are interleaved round-robin, each in its own seeded shuffled order, so the first n problems
    are balanced across kinds however different their sizes (add1 has 100 problems, add2 8,100).
    n=None returns every problem of the split once. With n, the train split starts a kind over
    (reshuffled) once it is used up, so the kinds stay balanced for any n; the test split never
    repeats a problem, so an n beyond its size is an error rather than a silently inflated evaluation.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    if isinstance(kinds, str) or not kinds:
        raise ValueError(f"kinds must be a non-empty sequence of kind names, got {kinds!r}")
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        raise ValueError(f"unknown kinds {unknown}; known kinds: {', '.join(KINDS)}")
    pools = {kind: problems_of(kind, split) for kind in dict.fromkeys(kinds)}  # dedupe, keep order
    total = sum(len(pool) for pool in pools.values())
    if n is not None and (n < 1 or (split == "test" and n > total)):
        raise ValueError(f"n must be in 1..{total} for the {split} split of kinds {list(kinds)}, got {n}")
    repeat = split == "train" and n is not None
    n = total if n is None else n
    # a string seed per kind: a kind's order does not depend on which other kinds are asked for
    streams = [_shuffled(pool, random.Random(f"{seed}:{kind}"), repeat) for kind, pool in pools.items()]
    problems: list[dict] = []
    while len(problems) < n:
        for stream in list(streams):
            problem = next(stream, None)
            if problem is None:
                streams.remove(stream)
            elif len(problems) < n:
                problems.append(problem)
    return problems
