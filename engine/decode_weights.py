"""The projections of a decode step, prepared once per rollout instead of once per token (DecodeWeights),
and the products that run them (decode_linear, packed_linear).

A decode step's activations are [rows, features], one token per row, so every product streams a whole weight
matrix for a handful of rows. On a GPU each product is one GEMM on the parameters themselves. On the CPU in
fp32, where torch runs oneDNN's linear on prepacked weights (packs_weights), each projection group's weights
are copied side by side into oneDNN's blocked layout once (PackedWeights), and its product reads that copy:
MKL's GEMM, which F.linear calls, lays the weight out again at every call, which at a decode step's row counts
costs about as much as the product itself (`bench/rollout.py --products`; docs/engine.md keeps the table). The
copy holds the projections' bytes once more, and is packed again only when a weight changed (a full-parameter
update, seen by the tensor's version counter, or another tensor in the module).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model import Block, Transformer

# The oneDNN operators of the packed path, private to torch but what torch.compile's CPU backend emits for a
# frozen linear layer; packs_weights checks they run before any pool relies on them.
PACK_ROWS = 32  # the row count oneDNN lays a packed weight out for; it serves every row count
_packs: bool | None = None  # packs_weights' check, made once per process


def packs_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether decode steps on this device and dtype run their products on prepacked oneDNN weights: fp32 on the
    CPU, where this torch has oneDNN on x86 and its packed linear gives F.linear's result on a small check (made
    once). Other dtypes and devices use decode_linear on the parameters."""
    global _packs
    if torch.device(device).type != "cpu" or dtype != torch.float32:
        return False
    if _packs is None:
        _packs = _packed_linear_works()
    return _packs


def _packed_linear_works() -> bool:
    generator = torch.Generator().manual_seed(0)  # not the global stream, which the run's own draws use
    linear = torch.nn.utils.skip_init(nn.Linear, 40, 24)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)
        linear.bias.normal_(generator=generator)
    x, residual = torch.randn(3, 40, generator=generator), torch.randn(3, 24, generator=generator)
    try:
        # x86 builds only: an Arm build runs oneDNN over the Arm Compute Library, where torch.compile's CPU
        # backend does not pack linear weights either, and docs/engine.md's table of the gain covers x86 alone
        if not torch.backends.mkldnn.is_available() or torch.ops.mkldnn._is_mkldnn_acl_supported():
            return False
        packed = PackedWeights.of([linear])
        plain, added = packed_linear(x, packed), packed_linear(x, packed, residual=residual)
    except (RuntimeError, AttributeError, NotImplementedError):  # a build without the operators
        return False
    expected = F.linear(x, linear.weight, linear.bias).detach()
    return torch.allclose(plain, expected, atol=1e-4) and torch.allclose(added, expected + residual, atol=1e-4)


@dataclass
class PackedWeights:
    """The weights [out_i, in] of some projections side by side, [sum of out_i, in], in oneDNN's packed layout,
    with their biases side by side (None if none has one; zeros stand in for a missing one), and what they were
    packed from: each weight and bias (weakly) with its version counter when packed, so stale() sees an update
    in place or another tensor."""

    weight: torch.Tensor  # opaque oneDNN layout: only packed_linear reads it
    bias: torch.Tensor | None
    sources: list[tuple[weakref.ref, int | None]]

    @classmethod
    @torch.no_grad()
    def of(cls, modules: list[nn.Module]) -> PackedWeights:
        """The packed weights of these projections (modules with `weight` [out, in] and `bias`, nn.Linear's)."""
        whole = torch.cat([m.weight for m in modules]) if len(modules) > 1 else modules[0].weight.contiguous()
        packed = torch.ops.mkldnn._reorder_linear_weight(whole.detach(), PACK_ROWS)
        bias = None
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.weight.new_zeros(len(m.weight)) if m.bias is None else m.bias for m in modules])
        return cls(packed, bias, [(weakref.ref(t), _version(t)) for t in _packed_tensors(modules)])

    def stale(self, modules: list[nn.Module]) -> bool:
        """Whether these projections' weights and biases are not, or no longer hold, what was packed."""
        current = _packed_tensors(modules)
        return len(current) != len(self.sources) or any(
            ref() is not t or version is None or _version(t) != version
            for t, (ref, version) in zip(current, self.sources)
        )


def _packed_tensors(modules: list[nn.Module]) -> list[torch.Tensor]:
    return [t for m in modules for t in (m.weight, m.bias) if t is not None]


def _version(t: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change); None for an inference tensor, which keeps
    none, so its packed copy is always taken as stale."""
    return None if t.is_inference() else t._version


def packed_linear(x: torch.Tensor, packed: PackedWeights, *, residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [rows, in] @ packed's weights side by side, plus their biases, plus residual [rows, out] when given (the
    GEMM's post-op): a new contiguous [rows, sum of out_features] tensor."""
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed.weight, packed.bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed.weight, packed.bias, "add")


def decode_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """F.linear(x, weight, bias), plus residual [rows, out_features] when given, for a decode step's
    activations x [rows, in] -> [rows, out_features]: a new contiguous tensor, or written into `out` (a
    [rows, out_features] view with unit column stride, such as a column slice of a group's output). The
    residual is the GEMM's accumulator (addmm), one kernel for the product and the sum."""
    if residual is not None:
        result = torch.addmm(residual, x, weight.t(), out=out)
        return result if bias is None else result.add_(bias)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass
