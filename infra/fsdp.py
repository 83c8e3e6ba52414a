"""Full-parameter training (`--lora-rank 0`) on FSDP2: every weight trains, sharded over the processes.

    torchrun --nproc-per-node 8 train.py --preset gppo-qwen3-8b-full

AdamW on every weight of Qwen3-8B holds 16 bytes per parameter (fp32 weights, gradients and two
moments): 131 GB, more than one GPU has. FSDP2 (`torch.distributed.fsdp.fully_shard`) splits each of
those tensors over the n ranks (dim 0, rank r holds rows r/n .. (r+1)/n), and each block's weights are
gathered only while it runs: the pre-forward hook all-gathers the block in the compute dtype (bf16
from the fp32 shards, FSDP's MixedPrecisionPolicy), the post-forward hook frees it, the backward
gathers it again and reduce-scatters its gradients in fp32 into the fp32 gradient shards. The
optimizer then steps each rank's shards on their own. One process is a world of one: the same code,
nothing to communicate, and the fp32 weights still compute in bf16 block by block.

Groups: each block is one; the root (embeddings, final norm, lm_head, so tied weights share a group)
is another. Training reaches the model through `model.hidden` (or engine/shared_prompts.py's
`hidden_shared`, which runs each prompt once for its rows) and `model.hidden_logprobs` rather than
`forward`; both run the blocks through `model.run_blocks`, which is registered as the forward method: it
gathers the root, which FSDP leaves gathered until the backward has used it (the final norm after it and
lm_head, once per chunk of hidden_logprobs, run without hooks of their own), and the root's gradients
are reduce-scattered when the backward ends.

The loss of each rank is its share of the whole step's (train.py normalizes over all ranks), so the
gradients are summed over the ranks, not averaged: the reduce-scatter runs with divide factor 1.

Sampling needs whole weights for thousands of decode steps. `whole(model)` all-gathers every group
once in the compute dtype (FSDP's own unshard, which follows the mixed-precision policy) and hands the
sampler a plain Transformer whose parameters are those gathered tensors, without copying them; on
leaving, the groups are resharded. The cost is the whole model in bf16 on every rank for the
rollout (16.4 GB for Qwen3-8B) and one all-gather of it per step; the weights the sampler reads are
bitwise the ones the training pass computes with.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from model import Transformer

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

# torch.distributed.fsdp and .tensor (DTensor) are imported by shard, the one place that makes sharded modules:
# importing them costs about half as much again as importing torch, which every command (train.py --help
# included) would pay at startup.
# Until they are imported no FSDP module or DTensor exists, so the checks below need not import them.


def is_dtensor(x) -> bool:
    """Whether x is a DTensor (a sharded parameter, gradient or norm)."""
    tensor = sys.modules.get("torch.distributed.tensor")
    return tensor is not None and isinstance(x, tensor.DTensor)


def _is_fsdp_module(module: nn.Module) -> bool:
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def master_dtype(compute: torch.dtype) -> torch.dtype:
    """The dtype trained weights live in: fp32 under bf16 / fp16 compute, so updates of 1e-6 of a weight are
    not rounded away (bf16 keeps 8 bits); otherwise the compute dtype itself (fp32 on the CPU, fp64 in tests)."""
    return torch.float32 if compute in (torch.bfloat16, torch.float16) else compute


def shard(model: Transformer, compute: torch.dtype, mesh: DeviceMesh | None = None) -> Transformer:
    """Wrap each block, then the root, in fully_shard over `mesh` (default: the default process group, of any
    size); in place. Parameters in master_dtype(compute) run in `compute`; gradients reduce in the master dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

    if mesh is None:
        if not dist.is_initialized():
            raise RuntimeError("fsdp.shard needs a process group (distributed.joined(..., group=True) opens one)")
        mesh = init_device_mesh("cuda" if dist.get_backend() == "nccl" else "cpu", (dist.get_world_size(),))
    master = next(model.parameters()).dtype
    policy = MixedPrecisionPolicy(param_dtype=None if compute == master else compute, reduce_dtype=master)
    for block in model.model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    register_fsdp_forward_method(model, "run_blocks")
    model.compute_dtype = compute  # what whole gathers in (resident_copy allocates it)
    for module in groups(model):
        module.set_gradient_divide_factor(1.0)  # a sum over the ranks: each loss is already its share
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM, which gloo has too (no PREMUL_SUM)
    return model


def is_sharded(model: nn.Module) -> bool:
    return _is_fsdp_module(model)


def groups(model: nn.Module) -> list[FSDPModule]:
    """The model's FSDP groups: the blocks, then the root."""
    inner = [m for m in model.modules() if _is_fsdp_module(m) and m is not model]
    return [*inner, model] if is_sharded(model) else inner


def reshard(model: nn.Module) -> None:
    """Free every gathered group (the root stays gathered after a forward without a backward)."""
    for module in groups(model):
        module.reshard()


@contextmanager
def whole(model: Transformer, into: Transformer | None = None) -> Iterator[Transformer]:
    """The model with whole weights, for the sampler and the export: a sharded model's groups gathered in the
    compute dtype, seen through a plain Transformer (no hooks, no copies) that must not outlive the block;
    any other model is itself. With `into` (resident_copy's), the weights are copied into its tensors in place,
    one group gathered at a time, and `into` is what the block sees: its addresses stay, so CUDA graphs
    captured over it serve every step. Collective: every rank enters it."""
    if not is_sharded(model):
        yield model
        return
    if into is not None:
        copy_whole(model, into)
        yield into
        return
    reshard(model)  # a group left gathered by an earlier forward is gathered again, from the current shards
    for module in groups(model):
        module.unshard()
    with torch.device("meta"):
        plain = Transformer(model.config)
    for name, param in model.named_parameters():
        owner, _, attr = name.rpartition(".")
        setattr(plain.get_submodule(owner), attr, nn.Parameter(param.detach(), requires_grad=False))
    if model.config.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    try:
        yield plain
    finally:
        del plain
        reshard(model)


def resident_copy(model: Transformer) -> Transformer:
    """A plain Transformer of a sharded model's config in its compute dtype on its device, weights
    uninitialized (copy_whole fills them): the sampler's copy of the whole weights, kept for the run."""
    with torch.device("meta"):
        plain = Transformer(model.config).to(model.compute_dtype)
    plain.to_empty(device=next(model.parameters()).device).requires_grad_(False)
    if model.config.tie_word_embeddings:
        plain.lm_head.weight = plain.model.embed_tokens.weight
    return plain


@torch.no_grad()
def copy_whole(model: Transformer, into: Transformer) -> None:
    """Copy a sharded model's current weights into `into`'s tensors in place, gathering one FSDP group at a time
    (the whole model is never gathered twice over). Collective: every rank calls it."""
    reshard(model)
    targets = dict(into.named_parameters())
    for group in groups(model):
        group.unshard()
        for name, param in model.named_parameters():
            if not is_dtensor(param) and name in targets:  # this group's, now gathered
                targets.pop(name).copy_(param)
        group.reshard()
    if targets:
        raise RuntimeError(f"copy_whole: {len(targets)} weights were never gathered, e.g. {next(iter(targets))}")


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """torch's clip_grad_norm_, whose norm over sharded gradients is a DTensor; returned as a plain tensor."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return norm.full_tensor() if is_dtensor(norm) else norm
