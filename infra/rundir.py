"""The run directory on disk: one writer at a time, the start of a run (a new run's first files, a resume's
checkpoint and the record of what it changed, the trackers, an export-only resume), checkpoints written
atomically and read back with a fallback, the metrics file trimmed for a resume, strict JSON files, and
the validation split and the adapter best on it.

    runs/NAME/.lock              held (flock) by the one process writing the run; it names that process
    runs/NAME/config.json        the run's settings, rewritten when a resume changes them
    runs/NAME/config.toml        the settings of its latest start or resume, as `--config` reads them: each
                                 value's origin, the derived ones as comments (config.to_toml)
    runs/NAME/metrics.jsonl      one JSON line per step; a resume that changes settings adds an event line
    runs/NAME/checkpoint-STEP/   adapter (PEFT format) + trainer.pt (optimizer, state, RNG); the two newest
                                 (a full run: shards/ + trainer.pt, see below)
    runs/NAME/latest             the name of the newest complete checkpoint
    runs/NAME/validation.json    the validation split: training problems held out of training, none of them
                                 a problem of the held-out sets
    runs/NAME/best/              the adapter with the best accuracy on the validation split (a full run: the
                                 whole weights, in transformers' layout); never chosen on the held-out sets
    runs/NAME/summary.json       before / after (held-out, the last policy) / best (validation), at the end

Every file is written under a temporary name and renamed into place, so a crash at any moment leaves
the previous good state readable; a write that fails (a full disk, a read-only folder) removes its
temporary file and raises WriteError naming the file.

A full-parameter run (--lora-rank 0) keeps its weights and AdamW's moments sharded over the ranks
(fsdp.py), and every rank writes its own shards with torch.distributed.checkpoint into the
checkpoint's temporary folder: shards/ holds one file per rank and the global shapes of every tensor,
so a run resumes on any number of processes, each reading the slices of the tensors it now holds.
"""

from __future__ import annotations

import errno
import fcntl
import json
import math
import os
import random
import shutil
import sys
import time
import warnings
from collections.abc import Mapping
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

import config
import lora
from config import Config
from infra import distributed, fsdp, loggers, weights

LOCK_FILE = ".lock"


class RunInUse(RuntimeError):
    """Another process holds the run directory's lock."""


class WriteError(OSError):
    """A file of the run could not be written. Says which, why, and (once the run has a checkpoint to
    continue from, run_dir) how to continue."""

    run_dir: Path | None = None

    def __str__(self) -> str:
        text = f"cannot write {self.filename}: {self.strerror}"
        if self.run_dir is not None:
            text += f"; the run keeps its last checkpoint: continue with python train.py --resume {self.run_dir}"
        return text


@contextmanager
def writing(path: Path, *temporary: Path):
    """A write of `path`: an OSError inside (ENOSPC, EACCES, ...) removes the temporary files or folders
    and becomes a WriteError naming the path; torch's and safetensors' own write errors arrive as OSError
    (save_checkpoint hands torch a Python file, lora.save_safetensors converts)."""
    try:
        yield
    except OSError as error:
        for leftover in temporary:
            if leftover.is_dir():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink(missing_ok=True)
        code = error.errno or errno.EIO
        raise WriteError(code, error.strerror or os.strerror(code), str(error.filename or path)) from None


# ----------------------------------------------------------------------------- one writer


def run_path(cfg: Config) -> Path:
    """The run directory the settings name (config.validate keeps --run-name one folder inside --out-dir)."""
    return Path(cfg.out_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))


def has_checkpoint(run_dir: Path) -> bool:
    """Whether the folder holds a run to continue: a `latest` pointer or any checkpoint."""
    return (run_dir / "latest").exists() or any(run_dir.glob("checkpoint-*"))


