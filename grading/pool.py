"""One pool of worker processes for every job that needs a time bound: the answer checker's sympy workers
(reward.py), user reward functions (scoring.py) and the sandbox's supervisors (sandbox.py).

A worker is a persistent process that answers one frame (8-byte length, then the bytes) with one frame. The
pool starts workers on demand, sends each job to an idle one, and waits with the job's deadline; a worker
past its deadline, or dead, is killed and replaced, and so is one whose reply the caller calls unhealthy.
The frames are bytes: each caller picks its encoding (JSON where the worker is not trusted to send pickles).

    workers = pool.Pool(lambda: pool.Launch([sys.executable, "-c", "...; pool.serve(handle)"]))
    replies = workers.map([b"job 1", b"job 2"], [2.0, 2.0], workers=2)   # bytes, or a pool.Failure each

This module imports only the standard library: the sandbox's supervisors import it under `python -I -S`.
"""

import atexit
import os
import select
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

READY = b"ready"  # a worker's first frame; any other first frame says why it cannot work
START_TIMEOUT_S = 60.0
_HEADER = struct.Struct("<Q")


class StartError(RuntimeError):
    """A worker did not start: its first frame, its stderr, or "no answer"."""


class Failure(NamedTuple):
    """A job without a reply: "timeout" (past its deadline) or "died" (the worker exited), and the end of
    the worker's stderr when the pool kept it."""

    kind: str
    log: str = ""


class Launch(NamedTuple):
    """How to start one worker: its command, environment (None: this process's), and whatever the caller
    attaches to it (a supervisor's user and root folder), handed back to `cleanup` when it is retired."""

    argv: list[str]
    env: dict[str, str] | None = None
    state: Any = None


@dataclass(eq=False)  # by identity: workers are dict keys
class Worker:
    proc: subprocess.Popen
    state: Any
    log: Any  # a temporary file holding its stderr, or None
    buffer: bytearray = field(default_factory=bytearray)

    def send(self, frame: bytes) -> None:
        self.proc.stdin.write(_HEADER.pack(len(frame)) + frame)
        self.proc.stdin.flush()

    def take(self) -> bytes | None:
        """A whole frame from what has been read, or None while it is incomplete."""
        if len(self.buffer) < _HEADER.size:
            return None
        size = _HEADER.size + _HEADER.unpack_from(self.buffer)[0]
        if len(self.buffer) < size:
            return None
        frame = bytes(self.buffer[_HEADER.size : size])
        del self.buffer[:size]
        return frame

    def read(self) -> bool:
        """Read what the worker has written; False at end of file (it died)."""
        chunk = os.read(self.proc.stdout.fileno(), 1 << 20)
        self.buffer += chunk
        return bool(chunk)

    def tail(self) -> str:
        if self.log is None:
            return ""
        self.log.seek(0)
        return self.log.read().decode(errors="replace").strip()[-500:]


