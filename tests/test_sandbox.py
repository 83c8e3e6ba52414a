"""Tests for sandbox.py: extraction, comparison, both test styles, limits, the pool, the command line, and
programs that try to get out or take the machine down."""

import fcntl
import functools
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict
from pathlib import Path

import pytest

from conftest import workers_root
from grading import sandbox
from grading.sandbox import Limits, extract_program, same_output, same_value

REPO = Path(__file__).resolve().parent.parent
STDIO = {"tests": [{"input": "3 4\n", "output": "7"}, {"input": "10 -2\n", "output": "8\n"}]}
ADD = "a, b = map(int, input().split())\nprint(a + b)\n"


@pytest.fixture(scope="module")
def available():
    """The sandbox needs root and namespaces (CI and these machines have both); elsewhere these tests skip."""
    try:
        sandbox.grade([ADD], [STDIO], workers=1)
    except sandbox.SandboxUnavailable as error:
        pytest.skip(str(error))


def run(programs, problems, **limits):
    return sandbox.grade(programs, problems, limits=Limits(**limits), workers=2)


# ----------------------------------------------------------------------------- extraction and comparison


@pytest.mark.parametrize(
    "completion, program",
    [
        ("Here:\n```python\nprint(1)\n```\n", "print(1)\n"),
        ("```python\nprint(1)\n```\nbetter:\n```python\nprint(2)\n```", "print(2)\n"),
        ("```py\nprint(1)\n```\nOutput:\n```\n1\n```", "print(1)\n"),  # an output example after the code
        ("```\nprint(1)\n```", "print(1)\n"),
        ("```cpp\nint main() {}\n```", None),
        ("<think>```python\nprint(1)\n```</think>no code after thinking", None),
        ("<think>```python\nprint(1)\n```</think>\n```python\nprint(2)\n```", "print(2)\n"),
        ("```python\nprint(1)\n", None),  # never closed: cut off at the length limit
        ("```python\n\n```", None),
        ("no code at all", None),
        ("  ```Python\n  x = 1\n  ```", "  x = 1\n"),
    ],
)
def test_extract_program(completion, program):
    assert extract_program(completion) == program


def test_same_output_tokens_and_tolerance():
    assert same_output("7\n", "7") and same_output("1 2\n3", "1\n2 3\n")
    assert not same_output("7 8", "7") and not same_output("YES", "yes")
    assert not same_output("0.3333", "0.333333")
    assert same_output("0.3333337", "0.333333", 1e-6) and not same_output("0.3334", "0.333333", 1e-6)
    assert same_output("1000000.5", "1000000.0", 1e-6)  # relative error: 5e-7
    assert not same_output("abc", "abd", 1e-6) and not same_output("1_000", "1000", 1e-6)


def test_comparison_is_strict():
    """Tokens split on ASCII whitespace only; numbers are ASCII digits; a tolerance is finite."""
    assert not same_output("1\x1c2\u30003", "1 2 3") and not same_output("1\xa02", "1 2")
    assert same_output("1\t2\r\n3\x0b\x0c", "1 2 3")
    assert not same_output("\u0663", "3", 1e-6) and not same_output("\uff13", "3", 1e-6)  # Arabic, fullwidth 3
    assert not same_output("YES", "yes") and same_output("YES Straße", "yes STRASSE", case_sensitive=False)
    assert same_value(["Ab", {"k": "CD"}], ["ab", {"k": "cd"}], case_sensitive=False)
    assert not same_value(["Ab"], ["ab"]) and not same_value({"K": 1}, {"k": 1}, case_sensitive=False)
    with pytest.raises(ValueError, match="tolerance must be a finite"):
        sandbox.check_problem({**STDIO, "tolerance": float("inf")}, "p")


def test_same_value():
    assert same_value([1, [2, 3]], [1, [2, 3]]) and not same_value([1, 2], [2, 1])
    assert not same_value(True, 1) and not same_value(1, True) and same_value(False, False)
    assert same_value(2, 2.0) and not same_value(0.1 + 0.2, 0.3) and same_value(0.1 + 0.2, 0.3, 1e-9)
    assert same_value({"a": [1.0]}, {"a": [1]}) and not same_value({"a": 1}, {"b": 1})
    assert not same_value("1", 1) and not same_value(None, 0)


def test_limits_are_checked():
    with pytest.raises(ValueError, match="Limits.timeout"):
        Limits(timeout=0)
    with pytest.raises(ValueError, match="Limits.memory_bytes"):
        Limits(memory_bytes=float("inf"))


def test_malformed_problems_name_what_is_wrong():
    for problem, message in [
        ({"tests": []}, "non-empty list"),
        ({"tests": [{"input": "1"}]}, "test 0"),
        ({"tests": [{"input": [1], "output": 1}], "style": "call"}, "fn_name"),
        ({"tests": [{"input": 1, "output": "1"}]}, "must be text"),
        ({**STDIO, "style": "pipes"}, "style"),
        ({**STDIO, "tolerance": -1}, "tolerance"),
        ({**STDIO, "tolerance": float("nan")}, "tolerance"),
        ({**STDIO, "case_sensitive": "no"}, "case_sensitive must be true or false"),
        ({"tests": [{"input": "\ud800", "output": "1"}]}, "lone surrogate"),
        ({"style": "call", "fn_name": "f", "tests": [{"input": [float("nan")], "output": 1}]}, "not a finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            sandbox.grade([ADD], [problem])
    with pytest.raises(ValueError, match="differ in length"):
        sandbox.grade([ADD, ADD], [STDIO])


# ----------------------------------------------------------------------------- grading


def test_stdio_verdicts(available):
    programs = [
        ADD,
        "print(7)",
        "print(",
        None,
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))\nexit()",
        "raise ValueError('no')",
        "a, b = map(int, input().split())\nprint(a + b)\nquit(0)",
    ]
    grades = run(programs, [STDIO] * len(programs))
    assert [(g.passed, g.reason, g.failed_test) for g in grades] == [
        (2, None, None),
        (1, "wrong_answer", 1),
        (0, "syntax_error", 0),
        (0, "no_code_block", 0),
        (2, None, None),
        (0, "runtime_error", 0),
        (2, None, None),
    ]
    assert "ValueError: no" in grades[5].detail and "SyntaxError" in grades[2].detail
    assert [g.reward() for g in grades[:2]] == [1.0, 0.0] and grades[1].reward(fraction=True) == 0.5


