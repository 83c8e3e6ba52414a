"""Running untrusted programs: a code completion graded against its problem's tests, in a sandbox.

A code problem is graded by running the program a completion wrote. The program is the last fenced
Python block of the completion (after the last </think>, when there is one), and it passes a test
when what it produces matches the test's expected output. The reward is 1 when every test passes
(GPPO's binary reward), or the fraction passed (fraction=True); no block, or a syntax error, is 0.

    grades = sandbox.grade([program], [problem])      # problem: {"tests": [...], "style": "stdio", ...}
    rewards = sandbox.reward(completions, problems)   # extraction, grading, one float per completion
    python train.py --dataset code --reward-fn sandbox:code_reward   # the built-in code reward function
    python -m grading.sandbox PROGRAM.py --tests TESTS.json    # one JSON line: passed, total, reason, seconds

Code grading is all here, apart from the math checker (reward.py): the reward function code_reward, and the
step's code metrics (metric_rows, step_metrics: tests passed, why programs failed).

Two test styles. "stdio" (Codeforces, CodeContests, TACO, APPS): the test's input is the program's
standard input, and its standard output must equal the expected output token for token (tokens split on
ASCII whitespace; a float token within the problem's "tolerance", absolute or relative, when it has one;
letters of either case when "case_sensitive" is false); each test runs in a fresh process. "call"
(LeetCode, HumanEval, the function problems of TACO and LiveCodeBench): the function "fn_name" (or
Solution().fn_name) is called with each test's input as its argument list and must return the expected
output; the tests run one after another in one process, each call timed by the supervisor.

Nothing a program does reaches the trainer or the machine. Every worker of the pool is a supervisor process
in a mount and network namespace of its own (as root, or as the trainer's user inside a user namespace of
its own), where it has built a read-only view of the file system: system binaries and libraries and the
interpreter with its standard library, no site-packages. Each run is a fresh process tree: a fresh pid and
IPC namespace whose first process is the program, a fresh size-capped tmpfs as its working directory, a
cgroup of its own (memory, every process and kernel object counted; processes; CPU time) where the machine
offers one, resource limits, a fresh session keyring, a seccomp filter, a scrubbed environment, no
capabilities, stdout and stderr in capped memory files. A run that outlives its time is killed, and with
the first process of a pid namespace dies every process in it, setsid or not. The outputs are compared in
the supervisor, which alone holds the expected outputs: a program cannot see or rewrite its verdict. What
each layer stops, and what none of them does, is in docs/sandbox.md.
"""

import argparse
import ctypes
import errno
import functools
import gc
import glob
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
import sysconfig
import tempfile
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Mapping, NamedTuple, Sequence

if not __package__:  # run as a file (python grading/sandbox.py): the repository is the folder above
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from grading import pool  # noqa: E402

STYLES = ("stdio", "call")
# why a program failed (its first failing test), in the order a failure is decided
REASONS = ("no_code_block", "syntax_error", "timeout", "output_limit", "memory", "runtime_error", "wrong_answer")
GRACE_S = 10.0  # a supervisor silent this long past a program's total time is replaced
WORK = "/sandbox"  # the program's working directory and home inside the view
PROGRAM = WORK + "/program.py"
MAX_COMPLETION_CHARS = 1 << 22  # extraction reads at most the last 4 MiB of a completion
MAX_PROGRAM_CHARS = 1 << 18  # a longer program is refused unrun (a judge's source limit), as a syntax error
MAX_TEST_DEPTH = 100  # tests' inputs and outputs nest at most this deep
TICK_S = 0.02  # how often the supervisor reads a running program's CPU time and memory


@dataclass(frozen=True)
class Limits:
    """What one program may use. Every field is enforced by the kernel or by the supervisor's clock."""

    timeout: float = 2.0  # wall seconds per test (call style: per call); CPU seconds likewise
    total_timeout: float = 30.0  # wall seconds for all of a program's tests; the rest fail as timeouts
    memory_bytes: int = 1 << 30  # one run, all its processes and kernel objects (cgroup); and address space
    output_bytes: int = 4 << 20  # stdout, stderr, call results and any one file (RLIMIT_FSIZE)
    disk_bytes: int = 16 << 20  # the working directory's tmpfs, all files together
    processes: int = 16  # processes and threads of one run (pids cgroup, RLIMIT_NPROC)
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


class SandboxUnavailable(SandboxError):
    """This machine cannot isolate programs (namespaces refused, or no seccomp binding)."""


# ----------------------------------------------------------------------------- extraction (in the trainer)

_OPEN_RE = re.compile(r"[ \t]*```[ \t]*([^\s`]*).*")  # a line that opens a fenced block, and its tag
_CLOSE_RE = re.compile(r"[ \t]*```[ \t]*")  # a line that closes one
PYTHON_TAGS = ("python", "python3", "py", "py3")


def extract_program(completion: str) -> str | None:
    """The program of a completion: the last ```python block after the last </think>, else the last
    untagged ``` block (a block in another language, or an output example after the code, is skipped).
    None when there is no closed block, or the block is empty. One pass over the lines of the last
    MAX_COMPLETION_CHARS characters: linear, whatever the fences."""
    lines = completion[-MAX_COMPLETION_CHARS:].rsplit("</think>", 1)[-1].split("\n")
    last: dict[bool, str] = {}  # is tagged python -> the last such block
    tag, start = None, 0  # the open block's tag (None: no block open) and its first line
    for i, line in enumerate(lines):
        if tag is None:
            if i + 1 < len(lines) and (opened := _OPEN_RE.fullmatch(line)):
                tag, start = opened[1].lower(), i + 1
        elif _CLOSE_RE.fullmatch(line):
            if tag in PYTHON_TAGS or not tag:
                last[bool(tag)] = "".join(body + "\n" for body in lines[start:i])
            tag = None
    program = last.get(True, last.get(False, ""))
    return program if program.strip() else None


# ----------------------------------------------------------------------------- the problem's checks


def check_problem(problem: Mapping, where: str) -> None:
    """A ValueError naming `where` unless the problem can be graded: data/code_layouts.py's checks of the
    format, and what grading needs besides: a finite tolerance, case_sensitive a bool, text that is UTF-8
    (no lone surrogates), finite numbers, values nested at most MAX_TEST_DEPTH deep."""
    from data.code_layouts import check_code_problem

    check_code_problem(problem, where)
    tolerance = problem.get("tolerance")
    if tolerance is not None and not math.isfinite(tolerance):
        raise ValueError(f"{where}: tolerance must be a finite number >= 0, got {tolerance!r}")
    case_sensitive = problem.get("case_sensitive", True)
    if not isinstance(case_sensitive, bool):
        raise ValueError(f"{where}: case_sensitive must be true or false, got {case_sensitive!r}")
    for i, test in enumerate(problem["tests"]):
        for key in ("input", "output"):
            if why := _unfit_value(test[key]):
                raise ValueError(f"{where}: test {i}: its {key} {why}")