class Pool:
    """Workers started by `launch` and ended by kill, then `cleanup(state)`; one caller at a time (a lock)."""

    def __init__(
        self,
        launch: Callable[[], Launch],
        *,
        cleanup: Callable[[Any], None] | None = None,
        keep_log: bool = False,
        quiet: bool = False,
        new_session: bool = False,
        start_timeout: float = START_TIMEOUT_S,
    ) -> None:
        self.launch, self.cleanup, self.start_timeout = launch, cleanup, start_timeout
        self.keep_log, self.quiet, self.new_session = keep_log, quiet, new_session
        self.idle: list[Worker] = []
        self.lock = threading.Lock()
        atexit.register(self.close)

    # ------------------------------------------------------------------------- starting and ending workers

    def _start(self, count: int) -> list[Worker]:
        """`count` new workers, started together and each waited for until its first frame."""
        workers = []
        try:
            for _ in range(count):
                launch = self.launch()
                log = tempfile.TemporaryFile() if self.keep_log else None
                stderr = log if log is not None else (subprocess.DEVNULL if self.quiet else None)
                proc = subprocess.Popen(
                    launch.argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=stderr,
                    env=launch.env,
                    bufsize=0,
                    start_new_session=self.new_session,  # the terminal's Ctrl-C is the caller's, not the worker's
                )
                workers.append(Worker(proc, launch.state, log))
            deadline = time.monotonic() + self.start_timeout
            for worker in workers:
                first = self._receive(worker, deadline)
                if first != READY:
                    why = first.decode(errors="replace") if isinstance(first, bytes) else worker.tail() or "no answer"
                    raise StartError(why)
        except BaseException:
            for worker in workers:
                self.retire(worker)
            raise
        return workers

    def retire(self, worker: Worker) -> None:
        """Kill a worker, then let the caller clean up after it."""
        worker.proc.kill()
        worker.proc.wait()
        for stream in (worker.proc.stdin, worker.proc.stdout):
            stream.close()
        if self.cleanup is not None:
            self.cleanup(worker.state)
        if worker.log is not None:
            worker.log.close()

    def _receive(self, worker: Worker, deadline: float) -> bytes | Failure:
        """One frame from one worker, waiting until `deadline`."""
        while (frame := worker.take()) is None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([worker.proc.stdout], [], [], wait)[0]:
                return Failure("timeout")
            if not worker.read():
                return Failure("died", worker.tail())
        return frame

    # ------------------------------------------------------------------------- running jobs

    def map(
        self,
        frames: Sequence[bytes],
        timeouts: Sequence[float],
        workers: int,
        healthy: Callable[[bytes], bool] | None = None,
    ) -> list[bytes | Failure]:
        """Each frame's reply, `workers` jobs at a time, each within its timeout (seconds from its send). A
        worker that misses its deadline or dies gives a Failure and is replaced; one whose reply is not
        `healthy` is replaced after it (the reply still counts). A worker found dead at a send (it died idle)
        is replaced and the job sent again."""
        replies: list[bytes | Failure | None] = [None] * len(frames)
        with self.lock:
            want = min(workers, len(frames))
            for worker in [w for w in self.idle if w.proc.poll() is not None]:
                self.idle.remove(worker)
                self.retire(worker)
            self.idle += self._start(max(0, want - len(self.idle)))
            idle, rest = self.idle[:want], self.idle[want:]
            busy: dict[Worker, tuple[int, float]] = {}  # -> (job index, deadline)
            todo = list(range(len(frames)))[::-1]
            try:
                while todo or busy:
                    while todo and idle:
                        i = todo.pop()
                        busy[self._send(idle.pop(), frames[i])] = (i, time.monotonic() + timeouts[i])
                    wait = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
                    ready, _, _ = select.select([w.proc.stdout for w in busy], [], [], wait)
                    now = time.monotonic()
                    for worker, (i, deadline) in list(busy.items()):
                        alive = worker.read() if worker.proc.stdout in ready else True
                        frame = worker.take()
                        if frame is None and alive and now < deadline:
                            continue  # still working
                        del busy[worker]
                        if frame is None:
                            replies[i] = Failure("timeout" if alive else "died", worker.tail())
                        else:
                            replies[i] = frame
                        if frame is None or (healthy is not None and not healthy(frame)):
                            self.retire(worker)
                            worker = self._start(1)[0]
                        idle.append(worker)
            finally:
                for worker in busy:  # an exception left them mid-job: their next reply would be out of step
                    self.retire(worker)
                self.idle = idle + rest
        return replies

    def call(self, frame: bytes, timeout: float) -> bytes | Failure:
        """One job on one worker (map of one)."""
        return self.map([frame], [timeout], 1)[0]

    def _send(self, worker: Worker, frame: bytes) -> Worker:
        """The worker the frame went to: this one, or its replacement when it died idle."""
        try:
            worker.send(frame)
        except (BrokenPipeError, ConnectionResetError):
            self.retire(worker)
            worker = self._start(1)[0]
            worker.send(frame)
        return worker

    def close(self) -> None:
        """Retire every idle worker (they would also die with this process: their stdin closes)."""
        with self.lock:
            for worker in self.idle:
                self.retire(worker)
            self.idle.clear()


# ----------------------------------------------------------------------------- the worker's side


def announce(message: bytes) -> None:
    """A worker's first frame: READY, or why it cannot work (then it exits)."""
    os.write(1, _HEADER.pack(len(message)) + message)


def serve(handle: Callable[[bytes], bytes]) -> None:
    """A worker's loop after READY: one frame in, handle(frame) out, until stdin closes. Python's own stdout
    becomes stderr, so that nothing a job prints can corrupt the replies."""
    sys.stdout = sys.stderr
    jobs = os.fdopen(0, "rb", buffering=0)
    announce(READY)
    while (header := _read_exactly(jobs, _HEADER.size)) is not None:
        frame = _read_exactly(jobs, _HEADER.unpack(header)[0])
        if frame is None:
            return
        reply = handle(frame)
        view = memoryview(_HEADER.pack(len(reply)) + reply)
        while view:
            view = view[os.write(1, view) :]


def _read_exactly(stream, size: int) -> bytes | None:
    data = bytearray()
    while len(data) < size:
        chunk = stream.read(size - len(data))
        if not chunk:
            return None
        data += chunk
    return bytes(data)
