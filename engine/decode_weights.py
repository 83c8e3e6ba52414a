"""The projections of a decode step, prepared once per rollout instead of once per token (DecodeWeights),
and the product each of them runs (decode_linear).

A decode step's activations are [rows, features], one token per row. On a GPU every product is F.linear.
On the CPU (fp32, torch's MKL) a product of a handful of rows is faster with the weight on the left
(weight @ x.T, one row padded to two) than as x @ weight.T, at the row counts and input widths of
WEIGHT_LEFT_ROWS, which come from `bench/rollout.py --products` (its table is in docs/engine.md). A
long-tailed rollout spends most of its decode steps on such a handful of rows.
"""

from __future__ import annotations

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


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a decode step's activations x [rows, in] -> [rows, out], contiguous.

    Where weight_on_the_left(x), the product runs as weight @ x.T (one row padded to two: a matrix-vector
    product is slower than a two-column one); its result differs from F.linear's by rounding only, as
    F.linear's own results differ between row counts."""
    if not weight_on_the_left(x):
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    columns = (F.pad(x, (0, 0, 0, 1)) if rows == 1 else x).t()  # [in, >= 2]
    out = torch.mm(weight, columns) if bias is None else torch.addmm(bias[:, None], weight, columns)
    return out[:, :rows].t().contiguous()


PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class DecodeWeights:
    """The projections of a decode step, prepared once per rollout instead of once per token.

    A projection's base weight and bias are the parameters themselves. A projection may carry a low-rank
    term: a module with a `low_rank()` method (lora.LoRALinear) returns (A [r, in], scaled B [out, r])
    in fp32, or None when it adds nothing now. Those are cast to the model's dtype once, into buffers that
    keep their address (CUDA graphs read them) and that `refresh` overwrites in place. The projections of
    a group that reads one input (q, k, v; gate, up) share one product with their A's side by side, and
    each adds its part with one addmm against its B padded with zeros to the group's rank: per adapted
    projection one operator more than the base step, instead of a cast, a scaling and two products.
    """

    def __init__(self, model: Transformer):
        self.signature = self.signature_of(model)
        self.groups = []  # per layer and group: (modules, A [in, r_total] or None, B's [r_total, out] or None)
        for block in model.model.layers:
            for names in PROJECTION_GROUPS:
                modules = [_projection(block, name) for name in names]
                terms = [_low_rank(m) for m in modules]
                ranks = [0 if t is None else t[0].shape[0] for t in terms]
                if not sum(ranks):
                    self.groups.append((modules, None, [None] * len(modules)))
                    continue
                device, dtype = model.device, model.dtype
                A = torch.zeros(modules[0].weight.shape[1], sum(ranks), dtype=dtype, device=device)
                Bs = [
                    None if not r else torch.zeros(sum(ranks), m.weight.shape[0], dtype=dtype, device=device)
                    for m, r in zip(modules, ranks)
                ]
                self.groups.append((modules, A, Bs))
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
        """Copy the current adapter values into the buffers (cast and scaled once)."""
        if self.signature_of(model) != self.signature:
            raise ValueError("DecodeWeights.refresh: the model's adapters changed shape; build new DecodeWeights")
        for modules, A, Bs in self.groups:
            lo = 0
            for module, B in zip(modules, Bs):
                term = _low_rank(module)
                if term is None:
                    continue
                a, scaled_b = term
                A[:, lo : lo + len(a)].copy_(a.t())
                B[lo : lo + len(a)].copy_(scaled_b.t())
                lo += len(a)

    def project(self, index: int, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of group `index` (layer * 4 + group) for its input x [rows, in]."""
        modules, A, Bs = self.groups[index]
        outs = [decode_linear(x, m.weight, m.bias) for m in modules]
        if A is None:
            return outs
        xa = torch.mm(x, A)  # [rows, r_total]
        return [out if B is None else torch.addmm(out, xa, B) for out, B in zip(outs, Bs)]


def _projection(block: Block, name: str) -> nn.Module:
    return getattr(block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, name)


def _low_rank(module: nn.Module):
    low_rank = getattr(module, "low_rank", None)
    return None if low_rank is None else low_rank()
