"""Errors as a run's user meets them: the user's own mistakes (USER_ERRORS, one line and exit status 2) told
apart from failures inside the work (inside_training: they keep their traceback), and out of memory named
by the phase it struck and the flag that lowers it (oom_hint).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from infra.rundir import RunInUse

USER_ERRORS = (ValueError, OSError, RunInUse)  # OSError: missing files, full disks, read-only folders


def inside_training(error: BaseException, functions: tuple[str, ...] = ("train_step", "held_out")) -> bool:
    """Whether an error was raised inside a training step rather than by the checks before it: those are
    bugs or hardware trouble, and keep their traceback."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in functions:
            return True
        tb = tb.tb_next
    return False


@contextmanager
def oom_hint(what: str, advice: str) -> Iterator[None]:
    """Out of memory inside the block becomes an error that names the phase and the flag that lowers it."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(f"out of memory in {what}: {advice}") from error
