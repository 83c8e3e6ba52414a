"""Running untrusted programs: a code completion graded against its problem's tests, in a sandbox.

A code problem is graded by running the program a completion wrote. The program is the last fenced
Python block of the completion (after the last </think>, when there is one), and it passes a test
when what it produces matches the test's expected output. The reward is 1 when every test passes
(GPPO's binary reward), or the fraction passed (fraction=True); no block, or a syntax error, is 0.

    grades = sandbox.grade([program], [problem])      # problem: {"tests": [...], "style": "stdio", ...}
    rewards = sandbox.reward(completions, problems)   # extraction, grading, one float per completion
    python train.py --dataset code --reward-fn sandbox:code_reward   # the built-in code reward function
    python sandbox.py PROGRAM.py --tests TESTS.json    # one JSON line: passed, total, reason, seconds

Code grading is all here, apart from the math checker (reward.py): the reward function code_reward, and the
step's code metrics (metric_rows, step_metrics: tests passed, why programs failed).

Two test styles. "stdio" (Codeforces, CodeContests, TACO, APPS): the test's input is the program's
standard input, and its standard output must equal the expected output token for token (a float token
within the problem's "tolerance", absolute or relative, when it has one); each test runs in a fresh
process. "call" (LeetCode, HumanEval, the function problems of TACO and LiveCodeBench): the function
"fn_name" (or Solution().fn_name) is called with each test's input as its argument list and must
return the expected output; the tests run one after another in one process.

Nothing a program does reaches the trainer or the machine. Every worker of the pool is a supervisor
process, run as root in a mount and network namespace of its own, where it has built a read-only view
of the file system (the interpreter and system libraries, nothing else). Each run is a fresh process
tree: a fresh pid and IPC namespace whose first process is the program, a fresh size-capped tmpfs as
its working directory, resource limits, a scrubbed environment, an unprivileged user of its own,
stdout and stderr in capped memory files. A run that outlives its time is killed, and with the first
process of a pid namespace dies every process in it, setsid or not. The outputs are compared in the
supervisor, which alone holds the expected outputs: a program cannot see or rewrite its verdict. What
each layer stops, and what none of them does, is in the README ("Code problems").
"""

import argparse
import ctypes
import json
import math
import os
import re
import resource
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping, Sequence

if not __package__:  # run as a file (python grading/sandbox.py): the repository is the folder above
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from grading import pool  # noqa: E402

STYLES = ("stdio", "call")
# why a program failed (its first failing test), in the order a failure is decided
REASONS = ("no_code_block", "syntax_error", "timeout", "output_limit", "memory", "runtime_error", "wrong_answer")
GRACE_S = 10.0  # a supervisor silent this long past a program's total time is replaced
WORK = "/sandbox"  # the program's working directory and home inside the view
PROGRAM = WORK + "/program.py"


@dataclass(frozen=True)
class Limits:
    """What one program may use. Every field is enforced by the kernel or by the supervisor's clock."""

    timeout: float = 2.0  # wall seconds per test (call style: between two results); CPU seconds likewise
    total_timeout: float = 30.0  # wall seconds for all of a program's tests; the rest fail as timeouts
    memory_bytes: int = 1 << 30  # address space (RLIMIT_AS)
    output_bytes: int = 4 << 20  # stdout, stderr and any one file (RLIMIT_FSIZE)
    disk_bytes: int = 16 << 20  # the working directory's tmpfs, all files together
    processes: int = 16  # processes and threads of the program's user (RLIMIT_NPROC)
    open_files: int = 64  # RLIMIT_NOFILE

    def __post_init__(self):
        for f in fields(self):
            value = getattr(self, f.name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"Limits.{f.name} must be a positive number, got {value!r}")


