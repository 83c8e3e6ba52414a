"""Tests for sandbox.py: extraction, comparison, both test styles, limits, the pool, the command line, and
programs that try to get out or take the machine down."""

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

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
    grades = []
    assert sandbox.reward(completions, [STDIO] * 3, grades=grades) == [1.0, 0.0, 0.0]
    assert sandbox.reward(completions, [STDIO] * 3, fraction=True) == [1.0, 0.0, 0.5]
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
    grades = []
    assert scoring.verdicts(completions, [problem] * 3, grades=grades) == [0.0, 1.0, 0.0]
    assert scoring.verdicts([program], [problem]) == [1.0]
    assert scoring.verdicts([program], [problem], open_thought=True, grades=grades) == [0.0]  # all of it thought
    assert [g.reason for g in grades] == ["no_code_block", None, "no_code_block", "no_code_block"]
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


def test_command_line_malformed_tests_files_exit_2_with_one_line(tmp_path):
    (tmp_path / "add.py").write_text(ADD)
    (tmp_path / "good.json").write_text(json.dumps(STDIO["tests"]))
    for i, (text, message) in enumerate(MALFORMED_TESTS_FILES):
        (tmp_path / f"{i}.json").write_text(text)
        done = cli(str(tmp_path / "add.py"), "--tests", str(tmp_path / f"{i}.json"))
        assert done.returncode == 2 and len(done.stderr.splitlines()) == 1, (text[:80], done.stderr[-500:])
        assert message in done.stderr and done.stderr.startswith("sandbox.py: "), (text[:80], done.stderr)
    for args, message in [
        (["missing.py", "--tests", str(tmp_path / "0.json")], "missing.py"),
        ([str(tmp_path / "add.py")], "--tests"),
        ([str(tmp_path / "add.py"), "--tests", str(tmp_path / "good.json"), "--tolerance", "inf"], "finite"),
    ]:
        done = cli(*args)
        assert done.returncode == 2 and message in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr


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
        "fill the disk": (
            "import os\nwritten = 0\ntry:\n    for i in range(10 ** 6):\n"
            "        with open(f'f{i}', 'wb') as f:\n            f.write(b'x' * (1 << 20))\n"
            "        written += 1 << 20\nexcept OSError:\n    pass\n"
            "print('ESCAPED' if written > 64 << 20 else 'contained')",
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


def test_hostile_programs_are_contained(available, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SANDBOX_TEST_SECRET", SECRET)
    pool = sandbox._new_pool()  # started with the secret in the environment
    monkeypatch.setattr(sandbox, "_POOL", pool)
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
        grades = sandbox.grade(
            [p for p, _, _ in programs.values()], [q for _, q, _ in programs.values()], limits=HOSTILE_LIMITS, workers=2
        )
        elapsed = time.monotonic() - started
        with pytest.raises(BlockingIOError):
            listener.accept()  # nobody connected
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
        assert sandbox_processes(pool) == []  # the fork bomb's and the threads' processes are gone
        assert [g.reason for g in sandbox.grade([ADD], [STDIO], workers=1)] == [None]  # and it still works
    finally:
        listener.close()
        pool.close()
    worst = max(zip(grades, programs), key=lambda pair: pair[0].seconds)
    with capsys.disabled():
        print(
            f"\n{len(programs)} hostile programs graded 0 in {elapsed:.1f} s on 2 workers; slowest: "
            f"{worst[1]} ({worst[0].seconds:.2f} s, {worst[0].reason})"
        )


def test_a_setsid_grandchild_dies_with_the_program(available, monkeypatch):
    """A grandchild that calls setsid leaves the process group, not the pid namespace: it is gone as soon as
    the program's verdict is in, and it never writes its file."""
    pool = sandbox._new_pool()
    monkeypatch.setattr(sandbox, "_POOL", pool)
    program = (
        "import os, time\nif os.fork() == 0:\n    os.setsid()\n    if os.fork() == 0:\n"
        "        time.sleep(2)\n        open('/sandbox/late', 'w').write('x')\n    os._exit(0)\nprint(7)"
    )
    try:
        (g,) = sandbox.grade([program], [{"tests": [{"input": "", "output": "7"}]}], workers=1)
        assert g.reason is None
        assert sandbox_processes(pool) == []
    finally:
        pool.close()
    assert sandbox_processes(pool) == []