class Group:
    """The projections of a block that read one input, as a decode step runs them: one [rows, sum(sizes)] output
    of their base products side by side (one packed product, or each into its column slice), and the low-rank
    terms of all add to it as x @ A @ B with one A [in, r_total] (the A's side by side) and one block-diagonal B
    [r_total, sum(sizes)] (zeros off the blocks): two products for the group, None without a term."""

    modules: list[nn.Module]
    sizes: list[int]
    A: torch.Tensor | None
    B: torch.Tensor | None
    packed: PackedWeights | None = None  # where packs_weights: the base weights side by side

    def base(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """The base products of input x [rows, in], side by side, plus residual (a one-projection group)."""
        if self.packed is not None:
            return packed_linear(x, self.packed, residual=residual)
        if len(self.modules) == 1:
            return decode_linear(x, self.modules[0].weight, self.modules[0].bias, residual=residual)
        out = x.new_empty(len(x), sum(self.sizes))
        for module, part in zip(self.modules, out.split(self.sizes, dim=1)):
            decode_linear(x, module.weight, module.bias, out=part)
        return out


class DecodeWeights:
    """The projections of a decode step, prepared once per rollout instead of once per token.

    Without packing, a projection's base weight and bias are the parameters themselves, which no copy doubles;
    with it (packs_weights: fp32 on the CPU), each group's base weights are packed side by side once, the
    vocabulary projection's too, and packed again by `refresh` only where a weight changed. A projection may
    carry a low-rank term: a module with a `low_rank()` method (lora.LoRALinear) returns (A [r, in], scaled
    B [out, r]) in fp32, or None when it adds nothing now. Those are cast to the model's dtype once, into the
    buffers of its Group, which keep their address (CUDA graphs read them) and that `refresh` overwrites in
    place. So are Qwen3's q_norm and k_norm weights, one [heads + kv_heads, head_dim] per layer (qk_norm), which
    normalize the step's queries and keys with one product.
    """

    def __init__(self, model: Transformer):
        self.signature = self.signature_of(model)
        device, dtype, cfg = model.device, model.dtype, model.config
        self.packs = packs_weights(device, dtype)
        self.groups: list[Group] = []  # per layer, its four groups in PROJECTION_GROUPS' order
        for block in model.model.layers:
            for names in PROJECTION_GROUPS:
                modules = [_projection(block, name) for name in names]
                sizes = [m.weight.shape[0] for m in modules]
                terms = [_low_rank(m) for m in modules]
                rank = sum(0 if t is None else t[0].shape[0] for t in terms)
                A = torch.zeros(modules[0].weight.shape[1], rank, dtype=dtype, device=device) if rank else None
                B = torch.zeros(rank, sum(sizes), dtype=dtype, device=device) if rank else None
                self.groups.append(Group(modules, sizes, A, B))
        self.vocabulary = Group([model.lm_head], [cfg.vocab_size], None, None)
        heads = cfg.num_heads + cfg.num_kv_heads
        self.qk_norms = [  # per layer [heads + kv_heads, head_dim]: q_norm's weight for each query head, then k_norm's
            torch.empty(heads, cfg.head_dim, dtype=dtype, device=device) for _ in model.model.layers if cfg.qk_norm
        ]
        self.refresh(model)

    @staticmethod
    def signature_of(model: Transformer) -> tuple:
        """Which projections carry a low-rank term and of what rank: buffers built for one signature
        serve any adapter values of it."""
        return tuple(
            None if (t := _low_rank(_projection(block, name))) is None else t[0].shape
            for block in model.model.layers
            for names in PROJECTION_GROUPS
            for name in names
        )

    @torch.no_grad()
    def refresh(self, model: Transformer) -> None:
        """Copy the current adapter values (cast and scaled once) and q/k norm weights into the buffers, and pack
        again the base weights that changed since they were packed."""
        if self.signature_of(model) != self.signature:
            raise ValueError("DecodeWeights.refresh: the model's adapters changed shape; build new DecodeWeights")
        for group in self.groups:
            row, column = 0, 0
            for module, size in zip(group.modules, group.sizes):
                term = _low_rank(module)
                if term is not None:
                    a, scaled_b = term  # [r, in], [out, r]
                    group.A[:, row : row + len(a)].copy_(a.t())
                    group.B[row : row + len(a), column : column + size].copy_(scaled_b.t())
                    row += len(a)
                column += size
        for group in (self.groups + [self.vocabulary]) if self.packs else []:
            if group.packed is None or group.packed.stale(group.modules):
                group.packed = PackedWeights.of(group.modules)
        for weight, block in zip(self.qk_norms, model.model.layers):
            heads = model.config.num_heads
            weight[:heads].copy_(block.self_attn.q_norm.weight)
            weight[heads:].copy_(block.self_attn.k_norm.weight)

    def project(self, index: int, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Group `index`'s (layer * 4 + group) outputs side by side, [rows, sum of out_features], for its input
        x [rows, in]; with `residual` (a one-projection group: o_proj, down_proj) residual + the projection."""
        group = self.groups[index]
        out = group.base(x, residual)
        if group.A is None:
            return out
        return out.addmm_(torch.mm(x, group.A), group.B)

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection [rows, V] of final-normed states x [rows, hidden]."""
        return self.vocabulary.base(x)


def _projection(block: Block, name: str) -> nn.Module:
    return getattr(block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, name)


def _low_rank(module: nn.Module):
    low_rank = getattr(module, "low_rank", None)
    return None if low_rank is None else low_rank()
