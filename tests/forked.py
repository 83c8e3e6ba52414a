"""The body of a command process that conftest.fork_command forks from multiprocessing's fork server: `python
SCRIPT ARGS` or `python -m MODULE ARGS` (train.py, sft.py, research.counterfactual) as its own __main__, in the
given folder and environment, with stdout and stderr appended to the given files.

The fork server imports PRELOAD once; every command forked from it starts with torch, torch._dynamo (which
torch.optim.AdamW imports) and transformers (the tokenizer's) already loaded, where a fresh interpreter pays
about 7 s of CPU for them before its first step. The process is still the command's own: signals reach it,
its exit status is the script's, and Python's default Ctrl-C handler is back in place (the fork server
ignores SIGINT; its children restore the handler)."""

import atexit
import os
import runpy
import sys

# research.counterfactual, run with -m, is left to the child: runpy warns when a module it runs is imported already
PRELOAD = ["forked", "train", "sft", "research.study", "torch._dynamo", "transformers"]


def run(argv: list[str], env: dict[str, str], cwd: str, stdout: str, stderr: str) -> None:
    """argv (what follows `python`) as the interpreter runs it: sys.path starts with the script's folder, or
    with cwd under -m. Exit handlers run as at the end of an interpreter (a multiprocessing child skips
    them), so pools of workers close as they would."""
    os.environ.clear()
    os.environ.update(env)
    if "OMP_NUM_THREADS" in env:  # torch read it when the fork server imported it; a fresh interpreter reads it now
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    os.chdir(cwd)
    for fd, path in ((1, stdout), (2, stderr)):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    try:
        if argv[0] == "-m":
            sys.path.insert(0, cwd)
            sys.argv = [argv[1], *argv[2:]]
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            sys.argv = list(argv)
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        atexit._run_exitfuncs()