def test_tolerance_large_input_and_unicode(available):
    numbers = " ".join(str(i) for i in range(200_000))  # 1.3 MB of input
    problems = [
        {"tests": [{"input": "1 3\n", "output": "0.333333"}], "tolerance": 1e-6},
        {"tests": [{"input": numbers, "output": str(sum(range(200_000)))}]},
        {"tests": [{"input": "héllo\n", "output": "olléh"}]},
    ]
    programs = [
        "a, b = map(int, input().split())\nprint(a / b)",
        "import sys\nprint(sum(map(int, sys.stdin.read().split())))",
        "print(input()[::-1])",
    ]
    assert [g.reason for g in run(programs, problems)] == [None, None, None]


def test_call_style(available):
    problem = {
        "style": "call",
        "fn_name": "twoSum",
        "tests": [{"input": [[2, 7, 11, 15], 9], "output": [0, 1]}, {"input": [[3, 2, 4], 6], "output": [1, 2]}],
    }
    leetcode = (
        "class Solution:\n    def twoSum(self, nums: List[int], target: int) -> List[int]:\n"
        "        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n"
        "                return (seen[target - x], i)\n            seen[x] = i\n"
    )
    plain = "def twoSum(nums, target):\n    print('debug output is ignored')\n    return [0, 1]\n"
    reads_stdin = (
        "import sys\ndata = sys.stdin.read()\ndef twoSum(nums, target):\n    return [0, 1] if not data else None"
    )
    grades = run(
        [leetcode, plain, "def other(): pass", "def twoSum(a, b): raise KeyError(a)", reads_stdin], [problem] * 5
    )
    assert [(g.passed, g.reason) for g in grades] == [
        (2, None),
        (1, "wrong_answer"),
        (0, "runtime_error"),
        (0, "runtime_error"),
        (1, "wrong_answer"),
    ]
    floats = {"style": "call", "fn_name": "f", "tolerance": 1e-6, "tests": [{"input": [3], "output": 0.333333}]}
    assert run(["def f(x): return 1 / x"], [floats])[0].reason is None


def test_timeouts_cost_one_limit(available):
    """A stdio program stops after its first timeout; a call-style program gets `timeout` per call, measured
    between results, so a slow second call fails alone and the first still counts."""
    three = {"tests": [{"input": "", "output": "1"}] * 3}
    calls = {
        "style": "call",
        "fn_name": "f",
        "tests": [{"input": [0], "output": 0}, {"input": [1], "output": 1}, {"input": [0], "output": 0}],
    }
    slow_second = "import time\ndef f(x):\n    if x: time.sleep(60)\n    return x"
    started = time.monotonic()
    stdio, call = run(["import time; time.sleep(60)", slow_second], [three, calls], timeout=0.5)
    assert time.monotonic() - started < 3
    assert (stdio.passed, stdio.reason, stdio.failed_test) == (0, "timeout", 0) and stdio.seconds < 2
    assert (call.passed, call.reason, call.failed_test) == (1, "timeout", 1) and call.seconds < 2


def test_total_time_bounds_a_program(available):
    many = {"tests": [{"input": "", "output": "1"}] * 50}
    (g,) = run(["import time; time.sleep(0.2); print(1)"], [many], timeout=1.0, total_timeout=1.0)
    assert g.reason == "timeout" and 0 < g.passed < 10 and g.seconds < 3


def test_a_step_never_waits_on_one_slow_program(available):
    """With a worker per program, a step's grading takes one program's limit, not the sum of them."""
    programs = ["import time; time.sleep(60)"] + [ADD] * 3
    started = time.monotonic()
    grades = sandbox.grade(programs, [STDIO] * 4, limits=Limits(timeout=1.0), workers=4)
    assert time.monotonic() - started < 4
    assert [g.reason for g in grades] == ["timeout", None, None, None]


def test_a_supervisor_that_died_idle_is_replaced(available, monkeypatch):
    pool = sandbox._new_pool()
    monkeypatch.setattr(sandbox, "_POOL", pool)
    try:
        sandbox.grade([ADD], [STDIO], workers=1)
        dead = pool.idle[0]
        dead.proc.kill()
        dead.proc.wait()
        assert [g.reason for g in sandbox.grade([ADD], [STDIO], workers=1)] == [None]
        assert dead not in pool.idle and len(pool.idle) == 1
    finally:
        pool.close()


def test_a_supervisor_past_its_deadline_is_replaced(available, monkeypatch):
    """The grader's own clock backs up the supervisor's: one that does not answer in time is killed with
    everything under its user, the program counts as a timeout, and a fresh supervisor takes its place."""
    pool = sandbox._new_pool()
    monkeypatch.setattr(sandbox, "_POOL", pool)
    monkeypatch.setattr(sandbox, "GRACE_S", -4.8)  # the grader gives up 0.2 s into a 5 s budget
    try:
        with pytest.warns(UserWarning, match="missed its deadline"):
            (g,) = sandbox.grade(["import time; time.sleep(60)"], [STDIO], limits=Limits(total_timeout=5.0), workers=1)
        assert g.reason == "timeout" and g.seconds < 2
        deadline = time.monotonic() + 2  # SIGKILLed, its processes take a moment to be reaped
        while sandbox_processes(pool) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sandbox_processes(pool) == []
        monkeypatch.setattr(sandbox, "GRACE_S", 10.0)
        assert [g.reason for g in sandbox.grade([ADD], [STDIO], workers=1)] == [None]
    finally:
        pool.close()