def _unfit_value(value) -> str | None:
    """Why a test's value cannot be sent and compared (None: it can); iterative, so any depth is safe."""
    stack = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_TEST_DEPTH:
            return f"nests deeper than {MAX_TEST_DEPTH}"
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return "holds a lone surrogate (not UTF-8 text)"
        elif isinstance(item, float) and not math.isfinite(item):
            return f"holds {item}, not a finite number"
        elif isinstance(item, (list, tuple)):
            stack += [(x, depth + 1) for x in item]
        elif isinstance(item, dict):
            stack += [(x, depth + 1) for pair in item.items() for x in pair]
        elif not (item is None or isinstance(item, (bool, int, float))):
            return f"holds a {type(item).__name__}, not a JSON value"
    return None


def _unrunnable(program: str) -> str | None:
    """Why a program is refused before it runs (None: it runs)."""
    if len(program) > MAX_PROGRAM_CHARS:
        return f"the program has {len(program)} characters, more than {MAX_PROGRAM_CHARS}"
    try:
        program.encode()
    except UnicodeEncodeError:
        return "the program is not UTF-8 text (a lone surrogate)"
    return None


# ----------------------------------------------------------------------------- comparison (in the supervisor)

_NUMBER_RE = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_ASCII_SPACE_RE = re.compile(r"[ \t\n\r\x0b\x0c]+")  # what a judge splits on: not \x1c-\x1f, \xa0 or \u3000


def same_output(actual: str, expected: str, tolerance: float | None = None, case_sensitive: bool = True) -> bool:
    """Whether stdout matches: the same tokens, split on ASCII whitespace; with a tolerance, two numeric
    tokens also match when |a - e| <= tolerance * max(1, |e|) (absolute or relative error, as judges state
    it); without case_sensitive, tokens that casefold equal match."""
    got, want = _tokens(actual), _tokens(expected)
    return len(got) == len(want) and all(
        g == w
        or (not case_sensitive and g.casefold() == w.casefold())
        or (tolerance is not None and _close(g, w, tolerance))
        for g, w in zip(got, want)
    )


def _tokens(text: str) -> list[str]:
    return [token for token in _ASCII_SPACE_RE.split(text) if token]


def _close(got: str, want: str, tolerance: float) -> bool:
    if not (_NUMBER_RE.fullmatch(got) and _NUMBER_RE.fullmatch(want)):
        return False
    a, e = float(got), float(want)
    return abs(a - e) <= tolerance * max(1.0, abs(e))


def same_value(actual, expected, tolerance: float | None = None, case_sensitive: bool = True) -> bool:
    """Whether a returned value (read back from JSON, so tuples are lists) equals the expected one; floats
    within the tolerance when the problem has one; strings that casefold equal without case_sensitive. A
    bool is not a number here: True does not equal 1."""
    if isinstance(actual, bool) or isinstance(expected, bool):
        return type(actual) is type(expected) and actual == expected
    if isinstance(actual, (int, float)) and isinstance(expected, (int, float)):
        return actual == expected or (
            tolerance is not None and abs(actual - expected) <= tolerance * max(1.0, abs(expected))
        )
    if isinstance(actual, str) and isinstance(expected, str):
        return actual == expected or (not case_sensitive and actual.casefold() == expected.casefold())
    if isinstance(actual, list) and isinstance(expected, list):
        return len(actual) == len(expected) and all(
            same_value(a, e, tolerance, case_sensitive) for a, e in zip(actual, expected)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            same_value(actual[k], expected[k], tolerance, case_sensitive) for k in actual
        )
    return type(actual) is type(expected) and actual == expected


def _call_verdict(line: bytes, expected, job: dict) -> str | None:
    """One call's verdict from its result line: whatever the line holds (any nesting, size or bytes) is a
    verdict, never an exception."""
    try:
        result = json.loads(line)
        if not isinstance(result, dict) or not ("ok" in result or "error" in result):
            return "wrong_answer"
        if "error" in result:
            return "memory" if result["error"] == "MemoryError" else "runtime_error"
        return None if same_value(result["ok"], expected, job["tolerance"], job["case_sensitive"]) else "wrong_answer"
    except (ValueError, TypeError, RecursionError, OverflowError, MemoryError):
        return "wrong_answer"


def _stdio_verdict(stdout: bytes, expected: str, job: dict) -> str | None:
    try:
        same = same_output(stdout.decode(errors="replace"), expected, job["tolerance"], job["case_sensitive"])
    except (ValueError, OverflowError, MemoryError):
        same = False
    return None if same else "wrong_answer"


# ----------------------------------------------------------------------------- inside the sandbox

# Runs the program inside the sandbox, as its user; nothing here is trusted afterwards. "stdio" runs it as
# __main__. "call" reads every test's arguments first (a program reading stdin then finds it empty), takes
# what it needs from json and os before the program can patch them, then makes each call when the
# supervisor's byte arrives on fd 4 (its clock for that call starts then) and writes one line to fd 3.
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
    dumps, loads, read, write, args = json.dumps, json.loads, os.read, os.write, sys.stdin.read().splitlines()
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
        if read(4, 1) != b"g":
            break
        try:
            text = dumps({"ok": function(*loads(line))})
        except BaseException as error:
            text = dumps({"error": type(error).__name__})
        view = memoryview((text + "\n").encode())
        while view:
            view = view[write(3, view):]
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


# ----------------------------------------------------------------------------- the seccomp filter (built in the trainer)

# What no test program needs, denied with EPERM: shared kernel state a program could read or leave behind
# (keyrings, SysV IPC, POSIX message queues), memory outside its address space (memfd), the kernel's large
# attack surfaces (io_uring, bpf, perf, userfaultfd), other processes (ptrace and friends), and the machine's
# configuration (mounts, namespaces, modules, clocks, swap, reboot). Names this architecture lacks are skipped.
DENIED_SYSCALLS = (
    *("add_key", "keyctl", "request_key"),
    *("shmget", "shmat", "shmdt", "shmctl", "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop"),
    *("semtimedop", "semctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify"),
    *("mq_getsetattr", "memfd_create", "memfd_secret", "io_uring_setup", "io_uring_enter", "io_uring_register"),
    *("ptrace", "process_vm_readv", "process_vm_writev", "pidfd_getfd", "kcmp", "perf_event_open", "bpf"),
    *("userfaultfd", "mount", "umount2", "pivot_root", "chroot", "unshare", "setns", "fsopen", "fsconfig"),
    *("fsmount", "fspick", "move_mount", "open_tree", "mount_setattr", "kexec_load", "kexec_file_load"),
    *("init_module", "finit_module", "delete_module", "reboot", "swapon", "swapoff", "acct", "quotactl"),
    *("syslog", "open_by_handle_at", "name_to_handle_at", "iopl", "ioperm", "settimeofday", "clock_settime"),
    *("clock_adjtime", "adjtimex", "sethostname", "setdomainname", "fanotify_init", "lookup_dcookie"),
    *("vhangup", "personality"),
)
AF_UNIX = 1
CLONE_NAMESPACES = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x80)


