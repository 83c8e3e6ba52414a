"""Small programming problems with tests, for the offline code demo and for tests: generated here.

Each problem asks for a Python program that reads standard input and prints one thing ("Read an integer n
and print n + 7."), and comes with five tests computed by a reference solution. They sit where a 135M chat
model writes a correct program some of the time, which is where GRPO has something to learn: variations
of the one worked example the "code" template shows (reading a number, printing arithmetic on it) are
often right, lists, strings and loops less often.

A problem's split ("train" or "test") and its tests are functions of its text alone (a crc32, as in
arithmetic.py), so the held-out set is the same whatever is asked for, and no training problem is evaluated.
"""

import random
import zlib
from typing import Callable, Iterator

TEST_PERCENT = 20  # share of the problems held out
TESTS_PER_PROBLEM = 5


def _number(rng: random.Random) -> str:
    return f"{rng.randint(-50, 200)}\n"


def _natural(rng: random.Random) -> str:
    return f"{rng.randint(0, 500)}\n"


def _positive(rng: random.Random) -> str:
    return f"{rng.randint(1, 12)}\n"


def _pair(rng: random.Random) -> str:
    return f"{rng.randint(-30, 99)} {rng.randint(-30, 99)}\n"


def _word(rng: random.Random) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8))) + "\n"


def _numbers(rng: random.Random) -> str:
    return " ".join(str(rng.randint(-20, 60)) for _ in range(rng.randint(2, 7))) + "\n"


Family = tuple[str, Callable[[str], str], Callable[[random.Random], str]]  # (statement, solution, input maker)


def _families() -> Iterator[Family]:
    """Every problem: its statement, a reference solution from input text to output text, and its inputs."""
    n = lambda text: int(text)  # noqa: E731
    for k in range(1, 31):
        yield f"Read an integer n and print n + {k}.", lambda t, k=k: str(n(t) + k), _number
        yield f"Read an integer n and print n - {k}.", lambda t, k=k: str(n(t) - k), _number
    for k in range(2, 21):
        yield f"Read an integer n and print n * {k}.", lambda t, k=k: str(n(t) * k), _number
        yield f"Read a non-negative integer n and print n % {k}.", lambda t, k=k: str(n(t) % k), _natural
        yield f"Read a non-negative integer n and print n // {k}.", lambda t, k=k: str(n(t) // k), _natural
    for k in range(0, 11):
        yield f"Read an integer n and print n * n + {k}.", lambda t, k=k: str(n(t) ** 2 + k), _number
    for k in range(2, 13):
        yield (
            f"Read an integer n and print YES if n is divisible by {k}, otherwise NO.",
            lambda t, k=k: "YES" if n(t) % k == 0 else "NO",
            _number,
        )
    for k in range(2, 11):
        yield (
            f"Read a word and print it {k} times on one line, separated by spaces.",
            lambda t, k=k: " ".join([t.strip()] * k),
            _word,
        )
    pair = lambda t: tuple(map(int, t.split()))  # noqa: E731
    yield "Read two integers a and b on one line and print a + b.", lambda t: str(sum(pair(t))), _pair
    yield "Read two integers a and b on one line and print a - b.", lambda t: str(pair(t)[0] - pair(t)[1]), _pair
    yield "Read two integers a and b on one line and print a * b.", lambda t: str(pair(t)[0] * pair(t)[1]), _pair
    yield "Read two integers a and b on one line and print the larger one.", lambda t: str(max(pair(t))), _pair
    yield "Read two integers a and b on one line and print the smaller one.", lambda t: str(min(pair(t))), _pair
    yield "Read an integer n and print n squared.", lambda t: str(n(t) ** 2), _number
    yield "Read an integer n and print its absolute value.", lambda t: str(abs(n(t))), _number
    yield (
        "Read an integer n and print even if n is even, otherwise odd.",
        lambda t: "even" if n(t) % 2 == 0 else "odd",
        _number,
    )
    yield "Read a word and print it reversed.", lambda t: t.strip()[::-1], _word
    yield "Read a word and print it in upper case.", lambda t: t.strip().upper(), _word
    yield "Read a word and print its length.", lambda t: str(len(t.strip())), _word
    yield "Read a word and print its first letter.", lambda t: t.strip()[0], _word
    yield "Read a word and print its last letter.", lambda t: t.strip()[-1], _word
    yield (
        "Read a positive integer n and print the numbers 1 to n, one per line.",
        lambda t: "\n".join(str(i) for i in range(1, n(t) + 1)),
        _positive,
    )
    yield (
        "Read a positive integer n and print the sum 1 + 2 + ... + n.",
        lambda t: str(n(t) * (n(t) + 1) // 2),
        _positive,
    )
    yield (
        "Read a positive integer n and print n factorial.",
        lambda t: str(__import__("math").factorial(n(t))),
        _positive,
    )
    yield (
        "Read a positive integer n and print the sum of its digits.",
        lambda t: str(sum(map(int, t.strip()))),
        _positive,
    )
    numbers = lambda t: list(map(int, t.split()))  # noqa: E731
    yield "Read integers on one line and print their sum.", lambda t: str(sum(numbers(t))), _numbers
    yield "Read integers on one line and print the largest.", lambda t: str(max(numbers(t))), _numbers
    yield "Read integers on one line and print the smallest.", lambda t: str(min(numbers(t))), _numbers
    yield "Read integers on one line and print how many there are.", lambda t: str(len(numbers(t))), _numbers
    yield (
        "Read integers on one line and print them sorted in increasing order, separated by spaces.",
        lambda t: " ".join(map(str, sorted(numbers(t)))),
        _numbers,
    )


def _seed(statement: str) -> int:
    # crc32, not hash(): Python salts str hashes per process, and splits and tests must never move
    return zlib.crc32(statement.encode())


def split_of(statement: str) -> str:
    return "test" if _seed(statement) % 100 < TEST_PERCENT else "train"


def _problem(statement: str, solve: Callable[[str], str], make_input: Callable[[random.Random], str]) -> dict:
    rng = random.Random(_seed(statement))
    inputs = [make_input(rng) for _ in range(TESTS_PER_PROBLEM)]
    return {
        "problem": statement,
        "task": "code",
        "style": "stdio",
        "tests": [{"input": text, "output": solve(text)} for text in inputs],
    }


def code_problems(split: str = "train", n: int | None = None, seed: int = 0) -> list[dict]:
    """Problems {"problem", "task": "code", "style": "stdio", "tests"} of one split, in a seeded order.

    n=None returns each problem of the split once; with n, the train split repeats (reshuffled) to give n
    problems, while the test split refuses an n beyond its size rather than repeat a held-out problem.
    """
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', got {split!r}")
    pool = [_problem(*family) for family in _families() if split_of(family[0]) == split]
    if n is not None and (n < 1 or (split == "test" and n > len(pool))):
        raise ValueError(f"n must be in 1..{len(pool)} for the {split} split of the code problems, got {n}")
    rng, problems = random.Random(f"{seed}:code"), []
    while len(problems) < (len(pool) if n is None else n):
        order = pool[:]
        rng.shuffle(order)
        problems += order[: (len(pool) if n is None else n) - len(problems)]
    return problems
