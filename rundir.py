"""The run directory on disk: checkpoints written atomically and read back with a fallback, the metrics
file trimmed for a resume, strict JSON files, and the best adapter.

    runs/NAME/config.json        the settings the run started with
    runs/NAME/metrics.jsonl      one JSON line per step
    runs/NAME/checkpoint-STEP/   adapter (PEFT format) + trainer.pt (optimizer, state, RNG); the two newest
    runs/NAME/latest             the name of the newest complete checkpoint
    runs/NAME/best/              the adapter with the best held-out accuracy
    runs/NAME/summary.json       before / after / best, written at the end

Every file is written under a temporary name and renamed into place, so a crash at any moment leaves
the previous good state readable.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
import warnings
from pathlib import Path

import numpy as np
import torch

import eval as evaluation
import lora
import weights
from config import Config


def keep_best(run_dir: Path, model, state: dict, result: dict, write: bool = True) -> None:
    """Keep the adapter with the best held-out accuracy in run_dir/best (the papers report best and last);
    every rank updates its state, and the writer (rank 0) the folder."""
    if state["best"] is not None and result["accuracy"] <= state["best"]["accuracy"]:
        return
    state["best"] = {**result, "step": state["step"]}
    if not write:
        return
    tmp = run_dir / ".best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    lora.save(model, tmp)
    shutil.rmtree(run_dir / "best", ignore_errors=True)
    os.replace(tmp, run_dir / "best")


def save_checkpoint(run_dir: Path, model, optimizer, state: dict) -> Path:
    """Write checkpoint-STEP under a temporary name, rename it into place, then repoint `latest`.

    Each rename is atomic, so a crash at any moment leaves `latest` naming a complete checkpoint. The two
    newest checkpoints are kept, so a latest one damaged on disk still has a fallback.
    """
    name = f"checkpoint-{state['step']:06d}"
    tmp, final = run_dir / f".{name}.tmp", run_dir / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lora.save(model, tmp / "adapter")
    torch.save({"optimizer": optimizer.state_dict(), "state": state, "rng": _rng_state()}, tmp / "trainer.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = run_dir / ".latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, run_dir / "latest")
    for old in sorted(run_dir.glob("checkpoint-*"))[:-2]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(run_dir: Path, model, optimizer) -> dict:
    """Restore the newest readable checkpoint (falling back to the one before, with a warning)."""
    latest = run_dir / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint found (missing {latest})")
    newest = run_dir / latest.read_text().strip()
    candidates = [newest, *sorted((p for p in run_dir.glob("checkpoint-*") if p != newest), reverse=True)]
    for ckpt_dir in candidates:
        try:
            lora.load(model, ckpt_dir / "adapter")
            saved = torch.load(ckpt_dir / "trainer.pt", weights_only=False)
        except Exception as error:  # a damaged file: say which, then try the previous checkpoint
            warnings.warn(f"{ckpt_dir} cannot be read ({type(error).__name__}: {error}); trying an older checkpoint")
            continue
        optimizer.load_state_dict(saved["optimizer"])
        _set_rng_state(saved["rng"])
        return saved["state"]
    raise ValueError(f"--resume {run_dir}: no readable checkpoint among {', '.join(p.name for p in candidates)}")


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from; they will be produced again.

    A process killed mid-write can leave a partial last line; it is dropped too. A bad line
    anywhere else means the file is not ours to rewrite, so it is an error.
    """
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line; fix or remove it before resuming") from None
        if record["step"] <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


def to_json(value) -> str:
    """Strict JSON: NaN and infinities (an undefined standard error, say) become null."""
    return json.dumps(evaluation.strict_json(value), allow_nan=False)


def write_json(path: Path, value) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(to_json(value) + "\n")
    os.replace(tmp, path)


def prepare_run_dir(cfg: Config) -> Path:
    """The run directory, after checking that starting or resuming there loses nothing."""
    run_dir = Path(cfg.out_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))
    if not cfg.resume and (run_dir / "latest").exists():
        raise FileExistsError(f"{run_dir} already holds a run: continue it with --resume {run_dir}, "
                              "or pick another --run-name")
    if cfg.export:
        weights.check_export_dir(cfg.export)  # before training, not after it
    return run_dir
