"""What the sampler keeps across calls and steps (Pool): the KV pool, allocated once, the decode weights and
the CUDA graphs captured over both; and the model a pool serves during a rollout (sampling_policy).
Importing it does not import the memory plan.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from engine.decode_weights import DecodeWeights
from engine.graphs import CudaGraph, Graphs
from engine.kv_cache import (
    DecodeAttention,
    KVPool,
    PagedRows,
    best_attention,
    flash_paged_attention_available,
    flex_paged_attention_available,
)
from engine.scheduler import group_blocks
from infra import fsdp
from model import ModelConfig, Transformer

# block sizes: FlashAttention's paged kernel needs multiples of 256; FlexAttention's kernels tile kv by 128
GATHER_BLOCK, FLEX_BLOCK, FLASH_BLOCK = 16, 128, 256
BLOCK_SIZES = {"gather": GATHER_BLOCK, "flex": FLEX_BLOCK, "flash": FLASH_BLOCK}


class Pool:
    """What the sampler keeps across calls and steps: the KV pool (allocated once, so a long run does
    not fragment the allocator by freeing and re-allocating its largest tensor), the decode weights
    (DecodeWeights, refreshed in place at each call) and the CUDA graphs captured over both.

    blocks counts the pool's blocks, block 0 included (reserved); max_len bounds a row's prompt plus
    completion (the block tables' width; default the model's context). attention is "flash" (CUDA,
    bf16/fp16, torch with the paged FlashAttention kernel), "flex" (torch with FlexAttention's block
    masks), "gather" or "auto" (pool_attention: the best of them for the device that agrees with gather
    on a small self-check, which the memory plan asks for too, so it plans the path the pool takes). graph_class
    replays the fixed-shape steps: CudaGraph on CUDA; EagerGraph stands in for it anywhere.

    A pool serves the model it was made with (bind serves another, dropping the decode weights and graphs,
    which read the model's tensors; the blocks are kept). A full-parameter run samples each step with its
    weights gathered anew, or copied into the pool's resident copy where it has one (sampling_policy), which
    the graphs survive.
    """

    def __init__(
        self,
        model: Transformer,
        blocks: int,
        *,
        max_len: int | None = None,
        block_size: int | None = None,
        attention: str = "auto",
        graph_class: type | None = None,
    ):
        kind = pool_attention(model.device, model.dtype, attention)
        self.block_size = block_size or BLOCK_SIZES[kind]
        if kind == "flash" and self.block_size % FLASH_BLOCK:
            raise ValueError(
                f"block_size={self.block_size}: the paged FlashAttention kernel needs a multiple of {FLASH_BLOCK}"
            )
        self.model, self.max_len = model, max_len or model.config.max_position_embeddings
        self.shape = (model.config, model.dtype, model.device)
        self.table_width = -(-self.max_len // self.block_size)
        self.kv = KVPool(model.config, blocks, self.block_size, model.dtype, model.device, kind)
        self.graph_class = graph_class or CudaGraph
        self.graphs = Graphs(self.kv, self.graph_class)
        self.weights: DecodeWeights | None = None
        self.resident: Transformer | None = None  # a sharded model's whole weights, if kept (sampling_policy)

    @classmethod
    def for_groups(cls, model: Transformer, prompt_lens: list[int], G: int, new_tokens: int, **kwargs) -> Pool:
        """A pool that holds these prompts' groups of G rows at once, each row at its full length."""
        block_size = kwargs.pop("block_size", None) or default_block_size(model, kwargs.get("attention", "auto"))
        blocks = 1 + sum(group_blocks(p, G, new_tokens, block_size) for p in prompt_lens)
        return cls(model, blocks, max_len=max(prompt_lens) + new_tokens, block_size=block_size, **kwargs)

    @property
    def attention(self) -> str:
        return self.kv.attention

    def check_fits(self, prompt_lens: list[int], G: int, new_tokens: int) -> None:
        """Raise ValueError before any work if some prompt's group cannot run to its full length in this pool
        alone (preemption could then never finish it) or a row would outgrow the block tables."""
        longest = max(prompt_lens)
        if longest + new_tokens > self.max_len:
            raise ValueError(
                f"pool: a prompt of {longest} tokens plus max_new_tokens={new_tokens} exceeds the "
                f"pool's max_len={self.max_len}"
            )
        need = group_blocks(longest, G, new_tokens, self.block_size)
        if need > self.kv.blocks - 1:
            raise ValueError(
                f"pool: {self.kv.blocks - 1} blocks of {self.block_size} slots hold no group of "
                f"{G} samples of the longest prompt ({longest} tokens) at {new_tokens} new tokens, "
                f"which needs {need}; give the pool more blocks or lower max_new_tokens"
            )

    def bind(self, model: Transformer) -> None:
        """Serve `model` from now on: a model of the pool's config, dtype and device whose weights may be other
        tensors than the last one's (its decode weights and graphs are built again)."""
        if model is self.model:
            return
        if (model.config, model.dtype, model.device) != self.shape:
            raise ValueError(
                f"pool: made for a model of {self.shape[1]} on {self.shape[2]} with another config, "
                f"given one of {model.dtype} on {model.device}"
            )
        self.release()
        self.model = model

    def release(self) -> None:
        """Let go of the model: its decode weights, and the graphs that read its tensors with their memory (bind
        serves another). Whether graphs failed to capture is kept: the fallback warns once per pool."""
        failed = self.graphs.failed
        self.model, self.weights, self.graphs = None, None, Graphs(self.kv, self.graph_class)
        self.graphs.failed = failed

    def decode_weights(self) -> DecodeWeights:
        """The decode weights with the adapters' current values; rebuilt (dropping the graphs that read the
        old buffers) when adapters were added, removed, merged or disabled since."""
        if self.weights is not None and self.weights.signature == DecodeWeights.signature_of(self.model):
            self.weights.refresh(self.model)
        else:
            self.weights = DecodeWeights(self.model)
            self.graphs.clear()
        return self.weights


def default_block_size(model: Transformer, attention: str = "auto") -> int:
    """The block size of a pool for this model and attention (pool_attention's choice for "auto")."""
    return BLOCK_SIZES[pool_attention(model.device, model.dtype, attention)]


_checked: dict[tuple, str] = {}  # (device, dtype) -> the kind "auto" chose there


def pool_attention(device: torch.device, dtype: torch.dtype, attention: str = "auto") -> str:
    """The attention kind a pool of this device and dtype uses: `attention` itself if named (ValueError if this
    torch or device lacks it), else the best available (best_attention) that passes a self-check against the
    gather path on a small pool of this device (CUDA only; meta, the plan's device, takes the best). A kind
    that fails its check falls back to the next: flash, flex, gather. Decided once per device and dtype."""
    device = torch.device(device)
    if attention not in ("auto", "flash", "flex", "gather"):
        raise ValueError(f"attention must be auto, flash, flex or gather, got {attention!r}")
    if attention == "flash" and not flash_paged_attention_available(device, dtype):
        raise ValueError(
            f"attention='flash' needs CUDA, bf16 or fp16 and torch's paged varlen_attn (model on {device} in {dtype})"
        )
    if attention == "flex" and not flex_paged_attention_available():
        raise ValueError("attention='flex' needs FlexAttention's BlockMask.from_kv_blocks with seq_lengths")
    if attention != "auto":
        return attention
    if device.type != "cuda":
        return best_attention(device, dtype)
    key = (str(device), dtype)
    if key not in _checked:
        kinds = [
            kind
            for kind, available in (
                ("flash", flash_paged_attention_available(device, dtype)),
                ("flex", flex_paged_attention_available()),
            )
            if available
        ]
        _checked[key] = next((k for k in kinds if _paged_agrees(device, dtype, k)), "gather")
    return _checked[key]


@torch.no_grad()
def _paged_agrees(device: torch.device, dtype: torch.dtype, kind: str) -> bool:
    """A self-check of a paged kernel on this machine: three rows of different lengths over random blocks of a
    small pool, against the gather path. False (with a warning) if it fails or differs."""
    cfg = ModelConfig(num_layers=1, num_heads=4, num_kv_heads=2, head_dim=64)
    kv = KVPool(cfg, 9, BLOCK_SIZES[kind], dtype, device, kind)
    heads, kv_heads, D = 2 * kv.k.shape[3], kv.k.shape[3], kv.k.shape[4]
    rows = 3
    width = min(4, kv.blocks - 1)
    g = torch.Generator(device=kv.k.device).manual_seed(0)
    # distinct blocks per row, as a row's table holds
    order = torch.rand(rows, kv.blocks - 1, generator=g, device=kv.k.device).argsort(1)
    table = (order[:, :width] + 1).int()
    length = torch.tensor([1, kv.block_size + 3, width * kv.block_size - 1], device=kv.k.device)
    length = length.clamp(max=width * kv.block_size - 1)
    try:
        kv.k[0].normal_(generator=g)
        kv.v[0].normal_(generator=g)
        q = torch.randn(rows, heads, D, generator=g, device=kv.k.device, dtype=kv.k.dtype)
        k = torch.randn(rows, kv_heads, D, generator=g, device=kv.k.device, dtype=kv.k.dtype)
        out = {}
        for name in (kind, "gather"):
            kv.attention = name
            paged = PagedRows(kv, table, length)
            out[name] = DecodeAttention(paged, width * kv.block_size)(0, q, torch.stack((k, k), 1)).float()
        error = (out[kind] - out["gather"]).abs().max().item()
        agrees = error < 0.05
        if not agrees:
            warnings.warn(f"paged {kind} attention differs from the gather path by {error:.3g}", stacklevel=3)
    except Exception as err:  # noqa: BLE001 - any failure of the kernel means the next kind
        warnings.warn(f"paged {kind} attention failed its self-check ({err!r})", stacklevel=3)
        agrees = False
    return agrees


@contextmanager
def sampling_policy(model: Transformer, pool: Pool | None) -> Iterator[Transformer]:
    """The model to sample with, the pool bound to it: the model itself, or a sharded model's whole weights.
    Those are gathered for the block (fsdp.whole) and the pool lets go of them on leaving (its decode weights
    and graphs are built again at the next rollout; its blocks stay), unless the pool has a resident copy
    (pool.resident = fsdp.resident_copy(model)): then they are copied into it in place, its tensors keep their
    addresses, and the graphs captured over them serve every later step (one capture per (rows, span) for the
    run), at the cost of the whole model in the compute dtype held for the run."""
    with fsdp.whole(model, into=None if pool is None else pool.resident) as policy:
        if pool is None or policy is model:
            yield policy
            return
        pool.bind(policy)  # the resident copy: the same tensors as last time, so bind keeps the graphs
        try:
            yield policy
        finally:
            if policy is not pool.resident:
                pool.release()
