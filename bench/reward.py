"""Benchmark of reward.py: grading throughput on real answers, fast path vs sympy workers.

GSM8K (1,319 test answers) is all plain numbers, so it measures the pure-Python fast path: graded
against itself (as bare answers and as full reference solutions, extracted via the last number)
and against shuffled references (the few solutions whose last number is not the answer are graded
wrong, as they should be under last-number extraction). MATH-500 mixes LaTeX, tuples, intervals and matrices, so its
shuffled run sends many pairs to the sympy workers.

    python bench/reward.py [--workers N] [--data DIR]

The answers come from DIR/gsm8k.jsonl (or gsm8k_test.jsonl) and DIR/math500.jsonl: by default data/, where
`python data/prepare.py gsm8k math500` writes them, else ../shared/data. Without them it says so and exits
with status 2: a benchmark that did not run does not pass.
"""

import argparse
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import reward  # noqa: E402
from data import read_problems  # noqa: E402

PLACES = (ROOT / "data", ROOT.parent / "shared" / "data")  # where the data is looked for, in order
FILES = {"gsm8k": ("gsm8k.jsonl", "gsm8k_test.jsonl"), "math500": ("math500.jsonl",)}


def find_data(folder: Path | None) -> dict[str, Path] | None:
    """The GSM8K and MATH-500 files of `folder` (default: the first of PLACES that has both), or None."""
    for place in [folder] if folder else PLACES:
        found = {name: next((place / f for f in files if (place / f).is_file()), None) for name, files in FILES.items()}
        if all(found.values()):
            return found
    return None


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
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--workers", type=int, default=2, help="sympy worker processes (default 2)")
    parser.add_argument(
        "--data",
        type=Path,
        default=None,
        help="folder with gsm8k.jsonl (or gsm8k_test.jsonl) and math500.jsonl (default: data/, else ../shared/data)",
    )
    args = parser.parse_args()
    workers = args.workers
    if workers < 1:
        parser.error(f"--workers must be >= 1, got {workers}")
    files = find_data(args.data)
    if files is None:
        where = args.data or " or ".join(str(place) for place in PLACES)
        print(
            f"bench/reward.py: no GSM8K and MATH-500 answers in {where} (gsm8k.jsonl or gsm8k_test.jsonl, and "
            "math500.jsonl); run `python data/prepare.py gsm8k math500` or give --data DIR",
            file=sys.stderr,
        )
        sys.exit(2)
    gsm8k, math500 = read_problems(files["gsm8k"]), read_problems(files["math500"])
    print(f"data: {files['gsm8k']}, {files['math500']}")
    gsm_answers = [row["answer"] for row in gsm8k]
    math_answers = [row["answer"] for row in math500]
    math_boxed = [f"So the final answer is $\\boxed{{{a}}}$." for a in math_answers]

    reward.reward(["\\sqrt{2}"] * workers, ["1.4142135623730951"] * workers, workers=workers)  # start workers
    runs = [("GSM8K answers vs themselves", gsm_answers, gsm_answers)]
    if all("solution" in row for row in gsm8k):
        # A solution ends in its final computation, e.g. "... = $<<9*2=18>>18 every day", so extraction falls
        # back to the last number. The answers are plain numbers, so the fast path must carry the whole run.
        runs.append(("GSM8K solutions vs answers", [row["solution"] for row in gsm8k], gsm_answers))
    runs += [
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
    print(
        f"fast path (GSM8K shuffled) / symbolic mix (MATH-500 shuffled): {fast / slow:.1f}x, "
        f"with {workers} worker processes; target >= 5,000 answers/s on GSM8K"
    )


if __name__ == "__main__":
    main()