class RunLock:
    """An exclusive lock on a run directory for the life of a process: train, resume and export take it
    before they write anything there, so two processes never write one run. flock is released by the
    kernel when the process ends, however it ends, so a lock left by a crash is never in the way; the
    file keeps the holder's pid for the message another process prints.

    A new run creates its folder here; if its start fails before the first step (a tracker that cannot log
    in, say), discard() removes the folder again, so the failed start leaves nothing behind that would block a
    retry.
    """

    def __init__(self, run_dir: Path, resume: bool, active: bool = True):
        self.run_dir, self.resume, self.active = run_dir, resume, active  # inactive: not the writing rank
        self.created, self.fd = False, None

    def __enter__(self) -> RunLock:
        if not self.active:
            return self
        try:
            with writing(self.run_dir):
                while self.fd is None:
                    try:
                        self.run_dir.mkdir(parents=True)
                        self.created = True
                    except FileExistsError:
                        pass
                    self.fd = self._take(self.run_dir / LOCK_FILE)
            if not self.resume and has_checkpoint(self.run_dir):  # checked under the lock: no two runs pass
                raise FileExistsError(
                    f"{self.run_dir} already holds a run: continue it with --resume "
                    f"{self.run_dir}, or pick another --run-name"
                )
            with writing(self.run_dir / LOCK_FILE):
                os.ftruncate(self.fd, 0)
                os.write(self.fd, f"{os.getpid()}\n".encode())
        except BaseException:
            self.discard()
            self.__exit__()
            raise
        return self

    def _take(self, path: Path) -> int | None:
        """The locked file's descriptor; None when the file was removed or replaced before the lock was
        taken (a failed start discarding its folder), so the caller takes the new one."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        except FileNotFoundError:
            return None  # the folder went away meanwhile
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunInUse(
                f"{self.run_dir} is in use by process {holder} (a train.py run, resume or export writes "
                "it); wait for that process to end, or stop it"
            ) from None
        try:
            same = os.stat(path).st_ino == os.fstat(fd).st_ino
        except FileNotFoundError:
            same = False
        if not same:
            os.close(fd)
            return None
        return fd

    def discard(self) -> None:
        """Remove the folder this lock created, while still holding the lock: a start that failed before the
        run's first step (its step-0 checkpoint holds nothing a retry would not write again)."""
        if self.active and self.created:
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def __exit__(self, *exc) -> None:
        if self.fd is not None:
            os.close(self.fd)  # releases the flock
            self.fd = None


# ----------------------------------------------------------------------------- starting a run


def open_run(cfg: Config, run_dir: Path, model, optimizer, world: distributed.World, save) -> dict:
    """The state a run starts from: a resumed run's checkpoint (the same on every rank, whatever the
    world size), or step 0 of a new run, checkpointed at once so a run stopped before its first step
    can resume. A resume that changes settings records them (record_resume)."""
    writer = world.rank == 0
    if cfg.resume:
        state = load_checkpoint(run_dir, model, optimizer)
        world.barrier("loading the checkpoint")  # before rank 0 may write the next one
        if writer:
            note_resume(cfg, run_dir, state["step"])
        return state
    state = {"step": 0, "data_position": 0, "before": None, "best": None}
    if writer:
        write_settings(cfg, run_dir)
    save(state)
    return state


def write_settings(cfg: Config | config.SFTConfig, run_dir: Path) -> None:
    """A new run's settings: config.json (every value it runs with) and config.toml (each value's origin, the
    derived ones as comments: the file `--config` reads to start the run again); no metrics yet."""
    write_json(run_dir / "config.json", config.flat_config(cfg))
    write_text(run_dir / "config.toml", config.to_toml(cfg))
    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
    print(f"run directory: {run_dir}", file=sys.stderr)