@functools.cache
def seccomp_filter() -> tuple[bytes, int]:
    """(the programs' seccomp filter as BPF, the number of keyctl on this machine). libseccomp (through
    pyseccomp, a ctypes binding with libseccomp's own Python API) resolves the names for this architecture
    and kills a program that calls in through another one (x32, i386). Built here, where site-packages are:
    the supervisors run without them and load the bytes. Besides DENIED_SYSCALLS: sockets of any family but
    AF_UNIX (EAFNOSUPPORT), clone into new namespaces (EPERM) and clone3, whose flags a filter cannot read
    (ENOSYS: the C library falls back to clone)."""
    try:
        import pyseccomp as seccomp
    except (ImportError, OSError) as error:  # OSError: the package is there, libseccomp.so is not
        raise SandboxUnavailable(
            f"sandbox.py needs pyseccomp and libseccomp to filter the programs' system calls ({error}); "
            "`make setup` installs pyseccomp, and libseccomp2 comes with the system"
        ) from None
    rules = seccomp.SyscallFilter(seccomp.ALLOW)
    for name in DENIED_SYSCALLS:
        if seccomp.resolve_syscall(seccomp.Arch.NATIVE, name) >= 0:
            rules.add_rule(seccomp.ERRNO(errno.EPERM), name)
    for name in ("socket", "socketpair"):
        rules.add_rule(seccomp.ERRNO(errno.EAFNOSUPPORT), name, seccomp.Arg(0, seccomp.NE, AF_UNIX))
    for flag in CLONE_NAMESPACES:
        rules.add_rule(seccomp.ERRNO(errno.EPERM), "clone", seccomp.Arg(0, seccomp.MASKED_EQ, flag, flag))
    rules.add_rule(seccomp.ERRNO(errno.ENOSYS), "clone3")
    with tempfile.TemporaryFile() as out:
        rules.export_bpf(out)
        out.seek(0)
        program = out.read()
    return program, seccomp.resolve_syscall(seccomp.Arch.NATIVE, "keyctl")


# ----------------------------------------------------------------------------- per-run cgroups

CGROUP_CONTROLLERS = ("memory", "pids", "cpuacct")  # cgroup v1's names; v2 has memory and pids, cpu.stat always


def cgroup_layout() -> tuple[int, dict[str, str]] | None:
    """Where this process may create a run's cgroups: (1, {controller: this process's cgroup folder in its
    v1 hierarchy}) or (2, {controller: its v2 folder}, memory and pids enabled below it), or None."""
    mounts, paths = {}, {}  # controller ("" for v2) -> mount point; -> this process's path in that hierarchy
    with open("/proc/self/mountinfo") as table:
        for line in table:
            parts = line.split()
            fstype, options = parts[parts.index("-") + 1], parts[-1].split(",")
            if fstype == "cgroup2":
                mounts.setdefault("", parts[4])
            elif fstype == "cgroup":
                for name in set(options) & set(CGROUP_CONTROLLERS):
                    mounts.setdefault(name, parts[4])
    with open("/proc/self/cgroup") as table:
        for line in table:
            _, names, path = line.rstrip("\n").split(":", 2)
            for name in names.split(",") if names else [""]:
                paths[name] = path
    if all(name in mounts and name in paths for name in CGROUP_CONTROLLERS):
        layout = 1, {name: mounts[name].rstrip("/") + paths[name] for name in CGROUP_CONTROLLERS}
    elif "" in mounts and "" in paths:
        folder = mounts[""].rstrip("/") + paths[""]
        try:
            enabled = Path(folder, "cgroup.subtree_control").read_text().split()
        except OSError:
            return None
        if not {"memory", "pids"} <= set(enabled):
            return None
        layout = 2, dict.fromkeys(CGROUP_CONTROLLERS, folder)
    else:
        return None
    return layout if all(os.access(folder, os.W_OK) for folder in layout[1].values()) else None


class _Cgroup:
    """One run's cgroup in each hierarchy: made before its job (empty, no limits), joined by the program's
    process while it waits for the job, given the run's limits once the job is known, read for CPU time and
    whether memory reached its limit, removed once the run's processes are gone. The files it reads are
    opened once and read with pread: a read costs a system call, not a file's opening."""

    def __init__(self, layout: tuple[int, dict[str, str]], name: str):
        self.version, folders = layout
        self.memory, self.pids, self.cpu = (f"{folders[c]}/{name}" for c in CGROUP_CONTROLLERS)
        self.folders = list(dict.fromkeys((self.memory, self.pids, self.cpu)))
        self.files: list[int] = []
        try:
            for folder in self.folders:
                os.mkdir(folder)
            v1 = self.version == 1
            self.usage = self._open(f"{self.cpu}/cpuacct.usage" if v1 else f"{self.cpu}/cpu.stat")
            self.events = self._open(f"{self.memory}/memory.failcnt" if v1 else f"{self.memory}/memory.events")
            self.ooms = self._open(f"{self.memory}/memory.oom_control") if v1 else self.events
        except OSError:
            self.remove()
            raise

    def _open(self, path: str) -> int:
        self.files.append(os.open(path, os.O_RDONLY))
        return self.files[-1]

    def limit(self, limits: Limits) -> None:
        """Set the run's memory (no swap) and process limits."""
        memory = str(int(limits.memory_bytes))
        if self.version == 1:
            settings = [("memory.limit_in_bytes", memory), ("memory.memsw.limit_in_bytes", memory)]
        else:
            settings = [("memory.max", memory), ("memory.swap.max", "0")]
        for file, value in settings:  # memsw and swap.max exist only where swap is accounted
            if os.path.exists(f"{self.memory}/{file}"):
                _write_file(f"{self.memory}/{file}", value)
        _write_file(f"{self.pids}/pids.max", str(int(limits.processes)))

    @property
    def procs(self) -> list[str]:
        return [f"{folder}/cgroup.procs" for folder in self.folders]

    def cpu_seconds(self) -> float:
        text = os.pread(self.usage, 4096, 0).decode()
        return int(text) / 1e9 if self.version == 1 else _field(text, "usage_usec") / 1e6

    def at_limit(self) -> bool:
        """Whether the run's memory reached its limit (the kernel then reclaims, fails or OOM-kills): the run
        is killed and graded "memory" at once rather than left to thrash at the limit."""
        events = os.pread(self.events, 4096, 0).decode()
        if self.version == 1:
            return int(events) > 0 or _field(os.pread(self.ooms, 4096, 0).decode(), "oom_kill") > 0
        return _field(events, "max") > 0 or _field(events, "oom_kill") > 0

    def remove(self) -> None:
        for fd in self.files:
            os.close(fd)
        self.files.clear()
        for folder in self.folders:
            _remove_cgroup(folder)


