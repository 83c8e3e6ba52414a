"""Stopping a run cleanly: Ctrl-C (or SIGTERM, as a scheduler sends it) during a run.

The first signal asks the loop to stop after the step it is in, which then writes a checkpoint and
ends with Stopped (exit status 130); a second one interrupts at once (Interrupted), and the last
checkpoint stays as it was. Inside `immediate()` (an evaluation, which holds nothing to save) the first
signal interrupts at once. train.py and sft.py run their loops inside a StopRequest.
"""

import signal
import sys
from pathlib import Path


class StopRequest:
    """While active, the first Ctrl-C (or SIGTERM) asks the loop to stop after the current step and
    checkpoint; a second one interrupts at once, and the last checkpoint stays as it was. Inside
    `immediate()` (evaluations, which hold nothing to save) the first one interrupts at once."""

    def __enter__(self):
        self.requested, self.interrupt_now = False, False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def immediate(self):
        return _Flag(self, "interrupt_now")

    def _handle(self, signum, frame):
        if self.requested or self.interrupt_now:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (press Ctrl-C again to abort without saving)", file=sys.stderr)


class _Flag:
    """Sets an attribute to True for the duration of a with block."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name

    def __enter__(self):
        setattr(self.owner, self.name, True)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, False)


class Stopped(Exception):
    """The loop stopped after a step on Ctrl-C (or SIGTERM), with a checkpoint of that step."""

    def __init__(self, run_dir: Path, step: int):
        super().__init__(f"stopped at step {step}; continue with: python train.py --resume {run_dir}")
        self.run_dir, self.step = run_dir, step


class Interrupted(KeyboardInterrupt):
    """A Ctrl-C that could not wait for the step to end (a second one, or one during an evaluation): the
    run keeps its last checkpoint."""

    def __init__(self, run_dir: Path):
        super().__init__(f"interrupted; the last checkpoint is kept: continue with python train.py --resume {run_dir}")
        self.run_dir = run_dir


def exit_interrupted() -> None:
    """Exit with status 130. A further Ctrl-C while the process ends (its worker pools closing) is ignored: the
    run is already safe, and it would only print a traceback from an exit handler."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.exit(130)
