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
from engine.kv_cache import DecodeAttention, KVPool, PagedRows, flash_paged_attention_available
from engine.scheduler import group_blocks
from infra import fsdp
from model import Transformer

GATHER_BLOCK, FLASH_BLOCK = 16, 256  # block sizes: FlashAttention's paged kernel needs multiples of 256


class Pool:
    """What the sampler keeps across calls and steps: the KV pool (allocated once, so a long run does
    not fragment the allocator by freeing and re-allocating its largest tensor), the decode weights
    (DecodeWeights, refreshed in place at each call) and the CUDA graphs captured over both.

    blocks counts the pool's blocks, block 0 included (reserved); max_len bounds a row's prompt plus
    completion (the block tables' width; default the model's context). attention is "flash" (CUDA,
    bf16/fp16, torch with the paged FlashAttention kernel), "gather" or "auto" (flash where it is
    available and agrees with gather on a small self-check at creation, else gather). graph_class
    replays the fixed-shape steps: CudaGraph on CUDA; EagerGraph stands in for it anywhere.

    A pool serves the model it was made with. A full-parameter run samples each step with weights gathered
    anew (fsdp.whole: a new Transformer whose tensors live only for the rollout), so it binds the pool to
    that model for the call and releases it after: the decode weights and graphs, which read the model's
    tensors, are dropped, and the blocks are kept.
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
        if attention not in ("auto", "flash", "gather"):
            raise ValueError(f"attention must be auto, flash or gather, got {attention!r}")
        flash = flash_paged_attention_available(model.device, model.dtype)
        if attention == "flash" and not flash:
            raise ValueError(
                f"attention='flash' needs CUDA, bf16 or fp16 and torch's paged varlen_attn "
                f"(model on {model.device} in {model.dtype})"
            )
        kind = "flash" if flash and attention != "gather" else "gather"
        self.block_size = block_size or default_block_size(model, attention)
        if kind == "flash" and self.block_size % FLASH_BLOCK:
            raise ValueError(
                f"block_size={self.block_size}: the paged FlashAttention kernel needs a multiple of {FLASH_BLOCK}"
            )
        self.model, self.max_len = model, max_len or model.config.max_position_embeddings
        self.shape = (model.config, model.dtype, model.device)
        self.table_width = -(-self.max_len // self.block_size)
        self.kv = KVPool(model.config, blocks, self.block_size, model.dtype, model.device, kind)
        if kind == "flash" and attention == "auto" and model.device.type == "cuda" and not _flash_agrees(self.kv):
            self.kv.attention = "gather"
        self.graph_class = graph_class or CudaGraph
        self.graphs = Graphs(self.kv, self.graph_class)
        self.weights: DecodeWeights | None = None

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
    """The block size of a pool for this model: FLASH_BLOCK where the paged FlashAttention kernel serves it."""
    flash = attention != "gather" and flash_paged_attention_available(model.device, model.dtype)
    return FLASH_BLOCK if flash else GATHER_BLOCK


@torch.no_grad()
def _flash_agrees(kv: KVPool) -> bool:
    """A self-check of the paged FlashAttention kernel on this machine: three rows of different lengths over
    random blocks, against the gather path. False (with a warning) if it fails or differs."""
    heads, kv_heads, D = 2 * kv.k.shape[3], kv.k.shape[3], kv.k.shape[4]
    rows = 3
    width = min(4, kv.blocks - 1)
    g = torch.Generator(device=kv.k.device).manual_seed(0)
    table = torch.randint(1, kv.blocks, (rows, width), generator=g, device=kv.k.device, dtype=torch.int32)
    length = torch.tensor([1, kv.block_size + 3, width * kv.block_size - 1], device=kv.k.device)
    length = length.clamp(max=width * kv.block_size - 1)
    saved = kv.k[0].clone(), kv.v[0].clone()
    try:
        kv.k[0].normal_(generator=g)
        kv.v[0].normal_(generator=g)
        q = torch.randn(rows, heads, D, generator=g, device=kv.k.device, dtype=kv.k.dtype)
        k = torch.randn(rows, kv_heads, D, generator=g, device=kv.k.device, dtype=kv.k.dtype)
        out = {}
        for kind in ("flash", "gather"):
            kv.attention = kind
            paged = PagedRows(kv, table, length)
            out[kind] = DecodeAttention(paged, width * kv.block_size)(0, q, k, k).float()
        error = (out["flash"] - out["gather"]).abs().max().item()
        agrees = error < 0.05
        if not agrees:
            warnings.warn(
                f"paged FlashAttention differs from the gather path by {error:.3g}; using gather", stacklevel=3
            )
    except Exception as err:  # noqa: BLE001 - any failure of the kernel means the gather path
        warnings.warn(f"paged FlashAttention failed its self-check ({err!r}); using gather", stacklevel=3)
        agrees = False
    finally:
        kv.k[0].copy_(saved[0])
        kv.v[0].copy_(saved[1])
        kv.attention = "flash"
    return agrees


@contextmanager
def sampling_policy(model: Transformer, pool: Pool | None) -> Iterator[Transformer]:
    """The model to sample with, the pool bound to it: the model itself, or a sharded model's weights gathered
    for the block (fsdp.whole). Those live only for the block, so the pool lets go of them on leaving (its
    decode weights and graphs are built again at the next rollout; its blocks stay)."""
    with fsdp.whole(model) as policy:
        if pool is None or policy is model:
            yield policy
            return
        pool.bind(policy)
        try:
            yield policy
        finally:
            pool.release()
