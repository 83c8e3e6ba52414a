"""The sampler's paged KV cache and the two passes that use it.

KVPool holds every layer's keys and values in blocks of block_size token slots; a row reaches its slots
through its block table (PagedRows). `prefill` runs prompts through the model, storing their keys and
values in the rows' blocks; `decode_step` runs one token per row, storing its key and value and
attending over the row's slots. Both run model.py's blocks: prefill through Transformer.run_blocks with
PrefillWrite as its attention, decode_step on [rows, features] activations with the projections of
DecodeWeights, in few operators a layer (each one kernel launch on a GPU, docs/engine.md).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engine.decode_weights import DecodeWeights
from model import ModelConfig, Transformer, leading_pads, rope_rotation

ATTENTION_KINDS = ("flash", "flex", "gather")


class KVPool:
    """The sampler's keys and values: every layer's in blocks of block_size token slots, k and v each
    [layers, blocks, block_size, kv_heads, head_dim], shared by all rows through their block tables. Both
    are views of one tensor kv [layers, 2, blocks, ...], so a step stores a token's key and value with
    one operator; each layer's k and v are contiguous, as the paged kernels read them.

    A row's t-th token sits at slot t of its sequence: block table[t // block_size], offset t % block_size,
    and its RoPE position is t too (rows hold no padding). A row holds blocks only for the tokens it has,
    and the G samples of a prompt share the blocks its prompt fills completely. Block 0 is never handed
    out: table entries past a row's blocks point at it, so a write past them or a read of them touches
    finite, unused slots (the pool starts zeroed) and never another row's.

    Attention reads a row's blocks in one of three ways (`attention`), all exact:
    - "flash" (CUDA, bf16/fp16, when torch has the paged FlashAttention kernel): torch.nn.attention.varlen
      reads the blocks in place through the block table, and only each row's own slots. It needs blocks
      of 256 slots.
    - "flex" (CUDA, any torch with FlexAttention's BlockMask.from_kv_blocks): flex_attention reads the blocks
      in place, the row's block table as the block mask's kv indices and a mask over the slots past its
      length; torch.compile makes it one kernel (eager, as on the CPU, it runs FlexAttention's math).
    - "gather" (any device and dtype): the rows' first `span` slots are copied into one [rows, kv_heads,
      span, head_dim] tensor per layer (index_select over whole blocks), and F.scaled_dot_product_attention
      attends over them with the unfilled slots masked (on the CPU index_select copies faster than advanced
      indexing, docs/engine.md). Given the rows' PromptGroups (the eager decode loop gives them), it copies
      each prompt group's blocks once instead: the shared blocks, then every member's own, one key sequence
      per group that all its members' queries attend over, each masked to the shared slots and its own, so
      a prompt is read once for its G rows and no row is padded to the longest. FlexAttention, the other
      in-place option, runs its math fallback on the CPU and needs torch.compile to be fast on a GPU.
    """

    def __init__(
        self, cfg: ModelConfig, blocks: int, block_size: int, dtype: torch.dtype, device, attention: str = "gather"
    ):
        if blocks < 2:
            raise ValueError(f"KVPool: blocks={blocks}; block 0 is reserved, so at least 2 are needed")
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"KVPool: attention must be one of {', '.join(ATTENTION_KINDS)}, got {attention!r}")
        shape = (cfg.num_layers, 2, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.k, self.v = self.kv[:, 0], self.kv[:, 1]
        self.block_size, self.attention = block_size, attention

    @property
    def blocks(self) -> int:
        return self.kv.shape[2]

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of keys and values over all layers."""
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def copy_blocks(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy blocks source [n] into blocks target [n] in every layer (a prompt's partly filled last
        block, given to each of its samples)."""
        self.kv.index_copy_(2, target, self.kv.index_select(2, source))


def flash_paged_attention_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has the paged FlashAttention kernel (varlen_attn with a block table) for this
    device and dtype. The meta device stands for CUDA here: the memory plan runs the CUDA path on it."""
    if device.type not in ("cuda", "meta") or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    return "block_table" in inspect.signature(varlen_attn).parameters


def flex_paged_attention_available() -> bool:
    """Whether this torch's FlexAttention takes a block mask built from block tables (BlockMask.from_kv_blocks
    with seq_lengths; the kv batch of one is shared by every query row): a check of the API, not the version.
    It runs on any device; only CUDA compiles it into one kernel."""
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return "seq_lengths" in inspect.signature(BlockMask.from_kv_blocks).parameters


def best_attention(device: torch.device, dtype: torch.dtype) -> str:
    """The fastest exact attention this torch offers for this device and dtype: flash, else flex (both for the
    half-precision dtypes a GPU samples in), else gather."""
    if flash_paged_attention_available(device, dtype):
        return "flash"
    # meta stands for CUDA in the memory plan; fp32 and float64 take gather there, as the CPU's exact reference
    fused = device.type in ("cuda", "meta") and dtype in (torch.float16, torch.bfloat16)
    return "flex" if fused and flex_paged_attention_available() else "gather"


_compiled_flex = None


def paged_flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_mask) -> torch.Tensor:
    """flex_attention of q [R, heads, 1, D] over k, v [1, kv_heads, slots, D] under block_mask; compiled on CUDA
    (one fused kernel, which a CUDA graph then captures), eager elsewhere. The memory plan replaces it on meta."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if q.device.type != "cuda":
        return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)


def flex_block_mask(rows: PagedRows):
    """The BlockMask of one decode step over a pool's flat slots: row r reads the blocks of its table that hold
    slots 0..length[r] (kv indices = table ids), and within them the slots at logical position <= length[r]
    (through a [R, blocks] map from a block id to its index in the row's table, -1 where absent)."""
    from torch.nn.attention.flex_attention import BlockMask

    pool, table, length = rows.pool, rows.table, rows.length
    R, width, bs, blocks = *table.shape, pool.block_size, pool.blocks
    used = (length // bs + 1).int()  # [R] blocks holding slots 0..length
    index = torch.arange(width, device=table.device).expand(R, width)
    held = index < used[:, None]  # [R, width]
    logical = torch.full((R, blocks), -1, dtype=torch.long, device=table.device)
    logical.scatter_(1, torch.where(held, table.long(), 0), torch.where(held, index, -1))
    logical[:, 0] = -1  # block 0 is never a row's: table entries past its blocks point at it
    kv_indices = F.pad(table, (0, blocks - width)) if blocks > width else table[:, :blocks]

    def mask_mod(b, h, q_idx, kv_idx):
        block = logical[b, kv_idx // bs]
        return (block >= 0) & (block * bs + kv_idx % bs <= length[b])

    return BlockMask.from_kv_blocks(
        used[:, None, None],
        kv_indices[:, None, None, :].contiguous(),
        BLOCK_SIZE=(128, bs),
        mask_mod=mask_mod,
        seq_lengths=(1, blocks * bs),
    )


@dataclass
class PromptGroups:
    """Which of a decode step's rows continue one prompt, so that gather attention copies each prompt's blocks
    once (DecodeAttention). Group u's key sequence is blocks[u] [S]: the blocks its prompt fills (shared by its
    rows), then each member's own blocks in turn, then block 0 as padding. owner [U, S] names the member (0..M-1)
    whose own block each is, -1 for a shared block, -2 for padding; index [U, S] is the block's place in its
    owner's table, so slot offset o of it holds position index * block_size + o. query [U, M] is the batch row of
    group u's m-th member and member [U, M] its index; a group of fewer than M members repeats its first in the
    columns past them (their outputs are dropped). place [R] is each batch row's column, u * M + m."""

    blocks: torch.Tensor
    owner: torch.Tensor
    index: torch.Tensor
    query: torch.Tensor
    member: torch.Tensor
    place: torch.Tensor

    @classmethod
    def of(cls, groups: list[tuple[int, list[list[int]]]], device) -> PromptGroups:
        """From the batch's groups in batch order, each (how many leading blocks its members share, the members'
        block lists, which cover each one's slots up to its next token's), a group's members being consecutive
        batch rows."""
        M = max(len(members) for _, members in groups)
        sequences, query, member, place = [], [], [], []
        first = 0  # the batch row of the group's first member
        for u, (shared, members) in enumerate(groups):
            # (block, owner, index) of each block of the group's key sequence
            sequence = [(block, -1, j) for j, block in enumerate(members[0][:shared])]
            sequence += [(own[j], m, j) for m, own in enumerate(members) for j in range(shared, len(own))]
            sequences.append(sequence)
            query.append([first + (m if m < len(members) else 0) for m in range(M)])
            member.append([m if m < len(members) else 0 for m in range(M)])
            place += [u * M + m for m in range(len(members))]
            first += len(members)
        S = max(map(len, sequences))
        padded = torch.tensor([seq + [(0, -2, 0)] * (S - len(seq)) for seq in sequences], device=device)  # [U, S, 3]
        blocks, owner, index = padded.unbind(-1)
        return cls(blocks, owner, index, *(torch.tensor(t, device=device) for t in (query, member, place)))


@dataclass
class PagedRows:
    """Rows' view of a KVPool for one pass: table [rows, max_blocks] int32 block ids (0 past a row's
    blocks) and length [rows] long, the slots each row has filled (its next token's slot and position);
    groups, when given, tells gather attention which rows share a prompt's blocks (PromptGroups)."""

    pool: KVPool
    table: torch.Tensor
    length: torch.Tensor
    groups: PromptGroups | None = None

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset) of the given slots [rows, T] of each row's sequence."""
        bs = self.pool.block_size
        return self.table.long().gather(1, positions // bs) * bs + positions % bs

    def write(self, layer: int, slots: torch.Tensor, kv: torch.Tensor) -> None:
        """Store keys and values kv [n, 2, kv_heads, head_dim] (key, then value) at flat slots [n]."""
        self.pool.kv[layer].view(2, -1, *kv.shape[2:]).index_copy_(1, slots, kv.transpose(0, 1))


class PrefillWrite:
    """What attention does during a prefill (`prefill`): store the batch's keys
    and values at slots 0..T-1 of each row's blocks, then attend causally within the batch."""

    def __init__(self, rows: PagedRows, T: int):
        self.rows = rows
        self.slots = rows.slots(torch.arange(T, device=rows.length.device).expand(len(rows.length), T)).reshape(-1)

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        """q [B, heads, T, D], k and v [B, kv_heads, T, D] -> attention output [B, T, heads, D]."""
        self.rows.write(layer, self.slots, torch.stack((k.transpose(1, 2), v.transpose(1, 2)), 2).flatten(0, 1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


class DecodeAttention:
    """One decode step's attention over the pool: each row's new key and value go to slot `length`, and
    its query attends over slots 0..length. Everything a layer needs is computed once per step, from
    device tensors only, so a CUDA graph captured for a (rows, span) shape serves every step of it."""

    def __init__(self, rows: PagedRows, span: int):
        pool, R = rows.pool, len(rows.length)
        bs = pool.block_size
        if span % bs or not 0 < span <= rows.table.shape[1] * bs:
            raise ValueError(
                f"span={span}: must be a positive multiple of the block size {bs} within the table "
                f"({rows.table.shape[1]} blocks)"
            )
        self.rows, self.span = rows, span
        self.write_slots = rows.slots(rows.length[:, None])[:, 0]  # [R]
        if pool.attention == "flash":
            seen = (rows.length + 1).int()  # [R] slots each query reads
            self.seen, self.cu_q = seen, torch.arange(R + 1, dtype=torch.int32, device=seen.device)
            self.cu_k = F.pad(seen.cumsum(0, dtype=torch.int32), (1, 0))
        elif pool.attention == "flex":
            self.block_mask = flex_block_mask(rows)
        elif rows.groups is not None:
            groups = rows.groups
            self.gather = groups.blocks.reshape(-1)  # [U * S]
            U, S = groups.blocks.shape
            position = groups.index[:, :, None] * bs + torch.arange(bs, device=groups.index.device)  # [U, S, bs]
            owner = groups.owner[:, None, :, None]  # [U, 1, S, 1]
            seen = (owner == -1) | (owner == groups.member[:, :, None, None])  # [U, M, S, 1]
            seen = seen & (position[:, None] <= rows.length[groups.query][:, :, None, None])  # [U, M, S, bs]
            self.mask = seen.view(U, -1, S * bs)  # [U, M, S * bs]
        else:
            self.gather = rows.table[:, : span // bs].reshape(-1).long()  # [R * blocks]
            positions = torch.arange(span, device=rows.length.device)
            self.mask = (positions <= rows.length[:, None])[:, None, None]  # [R, 1, 1, span]

    def __call__(self, layer: int, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        """q [R, heads, D] and the new keys and values kv [R, 2, kv_heads, D] -> attention output [R, heads * D]."""
        rows, pool = self.rows, self.rows.pool
        rows.write(layer, self.write_slots, kv)
        R, H, D = q.shape
        kv_heads = kv.shape[2]
        if pool.attention == "flash":
            from torch.nn.attention.varlen import varlen_attn

            out = varlen_attn(
                q,
                pool.k[layer],
                pool.v[layer],
                self.cu_q,
                self.cu_k,
                1,
                self.span,
                seqused_k=self.seen,
                block_table=rows.table,
                enable_gqa=True,
            )
            return out.reshape(R, H * D)
        if pool.attention == "flex":
            keys, values = (pool_[layer].view(1, -1, kv_heads, D).transpose(1, 2) for pool_ in (pool.k, pool.v))
            return paged_flex_attention(q[:, :, None], keys, values, self.block_mask).reshape(R, H * D)
        # one copy for keys and values: [2, sequences * blocks, block slots] -> each [sequences, kv_heads, slots, D]
        gathered = pool.kv[layer].view(2, pool.blocks, -1).index_select(1, self.gather)
        if rows.groups is None:
            keys, values = gathered.view(2, R, self.span, kv_heads, D).transpose(2, 3).unbind(0)
            # the query heads sharing a kv head are one query axis of length H / kv_heads: no copy per head
            out = F.scaled_dot_product_attention(
                q.view(R, kv_heads, H // kv_heads, D), keys, values, attn_mask=self.mask
            )
            return out.reshape(R, H * D)
        groups, (U, M), Hg = rows.groups, rows.groups.query.shape, H // kv_heads
        keys, values = gathered.view(2, U, -1, kv_heads, D).transpose(2, 3).unbind(0)  # [U, kv_heads, slots, D]
        # a group's members and the query heads sharing a kv head are one query axis of length M * Hg, member-major
        queries = q.index_select(0, groups.query.view(-1)).view(U, M, kv_heads, Hg, D).transpose(1, 2).flatten(2, 3)
        mask = self.mask[:, None, :, None].expand(-1, -1, -1, Hg, -1).flatten(2, 3)  # [U, 1, M * Hg, slots]
        out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask)  # [U, kv_heads, M * Hg, D]
        out = out.view(U, kv_heads, M, Hg, D).transpose(1, 2).reshape(U * M, H * D)
        return out.index_select(0, groups.place)


def prefill(model: Transformer, input_ids: torch.Tensor, pad_mask: torch.Tensor, rows: PagedRows) -> torch.Tensor:
    """The final-normed hidden state [B, hidden] of each row's last prompt token, for prompts left-padded
    to [B, T]; their keys and values are stored at slots 0.. of each row's blocks (rows.table).

    As in Transformer.hidden, each row is rotated so its real tokens come first, which is also the pool's
    layout: slot = position. The padding lands in the slots after the prompt (or in block 0), which the
    row's next tokens overwrite before any query reads them.
    """
    shift, T = leading_pads(pad_mask), input_ids.shape[1]
    arange = torch.arange(T, device=input_ids.device)
    rotated = input_ids.gather(1, (arange + shift[:, None]) % T)
    h = model.model.norm(model.run_blocks(rotated, arange.expand_as(input_ids), PrefillWrite(rows, T)))
    return h[torch.arange(len(h), device=h.device), T - 1 - shift]


def decode_step(
    model: Transformer, tokens: torch.Tensor, rows: PagedRows, span: int, weights: DecodeWeights | None = None
) -> torch.Tensor:
    """Logits [rows, V] for one token per row (tokens [rows] long): each is stored at slot rows.length of
    its row (its position) and attends over slots 0..length; rows.length is not advanced.

    Attention reads each row's first `span` slots (a multiple of the block size covering every row's
    length + 1; the rest are masked or skipped), and nothing here reads a Python number that changes
    between steps, so one CUDA graph per (rows, span) serves every step of that shape. The activations
    are [rows, features] throughout, and a layer runs few operators (each a kernel launch on a GPU):
    F.rms_norm for each norm; q, k and v written side by side into one [rows, heads + 2 kv_heads, D]
    output and the adapters' terms of the three added with one product (DecodeWeights.project), likewise
    gate and up; Qwen3's q_norm and k_norm as one norm over all heads (v's too, which is dropped) and one
    product; RoPE as one product and one sum for queries and keys together, written back in place so the
    keys sit beside the values for one cache write; and the residuals as the GEMMs' accumulators. The
    rotation is computed once per step for all layers. The sampler runs in eval mode, so LoRA dropout
    does not apply here.
    """
    cfg, R = model.config, len(tokens)
    H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    weights = weights if weights is not None else DecodeWeights(model)
    attend = DecodeAttention(rows, span)
    x = model.model.embed_tokens(tokens)  # [R, hidden]
    rotation = rope_rotation(rows.length, D, cfg.rope_theta, x.dtype)[:, None]  # [R, 1, 2, 2, D/2]
    for i, block in enumerate(model.model.layers):
        qkv = weights.project(4 * i, block.input_layernorm.fused(x)).view(R, H + 2 * KV, D)
        qk = qkv[:, : H + KV]
        if cfg.qk_norm:
            qk = F.rms_norm(qkv, (D,), eps=cfg.rms_norm_eps)[:, : H + KV] * weights.qk_norms[i]
        rotate(qk, rotation, out=qkv[:, : H + KV])
        out = attend(i, qkv[:, :H], qkv[:, H:].view(R, 2, KV, D))
        x = weights.project(4 * i + 1, out, residual=x)
        gate, up = weights.project(4 * i + 2, block.post_attention_layernorm.fused(x)).chunk(2, dim=1)
        x = weights.project(4 * i + 3, F.silu(gate) * up, residual=x)
    return weights.logits(model.model.norm.fused(x))


def rotate(x: torch.Tensor, rotation: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """RoPE of heads x [R, n, D] by rotation [R, 1, 2, 2, D/2] (model.rope_rotation), written into out [R, n, D]
    (which may be x itself): the halves' 2x2 rotation as one product and one sum."""
    R, n, D = x.shape
    product = x.view(R, n, 1, 2, D // 2) * rotation  # [R, n, 2, 2, D/2]: rotation[i, j] * x_j
    return torch.sum(product, dim=3, out=out.view(R, n, 2, D // 2))
