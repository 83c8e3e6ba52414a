"""Benchmark of reward.py: grading throughput on real answers, fast path vs sympy workers.

GSM8K (1,319 test answers) is all plain numbers, so it measures the pure-Python fast path: graded
against itself (as bare answers and as full reference solutions, extracted via the last number)
and against shuffled references (the few solutions whose last number is not the answer are graded
wrong, as they should be under last-number extraction). MATH-500 mixes LaTeX, tuples, intervals and matrices, so its
shuffled run sends many pairs to the sympy workers. Run: python bench/reward.py [--workers N]
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import reward  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


def load(name: str) -> list[dict]:
    with open(DATA / name) as f:
        return [json.loads(line) for line in f]


def shuffled(items: list[str], seed: int = 0) -> list[str]:
    items = list(items)
    random.Random(seed).shuffle(items)
    return items


def measure(completions: list[str], references: list[str], workers: int) -> tuple[float, float]:
    """(fraction graded correct, answers per second) for one reward() call."""
    start = time.perf_counter()
    scores = reward.reward(completions, references, workers=workers)
    elapsed = time.perf_counter() - start
    return sum(scores) / len(scores), len(scores) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--workers", type=int, default=2, help="sympy worker processes (default 2)")
    workers = parser.parse_args().workers
    if workers < 1:
        parser.error(f"--workers must be >= 1, got {workers}")
    if not DATA.is_dir():
        print(f"skipped: third-party data not found at {DATA}")
        return
    gsm8k, math500 = load("gsm8k_test.jsonl"), load("math500.jsonl")
    gsm_answers = [row["answer"] for row in gsm8k]
    # A solution ends in its final computation, e.g. "... = $<<9*2=18>>18 every day", so extraction falls back
    # to the last number. The answers are plain numbers, so the fast path must carry the whole run.
    gsm_solutions = [row["solution"] for row in gsm8k]
    math_answers = [row["answer"] for row in math500]
    math_boxed = [f"So the final answer is $\\boxed{{{a}}}$." for a in math_answers]

    reward.reward(["\\sqrt{2}"] * workers, ["1.4142135623730951"] * workers, workers=workers)  # start workers
    runs = [
        ("GSM8K answers vs themselves", gsm_answers, gsm_answers),
        ("GSM8K solutions vs answers", gsm_solutions, gsm_answers),
        ("GSM8K answers vs shuffled", gsm_answers, shuffled(gsm_answers)),
        ("MATH-500 boxed vs themselves", math_boxed, math_answers),
        ("MATH-500 boxed vs shuffled", math_boxed, shuffled(math_answers)),
    ]
    print(f"{'run':32s} {'n':>6s} {'graded equal':>13s} {'answers/s':>10s}")
    rates = {}
    for name, completions, references in runs:
        equal, rate = measure(completions, references, workers)
        rates[name] = rate
        print(f"{name:32s} {len(completions):6d} {equal:13.3f} {rate:10.0f}")
    fast, slow = rates["GSM8K answers vs shuffled"], rates["MATH-500 boxed vs shuffled"]
    print(f"fast path (GSM8K shuffled) / symbolic mix (MATH-500 shuffled): {fast / slow:.1f}x, "
          f"with {workers} worker processes; target >= 5,000 answers/s on GSM8K")


if __name__ == "__main__":
    main()