def _write_file(path: str, text: str) -> None:
    """Write a short value to a cgroup file (an error is the kernel's refusal of the value)."""
    fd = os.open(path, os.O_WRONLY)
    try:
        _write_all(fd, text.encode())
    finally:
        os.close(fd)


def _field(text: str, name: str) -> int:
    """A number from a cgroup file of "name value" lines (0 when it is not there)."""
    return next((int(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")), 0)


def _remove_cgroup(folder: str) -> None:
    """rmdir, retried while the kernel finishes the exit of the processes that were in it."""
    for _ in range(100):
        try:
            os.rmdir(folder)
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.01)
    warnings.warn(f"could not remove the sandbox cgroup {folder}")


class _Watch:
    """A run's CPU time and memory where no cgroup counts them: the program's process tree, read from /proc
    (every process of a pid namespace descends from its first). Memory is the tree's resident anonymous and
    shared memory, so the limit is checked every TICK_S, not enforced at each allocation."""

    def __init__(self, pid: int):
        self.pid, self.tick = pid, os.sysconf("SC_CLK_TCK")

    def _tree(self) -> list[int]:
        found, todo = [], [self.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            for children in glob.glob(f"/proc/{pid}/task/*/children"):
                try:
                    todo += map(int, Path(children).read_text().split())
                except OSError:
                    pass
        return found

    def cpu_seconds(self) -> float:
        total = 0
        for pid in self._tree():
            try:
                stat = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
            except OSError:
                continue
            total += sum(map(int, stat[11:15] if pid == self.pid else stat[11:13]))  # utime stime (cutime cstime)
        return total / self.tick

    def memory_bytes(self) -> int:
        total = 0
        for pid in self._tree():
            try:
                status = Path(f"/proc/{pid}/status").read_text()
            except OSError:
                continue
            total += 1024 * sum(_status_kb(status, name) for name in ("RssAnon", "RssShmem"))
        return total


def _status_kb(status: str, name: str) -> int:
    return next((int(line.split()[1]) for line in status.splitlines() if line.startswith(name + ":")), 0)


# ----------------------------------------------------------------------------- the supervisor

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x08000000, 0x20000000, 0x40000000
CLONE_NEWUSER = 0x10000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 32, 4096, 16384, 1 << 18
MS_NOEXEC, MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 8, 1024, 2048, 1 << 21
# a mount's flags as statvfs reports them -> as mount takes them: a remount in a user namespace must keep them
ST_TO_MS = {2: MS_NOSUID, 4: MS_NODEV, 8: MS_NOEXEC, 1024: MS_NOATIME, 2048: MS_NODIRATIME, 4096: MS_RELATIME}
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP = 1, 24, 38, 22
SECCOMP_MODE_FILTER, KEYCTL_JOIN_SESSION_KEYRING = 2, 1
DEVICES = ("null", "zero", "random", "urandom")
FD_BASE = 100  # a run's memory files and pipes are moved here, clear of the 0-4 they become in the program
EXEC_FD, LIFE_FD, START_FD = FD_BASE + 5, FD_BASE + 6, FD_BASE + 7

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.unshare.argtypes = [ctypes.c_int]
_libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
_libc.syscall.restype = ctypes.c_long


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def _check(result: int, what: str) -> None:
    if result != 0:
        code = ctypes.get_errno()
        raise OSError(code, f"{what}: {os.strerror(code)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(
        _libc.mount(encode(source), encode(target), encode(fstype), flags, encode(data)), f"mount {source} on {target}"
    )


def _unshare(flags: int) -> None:
    _check(_libc.unshare(flags), f"unshare({flags:#x})")


def _prctl(option: int, value: int, arg: int = 0) -> None:
    _check(_libc.prctl(option, value, arg, 0, 0), f"prctl({option}, {value})")


def _bind_read_only(source: str, target: str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    """Bind source at target, read-only: a bind takes its flags on remount, which keeps the source mount's
    own (a user namespace may not clear them)."""
    kept = sum(ms for st, ms in ST_TO_MS.items() if os.statvfs(source).f_flag & st)
    _mount(source, target, None, MS_BIND)
    _mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags | kept)


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


def _hidden_paths() -> list[str]:
    """The package folders inside the view, covered by an empty read-only tmpfs: this interpreter's
    site-packages and the system pythons' site- and dist-packages. What remains is the standard library."""
    found = {
        sysconfig.get_path(key, vars={"base": sys.base_prefix, "platbase": sys.base_prefix})
        for key in ("purelib", "platlib")
    }
    for pattern in ("/usr/lib/python3*/*-packages", "/usr/local/lib/python3*/*-packages"):
        found.update(glob.glob(pattern))
    return sorted(p for p in map(os.path.realpath, found) if os.path.isdir(p) and not os.path.islink(p))


def _build_view(root: str) -> None:
    """Private mount and network namespaces, and in them a read-only root at `root`: a 1 MB tmpfs holding
    the view's paths (bound read-only, no setuid), the package folders covered, four devices, and the mount
    point of the working directory. Nothing is mounted before "/" is private, so no mount reaches the
    machine's table."""
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
    for path in _hidden_paths():
        _mount("tmpfs", root + path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV, "size=4k,nr_inodes=1,mode=555")
    os.mkdir(root + "/dev")
    for name in DEVICES:
        open(f"{root}/dev/{name}", "w").close()
        _bind_read_only(f"/dev/{name}", f"{root}/dev/{name}", MS_NOSUID)
    os.mkdir(root + WORK)
    os.symlink(WORK, root + "/tmp")
    _mount(None, root, None, MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV)


def _enter_user_namespace(uid: int, gid: int) -> None:
    """Unprivileged: a user namespace of its own, where this user (mapped to itself, alone) holds the
    capabilities that build the view and the runs' namespaces, over those namespaces only."""
    _unshare(CLONE_NEWUSER)
    Path("/proc/self/setgroups").write_text("deny")  # an unprivileged map needs it: no dropping of groups
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def _supervise(config: dict) -> None:
    """A supervisor's life: enter its namespaces and build the view, then one job (a JSON frame) -> one
    JSON frame, until stdin closes."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != config["parent"]:  # the grader died before the line above took effect
        return
    if not config["privileged"]:
        try:
            _enter_user_namespace(config["uid"], config["gid"])
        except OSError as error:
            pool.announce(
                f"this kernel refuses an unprivileged user namespace ({error}): run as root, or allow "
                "them (sysctl user.max_user_namespaces, kernel.unprivileged_userns_clone, "
                "kernel.apparmor_restrict_unprivileged_userns)".encode()
            )
            return
    try:
        _build_view(config["root"])
    except OSError as error:
        pool.announce(f"cannot build the sandbox's view ({error})".encode())
        return
    config["cgroups"] = _probe_cgroups()
    gc.freeze()  # what exists now lives as long as the supervisor: no collection walks it (and copies its pages)
    runs = _Runs(config)

    def grade_one(frame: bytes) -> bytes:
        started = time.monotonic()
        try:
            result = _grade_job(json.loads(frame), runs)
        except Exception as error:
            result = {"error": f"{type(error).__name__}: {error}"}
        return json.dumps({**result, "seconds": time.monotonic() - started}).encode()

    pool.serve(grade_one)


def _probe_cgroups() -> tuple[int, dict[str, str]] | None:
    """cgroup_layout, where a run's cgroup can in fact be made (and removed) there."""
    layout = cgroup_layout()
    if layout is None:
        return None
    try:
        probe = _Cgroup(layout, f"sandbox-probe-{os.getpid()}")
        try:
            probe.limit(Limits())
        finally:
            probe.remove()
    except OSError:
        return None
    return layout


def _grade_job(job: dict, runs: "_Runs") -> dict:
    """Every test of one program, in order: stdio tests one run each, call tests one run for all. Runs stop
    after a timeout (a program too slow once is too slow again, and each costs the full limit) and when
    the program's total time is spent; the tests not run count as failed."""
    limits, tests = Limits(**job["limits"]), job["tests"]
    end = time.monotonic() + limits.total_timeout
    try:
        compile(job["source"], PROGRAM, "exec", dont_inherit=True)
    except (SyntaxError, ValueError, MemoryError, RecursionError) as error:
        return {"verdicts": ["syntax_error"] * len(tests), "detail": f"{type(error).__name__}: {error}"[:500]}
    if job["style"] == "call":
        return runs.run(job, tests, end)
    verdicts, detail = [], ""
    for test in tests:
        if verdicts and verdicts[-1] == "timeout" or time.monotonic() >= end:
            verdicts.append("timeout")
            continue
        run = runs.run(job, [test], end)
        verdicts += run["verdicts"]
        detail = detail or run["detail"]
    return {"verdicts": verdicts, "detail": detail}


class _Runs:
    """A supervisor's runs, one at a time, each made ready one run ahead. A run is a forked run supervisor
    (namespaces apply to a process and its children) that enters fresh pid, mount and IPC namespaces and
    forks the program's process, which joins the run's fresh cgroup; both then wait for the job. Joining a
    cgroup waits for the kernel (an RCU grace period, several milliseconds), so it happens while the run
    before goes on, and a job finds its process tree made."""

    def __init__(self, config: dict):
        self.config = config
        # without root or a cgroup, RLIMIT_NPROC alone bounds a program's processes, and it counts the
        # supervisor's user: a run then waits until the next run's two processes exist, so that the count
        # it allows for holds them for the whole run
        self.wait_ready = not config["privileged"] and not config["cgroups"]
        self.ready: tuple[int, int, int] | None = None
        self.ready = self._make()

    def _make(self) -> tuple[int, int, int]:
        """A run that waits for its job: (its supervisor's pid, the job pipe's write end, the report pipe's
        read end). Its report starts with one byte once both its processes exist."""
        job_r, job_w = os.pipe()
        report_r, report_w = os.pipe()
        child = os.fork()
        if child == 0:
            code = 1
            try:
                for fd in (job_w, report_r, *(self.ready[1:] if self.ready else ())):  # the run before's ends
                    os.close(fd)
                result, code = _run_in_child(job_r, report_w, self.config), 0
            except BaseException as error:
                result = {"error": f"{type(error).__name__}: {error}"}
            finally:  # never back into the supervisor's loop
                try:
                    _write_all(report_w, json.dumps(result).encode())
                finally:
                    os._exit(code)
        os.close(job_r)
        os.close(report_w)
        first = os.read(report_r, 1) if self.wait_ready else b"."
        if first != b".":  # it failed before it forked the program's process: the rest of its report says why
            os.close(job_w)
            raise SandboxError(_report(child, report_r, first).get("error", "the run's supervisor failed"))
        return child, job_w, report_r

    def run(self, job: dict, tests: list[dict], end: float) -> dict:
        """One run of the program on these tests, ending by `end` at the latest: {"verdicts": [reason or
        None per test], "detail": stderr's end}. The next run is forked first, and joins its cgroup while this
        one goes on."""
        child, job_w, report_r = self.ready
        self.ready = self._make()
        try:
            _write_all(job_w, json.dumps({**job, "tests": tests, "end": end}).encode())
        except BrokenPipeError:  # the run's supervisor is gone: its report, below, is empty
            pass
        os.close(job_w)
        result = _report(child, report_r)
        if "error" in result:
            raise SandboxError(result["error"])
        return result


def _report(child: int, report_r: int, head: bytes = b"") -> dict:
    """A run supervisor's report (after `head`, what was read of it already), without the byte that said
    its processes exist, once it has exited."""
    text = (head + _read_pipe(report_r)).removeprefix(b".")
    os.close(report_r)
    os.waitpid(child, 0)
    return json.loads(text) if text else {"error": "the run's supervisor died without a report"}


class _Tree(NamedTuple):
    """A run's process tree before its job: the program's process and the run supervisor's ends of its
    pipes and files (the memory files and the program's ends sit at FD_BASE and up)."""

    pid: int  # the program's process: pid 1 of the run's pid namespace
    pidfd: int
    cgroup: "_Cgroup | None"
    start: int  # write end: the run's settings, which start the program's process
    exec_report: int  # read end: closes at exec, or says why the program could not start
    results: int  # read end of the program's fd 3 (call style)
    go: int  # write end of the program's fd 4 (call style)


def _run_in_child(job_pipe: int, report: int, config: dict) -> dict:
    """A run's supervisor: make the run's process tree, say so (one byte on the report pipe), wait for the
    job, run it. Whatever fails, the program's process is killed and the cgroup removed."""
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    _unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC)
    tree = _make_tree(config)
    try:
        os.write(report, b".")
        text = _read_pipe(job_pipe)
        if not text:
            raise SandboxError("no job came: the supervisor is gone")
        return _run_job(json.loads(text), tree, config)
    except BaseException:
        try:
            signal.pidfd_send_signal(tree.pidfd, signal.SIGKILL)
            os.waitid(os.P_PIDFD, tree.pidfd, os.WEXITED)
        except (ProcessLookupError, ChildProcessError):  # reaped already
            pass
        raise
    finally:
        if tree.cgroup:
            tree.cgroup.remove()


def _make_tree(config: dict) -> _Tree:
    """The run's memory files (stdin, stdout, stderr) and pipes at fixed descriptors, its cgroup, and the
    program's process, forked: it joins the cgroup and waits for the run's settings."""
    for i, name in enumerate(("stdin", "stdout", "stderr")):
        _memory_file(name, FD_BASE + i)
    results_r, results_w = os.pipe2(os.O_CLOEXEC)  # call style: fd 3, the results, read as they come
    go_r, go_w = os.pipe2(os.O_CLOEXEC)  # fd 4: the supervisor's go for each call
    exec_r, exec_w = os.pipe()  # the program's side closes at exec (O_CLOEXEC) or reports why it could not
    life_r, _ = os.pipe()  # the write end stays open while this process lives
    start_r, start_w = os.pipe()
    for fd, target in ((results_w, FD_BASE + 3), (go_r, FD_BASE + 4), (exec_w, EXEC_FD), (life_r, LIFE_FD)):
        os.dup2(fd, target, inheritable=False)
        os.close(fd)
    os.dup2(start_r, START_FD, inheritable=False)
    os.close(start_r)
    name = f"{os.path.basename(config['root'])}-{os.getpid()}"  # the supervisor's cleanup finds it by its root
    cgroup = _Cgroup(config["cgroups"], name) if config["cgroups"] else None
    pid = os.fork()
    if pid == 0:
        _exec_program(config, cgroup.procs if cgroup else [], start_w)
    for fd in (FD_BASE + 3, FD_BASE + 4, EXEC_FD, START_FD):
        os.close(fd)
    return _Tree(pid, os.pidfd_open(pid), cgroup, start_w, exec_r, results_r, go_w)


def _run_job(job: dict, tree: _Tree, config: dict) -> dict:
    """Fill the run's tmpfs and stdin, set its limits, start the program, wait for it, and grade what it
    wrote."""
    limits, tests, call = Limits(**job["limits"]), job["tests"], job["style"] == "call"
    root, uid, gid = config["root"], config["uid"], config["gid"]
    _mount(
        "tmpfs",
        root + WORK,
        "tmpfs",
        MS_NOSUID | MS_NODEV,
        f"size={limits.disk_bytes},nr_inodes=1024,mode=700,uid={uid},gid={gid}",
    )
    with open(root + PROGRAM, "w") as f:
        f.write(job["source"])
    stdin = "".join(json.dumps(t["input"]) + "\n" for t in tests) if call else tests[0]["input"]
    _write_all(FD_BASE, stdin.encode())
    os.lseek(FD_BASE, 0, os.SEEK_SET)
    if tree.cgroup:
        tree.cgroup.limit(limits)
    cpu = max(1, math.ceil(min(limits.timeout * len(tests), limits.total_timeout)))
    argv = [config["python"], "-I", "-S", "-B", "-c", _LAUNCHER, job["style"], PROGRAM, job.get("fn_name") or ""]
    settings = {"argv": argv, "fds": 5 if call else 3, "rlimits": _rlimits(limits, cpu, config["privileged"])}
    try:
        _write_all(tree.start, json.dumps(settings).encode())
    except BrokenPipeError:  # the program's process failed before its settings came: the exec pipe says why
        pass
    os.close(tree.start)
    failure = os.read(tree.exec_report, 4096)
    if failure:
        raise SandboxError(f"the program could not start: {failure.decode(errors='replace')}")
    calls = _Calls(tests, tree.results, tree.go, job, limits) if call else None
    meter = tree.cgroup or _Watch(tree.pid)
    status, usage, killed = _wait(tree.pid, tree.pidfd, meter, limits, job["end"], calls)
    if killed is None and tree.cgroup is not None and tree.cgroup.at_limit():
        killed = "memory"  # it reached its limit between two reads, or the kernel killed one of its processes
    stdout, stderr = _read(FD_BASE + 1, limits.output_bytes), _read(FD_BASE + 2, limits.output_bytes)
    ended = _ended(status, usage, killed, cpu, stdout, stderr, limits)
    detail = stderr[-300:].decode(errors="replace")
    if not call:
        if ended is None:
            ended = _stdio_verdict(stdout, tests[0]["output"], job)
        return {"verdicts": [ended], "detail": detail}
    verdicts = calls.verdicts
    verdicts += [ended or "runtime_error"] * (len(tests) - len(verdicts))  # the calls that never returned
    return {"verdicts": verdicts, "detail": detail}


def _rlimits(limits: Limits, cpu: int, privileged: bool) -> list[tuple[int, int]]:
    """The program's resource limits, (resource, value) pairs."""
    # privileged, a user of its own counts only the program's processes; unprivileged, the user's count in
    # its namespace also holds the supervisor, this run's supervisor, and the next run's two processes
    processes = limits.processes + (0 if privileged else 4)
    return [
        (resource.RLIMIT_CPU, cpu),
        (resource.RLIMIT_AS, int(limits.memory_bytes)),
        (resource.RLIMIT_FSIZE, int(limits.output_bytes)),
        (resource.RLIMIT_NPROC, int(processes)),
        (resource.RLIMIT_NOFILE, int(limits.open_files)),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MSGQUEUE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
    ]


def _memory_file(name: str, fd: int) -> None:
    """A memory file at a fixed descriptor: outside every file system the program can see."""
    temporary = os.memfd_create(name)
    os.dup2(temporary, fd, inheritable=False)
    os.close(temporary)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _read_pipe(fd: int) -> bytes:
    """Everything written to a pipe until every writer closed it."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _exec_program(config: dict, cgroups: list[str], start_w: int) -> None:
    """The program's process, pid 1 of its namespace. Before its job: join the run's cgroup, enter the view,
    drop every capability from the bounding set (none survives exec, whatever the user), wait for the run's
    settings. Then: take the run's files as fds 0..2 (call style: 0..4), set the limits, drop to the run's
    user with a fresh session keyring and the seccomp filter, exec. Anything failing is reported on the
    exec pipe."""
    try:
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # it waits for its job: never past the run's supervisor
        os.close(start_w)  # so that the start pipe reads EOF once the run's supervisor is gone
        for procs in cgroups:
            _write_file(procs, "0")
        os.chroot(config["root"])
        for capability in range(64):
            if _libc.prctl(PR_CAPBSET_DROP, capability, 0, 0, 0) != 0:
                break
        settings = _read_pipe(START_FD)
        if not settings:  # no job for this run: its supervisor is gone
            os._exit(1)
        settings = json.loads(settings)
        os.chdir(WORK)  # the run's tmpfs, mounted since
        for target in range(settings["fds"]):
            os.dup2(FD_BASE + target, target)
        os.closerange(settings["fds"], EXEC_FD)
        os.closerange(LIFE_FD + 1, 1 << 16)
        for which, value in settings["rlimits"]:
            resource.setrlimit(which, (value, value))  # soft = hard: at the CPU limit SIGKILL, not SIGXCPU
        if config["privileged"]:
            os.setgroups([])
        os.setresgid(config["gid"], config["gid"], config["gid"])
        os.setresuid(config["uid"], config["uid"], config["uid"])
        if _libc.syscall(config["keyctl"], KEYCTL_JOIN_SESSION_KEYRING, None) < 0:  # none of the grader's keys
            _check(-1, "keyctl(JOIN_SESSION_KEYRING)")
        _prctl(PR_SET_NO_NEW_PRIVS, 1)
        _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # after setuid, which clears it
        rules = ctypes.create_string_buffer(config["seccomp"])
        program = _SockFprog(len(config["seccomp"]) // 8, ctypes.addressof(rules))
        _prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.addressof(program))
        if select.select([LIFE_FD], [], [], 0)[0]:  # the lifeline reads EOF: the run's supervisor died
            os._exit(1)
        os.execve(settings["argv"][0], settings["argv"], ENV)
    except BaseException as error:
        try:
            os.write(EXEC_FD, f"{type(error).__name__}: {error}".encode())
        finally:
            os._exit(127)


class _Calls:
    """A call-style run's clock: the go for each call, its result line, its verdict. A call's time, wall and
    CPU, runs from its go to its line; whatever else the program writes gains it nothing."""

    def __init__(self, tests: list[dict], results: int, go: int, job: dict, limits: Limits):
        self.tests, self.results, self.go, self.job, self.limits = tests, results, go, job, limits
        self.verdicts: list[str | None] = []
        self.buffer, self.size = bytearray(), 0
        self.started, self.cpu_start, self.closed = 0.0, 0.0, False

    def send_go(self, cpu: float) -> None:
        self.started, self.cpu_start = time.monotonic(), cpu
        try:
            os.write(self.go, b"g")
        except BrokenPipeError:  # the program closed its end: the call never comes
            pass

    def read(self, cpu_of) -> str | None:
        """Take what the program wrote to fd 3: a verdict per whole line, the next go after each; "output_limit"
        once it wrote more than its limit, else None."""
        chunk = os.read(self.results, 1 << 20)
        self.closed = not chunk  # every copy of fd 3 is closed: nothing more will come
        self.size += len(chunk)
        if self.size > self.limits.output_bytes:
            return "output_limit"
        self.buffer += chunk
        while (newline := self.buffer.find(b"\n")) >= 0 and len(self.verdicts) < len(self.tests):
            line = bytes(self.buffer[:newline])
            del self.buffer[: newline + 1]
            self.verdicts.append(_call_verdict(line, self.tests[len(self.verdicts)]["output"], self.job))
            if len(self.verdicts) < len(self.tests):
                self.send_go(cpu_of())
        return None


def _wait(
    pid: int, pidfd: int, meter, limits: Limits, end: float, calls: _Calls | None
) -> tuple[int, resource.struct_rusage, str | None]:
    """Wait for the program, killing it for "timeout" (a test's or a call's wall or CPU time, or the total),
    "memory" (the run's, where no cgroup enforces it) or "output_limit" (call results). Every TICK_S the
    supervisor reads the run's CPU time (and memory) itself."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    started, cpu_start, killed = time.monotonic(), 0.0, None
    if calls is not None:
        poller.register(calls.results, select.POLLIN)
        calls.send_go(meter.cpu_seconds())
    while True:
        if calls is not None:
            started, cpu_start = calls.started, calls.cpu_start
        now = time.monotonic()
        cpu = meter.cpu_seconds()
        if now >= min(end, started + limits.timeout) or cpu - cpu_start > limits.timeout:
            killed = "timeout"
        elif isinstance(meter, _Watch) and meter.memory_bytes() > limits.memory_bytes:
            killed = "memory"
        elif isinstance(meter, _Cgroup) and meter.at_limit():
            killed = "memory"
        if killed:
            os.kill(pid, signal.SIGKILL)  # pid 1 of its namespace: every process in it dies with it
            break
        events = dict(poller.poll(math.ceil(min(TICK_S, min(end, started + limits.timeout) - now) * 1000)))
        if calls is not None and calls.results in events:
            if killed := calls.read(meter.cpu_seconds):
                os.kill(pid, signal.SIGKILL)
                break
            if calls.closed:
                poller.unregister(calls.results)
        if pidfd in events:
            break
    _, status, usage = os.wait4(pid, 0)
    if calls is not None and killed is None:  # what it wrote before it exited: every writer is gone now
        while not calls.closed and killed is None:
            killed = calls.read(meter.cpu_seconds)
    return status, usage, killed


def _read(fd: int, limit: int) -> bytes:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks, size = [], 0
    while size < limit and (chunk := os.read(fd, min(1 << 20, limit - size))):
        chunks.append(chunk)
        size += len(chunk)
    return b"".join(chunks)


def _ended(
    status: int, usage, killed: str | None, cpu: int, stdout: bytes, stderr: bytes, limits: Limits
) -> str | None:
    """Why a run failed, from how it ended (None: it exited 0 within every limit)."""
    if killed:
        return killed
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


# ----------------------------------------------------------------------------- the pool (the grader's side)

# As root, a user of its own per supervisor: RLIMIT_NPROC counts a user's processes machine-wide, so two
# running programs must never share one. The block depends on this process, so several trainers on one
# machine draw different users; every pool of this process draws from it. Without root, every supervisor
# runs as this user, each in a user namespace of its own.
UID_BASE = 3_000_000_000 + (os.getpid() % 1_000_000) * 256
_free_uids = list(range(UID_BASE, UID_BASE + 256))
_ROOT = str(Path(__file__).resolve().parent.parent)
_KILL = shutil.which("kill") or "/bin/kill"


def _launch() -> pool.Launch:
    """A supervisor: `python -I -S` with an empty environment, its user and its (empty) mount point."""
    program, keyctl = seccomp_filter()
    privileged = os.geteuid() == 0
    uid = _free_uids.pop() if privileged else os.getuid()
    config = {
        "root": tempfile.mkdtemp(prefix="sandbox-"),
        "uid": uid,
        "gid": uid if privileged else os.getgid(),
        "privileged": privileged,
        "parent": os.getpid(),
        "python": _interpreter(),
        "seccomp": program.hex(),
        "keyctl": keyctl,
    }
    code = (
        f"import sys, json; sys.path.insert(0, {_ROOT!r}); from grading import sandbox; "
        f"config = json.loads({json.dumps(config)!r}); config['seccomp'] = bytes.fromhex(config['seccomp']); "
        f"sandbox._supervise(config)"
    )
    return pool.Launch([sys.executable, "-I", "-S", "-c", code], env={}, state=(config["root"], uid, privileged))


def _cleanup(state: tuple[str, int, bool]) -> None:
    """After a supervisor is killed: kill what is left under its user (its runs die with it in any case,
    through their parent-death signals), remove its runs' cgroups (named after its mount point: the run
    made ready for its next job always leaves one) and its (empty) mount point."""
    root, uid, privileged = state
    if privileged:  # kill(-1) as that user reaches every process it owns, in any pid namespace, and nothing else
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
        _free_uids.append(uid)
    layout = cgroup_layout()
    for folder in set(layout[1].values()) if layout else ():
        for leftover in glob.glob(f"{folder}/{os.path.basename(root)}-*"):
            _remove_cgroup(leftover)
    try:
        os.rmdir(root)  # its mounts lived in its own namespace: here it is an empty folder
    except OSError as error:
        warnings.warn(f"could not remove the sandbox mount point {root}: {error}")


def _new_pool() -> pool.Pool:
    """Supervisors, one per worker; one that misses a deadline, dies or fails is replaced, and whatever ran
    under its user is killed."""
    return pool.Pool(_launch, cleanup=_cleanup, keep_log=True, new_session=True)


def _interpreter() -> str:
    """The programs' python: this interpreter's base installation, inside the view (not a virtualenv)."""
    return os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)


_POOL = _new_pool()


def _healthy(reply: bytes) -> bool:
    return not reply.startswith(b'{"error"')


def _run_jobs(jobs: list[dict], workers: int) -> list[dict]:
    """Each job's result from a supervisor: {"verdicts", "detail", "seconds"}. A supervisor that misses its
    deadline, dies or fails is replaced, and its program graded (timeout, runtime_error) with a warning; the
    other programs' grades stand."""
    frames = [json.dumps(job).encode() for job in jobs]
    timeouts = [job["limits"]["total_timeout"] + GRACE_S for job in jobs]
    try:
        replies = _POOL.map(frames, timeouts, workers, healthy=_healthy)
    except pool.StartError as error:
        raise SandboxUnavailable(f"the sandbox cannot start here: {error}") from None
    results = []
    for job, reply, timeout in zip(jobs, replies, timeouts):
        result = reply if isinstance(reply, pool.Failure) else json.loads(reply)
        if isinstance(result, dict) and "error" not in result:
            results.append(result)
            continue
        if isinstance(result, pool.Failure) and result.kind == "timeout":
            why, verdict = "missed its deadline", "timeout"
        elif isinstance(result, pool.Failure):
            why, verdict = f"died ({result.log})", "runtime_error"
        else:
            why, verdict = f"failed ({result['error']})", "runtime_error"
        warnings.warn(f"a sandbox supervisor {why}; it is replaced, and the program is graded {verdict}")
        seconds = timeout if verdict == "timeout" else 0.0
        results.append({"verdicts": [verdict] * len(job["tests"]), "detail": why[:300], "seconds": seconds})
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
    "tolerance" and "case_sensitive" (optional)}, as data/prepare.py writes code problems. A program of None
    (no code block) is graded without running, one too long or not UTF-8 as a syntax error. Raises
    SandboxUnavailable where programs cannot be isolated, ValueError for a malformed problem; never raises
    for anything a program does.
    """
    if len(programs) != len(problems):
        raise ValueError(f"programs and problems differ in length: {len(programs)} vs {len(problems)}")
    for i, problem in enumerate(problems):
        check_problem(problem, f"problems[{i}]")
    refused = [None if program is None else _unrunnable(program) for program in programs]
    jobs = [
        {
            "source": program,
            "tests": problem["tests"],
            "style": problem.get("style", "stdio"),
            "fn_name": problem.get("fn_name"),
            "tolerance": problem.get("tolerance"),
            "case_sensitive": problem.get("case_sensitive", True),
            "limits": asdict(limits),
        }
        for program, problem, why in zip(programs, problems, refused)
        if program is not None and why is None
    ]
    ran = iter(_run_jobs(jobs, workers or os.cpu_count() or 1) if jobs else [])
    grades = []
    for program, problem, why in zip(programs, problems, refused):
        total = len(problem["tests"])
        if program is None or why is not None:
            grades.append(Grade(0, total, "no_code_block" if program is None else "syntax_error", 0.0, 0, why or ""))
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
) -> list[float]:
    """Per completion: 1.0 when its program passes every test of its problem (fraction: the share passed)."""
    return [g.reward(fraction) for g in grade_completions(completions, problems, limits=limits, workers=workers)]


def grade_completions(
    completions: Sequence[str], problems: Sequence[Mapping], *, limits: Limits = Limits(), workers: int | None = None
) -> list[Grade]:
    """Per completion, the Grade of the program it holds (for metrics: reasons, tests passed, seconds)."""
    return grade([extract_program(c) for c in completions], problems, limits=limits, workers=workers)


def code_reward(
    completions: list[str],
    tests: list | None = None,
    task: list[str | None] | None = None,
    style: list[str | None] | None = None,
    fn_name: list[str | None] | None = None,
    tolerance: list[float | None] | None = None,
    case_sensitive: list[bool | None] | None = None,
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
            "case_sensitive": case_sensitive[i] if case_sensitive and case_sensitive[i] is not None else True,
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


def _read_argument(name: str, path: str) -> str:
    """A file named on the command line as text; an OSError or a bad encoding is a ValueError naming the argument
    and the file."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{name} {path}: {error.strerror or error}") from None
    except UnicodeDecodeError as error:
        raise ValueError(f"{name} {path}: not UTF-8 text ({error.reason} at byte {error.start})") from None