def test_reward_extracts_and_reports(available):
    completions = [f"```python\n{ADD}```", "I cannot solve it.", "```python\nprint(7)\n```"]
    assert sandbox.reward(completions, [STDIO] * 3) == [1.0, 0.0, 0.0]
    assert sandbox.reward(completions, [STDIO] * 3, fraction=True) == [1.0, 0.0, 0.5]
    grades = sandbox.grade_completions(completions, [STDIO] * 3)
    assert [g.reason for g in grades] == [None, "no_code_block", "wrong_answer"]


def test_a_program_is_read_after_the_thought_and_an_unclosed_thought_runs_nothing(available):
    """scoring.verdicts and sandbox.code_reward grade the answer part only (reward.split_thinking)."""
    from grading import scoring

    problem = {"task": "code", "problem": "Add the two numbers.", **STDIO}
    program = f"```python\n{ADD}```"
    completions = [
        f"<think>\nfirst try:\n{program}\n</think>\nno program here",
        f"<think>\nplan\n</think>\n{program}",
        f"<think>\nstill thinking\n{program}",
    ]
    values, grades = scoring.verdicts(completions, [problem] * 3)
    assert values == [0.0, 1.0, 0.0] and scoring.verdicts([program], [problem])[0] == [1.0]
    thought, thought_grades = scoring.verdicts([program], [problem], open_thought=True)
    assert thought == [0.0]  # all of it thought
    assert [g.reason for g in grades + thought_grades] == ["no_code_block", None, "no_code_block", "no_code_block"]
    columns = {"task": ["code"] * 3 + [None], "tests": [STDIO["tests"]] * 3 + [None], "answer": [None] * 3 + ["7"]}
    assert sandbox.code_reward(completions + ["7"], **columns) == [0.0, 1.0, 0.0, None]  # None: not its row


# ----------------------------------------------------------------------------- command line


def cli(*args, cwd=None):
    return subprocess.run(
        [sys.executable, "-m", "grading.sandbox", *args],
        capture_output=True,
        text=True,
        cwd=cwd or REPO,
        timeout=60,
    )


def test_command_line(available, tmp_path):
    (tmp_path / "add.py").write_text(ADD)
    (tmp_path / "tests.json").write_text(json.dumps(STDIO["tests"] + [{"input": "1 1", "output": "3"}]))
    done = cli(str(tmp_path / "add.py"), "--tests", str(tmp_path / "tests.json"))
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert (result["passed"], result["total"], result["reason"], result["failed_test"]) == (2, 3, "wrong_answer", 2)
    assert result["seconds"] > 0
    (tmp_path / "reply.txt").write_text("Sure.\n```python\ndef f(x):\n    return 2 * x\n```")
    (tmp_path / "calls.json").write_text(json.dumps([{"input": [2], "output": 4}]))
    done = cli(str(tmp_path / "reply.txt"), "--completion", "--fn-name", "f", "--tests", str(tmp_path / "calls.json"))
    assert json.loads(done.stdout)["reason"] is None, done.stderr


