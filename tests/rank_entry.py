"""The script each torchrun agent of the simulated nodes runs (test_distributed.run_nodes):

    rank_entry.py MODULE.WORKER ARG...

runs MODULE.WORKER(rank, *ARGS) in the environment torchrun gives its worker, as a spawned rank runs it
under run_ranks (the worker applies its own patches). First it writes where torchrun placed it,
node-rank-RANK.json in NODE_LOG_DIR, so the test can check that each rank ran as the one rank of its node.
"""

import importlib
import json
import os
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
PLACEMENT = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE")


def main(argv: list[str]) -> None:
    target, *args = argv
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]  # the worker's modules, importable as under pytest
    module, _, name = target.rpartition(".")
    worker = getattr(importlib.import_module(module), name)
    placement = {key: int(os.environ[key]) for key in PLACEMENT}
    Path(os.environ["NODE_LOG_DIR"], f"node-rank-{placement['RANK']}.json").write_text(json.dumps(placement))
    torch.set_num_threads(1)  # the ranks share the cores, as under run_ranks
    worker(placement["RANK"], *args)


if __name__ == "__main__":
    main(sys.argv[1:])