def _read_problem(args) -> tuple[dict, str, Limits]:
    """The command line's problem, program source and limits; a ValueError or OSError says what is wrong."""
    source, text = (_read_argument(name, path) for name, path in (("PROGRAM", args.program), ("--tests", args.tests)))
    try:
        problem = json.loads(text)
    except RecursionError:
        raise ValueError(f"--tests {args.tests}: nested too deeply to read") from None
    except ValueError as error:
        raise ValueError(f"--tests {args.tests}: not JSON ({error})") from None
    problem = {"tests": problem} if isinstance(problem, list) else problem
    if not isinstance(problem, dict):
        raise ValueError(f"--tests {args.tests}: expected a list of tests or a problem object")
    problem = {"style": "call" if args.fn_name else "stdio", **problem}
    problem.update({k: v for k, v in (("fn_name", args.fn_name), ("tolerance", args.tolerance)) if v is not None})
    limits = Limits(timeout=args.timeout, memory_bytes=int(args.memory_mb * 2**20))
    check_problem(problem, f"--tests {args.tests}")
    return problem, source, limits


def main(argv: list[str] | None = None) -> int:
    """python -m grading.sandbox PROGRAM.py --tests TESTS.json: one JSON line; exit 0 when graded, 1 where
    the sandbox cannot run, 2 on bad arguments or a malformed tests file (one line naming the problem)."""
    parser = argparse.ArgumentParser(prog="sandbox.py", description=main.__doc__)
    parser.add_argument("program", help="a Python program, or with --completion a completion to extract it from")
    parser.add_argument(
        "--tests",
        required=True,
        help='JSON: a list of {"input", "output"} tests, or a code '
        'problem {"tests", "style", "fn_name", "tolerance", "case_sensitive"} as data/prepare.py writes them',
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
        help="memory of one run in MiB (default: %(default)s)",
    )
    parser.error = lambda message: parser.exit(2, f"sandbox.py: {message}\n")
    args = parser.parse_args(argv)
    try:
        problem, source, limits = _read_problem(args)
    except (OSError, ValueError) as error:  # json's and check_problem's errors are ValueErrors
        parser.error(str(error).replace("\n", " "))
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