def note_resume(cfg: Config | config.SFTConfig, run_dir: Path, step: int) -> None:
    """A resume's record, train.py's and sft.py's: the metrics after its checkpoint dropped, config.toml with the
    settings it now runs with, and what changed, derived values included, in config.json and metrics.jsonl
    (record_resume) and on stderr."""
    truncate_metrics(run_dir / "metrics.jsonl", step)
    write_text(run_dir / "config.toml", config.to_toml(cfg))
    saved = config.saved_config(
        run_dir, (config.SFT_FIELDS if isinstance(cfg, config.SFTConfig) else config.FIELDS).keys()
    )
    changed = config.changed_settings(saved, cfg)
    if changed:
        record_resume(run_dir, step, changed, {**config.flat_config(cfg), "resume": saved.get("resume")})
    shown = ", ".join(f"--{name.replace('_', '-')} {old} -> {new}" for name, (old, new) in changed.items())
    print(f"resumed {run_dir} at step {step}" + (f"; changed: {shown}" if shown else ""), file=sys.stderr)


def open_trackers(cfg: Config, run_dir: Path, state: dict, eval_sets: list[str], writer: bool) -> loggers.Loggers:
    """The --log trackers of the writing process (none on the others), with the evaluations logged so far."""
    earlier = [(state["before"], 0, "before")] if state["before"] else []
    if cfg.resume and cfg.log and writer:  # the results table goes on from the run's earlier evaluations
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("eval"):
                earlier.append((record["eval"], record["step"], f"step {record['step']}"))
        if state.get("after"):  # a finished run trained further: its final evaluation so far
            earlier.append((state["after"], state["step"], "after"))
    return loggers.Loggers(
        cfg.log if writer else "",
        run_dir,
        config.flat_config(cfg),
        config.to_toml(cfg),
        cfg.log_project,
        state["step"],
        bool(cfg.resume),
        eval_sets,
        earlier,
    )


def export_run(cfg: Config, run_dir: Path, model, tokenizer, optimizer, world: distributed.World) -> dict:
    """--resume RUN --steps 0 --export DIR: the policy of the run's last checkpoint, merged and exported;
    nothing trains, nothing is evaluated, and the run directory is left as it was."""
    state = load_checkpoint(run_dir, model, optimizer)
    with fsdp.whole(model) as whole_model:  # a sharded model is gathered on every rank, for rank 0 to write
        if world.rank == 0:
            weights.save_pretrained(whole_model, cfg.export, tokenizer=tokenizer)
            print(
                f"exported the {'merged ' if cfg.lora_rank else ''}weights of {run_dir} at step {state['step']} "
                f"to {cfg.export}",
                file=sys.stderr,
            )
    world.barrier("waiting for rank 0 to write the export")
    return state


# ----------------------------------------------------------------------------- checkpoints


VALIDATION_PROBLEMS = 32  # problems of the validation split, at most a quarter of the training set


