"""The run directory on disk: checkpoints written atomically and read back with a fallback, the metrics
file trimmed for a resume, strict JSON files, and the best adapter.

    runs/NAME/config.json        the settings the run started with
    runs/NAME/config.toml        the settings of its latest start or resume, as `train.py --config` reads them
    runs/NAME/metrics.jsonl      one JSON line per step
    runs/NAME/checkpoint-STEP/   adapter (PEFT format) + trainer.pt (optimizer, state, RNG); the two newest
                                 (a full run: shards/ + trainer.pt, see below)
    runs/NAME/latest             the name of the newest complete checkpoint
    runs/NAME/best/              the adapter with the best held-out accuracy (a full run: the whole weights,
                                 in transformers' layout)
    runs/NAME/summary.json       before / after / best, written at the end

Every file is written under a temporary name and renamed into place, so a crash at any moment leaves
the previous good state readable.

A full-parameter run (--lora-rank 0) keeps its weights and AdamW's moments sharded over the ranks
(fsdp.py), and every rank writes its own shards with torch.distributed.checkpoint into the
checkpoint's temporary folder: shards/ holds one file per rank and the global shapes of every tensor,
so a run resumes on any number of processes, each reading the slices of the tensors it now holds.
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

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict, set_model_state_dict,
                                                     set_state_dict)

import distributed
import eval as evaluation
import fsdp
import lora
import weights
from config import Config


def keep_best(run_dir: Path, model, state: dict, result: dict, write: bool = True, tokenizer=None) -> None:
    """Keep the policy with the best held-out accuracy in run_dir/best (the papers report best and last):
    a LoRA run's adapter, a full run's whole weights (with the tokenizer, so eval.py --model reads it).
    Every rank updates its state (and gathers a sharded model's weights), and the writer (rank 0) the folder."""
    if state["best"] is not None and result["accuracy"] <= state["best"]["accuracy"]:
        return
    state["best"] = {**result, "step": state["step"]}
    with fsdp.whole(model) as whole_model:
        if not write:
            return
        if not lora.lora_modules(model):
            weights.save_pretrained(whole_model, run_dir / "best", tokenizer=tokenizer)  # replaces itself atomically
            return
        tmp = run_dir / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        lora.save(model, tmp)
        shutil.rmtree(run_dir / "best", ignore_errors=True)
        os.replace(tmp, run_dir / "best")


def save_checkpoint(run_dir: Path, model, optimizer, state: dict, world: distributed.World = distributed.SOLO) -> Path:
    """Write checkpoint-STEP under a temporary name, rename it into place, then repoint `latest`.

    Each rename is atomic, so a crash at any moment leaves `latest` naming a complete checkpoint. The two
    newest checkpoints are kept, so a latest one damaged on disk still has a fallback. Every rank calls it:
    rank 0 writes the files, and each rank its shards of a sharded model; the others wait for rank 0.
    """
    name = f"checkpoint-{state['step']:06d}"
    tmp, final = run_dir / f".{name}.tmp", run_dir / name
    sharded, writer = fsdp.is_sharded(model), world.rank == 0
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if sharded:
        world.barrier("waiting for rank 0 to start a checkpoint")
        has_moments = _save_shards(model, optimizer, tmp / SHARDS)
        world.barrier("waiting for every rank to write its shards")
    if writer:
        if not sharded:
            lora.save(model, tmp / "adapter")
        optimizer_state = {"has_moments": has_moments} if sharded else optimizer.state_dict()
        torch.save({"optimizer": optimizer_state, "state": state, "rng": _rng_state()}, tmp / "trainer.pt")
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        pointer = run_dir / ".latest.tmp"
        pointer.write_text(name)
        os.replace(pointer, run_dir / "latest")
        for old in sorted(run_dir.glob("checkpoint-*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    world.barrier("waiting for rank 0 to write a checkpoint")
    return final


def load_checkpoint(run_dir: Path, model, optimizer) -> dict:
    """Restore the newest readable checkpoint (falling back to the one before, with a warning). Every rank
    calls it; a sharded model's ranks read their own slices of the shards together."""
    latest = run_dir / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint found (missing {latest})")
    newest = run_dir / latest.read_text().strip()
    candidates = [newest, *sorted((p for p in run_dir.glob("checkpoint-*") if p != newest), reverse=True)]
    for ckpt_dir in candidates:
        try:
            saved = torch.load(ckpt_dir / "trainer.pt", weights_only=False)
            if fsdp.is_sharded(model):
                _load_shards(model, optimizer, ckpt_dir / SHARDS, saved["optimizer"]["has_moments"])
            else:
                lora.load(model, ckpt_dir / "adapter")
                optimizer.load_state_dict(saved["optimizer"])
        except Exception as error:  # a damaged file: say which, then try the previous checkpoint
            warnings.warn(f"{ckpt_dir} cannot be read ({type(error).__name__}: {error}); trying an older checkpoint")
            continue
        _set_rng_state(saved["rng"])
        return saved["state"]
    raise ValueError(f"--resume {run_dir}: no readable checkpoint among {', '.join(p.name for p in candidates)}")


SHARDS = "shards"  # a full run's weights and AdamW moments, as torch.distributed.checkpoint writes them


def _save_shards(model, optimizer, path: Path) -> bool:
    """Every rank writes its shards of the weights and, once AdamW has stepped, of its moments; returns whether
    the moments were written. Before the first step there are none: asking torch for the optimizer's state
    dict would create them with one empty step, and AdamW's bias correction would then count one step too many."""
    fsdp.reshard(model)  # the shards are the weights; a gathered root is a copy of them
    has_moments = bool(optimizer.state)
    if has_moments:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=path)
    else:
        dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=path)
    return has_moments


def _load_shards(model, optimizer, path: Path, has_moments: bool) -> None:
    """Read this rank's slices of the saved weights (and moments) into the model and optimizer, whatever the
    number of ranks that wrote them."""
    fsdp.reshard(model)
    if has_moments:  # the optimizer's state dict, moments created empty, is the layout to read into
        model_state, optimizer_state = get_state_dict(model, optimizer)
        loaded = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(loaded, checkpoint_id=path)
        set_state_dict(model, optimizer, model_state_dict=loaded["model"], optim_state_dict=loaded["optimizer"])
    else:
        loaded = {"model": get_model_state_dict(model)}
        dcp.load(loaded, checkpoint_id=path)
        set_model_state_dict(model, loaded["model"])


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
    write_text(path, to_json(value) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write a file under a temporary name and rename it into place: never half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
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
