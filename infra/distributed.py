"""Several processes (torchrun): who this process is, and the few collectives a training step needs.

    torchrun --nproc-per-node 8 train.py --preset gppo-qwen3-8b

Data parallel: of a step's prompts, rank r of n samples, grades and trains on the r-th slice, whole
prompts with all G completions, and the adapters' gradients are summed over the ranks in one
all-reduce (full-parameter training shards the weights instead, and FSDP2 sums the gradients: fsdp.py).
One process alone is rank 0 of 1 and every collective returns its input, so a single-GPU run is the
same code. nccl joins GPUs (one per process), gloo joins CPU processes.
"""

from __future__ import annotations

import hashlib
import json
import os
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from infra import fsdp


@dataclass(frozen=True)
class World:
    """This process's place in a torchrun job, and the collectives a step needs. Collectives block, so a
    rank that died or hangs turns into an error here after --dist-timeout seconds, naming what was
    being waited for."""

    rank: int = 0
    size: int = 1
    device: torch.device = torch.device("cpu")  # where collectives run: the GPU for nccl, the CPU for gloo
    timeout: float = 0.0

    def prompts(self, count: int) -> slice:
        """This rank's prompts of a step of `count` (a multiple of size)."""
        share = count // self.size
        return slice(self.rank * share, (self.rank + 1) * share)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.SUM, "a sum")

    def min(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.MIN, "a minimum")

    def max(self, x: torch.Tensor) -> torch.Tensor:
        return self._reduce(x, dist.ReduceOp.MAX, "a maximum")

    def cat(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's x (same shape on all), concatenated in rank order along dim 0."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x, device=self.device) for _ in range(self.size)]
        with self._waiting("gathering a tensor"):
            dist.all_gather(parts, x.to(self.device))
        return torch.cat(parts).to(x.device)

    def exchange(self, x: torch.Tensor, send: list[int], receive: list[int]) -> torch.Tensor:
        """Rows of x dealt out over the ranks (an all-to-all): its first send[0] rows to rank 0, the next send[1]
        to rank 1, and so on; returns the rows the ranks sent here, receive[r] of them from rank r, in rank
        order. Every rank's x has the same trailing shape and dtype."""
        if self.size == 1:
            return x
        y = torch.empty(sum(receive), *x.shape[1:], dtype=x.dtype, device=self.device)
        with self._waiting("exchanging rows"):
            dist.all_to_all_single(y, x.to(self.device).contiguous(), receive, send)
        return y.to(x.device)

    def gather(self, value) -> list:
        """Every rank's value (any picklable object), in rank order."""
        if self.size == 1:
            return [value]
        values = [None] * self.size
        with self._waiting("gathering results"):
            dist.all_gather_object(values, value)
        return values

    def barrier(self, what: str) -> None:
        if self.size > 1:
            with self._waiting(what):
                dist.barrier()

    def _reduce(self, x: torch.Tensor, op, what: str) -> torch.Tensor:
        if self.size == 1:
            return x
        y = x.to(self.device, copy=True)
        with self._waiting(what):
            dist.all_reduce(y, op)
        return y.to(x.device)

    @contextmanager
    def _waiting(self, what: str):
        try:
            yield
        except RuntimeError as error:  # torch.distributed's errors, timeouts included, are RuntimeErrors
            raise RuntimeError(
                f"rank {self.rank} of {self.size}: {what} across processes failed; another process died or "
                f"hangs (its own error is in its log; a process waits --dist-timeout {self.timeout:g} s): "
                f"{error}"
            ) from error


SOLO = World()


def world_size() -> int:
    """How many processes torchrun started (1 without torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextmanager
def joined(device: torch.device, timeout: float, group: bool = False):
    """The World this process belongs to: torchrun's (RANK, WORLD_SIZE and LOCAL_RANK in the environment),
    or one process alone. On CUDA each process takes the GPU of its LOCAL_RANK. With group=True one process
    alone gets a process group of its own too (FSDP2 shards over a process group, even of one rank)."""
    size = world_size()
    if size == 1 and not group:
        yield SOLO
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", device.index or 0)))  # "cuda" means this GPU now
        device = torch.device("cuda", torch.cuda.current_device())
        # collectives stay asynchronous (a blocking wait would stall the host on each one and lose FSDP2's
        # prefetch); a collective past the process group's timeout is caught by NCCL's watchdog, which aborts
        # the communicators and ends the process with the timed-out collective in its message
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if size == 1:  # no torchrun: no rendezvous either
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout)
        )
    else:
        dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    try:
        yield World(dist.get_rank(), size, device, timeout)
    finally:
        dist.destroy_process_group()


def check_same_settings(world: World, settings: dict) -> None:
    """Every process must run the same settings (one launch command on every node); a difference is named."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode()).hexdigest()
    if len(set(world.gather(digest))) == 1:
        return
    for rank, theirs in enumerate(world.gather(settings)):
        differ = sorted(name for name in settings if theirs.get(name) != settings[name])
        if differ:
            shown = ", ".join(f"{name}={theirs.get(name)!r} (here {settings[name]!r})" for name in differ)
            raise ValueError(
                f"rank {rank} runs other settings than rank {world.rank}: {shown}; launch every "
                "process with the same command"
            )


def sum_gradients(params: list[torch.nn.Parameter], world: World, loss_sum: torch.Tensor) -> torch.Tensor:
    """Sum the adapters' gradients over the ranks, in one all-reduce of one flat buffer; returns the
    optimizer step's whole loss (the ranks' sum), so every rank takes the same skip decision. Sharded
    parameters (DTensors, fsdp.py) are left alone: FSDP2 reduce-scattered their gradients in the backward.

    Each rank's loss is already its share of the whole step's (the normalizers are global), so the
    sum, not the mean, is the gradient of one process on the whole batch. A plain all-reduce rather
    than DistributedDataParallel: only the adapters train, their gradients are small (Qwen3-8B's
    rank-32 adapters: 87M parameters, 350 MB in fp32), the loss reaches the model through model.hidden and the
    frozen passes rather than one forward(), and a rank may hold no rows of a mini-batch at all.
    """
    params = [p for p in params if not fsdp.is_dtensor(p)]
    if world.size == 1:
        return loss_sum
    if not params:
        return world.sum(loss_sum.detach())
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]  # no rows here: zeros
    flat = world.sum(torch.cat([*(g.flatten() for g in grads), loss_sum.detach().to(grads[0]).reshape(1)]))
    for p, g in zip(params, flat[:-1].split([g.numel() for g in grads])):
        p.grad = g.view_as(p)
    return flat[-1]
