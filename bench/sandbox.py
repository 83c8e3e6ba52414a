"""Benchmark of grading/sandbox.py: programs graded per second, trivial and timeout-bound, against bare processes.

Trivial programs (read two numbers, print their sum) measure what isolation costs per run: the sandboxed
grade of each against T tests, side by side with the same program run T times as a bare process
(`python -I -S`, no namespaces, no limits) from as many threads as the sandbox has workers. Timeout-bound
programs (an infinite loop, one test each) measure how fast a step gets through programs that never
finish: at best workers / timeout per second. Run: python bench/sandbox.py [--workers N] [--programs N]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from grading import sandbox  # noqa: E402

ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


def problem(tests: int) -> dict:
    return {"tests": [{"input": f"{i} {i + 1}\n", "output": str(2 * i + 1)} for i in range(tests)]}


def sandboxed(programs: list[str], problems: list[dict], workers: int, limits: sandbox.Limits) -> float:
    """Programs graded per second, after the pool has started (a training run starts it once)."""
    sandbox.grade(programs[:workers], problems[:workers], limits=limits, workers=workers)
    start = time.perf_counter()
    grades = sandbox.grade(programs, problems, limits=limits, workers=workers)
    elapsed = time.perf_counter() - start
    expected = {None} if programs[0] == ADD else {"timeout"}
    assert {g.reason for g in grades} == expected, {g.reason for g in grades}
    return len(programs) / elapsed


def bare(count: int, tests: int, workers: int) -> float:
    """Programs per second when each test is a bare `python -I -S program.py` with the test on stdin."""
    python = sandbox._interpreter()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "program.py"
        path.write_text(ADD)

        def one(_):
            for i in range(tests):
                out = subprocess.run(
                    [python, "-I", "-S", str(path)], input=f"{i} {i + 1}\n", capture_output=True, text=True, timeout=60
                ).stdout
                assert out.split() == [str(2 * i + 1)]

        start = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(one, range(count)))
        return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=os.cpu_count(), help="sandbox workers (default: CPUs)")
    parser.add_argument("--programs", type=int, default=64, help="trivial programs per measurement")
    parser.add_argument("--timeout", type=float, default=0.5, help="seconds per test of the timeout-bound programs")
    args = parser.parse_args()
    print(f"{args.workers} workers, {os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f}\n")
    print("| programs | tests each | sandboxed programs/s | bare processes programs/s | sandboxed / bare |")
    print("| --- | --: | --: | --: | --: |")
    for tests in (1, 10):
        count = max(args.workers, args.programs // tests)
        ours = sandboxed([ADD] * count, [problem(tests)] * count, args.workers, sandbox.Limits())
        theirs = bare(count, tests, args.workers)
        print(f"| trivial (a + b) | {tests} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x |")
    count = 4 * args.workers
    limits = sandbox.Limits(timeout=args.timeout)
    heavy = sandboxed(["while True:\n    pass\n"] * count, [problem(1)] * count, args.workers, limits)
    print(
        f"| infinite loop, timeout {args.timeout} s | 1 | {heavy:.2f} | - | "
        f"{heavy / (args.workers / args.timeout):.2f}x of workers/timeout |"
    )


if __name__ == "__main__":
    main()
