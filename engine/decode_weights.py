"""The projections of a decode step, prepared once per rollout instead of once per token (DecodeWeights),
and the product each of them runs (decode_linear).

A decode step's activations are [rows, features], one token per row. On a GPU every product is one GEMM.
On the CPU (fp32, torch's MKL) a product of a handful of rows is faster with the weight on the left
(weight @ x.T, one row padded to two) than as x @ weight.T, at the row counts and input widths of
WEIGHT_LEFT_ROWS, which come from `bench/rollout.py --products` (its table is in docs/engine.md). A
long-tailed rollout spends most of its decode steps on such a handful of rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from model import Block, Transformer

# Row counts at which decode_linear puts the weight on the left of a CPU product, each with the largest
# in_features where that was measured faster (bench/rollout.py --products, one and two threads, fp32, MKL).
WEIGHT_LEFT_ROWS = {1: 1536, 2: float("inf"), 3: float("inf"), 4: 1536}
WEIGHT_LEFT_MEASURED = torch.backends.mkl.is_available()  # other CPU BLAS libraries were not measured


def weight_on_the_left(x: torch.Tensor) -> bool:
    """Whether decode_linear runs this input's product as weight @ x.T: fp32 on an MKL CPU, at the row counts
    and input widths of WEIGHT_LEFT_ROWS."""
    rows, in_features = x.shape
    measured = WEIGHT_LEFT_MEASURED and x.device.type == "cpu" and x.dtype == torch.float32
    return measured and in_features <= WEIGHT_LEFT_ROWS.get(rows, 0)


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
    [rows, out_features] view with unit column stride, such as a column slice of a group's output).

    The residual is the GEMM's accumulator (addmm), one kernel for the product and the sum. Where
    weight_on_the_left(x), the product runs as weight @ x.T (one row padded to two: a matrix-vector product
    is slower than a two-column one) and the sum or the copy into `out` is an operator of its own; the
    result differs from F.linear's by rounding only, as F.linear's own results differ between row counts."""
    if weight_on_the_left(x):
        rows = x.shape[0]
        columns = (F.pad(x, (0, 0, 0, 1)) if rows == 1 else x).t()  # [in, >= 2]
        product = torch.mm(weight, columns) if bias is None else torch.addmm(bias[:, None], weight, columns)
        result = product[:, :rows].t()
        if residual is not None:
            result = residual + result
        return result.contiguous() if out is None else out.copy_(result)
    if residual is not None:
        result = torch.addmm(residual, x, weight.t(), out=out)
        return result if bias is None else result.add_(bias)
    if out is None:
        return F.linear(x, weight, bias)
    return torch.mm(x, weight.t(), out=out) if bias is None else torch.addmm(bias, x, weight.t(), out=out)


PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass
class Group:
    """The projections of a block that read one input, as a decode step runs them: each base product writes
    its column slice (`sizes` wide) of one [rows, sum(sizes)] output, and the low-rank terms of all add to
    it as x @ A @ B with one A [in, r_total] (the A's side by side) and one block-diagonal B
    [r_total, sum(sizes)] (zeros off the blocks): two products for the group, None without a term."""

    modules: list[nn.Module]
    sizes: list[int]
    A: torch.Tensor | None
    B: torch.Tensor | None


class DecodeWeights:
    """The projections of a decode step, prepared once per rollout instead of once per token.

    A projection's base weight and bias are the parameters themselves, which no copy doubles. A projection
    may carry a low-rank term: a module with a `low_rank()` method (lora.LoRALinear) returns (A [r, in],
    scaled B [out, r]) in fp32, or None when it adds nothing now. Those are cast to the model's dtype once,
    into the buffers of its Group, which keep their address (CUDA graphs read them) and that `refresh`
    overwrites in place. So are Qwen3's q_norm and k_norm weights, one [heads + kv_heads, head_dim] per
    layer (qk_norm), which normalize the step's queries and keys with one product.
    """

    def __init__(self, model: Transformer):
        self.signature = self.signature_of(model)
        device, dtype, cfg = model.device, model.dtype, model.config
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
        """Copy the current adapter values (cast and scaled once) and q/k norm weights into the buffers."""
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
        for weight, block in zip(self.qk_norms, model.model.layers):
            heads = model.config.num_heads
            weight[:heads].copy_(block.self_attn.q_norm.weight)
            weight[heads:].copy_(block.self_attn.k_norm.weight)

    def project(self, index: int, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """Group `index`'s (layer * 4 + group) outputs side by side, [rows, sum of out_features], for its input
        x [rows, in]; with `residual` (a one-projection group: o_proj, down_proj) residual + the projection."""
        group = self.groups[index]
        if len(group.modules) == 1:
            module = group.modules[0]
            out = decode_linear(x, module.weight, module.bias, residual=residual)
        else:
            out = x.new_empty(len(x), sum(group.sizes))
            for module, part in zip(group.modules, out.split(group.sizes, dim=1)):
                decode_linear(x, module.weight, module.bias, out=part)
        if group.A is None:
            return out
        return out.addmm_(torch.mm(x, group.A), group.B)


def _projection(block: Block, name: str) -> nn.Module:
    return getattr(block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, name)


def _low_rank(module: nn.Module):
    low_rank = getattr(module, "low_rank", None)
    return None if low_rank is None else low_rank()