MALFORMED_TESTS_FILES = [  # (the tests file's text, what its one line of error names)
    ('[{"input": 1}', "not JSON"),
    ("[]", "non-empty list"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    (
        '{"style": "call", "fn_name": "f", "tests": [{"input": [' + "[" * 150 + "]" * 150 + '], "output": 1}]}',
        "nests deeper",
    ),
    ('[{"input": "\\ud800", "output": "1"}]', "lone surrogate"),
    ('{"tests": [{"input": "", "output": "1"}], "tolerance": Infinity}', "tolerance must be a finite"),
    ('{"tests": [{"input": "", "output": "1"}], "tolerance": NaN}', "tolerance"),
    ('{"tests": [{"input": "", "output": "1"}], "tolerance": true}', "tolerance"),
    ('{"tests": [{"input": "", "output": "1"}], "tolerance": "1e-6"}', "tolerance"),
    ('{"tests": [{"input": "", "output": "1"}], "case_sensitive": "false"}', "case_sensitive"),
    ('{"tests": [{"input": 7, "output": "1"}]}', "must be text"),
    ('{"tests": {"input": "", "output": "1"}}', "non-empty list"),
    ('"tests"', "expected a list of tests"),
    ('{"style": "call", "tests": [{"input": [1], "output": 1}]}', "fn_name"),
    ('{"style": "call", "fn_name": "f", "tests": [{"input": 1, "output": 1}]}', "list of arguments"),
    ('{"style": "call", "fn_name": "f", "tests": [{"input": [1e999], "output": 1}]}', "not a finite"),
]


def exit_of_main(capsys, *args) -> tuple[int, str]:
    """sandbox.main(args) in this process, for a refusal that comes before any grading: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exited:
        sandbox.main(list(args))
    return exited.value.code, capsys.readouterr().err


def test_command_line_malformed_tests_files_exit_2_with_one_line(tmp_path, capsys):
    """Each refusal through main() in this process; the first tests file and the first bad arguments also as
    typed, in a process of their own (as tests/test_command_lines.py runs others)."""
    (tmp_path / "add.py").write_text(ADD)
    (tmp_path / "good.json").write_text(json.dumps(STDIO["tests"]))
    for i, (text, message) in enumerate(MALFORMED_TESTS_FILES):
        (tmp_path / f"{i}.json").write_text(text)
        status, stderr = exit_of_main(capsys, str(tmp_path / "add.py"), "--tests", str(tmp_path / f"{i}.json"))
        assert status == 2 and len(stderr.splitlines()) == 1, (text[:80], stderr[-500:])
        assert message in stderr and stderr.startswith("sandbox.py: "), (text[:80], stderr)
    bad_arguments = [
        (["missing.py", "--tests", str(tmp_path / "0.json")], "missing.py"),
        ([str(tmp_path / "add.py")], "--tests"),
        ([str(tmp_path / "add.py"), "--tests", str(tmp_path / "good.json"), "--tolerance", "inf"], "finite"),
    ]
    for args, message in bad_arguments:
        status, stderr = exit_of_main(capsys, *args)
        assert status == 2 and message in stderr and len(stderr.splitlines()) == 1, stderr
    for args, message in [
        ([str(tmp_path / "add.py"), "--tests", str(tmp_path / "0.json")], MALFORMED_TESTS_FILES[0][1]),
        *bad_arguments[:2],
    ]:
        done = cli(*args)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr
        assert done.stderr.startswith("sandbox.py: "), done.stderr


# ----------------------------------------------------------------------------- hostile programs

SECRET = "sandbox-test-secret-4417"
HOSTILE_LIMITS = Limits(timeout=1.0, memory_bytes=256 << 20, output_bytes=1 << 20, disk_bytes=4 << 20)


def hostile_programs(victim: Path, secret_file: Path, port: int) -> dict[str, tuple[str, dict, set[str]]]:
    """name -> (program, problem, the reasons it may be graded with). Each prints the expected output only
    if its attack worked, so a pass would be an escape; the rest is checked on the machine afterwards."""
    home, repo = Path.home(), REPO
    outside_tmp = [
        str(path)
        for path in (home / "pwned-sandbox", repo / "pwned-sandbox", victim)
        if not str(path.resolve()).startswith("/tmp/")
    ]
    expect = lambda output: {"tests": [{"input": "", "output": output}]}  # noqa: E731
    escaped = expect("ESCAPED")
    return {
        "fork bomb": (
            "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
            escaped,
            {"timeout"},
        ),
        # filling 256 MB takes a while on a busy machine: it may run out of time before it runs out of memory
        "memory bomb": (
            "blocks = []\nwhile True:\n    blocks.append(bytearray(1 << 24))",
            escaped,
            {"memory", "timeout"},
        ),
        "one huge allocation": ("x = bytearray(1 << 40)", escaped, {"memory"}),
        "infinite loop": ("while True:\n    pass", escaped, {"timeout"}),
        "busy threads": (
            "import threading\ndef spin():\n    while True:\n        pass\nfor _ in range(8):\n"
            "    threading.Thread(target=spin).start()",
            escaped,
            {"timeout"},
        ),
        "sleep past the limit": ("import time\ntime.sleep(3600)\nprint('ESCAPED')", escaped, {"timeout"}),
        "huge output": ("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", escaped, {"output_limit"}),
        "write home and repository": (
            # /tmp inside is the program's own directory, so a write below it (the victim's, a repository
            # cloned under /tmp) lands there: only the host can tell, afterwards; the program counts the rest
            f"import os\nwrote = []\nfor path in {outside_tmp!r}:\n    try:\n"
            f"        os.makedirs(os.path.dirname(path), exist_ok=True)\n"
            f"        with open(path, 'w') as f:\n            f.write('pwned')\n        wrote.append(path)\n"
            f"    except OSError:\n        pass\n"
            f"print('ESCAPED' if wrote else 'no')",
            escaped,
            {"wrong_answer"},
        ),
        "read environment": (
            "import os\nprint(os.environ.get('SANDBOX_TEST_SECRET', 'nothing'))",
            expect(SECRET),
            {"wrong_answer"},
        ),
        "read files outside": (f"print(open({str(secret_file)!r}).read())", expect(SECRET), {"runtime_error"}),
        "read the repository": (
            f"print(open({str(repo / 'sandbox.py')!r}).readline())",
            expect((repo / "grading" / "sandbox.py").read_text().splitlines()[0]),
            {"runtime_error"},
        ),
        "network connection": (
            f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
            f"s.sendall(b'hello')\nprint('ESCAPED')",
            escaped,
            {"runtime_error"},
        ),
        "kill its parent": (
            f"import os, signal\nhit = 0\nfor pid in (os.getppid(), {os.getpid()}):\n"
            f"    if pid > 1:\n        try:\n            os.kill(pid, signal.SIGKILL)\n"
            f"            hit += 1\n        except OSError:\n            pass\n"
            f"try:\n    os.kill(-1, signal.SIGKILL)\n    hit += 1\nexcept OSError:\n    pass\n"
            f"print('ESCAPED' if hit else 'contained')",
            escaped,
            {"wrong_answer"},
        ),
        "os.system": (
            f"import os\nos.system('echo pwned > {repo / 'pwned-system'} && echo ESCAPED; "
            f"echo pwned > {home / 'pwned-system'} && echo ESCAPED')",
            escaped,
            {"wrong_answer"},
        ),
        "ctypes segfault": ("import ctypes\nctypes.string_at(0)", escaped, {"runtime_error"}),
        "deep recursion": (
            "import sys\nsys.setrecursionlimit(10 ** 8)\nx = []\nfor _ in range(10 ** 6):\n    x = [x]\nprint(repr(x))",
            escaped,
            {"runtime_error", "memory", "timeout"},
        ),
        "expected output, then exit 1": ("import sys\nprint('ESCAPED')\nsys.exit(1)", escaped, {"runtime_error"}),
        "closing stdout early": (
            "import os\nprint('ESCAPED', flush=True)\nos.close(1)\nwhile True:\n    pass",
            escaped,
            {"timeout"},
        ),
        "patching builtins": (
            "import builtins, json\nclass Equal:\n    def __eq__(self, other):\n        return True\n"
            "builtins.isinstance = lambda *args: True\njson.dumps = lambda *args, **kwargs: '{\"ok\": 7}'\n"
            "def solve(x):\n    return Equal()",
            {"style": "call", "fn_name": "solve", "tests": [{"input": [1], "output": 7}]},
            {"runtime_error"},
        ),
        **kernel_state_programs(),
        "fill the disk": (
            "import os\nwritten = 0\ntry:\n    for i in range(10 ** 6):\n"
            "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
            "        written += 1 << 20\nexcept OSError:\n    pass\n"
            "print('ESCAPED' if written > 64 << 20 else 'contained')",
            escaped,
            {"wrong_answer"},
        ),
    }


# the kernel's numbers of the calls Python has no function for, by machine
SYSCALLS = (
    "import ctypes, platform\nlibc = ctypes.CDLL(None, use_errno=True)\n"
    "ADD_KEY, KEYCTL, IO_URING_SETUP, USERFAULTFD = "
    "{'x86_64': (248, 250, 425, 323), 'aarch64': (217, 219, 425, 282)}[platform.machine()]\n"
)


def kernel_state_programs() -> dict[str, tuple[str, dict, set[str]]]:
    """Programs that reach for what the kernel shares beyond a process: keyrings, SysV and POSIX IPC, memory
    outside the address space, socket families, the kernel's large interfaces, site-packages. Each prints
    ESCAPED only if it got what it reached for (more memory than HOSTILE_LIMITS allows, for the memory ones)."""
    escaped = {"tests": [{"input": "", "output": "ESCAPED"}]}
    return {
        "keyrings: read the grader's, plant keys": (
            SYSCALLS + "hits = []\nfor ring in (-3, -4, -5):  # session, user, user session\n"
            "    if libc.syscall(ADD_KEY, b'user', b'planted', b'x', 1, ring) >= 0:\n        hits.append(ring)\n"
            "buffer = ctypes.create_string_buffer(4096)\n"
            "if libc.syscall(KEYCTL, 11, -3, buffer, 4096) >= 0:  # KEYCTL_READ\n    hits.append('read')\n"
            "print('ESCAPED' if hits else 'contained')",
            escaped,
            {"wrong_answer"},
        ),
        "SysV shared memory past the limit": (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.shmat.restype = ctypes.c_void_p\n"
            "held = 0\nfor _ in range(6):\n    segment = libc.shmget(0, 128 << 20, 0o1600)\n"
            "    if segment < 0:\n        break\n    address = libc.shmat(segment, None, 0)\n"
            "    if address in (None, ctypes.c_void_p(-1).value):\n        break\n"
            "    ctypes.memset(address, 1, 128 << 20)\n    libc.shmdt(ctypes.c_void_p(address))\n"
            "    held += 128 << 20\nprint('ESCAPED' if held > 256 << 20 else 'contained')",
            escaped,
            {"wrong_answer", "memory"},
        ),
        "message queues past the limit": (
            "import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
            "message = ctypes.create_string_buffer((1).to_bytes(8, 'little') + bytes(8192))\nqueued = 0\n"
            "while queued <= 256 << 20:\n    queue = libc.msgget(0, 0o1600)\n    if queue < 0:\n        break\n"
            "    while libc.msgsnd(queue, message, 8192, 0o4000) == 0:  # IPC_NOWAIT\n        queued += 8192\n"
            "print('ESCAPED' if queued > 256 << 20 else 'contained')",
            escaped,
            {"wrong_answer", "memory", "timeout"},
        ),
        "memfds past the limit": (
            "import os\nheld = []\ntry:\n    for _ in range(8):\n        fd = os.memfd_create('x')\n"
            "        os.write(fd, b'x' * (64 << 20))\n        held.append(fd)\nexcept OSError:\n    pass\n"
            "print('ESCAPED' if len(held) * 64 > 256 else 'contained')",
            escaped,
            {"wrong_answer", "memory"},
        ),
        "forked children past the limit": (
            "import os, time\nr, w = os.pipe()\nfor _ in range(14):\n    if os.fork() == 0:\n"
            "        block = b'x' * (100 << 20)\n        os.write(w, b'.')\n        time.sleep(30)\n"
            "        os._exit(0)\nos.close(w)\ngot = b''\nwhile len(got) < 14:\n    chunk = os.read(r, 14)\n"
            "    if not chunk:\n        break\n    got += chunk\nprint('ESCAPED' if len(got) >= 14 else 'contained')",
            escaped,
            {"memory", "timeout"},  # on a busy machine the children may not reach the limit within 1 s
        ),
        "socket families beyond Unix": (
            "import socket\nmade = []\nfor family, kind in ((40, 1), (16, 3), (17, 3), (2, 1), (10, 2)):\n"
            "    try:\n        socket.socket(family, kind)\n        made.append(family)\n    except OSError:\n"
            "        pass\nprint('ESCAPED' if made else 'contained')",
            escaped,
            {"wrong_answer"},
        ),
        "io_uring, userfaultfd, ptrace, namespaces, mount": (
            SYSCALLS + "opened = []\nparams = ctypes.create_string_buffer(120)\n"
            "if libc.syscall(IO_URING_SETUP, 8, params) >= 0:\n    opened.append('io_uring')\n"
            "if libc.syscall(USERFAULTFD, 0) >= 0:\n    opened.append('userfaultfd')\n"
            "if libc.ptrace(0, 0, None, None) == 0:\n    opened.append('ptrace')\n"
            "if libc.unshare(0x10000000) == 0:\n    opened.append('user namespace')\n"
            "if libc.mount(b'none', b'/sandbox', b'tmpfs', 0, None) == 0:\n    opened.append('mount')\n"
            "print('ESCAPED' if opened else 'contained')",
            escaped,
            {"wrong_answer"},
        ),
        "site-packages in the view": (
            f"import os\nseen = [p for p in {sandbox._hidden_paths()!r} if os.path.isdir(p) and os.listdir(p)]\n"
            f"print('ESCAPED' if seen else 'contained')",
            escaped,
            {"wrong_answer"},
        ),
    }


def sandbox_processes(pool) -> list[str]:
    """Every process on the machine running as one of the pool's users."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(line for line in status.read_text().splitlines() if line.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if sandbox.UID_BASE <= uid < sandbox.UID_BASE + 256:
            found.append(status.parent.name)
    return found


# Grades as an unprivileged user, in a process of its own: the programs, problems, limits and workers on
# stdin; the grades and the user's processes still alive after the pool closed on stdout.
USER_RUNNER = r"""
import json, os, sys, time
from pathlib import Path
from grading import sandbox
job = json.load(sys.stdin)
limits = sandbox.Limits(**job["limits"])
grades = sandbox.grade(job["programs"], job["problems"], limits=limits, workers=job["workers"])
sandbox.close()
def alive():
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            uid = int(next(l for l in status.read_text().splitlines() if l.startswith("Uid:")).split()[1])
        except (OSError, StopIteration):
            continue
        if uid == os.getuid() and int(status.parent.name) != os.getpid():
            found.append(status.parent.name)
    return found
deadline = time.monotonic() + 3
while alive() and time.monotonic() < deadline:
    time.sleep(0.05)
print(json.dumps({"grades": [vars(g) for g in grades], "alive": alive()}))
"""
USER = 65534


@functools.cache
def as_user() -> list[str] | str:
    """The command that runs this project's python as an unprivileged user, or why there is none."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        return "dropping to an unprivileged user needs root and setpriv"
    drop = ["setpriv", "--reuid", str(USER), "--regid", str(USER), "--clear-groups"]
    if subprocess.run([*drop, "unshare", "-Ur", "true"], capture_output=True).returncode != 0:
        return "this kernel forbids unprivileged user namespaces (unshare -Ur fails)"
    import pyseccomp

    path = f"PYTHONPATH={REPO}:{Path(pyseccomp.__file__).parent}"
    probe = "import subprocess, sys; subprocess.run([sys.executable, '-c', 'import ctypes'], check=True)"
    for python in dict.fromkeys([sys.executable, getattr(sys, "_base_executable", ""), "/usr/bin/python3"]):
        command = [*drop, "env", "-i", path, "PATH=/usr/bin:/bin", python]
        if python and subprocess.run([*command, "-c", probe], capture_output=True).returncode == 0:
            return command
    return f"no python here runs as user {USER}"


@pytest.fixture(params=["root", "user"])
def grade_as(request, available, monkeypatch, tmp_path_factory):
    """sandbox.grade as root (a fresh pool) or as an unprivileged user (supervisors in user namespaces):
    (grades, processes of the sandbox still alive once the pool closed). A user run counts every process of
    its uid, which the suite's other workers' user runs share: they take turns, under a lock."""
    if request.param == "user" and isinstance(as_user(), str):
        pytest.skip(as_user())

    def grade(programs, problems, limits=HOSTILE_LIMITS, workers=2, env=None):
        if request.param == "user":
            job = {"programs": programs, "problems": problems, "limits": asdict(limits), "workers": workers}
            command = [*as_user()[:-1], *(f"{k}={v}" for k, v in (env or {}).items()), as_user()[-1]]
            with open(workers_root(tmp_path_factory) / "sandbox-user.lock", "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                done = subprocess.run(
                    [*command, "-c", USER_RUNNER],
                    input=json.dumps(job),
                    capture_output=True,
                    text=True,
                    cwd="/",
                    timeout=300,
                )
            assert done.returncode == 0, done.stderr[-3000:]
            out = json.loads(done.stdout)
            return [sandbox.Grade(**g) for g in out["grades"]], out["alive"]
        for key, value in (env or {}).items():
            monkeypatch.setenv(key, value)
        pool = sandbox._new_pool()  # started with this environment
        monkeypatch.setattr(sandbox, "_POOL", pool)
        try:
            grades = sandbox.grade(programs, problems, limits=limits, workers=workers)
            deadline = time.monotonic() + 2  # SIGKILLed, its processes take a moment to be reaped
            while sandbox_processes(pool) and time.monotonic() < deadline:
                time.sleep(0.05)
            return grades, sandbox_processes(pool)
        finally:
            pool.close()

    grade.mode = request.param
    return grade


def test_hostile_programs_are_contained(grade_as, tmp_path, capsys):
    victim, secret_file = tmp_path / "victim.txt", tmp_path / "secret.txt"
    victim.write_text("untouched")
    secret_file.write_text(SECRET)
    secret_file.chmod(0o644)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    listener.settimeout(0)
    programs = hostile_programs(victim, secret_file, listener.getsockname()[1])
    started = time.monotonic()
    try:
        grades, alive = grade_as(
            [p for p, _, _ in programs.values()],
            [q for _, q, _ in programs.values()],
            env={"SANDBOX_TEST_SECRET": SECRET},
        )
        elapsed = time.monotonic() - started
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
    finally:
        listener.close()
    for name, grade in zip(programs, grades):
        assert grade.passed == 0 and grade.reason in programs[name][2], (name, grade)
        assert grade.seconds < HOSTILE_LIMITS.timeout + 3, (name, grade)
    assert victim.read_text() == "untouched"
    for path in (
        REPO / "pwned-sandbox",
        REPO / "pwned-system",
        Path.home() / "pwned-sandbox",
        Path.home() / "pwned-system",
    ):
        assert not path.exists(), path
    assert alive == []  # the fork bomb's and the threads' processes are gone
    for name in (b"planted", b"sandbox-state"):
        assert not host_has_key(name), name
    worst = max(zip(grades, programs), key=lambda pair: pair[0].seconds)
    with capsys.disabled():
        print(
            f"\n{len(programs)} hostile programs graded 0 as {grade_as.mode} in {elapsed:.1f} s on 2 workers; "
            f"slowest: {worst[1]} ({worst[0].seconds:.2f} s, {worst[0].reason})"
        )


def test_memory_past_the_limit_is_stopped_at_the_limit(grade_as):
    """The tracker's four ways past an address-space limit, at 128 MB with time to spare: kernel objects are
    refused (seccomp), and forked children together are killed at the run's limit (cgroup, else the
    supervisor's watch), graded "memory"."""
    names = ("SysV shared memory past the limit", "message queues past the limit", "memfds past the limit")
    programs = [kernel_state_programs()[name][0] for name in (*names, "forked children past the limit")]
    limits = Limits(timeout=20.0, memory_bytes=128 << 20, output_bytes=1 << 20, disk_bytes=4 << 20)
    grades, alive = grade_as(programs, [ESCAPED] * 4, limits=limits)
    assert [g.reason for g in grades] == ["wrong_answer"] * 3 + ["memory"], grades
    assert alive == []


ESCAPED = {"tests": [{"input": "", "output": "ESCAPED"}]}


def host_has_key(name: bytes) -> bool:
    """Whether this process's session or user keyring holds a "user" key of that name."""
    import ctypes
    import platform

    keyctl = {"x86_64": 250, "aarch64": 219}[platform.machine()]
    libc = ctypes.CDLL(None, use_errno=True)
    return any(libc.syscall(keyctl, 10, ring, b"user", name, 0) >= 0 for ring in (-3, -4))  # KEYCTL_SEARCH


STATEFUL = SYSCALLS + (
    "import os\nfound = os.path.exists('/sandbox/state') or os.path.exists('/tmp/state') or any(\n"
    "    libc.syscall(KEYCTL, 10, ring, b'user', b'sandbox-state', 0) >= 0 for ring in (-3, -4, -5))\n"
    "open('/sandbox/state', 'w').write('x')\n"
    "for ring in (-3, -4, -5):\n    libc.syscall(ADD_KEY, b'user', b'sandbox-state', b'x', 1, ring)\n"
    "print('ESCAPED' if found else 'fresh')"
)


def test_state_of_one_run_is_invisible_to_the_next_test_and_program(grade_as):
    """A file, a key in any keyring: whatever a run leaves, the next test and the next program on the same
    supervisor (one worker) start without it, and the host's keyrings never see it."""
    problem = {"tests": [{"input": "", "output": "fresh"}] * 3}
    grades, alive = grade_as([STATEFUL] * 3, [problem] * 3, workers=1)
    assert [(g.passed, g.reason) for g in grades] == [(3, None)] * 3, grades
    assert not host_has_key(b"sandbox-state") and alive == []


def test_a_run_at_its_memory_limit_leaves_the_next_run_its_whole_limit(grade_as):
    """Each run is counted from zero: after a program killed at the memory limit, programs that each hold
    most of it (a touched block and a file in their tmpfs), one after another on one supervisor, pass."""
    bomb = "blocks = []\nwhile True:\n    blocks.append(b'x' * (1 << 24))"
    fill = (
        "block = b'x' * (96 << 20)\nwith open('/sandbox/file', 'wb') as f:\n    f.write(b'y' * (8 << 20))\nprint('ok')"
    )
    limits = Limits(timeout=10.0, memory_bytes=160 << 20, output_bytes=16 << 20, disk_bytes=12 << 20)
    problems = [ESCAPED] + [{"tests": [{"input": "", "output": "ok"}] * 2}] * 2
    grades, alive = grade_as([bomb, fill, fill], problems, limits=limits, workers=1)
    assert [(g.passed, g.reason) for g in grades] == [(0, "memory"), (2, None), (2, None)], grades
    assert alive == []


def test_runs_made_ahead_leave_no_cgroup_behind(available, monkeypatch):
    """Every supervisor keeps its next run ready, its cgroup made and joined; retiring the supervisor removes
    that cgroup too."""
    layout = sandbox.cgroup_layout()
    if layout is None:
        pytest.skip("this process may not make cgroups here: runs are watched instead")
    pool = sandbox._new_pool()
    monkeypatch.setattr(sandbox, "_POOL", pool)

    def cgroups(names: list[str]) -> list[Path]:
        return [path for folder in set(layout[1].values()) for name in names for path in Path(folder).glob(f"{name}-*")]

    try:
        sandbox.grade([ADD] * 2, [STDIO] * 2, workers=2)
        names = [os.path.basename(worker.state[0]) for worker in pool.idle]  # each supervisor's mount point
        assert len(names) == 2 and cgroups(names), "no run was made ahead"
    finally:
        pool.close()
    assert cgroups(names) == []


def test_a_call_kept_alive_by_writing_its_results_file_times_out(grade_as):
    """A call's time runs on the supervisor's clock, from its go to its result: a thread that writes fd 3
    (or truncates it) while the call sleeps gains nothing."""
    keep_alive = (
        "import os, threading, time\ndef touch():\n    while True:\n        for data in (b' ', b'  '):\n"
        "            try:\n                os.write(3, data)\n                os.ftruncate(3, 0)\n"
        "            except OSError:\n                pass\n            time.sleep(0.05)\n"
        "threading.Thread(target=touch, daemon=True).start()\n"
        "def f(x):\n    time.sleep(4)\n    return x"
    )
    problem = {"style": "call", "fn_name": "f", "tests": [{"input": [1], "output": 1}] * 2}
    (g,), _ = grade_as([keep_alive], [problem], limits=Limits(timeout=1.0))
    assert (g.passed, g.reason, g.failed_test) == (0, "timeout", 0) and g.seconds < 3, g


def test_hostile_results_are_graded_and_the_batch_kept(grade_as):
    """Whatever a call returns or writes is a verdict for that program; the honest programs of the same
    batch keep their grades."""
    honest = "def f(x):\n    return x"
    hostile = {
        "nested 990 deep": (
            "def f(x):\n    v = []\n    for _ in range(990):\n        v = [v]\n    return v",
            {"wrong_answer", "runtime_error"},
        ),
        "brackets on fd 3": (
            "import os\ndef f(x):\n    os.write(3, b'[' * 100000 + b'\\n')\n    return x",
            {"wrong_answer"},
        ),
        "bytes that are not UTF-8": (
            "import os\ndef f(x):\n    os.write(3, b'\\xff\\xfe{\"ok\": 1}\\n')\n    return x",
            {"wrong_answer"},
        ),
        "a result past the output limit": ("def f(x):\n    return 'x' * (2 << 20)", {"output_limit"}),
        "not a number": ("def f(x):\n    return float('nan')", {"wrong_answer"}),
        "an int too long for JSON": ("def f(x):\n    return 10 ** 5000", {"runtime_error"}),
        "a lone surrogate": ("def f(x):\n    return '\\ud800'", {"wrong_answer"}),
    }
    problem = {"style": "call", "fn_name": "f", "tests": [{"input": [1], "output": 1}, {"input": [2], "output": 2}]}
    programs = [honest] + [p for p, _ in hostile.values()] + [honest]
    grades, _ = grade_as(programs, [problem] * len(programs))
    assert (grades[0].passed, grades[0].reason) == (2, None) and (grades[-1].passed, grades[-1].reason) == (2, None)
    for name, grade in zip(hostile, grades[1:-1]):
        assert grade.passed == 0 and grade.reason in hostile[name][1], (name, grade)


def test_a_failing_supervisor_is_retired_and_the_batch_kept(available, monkeypatch):
    """A supervisor that dies mid-batch, or reports a failure, is replaced; its program is graded, with a
    warning, and the rest of the batch keeps its grades."""
    pool = sandbox._new_pool()
    monkeypatch.setattr(sandbox, "_POOL", pool)
    try:
        sandbox.grade([ADD, ADD], [STDIO] * 2, workers=2)
        first = list(pool.idle)
        killer = threading.Timer(0.5, lambda: [w.proc.kill() for w in first])
        killer.start()
        with pytest.warns(UserWarning, match="supervisor died"):
            grades = sandbox.grade(["import time; time.sleep(5)"] * 2 + [ADD] * 3, [STDIO] * 5, workers=2)
        assert [g.reason for g in grades] == ["runtime_error"] * 2 + [None] * 3
        assert not set(first) & set(pool.idle)
        with pytest.warns(UserWarning, match="supervisor failed"):
            (g,) = sandbox.grade([ADD], [STDIO], limits=Limits(processes=1e30), workers=1)  # pids.max refuses it
        assert g.reason == "runtime_error"
        assert [g.reason for g in sandbox.grade([ADD], [STDIO], workers=1)] == [None]
    finally:
        pool.close()


def test_a_kernel_without_user_namespaces_is_a_one_line_refusal():
    """Where the kernel refuses a user namespace (here a seccomp filter makes unshare fail as such a kernel
    does), the command line says so in one line and exits 1."""
    if isinstance(as_user(), str):
        pytest.skip(as_user())
    import pyseccomp

    def refuse_unshare():
        rules = pyseccomp.SyscallFilter(pyseccomp.ALLOW)
        rules.add_rule(pyseccomp.ERRNO(1), "unshare")
        rules.load()

    with tempfile.TemporaryDirectory() as folder:  # pytest's own folders are closed to other users
        folder = Path(folder)
        for name, text in (("add.py", ADD), ("tests.json", json.dumps(STDIO["tests"]))):
            (folder / name).write_text(text)
            (folder / name).chmod(0o644)
        folder.chmod(0o755)
        done = subprocess.run(
            [*as_user(), "-m", "grading.sandbox", str(folder / "add.py"), "--tests", str(folder / "tests.json")],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            preexec_fn=refuse_unshare,
        )
    assert done.returncode == 1 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "refuses an unprivileged user namespace" in done.stderr and "Operation not permitted" in done.stderr


def test_extraction_of_a_hostile_megabyte_is_linear():
    """Extraction runs in the trainer with no clock: a megabyte of unclosed fences takes well under a second."""
    import reward

    for completion in (
        "```python\n" * 100_000,
        " ```py x\n" * 110_000,
        "```" * 330_000 + "\n",
        "</think>```\n" * 80_000,
        "```python\n" + "x\n" * 500_000,
    ):
        started = time.perf_counter()
        program = sandbox.extract_program(reward.split_thinking(completion).answer or "")
        assert time.perf_counter() - started < 1.0, completion[:20]
        assert program is None or len(program) <= len(completion)
    assert sandbox.extract_program("```python\nprint(1)\n```\n" + "```python\n" * 100_000) == "print(1)\n"


def test_a_program_past_the_source_limit_is_refused_unrun():
    (g,) = sandbox.grade(["x = 1\n" * sandbox.MAX_PROGRAM_CHARS], [STDIO])
    assert (g.reason, g.seconds) == ("syntax_error", 0.0) and "more than" in g.detail


def test_a_setsid_grandchild_dies_with_the_program(available, monkeypatch):
    """A grandchild that calls setsid leaves the process group, not the pid namespace: it is killed with the
    namespace once the program's verdict is in, gone within a second (the kernel reaps it), long before its
    two-second sleep would let it write its file."""
    pool = sandbox._new_pool()
    monkeypatch.setattr(sandbox, "_POOL", pool)
    program = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(2)\n        open('/sandbox/late', 'w').write('x')\n    os._exit(0)\nprint(7)"
    )
    try:
        (g,) = sandbox.grade([program], [{"tests": [{"input": "", "output": "7"}]}], workers=1)
        verdict = time.monotonic()
        assert g.reason is None
        while sandbox_processes(pool) and time.monotonic() - verdict < 1.0:
            time.sleep(0.01)
        assert sandbox_processes(pool) == [], "alive a second after the verdict"
    finally:
        pool.close()
    assert sandbox_processes(pool) == []
