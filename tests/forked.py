"""The body of a command process that conftest.launch forks from multiprocessing's fork server: `python SCRIPT
ARGS` (train.py, sft.py) as its own __main__, in the repository root, with the launching test's environment,
stdout to /dev/null and stderr to a log file.

The fork server imports PRELOAD once; every command forked from it starts with torch, torch._dynamo (which
torch.optim.AdamW imports) and transformers (the tokenizer's) already loaded, where a fresh interpreter pays
about 7 s of CPU for them before its first step. The process is still the command's own: signals reach it,
its exit status is the script's, and Python's default Ctrl-C handler is back in place (the fork server
ignores SIGINT; its children restore the handler)."""

import atexit
import os
import runpy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRELOAD = ["forked", "train", "sft", "torch._dynamo", "transformers"]


def run(script: str, args: list[str], env: dict[str, str], log: str) -> None:
    """SCRIPT ARGS as `python SCRIPT ARGS` runs it from the repository root; exit handlers run as at the end of
    an interpreter (a multiprocessing child skips them), so pools of workers close as they would."""
    os.environ.clear()
    os.environ.update(env)
    os.chdir(ROOT)
    sys.path.insert(0, str(ROOT))
    sys.argv = [script, *args]
    devnull, stderr = os.open(os.devnull, os.O_WRONLY), os.open(log, os.O_WRONLY | os.O_APPEND)
    os.dup2(devnull, 1)
    os.dup2(stderr, 2)
    try:
        runpy.run_path(script, run_name="__main__")
    finally:
        atexit._run_exitfuncs()