def validation_split(train_set: list[dict], eval_sets: dict[str, list[dict]], seed: int) -> tuple[list, list]:
    """(training problems, validation problems): the validation split is a seeded sample of the training set
    (its distribution), drawn only among problems whose statement is in no held-out set, and taken out of
    training. The best checkpoint is chosen on it, so no held-out figure comes from a checkpoint selected on
    the held-out problems. VALIDATION_PROBLEMS of them, at most a quarter of the training set."""
    held_out = {problem["problem"] for problems in eval_sets.values() for problem in problems}
    eligible = [i for i, problem in enumerate(train_set) if problem["problem"] not in held_out]
    size = min(VALIDATION_PROBLEMS, len(train_set) // 4, len(eligible))
    order = torch.randperm(len(eligible), generator=torch.Generator().manual_seed(seed * 7907 + 1))
    chosen = {eligible[int(i)] for i in order[:size]}
    return (
        [problem for i, problem in enumerate(train_set) if i not in chosen],
        [train_set[i] for i in sorted(chosen)],
    )


def keep_best(run_dir: Path, model, state: dict, result: dict, write: bool = True, tokenizer=None) -> None:
    """Keep the policy with the best accuracy on the validation split (result: its evaluation) in run_dir/best:
    a LoRA run's adapter, a full run's whole weights (with the tokenizer, so eval.py --model reads it).
    Every rank updates its state (and gathers a sharded model's weights), and the writer (rank 0) the folder."""
    if state["best"] is not None and result["accuracy"] <= state["best"]["accuracy"]:
        return
    state["best"] = {**result, "step": state["step"], "split": "validation"}
    with fsdp.whole(model) as whole_model:
        if not write:
            return
        if not lora.lora_modules(model):
            with writing(run_dir / "best"):  # replaces itself atomically
                weights.save_pretrained(whole_model, run_dir / "best", tokenizer=tokenizer)
            return
        tmp = run_dir / ".best.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        with writing(run_dir / "best", tmp):
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
    tmp, final, pointer = run_dir / f".{name}.tmp", run_dir / name, run_dir / ".latest.tmp"
    sharded, writer = fsdp.is_sharded(model), world.rank == 0
    with writing(final, *([tmp] if writer else [])):
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
            with open(tmp / "trainer.pt", "wb") as f:  # a Python file: a full disk is an OSError, not torch's
                torch.save({"optimizer": optimizer_state, "state": state, "rng": _rng_state()}, f)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(tmp, final)
    if writer:
        with writing(run_dir / "latest", pointer):  # failing here, `latest` still names the checkpoint before
            pointer.write_text(name)
            os.replace(pointer, run_dir / "latest")
        for old in sorted(run_dir.glob("checkpoint-*"))[:-2]:
            shutil.rmtree(old, ignore_errors=True)
    world.barrier("waiting for rank 0 to write a checkpoint")
    return final


def load_checkpoint(run_dir: Path, model, optimizer) -> dict:
    """Restore the newest readable checkpoint (falling back to the one before, with a warning). Without a
    `latest` pointer (lost or deleted) the newest checkpoint folder is taken, with a warning. Every rank
    calls it; a sharded model's ranks read their own slices of the shards together."""
    latest, found = run_dir / "latest", sorted(run_dir.glob("checkpoint-*"), reverse=True)
    if latest.is_file():
        newest = run_dir / latest.read_text().strip()
        candidates = [newest, *(p for p in found if p != newest)]
    elif found:
        warnings.warn(f"{latest} is missing; resuming from the newest checkpoint folder, {found[0].name}")
        candidates = found
    else:
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint found (no {latest.name} and no checkpoint-*)")
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
    import torch.distributed.checkpoint as dcp  # a sharded run's only (its import pulls in DTensor: fsdp.py)
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

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
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

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
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def _set_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


# ----------------------------------------------------------------------------- metrics and JSON files


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
    write_text(path, "".join(line + "\n" for line in kept))


def append_metrics(path: Path, record: dict) -> None:
    """One line more in metrics.jsonl (a step, or a resume's event line)."""
    with writing(path), path.open("a") as f:
        f.write(to_json(record) + "\n")


def record_resume(run_dir: Path, step: int, changed: dict[str, list], settings: dict) -> None:
    """A resume that changed settings says so in the run: config.json holds the settings now in force, and
    metrics.jsonl an event line {"step", "event": "resume", "changed": {name: [before, now]}} at the step
    the new settings start after. Readers of metrics.jsonl skip lines with an "event"."""
    write_json(run_dir / "config.json", settings)
    append_metrics(run_dir / "metrics.jsonl", {"step": step, "event": "resume", "changed": changed})


def strict_json(value):
    """value with every NaN and infinity replaced by None: strict JSON readers reject Python's NaN, and a
    standard error over one problem is undefined (NaN), so it is written as null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, Mapping):
        return {key: strict_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict_json(item) for item in value]
    return value


def to_json(value) -> str:
    """Strict JSON: NaN and infinities (an undefined standard error, say) become null."""
    return json.dumps(strict_json(value), allow_nan=False)


def write_json(path: Path, value) -> None:
    write_text(path, to_json(value) + "\n")


def write_text(path: Path, text: str) -> None:
    """Write text to path through a temporary file renamed into place: never half a file, and a failed
    write leaves neither."""
    tmp = path.with_name(path.name + ".tmp")
    with writing(path, tmp):
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, path)