@dataclass
class Grade:
    """One program's result: tests passed of total, and the first failure (reason None: all passed)."""

    passed: int
    total: int
    reason: str | None
    seconds: float  # wall time of grading it, from the job's start to its verdict
    failed_test: int | None = None  # index of the first failing test
    detail: str = ""  # the end of the failing run's stderr, or what failed to parse

    def reward(self, fraction: bool = False) -> float:
        """1.0 when every test passed, else 0.0; with fraction, the share of tests passed."""
        if fraction:
            return self.passed / self.total
        return float(self.reason is None)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the program): a bug or a machine that refuses a layer."""


# ----------------------------------------------------------------------------- extraction

_FENCE_RE = re.compile(r"^[ \t]*```[ \t]*([^\s`]*)[^\n]*\n(.*?)^[ \t]*```[ \t]*$", re.M | re.S)
PYTHON_TAGS = ("python", "python3", "py", "py3")


def extract_program(completion: str) -> str | None:
    """The program of a completion: the last ```python block after the last </think>, else the last
    untagged ``` block (a block in another language, or an output example after the code, is skipped).
    None when there is no closed block, or the block is empty."""
    text = completion.rsplit("</think>", 1)[-1]
    blocks = [(tag.lower(), body) for tag, body in _FENCE_RE.findall(text)]
    tagged = [body for tag, body in blocks if tag in PYTHON_TAGS]
    untagged = [body for tag, body in blocks if not tag]
    program = (tagged or untagged or [""])[-1]
    return program if program.strip() else None


# ----------------------------------------------------------------------------- comparison (in the supervisor)

_NUMBER_RE = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


def same_output(actual: str, expected: str, tolerance: float | None = None) -> bool:
    """Whether stdout matches: the same whitespace-separated tokens; with a tolerance, two numeric tokens
    also match when |a - e| <= tolerance * max(1, |e|) (absolute or relative error, as judges state it)."""
    got, want = actual.split(), expected.split()
    return len(got) == len(want) and all(
        g == w or (tolerance is not None and _close(g, w, tolerance)) for g, w in zip(got, want)
    )


def _close(got: str, want: str, tolerance: float) -> bool:
    if not (_NUMBER_RE.fullmatch(got) and _NUMBER_RE.fullmatch(want)):
        return False
    a, e = float(got), float(want)
    return abs(a - e) <= tolerance * max(1.0, abs(e))


def same_value(actual, expected, tolerance: float | None = None) -> bool:
    """Whether a returned value (read back from JSON, so tuples are lists) equals the expected one; floats
    within the tolerance when the problem has one. A bool is not a number here: True does not equal 1."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        return actual == expected or (
            tolerance is not None and abs(actual - expected) <= tolerance * max(1.0, abs(expected))
        )
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(same_value(a, e, tolerance) for a, e in zip(actual, expected))
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(same_value(actual[k], expected[k], tolerance) for k in actual)
    return type(actual) is type(expected) and actual == expected


# ----------------------------------------------------------------------------- inside the sandbox

# Runs the program inside the sandbox, as its user; nothing here is trusted afterwards. "stdio" runs it as
# __main__. "call" reads every test's arguments first (a program reading stdin then finds it empty), takes
# what it needs from json before the program can patch it, and writes one line per call to fd 3.
_LAUNCHER = r"""
import builtins, sys
style, path, name = sys.argv[1:4]
builtins.exit = builtins.quit = sys.exit  # what site adds; the sandbox's python runs without site
code = compile(open(path).read(), path, "exec")
if style == "stdio":
    sys.argv = [path]
    exec(code, {"__name__": "__main__", "__builtins__": builtins})
else:
    import json, os
    dumps, loads, write, args = json.dumps, json.loads, os.write, sys.stdin.read().splitlines()
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    sys.stdin = open(os.devnull)
    namespace = {"__name__": "solution", "__builtins__": builtins}
    # the names a LeetCode judge provides: starter code says List[int] without importing it
    exec("from typing import *\nfrom collections import *\nfrom heapq import *\nfrom bisect import *\n"
         "from itertools import *\nfrom functools import *\nimport collections, heapq, bisect, itertools, "
         "functools, math, string, re", namespace)
    exec(code, namespace)
    if isinstance(namespace.get("Solution"), type) and hasattr(namespace["Solution"], name):
        function = getattr(namespace["Solution"](), name)
    else:
        function = namespace[name]
    for line in args:
        try:
            text = dumps({"ok": function(*loads(line))})
        except BaseException as error:
            text = dumps({"error": type(error).__name__})
        write(3, (text + "\n").encode())
"""

