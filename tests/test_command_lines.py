"""The small command lines a user runs by hand, as a user runs them: reward.py (the answer checker) and the
sandbox's. A mistake is one line naming the argument and the file, and a closed pipe ends quietly."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def command(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *argv], cwd=ROOT, capture_output=True, text=True)


def test_reward_py_takes_only_the_templates_that_exist():
    typo = command("reward.py", "x = 5", "5", "--template", "equaton")
    assert typo.returncode == 2 and typo.stdout == "" and typo.stderr.count("\n") == 1
    assert "argument --template: invalid choice: 'equaton'" in typo.stderr and "'equation'" in typo.stderr
    known = command("reward.py", "x = 5", "5", "--template", "equation")
    assert known.returncode == 0 and known.stdout.startswith("verdict: correct")


def test_reward_py_into_a_closed_pipe_ends_quietly():
    process = subprocess.Popen(
        [sys.executable, "reward.py", "The answer is 5", "5"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    process.stdout.close()  # `| head -1` once it has read its line: the rest meets a closed pipe
    err = process.stderr.read().decode()
    assert process.wait() == 0 and err == "", err


def test_the_sandbox_names_the_argument_and_file_it_cannot_read(tmp_path):
    program, tests = tmp_path / "p.py", tmp_path / "tests.json"
    program.write_text("print(input())\n")
    tests.write_bytes(b"\xff")
    cases = [
        ([str(program), "--tests", str(tests)], f"sandbox.py: --tests {tests}: not UTF-8 text"),
        ([str(program), "--tests", str(tmp_path)], f"sandbox.py: --tests {tmp_path}: Is a directory"),
        (
            [str(tmp_path / "gone.py"), "--tests", str(tests)],
            f"sandbox.py: PROGRAM {tmp_path / 'gone.py'}: No such file",
        ),
    ]
    for argv, message in cases:
        out = command("-m", "grading.sandbox", *argv)
        assert out.returncode == 2 and out.stderr.startswith(message) and out.stderr.count("\n") == 1, out.stderr
    tests.write_text('[{"input": "1"}]')
    out = command("-m", "grading.sandbox", str(program), "--tests", str(tests))
    assert out.returncode == 2 and out.stderr.startswith(f"sandbox.py: --tests {tests}: test 0 is not an object")