# The whole environment a program sees. Two malloc arenas: each arena reserves 64 MB of address space, and
# RLIMIT_AS counts reservations, so a program with a few threads would otherwise run out of memory it never used.
ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": WORK,
    "TMPDIR": WORK,
    "LANG": "C.UTF-8",
    "LC_ALL": "C.UTF-8",
    "MALLOC_ARENA_MAX": "2",
}


# ----------------------------------------------------------------------------- the supervisor (root)

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS = 1, 38
DEVICES = ("null", "zero", "random", "urandom")
FD_BASE = 100  # a run's memory files and pipes are moved here, clear of the 0-3 they become in the program

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {source} on {target}"
    )


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def _prctl(option: int, value: int) -> None:
    _check(_libc.prctl(option, value, 0, 0, 0), f"prctl({option}, {value})")


def _bind_read_only(source: str, target: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)  # a bind takes its flags on remount


def _view_paths() -> list[str]:
    """What the program sees of the machine: system binaries and libraries, and this interpreter's prefix."""
    paths = []
    for path in (
        "/usr",
        "/bin",
        "/sbin",
        "/lib",
        "/lib32",
        "/lib64",
        "/libx32",
        "/etc/ld.so.cache",
        os.path.realpath(sys.base_prefix),
    ):
        if os.path.lexists(path) and not any(path == p or path.startswith(p + "/") for p in paths):
            paths.append(path)
    return paths


def _build_view(root: str) -> None:
    """Private mount and network namespaces, and in them a read-only root at `root`: a 1 MB tmpfs holding
    the view's paths (bound read-only, no setuid), four devices, and the mount point of the working
    directory. Nothing is mounted before "/" is private, so no mount reaches the machine's table."""
    _unshare(CLONE_NEWNS | CLONE_NEWNET)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=4096,mode=755")
    for path in _view_paths():
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):  # /lib -> usr/lib on a merged-/usr system
            os.symlink(os.readlink(path), target)
        elif os.path.isdir(path):
            os.mkdir(target)
            _bind_read_only(path, target)
        else:
            open(target, "w").close()
            _bind_read_only(path, target)
    os.mkdir(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _bind_read_only(f"/dev/{name}", f"{root}/dev/{name}", MS_NOSUID)
    os.mkdir(root + WORK)
    os.symlink(WORK, root + "/tmp")
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _supervise(root: str, uid: int, parent: int, python: str) -> None:
    """A supervisor's life: build the view, then one job (a JSON frame) -> one JSON frame, until stdin closes."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the grader died before the line above took effect
        return
    try:
        _build_view(root)
    except OSError as error:
        pool.announce(f"cannot build the sandbox's view ({error})".encode())
        return

    def grade_one(frame: bytes) -> bytes:
        started = time.monotonic()
        try:
            result = _grade_job(json.loads(frame), root, uid, python)
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        return json.dumps({**result, "seconds": time.monotonic() - started}).encode()

    pool.serve(grade_one)


def _grade_job(job: dict, root: str, uid: int, python: str) -> dict:
    """Every test of one program, in order: stdio tests one run each, call tests one run for all. Runs stop
    after a timeout (a program too slow once is too slow again, and each costs the full limit) and when
    the program's total time is spent; the tests not run count as failed."""
    limits, tests = Limits(**job["limits"]), job["tests"]
    started = time.monotonic()
    end = started + limits.total_timeout
    try:
        compile(job["source"], PROGRAM, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        return {"verdicts": ["syntax_error"] * len(tests), "detail": f"{type(error).__name__}: {error}"[:500]}
    if job["style"] == "call":
        return _run(job, tests, root, uid, python, limits, end)
    verdicts, detail = [], ""
    for test in tests:
        if verdicts and verdicts[-1] == "timeout" or time.monotonic() >= end:
            verdicts.append("timeout")
            continue
        run = _run(job, [test], root, uid, python, limits, end)
        verdicts += run["verdicts"]
        detail = detail or run["detail"]
    return {"verdicts": verdicts, "detail": detail}


def _run(job: dict, tests: list[dict], root: str, uid: int, python: str, limits: Limits, end: float) -> dict:
    """One run of the program in a fresh process tree, from a forked child (namespaces apply to a process
    and its children); returns {"verdicts": [reason or None per test], "detail": stderr's end}."""
    report_r, report_w = os.pipe()
    child = os.fork()
    if child == 0:
        code = 1
        try:
            os.close(report_r)
            result, code = _run_in_child(job, tests, root, uid, python, limits, end), 0
        except BaseException as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        finally:  # never back into the supervisor's loop
            try:
                with os.fdopen(report_w, "w") as report:
                    report.write(json.dumps(result))
            finally:
                os._exit(code)
    os.close(report_w)
    with os.fdopen(report_r) as report:
        text = report.read()
    os.waitpid(child, 0)
    result = json.loads(text) if text else {"error": "the run's supervisor died without a report"}
    if "error" in result:
        raise SandboxError(result["error"])
    return result


def _run_in_child(job: dict, tests: list[dict], root: str, uid: int, python: str, limits: Limits, end: float) -> dict:
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC)
    _mount(
        "tmpfs",
        root + WORK,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={limits.disk_bytes},nr_inodes=1024,mode=700,uid={uid},gid={uid}",
    )
    with open(root + PROGRAM, "w") as f:
        f.write(job["source"])
    call = job["style"] == "call"
    stdin = "".join(json.dumps(t["input"]) + "\n" for t in tests) if call else tests[0]["input"]
    files = [_memory_file(name, FD_BASE + i) for i, name in enumerate(("stdin", "stdout", "stderr", "results"))]
    _write_all(files[0], stdin.encode())
    os.lseek(files[0], 0, os.SEEK_SET)
    exec_r, exec_w = os.pipe()  # the program's side closes at exec (O_CLOEXEC) or reports why it could not
    life_r, life_w = os.pipe()  # open while this process lives
    os.dup2(exec_w, FD_BASE + 4, inheritable=False)
    os.dup2(life_r, FD_BASE + 5, inheritable=False)
    cpu = max(1, math.ceil(min(limits.timeout * len(tests), limits.total_timeout)))
    argv = [python, "-I", "-S", "-B", "-c", _LAUNCHER, job["style"], PROGRAM, job.get("fn_name") or ""]
    pid = os.fork()
    if pid == 0:
        _exec_program(root, uid, limits, cpu, argv)
    os.close(exec_w)
    os.close(FD_BASE + 4)
    failure = os.read(exec_r, 4096)
    if failure:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise SandboxError(f"the program could not start: {failure.decode(errors='replace')}")
    status, usage, timed_out = _wait(pid, files[3] if call else None, limits.timeout, end)
    stdout, stderr = _read(files[1], limits.output_bytes), _read(files[2], limits.output_bytes)
    ended = _ended(status, usage, timed_out, cpu, stdout, stderr, limits)
    detail = stderr[-300:].decode(errors="replace")
    if not call:
        if ended is None and not same_output(stdout.decode(errors="replace"), tests[0]["output"], job["tolerance"]):
            ended = "wrong_answer"
        return {"verdicts": [ended], "detail": detail}
    lines = _read(files[3], limits.output_bytes).decode(errors="replace").splitlines()
    verdicts = [_call_verdict(line, test["output"], job["tolerance"]) for line, test in zip(lines, tests)]
    verdicts += [ended or "runtime_error"] * (len(tests) - len(verdicts))  # the calls that never returned
    return {"verdicts": verdicts, "detail": detail}


def _memory_file(name: str, fd: int) -> int:
    """A memory file at a fixed descriptor: outside every file system the program can see."""
    temporary = os.memfd_create(name)
    os.dup2(temporary, fd, inheritable=False)
    os.close(temporary)
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _exec_program(root: str, uid: int, limits: Limits, cpu: int, argv: list[str]) -> None:
    """The program's process, pid 1 of its namespace: enter the view, take the run's files as fds 0-3,
    set the limits, drop to the run's user, exec. Anything failing is reported on the exec pipe."""
    report = FD_BASE + 4
    try:
        os.chroot(root)
        os.chdir(WORK)
        for target in range(4):
            os.dup2(FD_BASE + target, target)
        os.closerange(4, report)
        os.closerange(FD_BASE + 6, 1 << 16)
        for which, value in (
            (resource.RLIMIT_CPU, cpu),
            (resource.RLIMIT_AS, limits.memory_bytes),
            (resource.RLIMIT_FSIZE, limits.output_bytes),
            (resource.RLIMIT_NPROC, limits.processes),
            (resource.RLIMIT_NOFILE, limits.open_files),
            (resource.RLIMIT_CORE, 0),
            (resource.RLIMIT_MSGQUEUE, 0),
            (resource.RLIMIT_MEMLOCK, 0),
        ):
            resource.setrlimit(which, (value, value))  # soft = hard: at the CPU limit SIGKILL, not SIGXCPU
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        if select.select([FD_BASE + 5], [], [], 0)[0]:  # the lifeline reads EOF: the run's supervisor died
            os._exit(1)
        os.execve(argv[0], argv, ENV)
    except BaseException as error:
        try:
            os.write(report, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)


def _wait(pid: int, results: int | None, timeout: float, end: float) -> tuple[int, resource.struct_rusage, bool]:
    """Wait for the program, killing it once `timeout` passes without progress or at `end`. Progress is a new
    result line (call style); a stdio run has none, so its limit is plain wall time."""
    pidfd = os.pidfd_open(pid)
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    last, size, timed_out = time.monotonic(), 0, False
    while True:
        now = time.monotonic()
        deadline = min(end, last + timeout)
        if now >= deadline:
            os.kill(pid, signal.SIGKILL)  # pid 1 of its namespace: every process in it dies with it
            timed_out = True
            break
        wait = deadline - now if results is None else min(deadline - now, 0.05)
        if poller.poll(math.ceil(wait * 1000)):
            break
        if results is not None and (grown := os.fstat(results).st_size) != size:
            size, last = grown, time.monotonic()
    os.close(pidfd)
    _, status, usage = os.wait4(pid, 0)
    return status, usage, timed_out


def _read(fd: int, limit: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(1 << 20, limit - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _ended(status: int, usage, timed_out: bool, cpu: int, stdout: bytes, stderr: bytes, limits: Limits) -> str | None:
    """Why a run failed, from how it ended (None: it exited 0 within every limit)."""
    if timed_out:
        return "timeout"
    if len(stdout) >= limits.output_bytes or len(stderr) >= limits.output_bytes:
        return "output_limit"
    if os.WIFSIGNALED(status):
        used = usage.ru_utime + usage.ru_stime
        return (
            "timeout"
            if os.WTERMSIG(status) in (signal.SIGKILL, signal.SIGXCPU) and used >= cpu - 0.1
            else "runtime_error"
        )
    if os.WEXITSTATUS(status) != 0:
        return "memory" if b"MemoryError" in stderr[-2000:] else "runtime_error"
    return None


def _call_verdict(line: str, expected, tolerance: float | None) -> str | None:
    try:
        result = json.loads(line)
    except ValueError:
        return "wrong_answer"
    if not isinstance(result, dict) or not ("ok" in result or "error" in result):
        return "wrong_answer"
    if "error" in result:
        return "memory" if result["error"] == "MemoryError" else "runtime_error"
    return None if same_value(result["ok"], expected, tolerance) else "wrong_answer"


# ----------------------------------------------------------------------------- the pool (the grader's side)


class SandboxUnavailable(SandboxError):
    """This machine cannot isolate programs (not root, or namespaces refused)."""


# A user of its own per supervisor: RLIMIT_NPROC counts a user's processes machine-wide, so two running
# programs must never share one. The block depends on this process, so several trainers on one machine draw
# different users; every pool of this process draws from it.
UID_BASE = 3_000_000_000 + (os.getpid() % 1_000_000) * 256
_free_uids = list(range(UID_BASE, UID_BASE + 256))
_ROOT = str(Path(__file__).resolve().parent.parent)
_KILL = shutil.which("kill") or "/bin/kill"


def _launch() -> pool.Launch:
    """A supervisor: `python -I -S` with an empty environment, its user and its (empty) mount point."""
    if os.geteuid() != 0:
        raise SandboxUnavailable(
            "sandbox.py runs programs only as root: it builds namespaces and runs each "
            "program as a user of its own (run the trainer as root, e.g. in a container)"
        )
    root, uid = tempfile.mkdtemp(prefix="sandbox-"), _free_uids.pop()
    code = (
        f"import sys; sys.path.insert(0, {_ROOT!r}); from grading import sandbox; "
        f"sandbox._supervise({root!r}, {uid}, {os.getpid()}, {_interpreter()!r})"
    )
    return pool.Launch([sys.executable, "-I", "-S", "-c", code], env={}, state=(root, uid))


def _cleanup(state: tuple[str, int]) -> None:
    """After a supervisor is killed: kill every process left under its user, drop its (empty) mount point."""
    root, uid = state
    # kill(-1) as that user reaches every process it owns, in any pid namespace, and nothing else
    subprocess.run(
        [_KILL, "-9", "--", "-1"],
        user=uid,
        group=uid,
        extra_groups=[],
        env={},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    )
    try:
        os.rmdir(root)  # its mounts lived in its own namespace: here it is an empty folder
    except OSError as error:
        warnings.warn(f"could not remove the sandbox mount point {root}: {error}")
    _free_uids.append(uid)


def _new_pool() -> pool.Pool:
    """Supervisors, one per worker; one that misses a deadline or dies is replaced, and whatever ran under
    its user is killed."""
    return pool.Pool(_launch, cleanup=_cleanup, keep_log=True, new_session=True)


def _interpreter() -> str:
    """The programs' python: this interpreter's base installation, inside the view (not a virtualenv)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


_POOL = _new_pool()


def _run_jobs(jobs: list[dict], workers: int) -> list[dict]:
    """Each job's result from a supervisor: {"verdicts", "detail", "seconds"}."""
    frames = [json.dumps(job).encode() for job in jobs]
    timeouts = [job["limits"]["total_timeout"] + GRACE_S for job in jobs]
    try:
        replies = _POOL.map(frames, timeouts, workers)
    except pool.StartError as error:
        raise SandboxUnavailable(f"the sandbox cannot start here: {error}") from None
    results = []
    for job, reply, timeout in zip(jobs, replies, timeouts):
        if isinstance(reply, pool.Failure) and reply.kind == "died":
            raise SandboxError(f"a sandbox supervisor died ({reply.log})")
        if isinstance(reply, pool.Failure):
            warnings.warn("a sandbox supervisor missed its deadline; the program is graded as a timeout")
            result = {"verdicts": ["timeout"] * len(job["tests"]), "detail": "missed its deadline", "seconds": timeout}
        else:
            result = json.loads(reply)
            if "error" in result:
                raise SandboxError(f"the sandbox failed: {result['error']}")
        results.append(result)
    return results


# ----------------------------------------------------------------------------- public API


def grade(
    programs: Sequence[str | None],
    problems: Sequence[Mapping],
    *,
    limits: Limits = Limits(),
    workers: int | None = None,
) -> list[Grade]:
    """Grade each program against its problem's tests, `workers` programs at a time (default: one per CPU).

    A problem is {"tests": [{"input", "output"}, ...], "style": "stdio" or "call", "fn_name" (call style),
    "tolerance" (optional)}, as data/prepare.py writes code problems. A program of None (no code block) is
    graded without running. Raises SandboxUnavailable where programs cannot be isolated, ValueError for a
    malformed problem; never raises for anything a program does.
    """
    from data.code_layouts import check_code_problem

    if len(programs) != len(problems):
        raise ValueError(f"programs and problems differ in length: {len(programs)} vs {len(problems)}")
    for i, problem in enumerate(problems):
        check_code_problem(problem, f"problems[{i}]")
    jobs = [
        {
            "source": program,
            "tests": problem["tests"],
            "style": problem.get("style", "stdio"),
            "fn_name": problem.get("fn_name"),
            "tolerance": problem.get("tolerance"),
            "limits": asdict(limits),
        }
        for program, problem in zip(programs, problems)
        if program is not None
    ]
    ran = iter(_run_jobs(jobs, workers or os.cpu_count() or 1) if jobs else [])
    grades = []
    for program, problem in zip(programs, problems):
        total = len(problem["tests"])
        if program is None:
            grades.append(Grade(0, total, "no_code_block", 0.0, 0))
            continue
        result = next(ran)
        verdicts = result["verdicts"]
        failed = next((i for i, verdict in enumerate(verdicts) if verdict is not None), None)
        grades.append(
            Grade(
                verdicts.count(None),
                total,
                None if failed is None else verdicts[failed],
                result["seconds"],
                failed,
                result["detail"] if failed is not None else "",
            )
        )
    return grades


def reward(
    completions: Sequence[str],
    problems: Sequence[Mapping],
    *,
    fraction: bool = False,
    limits: Limits = Limits(),
    workers: int | None = None,
    grades: list | None = None,
) -> list[float]:
    """Per completion: 1.0 when its program passes every test of its problem (fraction: the share passed).
    `grades`, a list, receives each completion's Grade (for metrics: reasons, tests passed, seconds)."""
    graded = grade([extract_program(c) for c in completions], problems, limits=limits, workers=workers)
    if grades is not None:
        grades.extend(graded)
    return [g.reward(fraction) for g in graded]


def code_reward(
    completions: list[str],
    tests: list | None = None,
    task: list[str | None] | None = None,
    style: list[str | None] | None = None,
    fn_name: list[str | None] | None = None,
    tolerance: list[float | None] | None = None,
    open_thought: list[bool] | None = None,
    **columns,
) -> list[float | None]:
    """The built-in reward of code problems as a reward function (TRL's signature, see scoring.py): per
    completion 1.0 when the program of its answer part (after its thought, reward.split_thinking) passes
    every test of its row's problem, else 0.0; None on a row that is not a code problem (task "code"), which
    reward.math_reward grades. train.py grades its code rows once itself, with --code-reward and
    --code-timeout (scoring.verdicts), and hands the values over."""
    import reward as math_checker  # split_thinking: one reading of a thought for every grader

    mine = [i for i in range(len(completions)) if task and task[i] == "code"]
    problems = [
        {
            "tests": tests[i],
            "style": (style and style[i]) or "stdio",
            "fn_name": fn_name and fn_name[i],
            "tolerance": tolerance and tolerance[i],
        }
        for i in mine
    ]
    opened = bool(open_thought and open_thought[0])
    answers = [math_checker.split_thinking(completions[i], opened).answer or "" for i in mine]  # "": no program
    values: list[float | None] = [None] * len(completions)
    for i, value in zip(mine, reward(answers, problems)):
        values[i] = value
    return values


def metric_rows(grades: Sequence[Grade | None]) -> list[list[float]]:
    """Per completion, what its step's code metrics average: [is a code problem, share of tests passed, a
    one-hot of REASONS for why it failed]; a math row (grade None) is all zeros."""
    rows = [[0.0] * (2 + len(REASONS)) for _ in grades]
    for row, grade in zip(rows, grades):
        if grade is not None:
            row[:2] = [1.0, grade.passed / grade.total]
            if grade.reason is not None:
                row[2 + REASONS.index(grade.reason)] = 1.0
    return rows


def step_metrics(rows) -> dict:
    """A step's metric_rows (a tensor [N, 2 + reasons], every rank's) as metrics: the share of tests passed
    and, for each reason, the share of code completions that failed for it (code_no_code_block,
    code_timeout, ...); none in a step without code."""
    code = rows[rows[:, 0] == 1]
    if not len(code):
        return {}
    return {
        "code_tests_passed": float(code[:, 1].mean()),
        **{f"code_{reason}": float(code[:, 2 + i].mean()) for i, reason in enumerate(REASONS)},
    }


def close() -> None:
    """Stop the pool's supervisors now (they also stop when this process exits)."""
    _POOL.close()


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    """python sandbox.py PROGRAM.py --tests TESTS.json: one JSON line; exit 0 when graded, 2 on bad arguments."""
    parser = argparse.ArgumentParser(prog="sandbox.py", description=main.__doc__)
    parser.add_argument("program", help="a Python program, or with --completion a completion to extract it from")
    parser.add_argument(
        "--tests",
        required=True,
        help='JSON: a list of {"input", "output"} tests, or a code '
        'problem {"tests", "style", "fn_name", "tolerance"} as data/prepare.py writes them',
    )
    parser.add_argument("--fn-name", help="call style: call this function (or Solution().NAME) with each input")
    parser.add_argument("--tolerance", type=float, help="numbers match within this absolute or relative error")
    parser.add_argument(
        "--completion", action="store_true", help="PROGRAM is a model's completion: grade its last ```python block"
    )
    parser.add_argument("--timeout", type=float, default=Limits.timeout, help="seconds per test (default: %(default)s)")
    parser.add_argument(
        "--memory-mb",
        type=float,
        default=Limits.memory_bytes / 2**20,
        help="address space in MiB (default: %(default)s)",
    )
    parser.error = lambda message: parser.exit(2, f"sandbox.py: {message}\n")
    args = parser.parse_args(argv)
    try:
        source = Path(args.program).read_text()
        problem = json.loads(Path(args.tests).read_text())
        problem = {"tests": problem} if isinstance(problem, list) else problem
        if not isinstance(problem, dict):
            raise ValueError(f"--tests {args.tests}: expected a list of tests or a problem object")
        problem = {"style": "call" if args.fn_name else "stdio", **problem}
        problem.update({k: v for k, v in (("fn_name", args.fn_name), ("tolerance", args.tolerance)) if v is not None})
        limits = Limits(timeout=args.timeout, memory_bytes=int(args.memory_mb * 2**20))
        from data.code_layouts import check_code_problem

        check_code_problem(problem, f"--tests {args.tests}")
    except (OSError, ValueError) as error:  # json's errors are ValueErrors
        parser.error(str(error))
    program = extract_program(source) if args.completion else source
    try:
        (result,) = grade([program], [problem], limits=limits, workers=1)
    except SandboxUnavailable as error:
        print(f"sandbox.py: {error}", file=sys.stderr)
        return 1
    print(
        json.dumps(
            {
                "passed": result.passed,
                "total": result.total,
                "reason": result.reason,
                "failed_test": result.failed_test,
                "seconds": round(result.seconds, 4),
                "detail": result.detail,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
