"""Counting what a pass allocates without running it on a GPU: LiveBytes, a dispatch mode that counts the bytes of
every storage an operator creates while it lives, and what lets the memory plan (engine/memory.py) run real code
on the meta device fast and as CUDA would allocate.

- LiveBytes counts the storages operators create while it is active, each once however many views share it,
  until Python frees it; its peak is a pass's own peak.
- On meta and fake tensors a functional operator's output layouts depend only on its arguments' layouts, so
  LiveBytes runs each distinct call once and answers later ones with fresh empty tensors of the same layouts
  (the layout memo): torch's meta kernels are mostly Python, a few milliseconds each, and a plan runs
  thousands of them.
- flash_attention_on_meta makes attention on meta tensors allocate what the fused CUDA kernels do, not the
  [T, T] scores of the math fallback.
- storage_bytes counts the bytes behind tensors, tied weights once.
"""

from __future__ import annotations

import operator
import weakref
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, in_kernel_invocation_manager
from torch.utils._python_dispatch import TorchDispatchMode

from engine import kv_cache
from infra import fsdp

_nbytes = operator.methodcaller("nbytes")


class LiveBytes(TorchDispatchMode):
    """Bytes of the tensor storages that operators created while this mode was active and that are
    still alive (`live`), and the most there ever were (`peak`).

    A storage counts once however many views share it; it stops counting when Python frees it (a
    weakref callback). Storages created before the mode (weights, the LoRA state) are not counted.
    On meta and fake tensors, torch.equal, which has no kernel there, answers True. A sharded tensor
    (DTensor) counts its local shard. `resizable` storages are grown and shrunk in place by their owner
    outside any operator (FSDP2 gathers a group's weights into storages it resizes to 0 when it frees
    them): what they hold at each operator counts towards the peak, not towards `live`.
    """

    def __init__(self, resizable=()):
        super().__init__()
        self.live = self.peak = 0
        self._alive: dict[int, weakref.ref] = {}
        self.resizable = list(resizable)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors((args, kwargs.values()))
        if func is torch.ops.aten.equal.default and _no_data(inputs[0]):
            return True
        out = _meta_result(func, args, kwargs, inputs)
        seen = {id(t.untyped_storage()) for t in inputs}  # in-place ops and views return these
        for t in _tensors(out):
            storage = t.untyped_storage()
            if id(storage) not in seen and id(storage) not in self._alive:
                self._count(storage)
        if self.resizable:
            self.peak = max(self.peak, self.live + sum(map(_nbytes, self.resizable)))
        return out

    def _count(self, storage) -> None:
        key, size = id(storage), storage.nbytes()
        self._alive[key] = weakref.ref(storage, lambda _, key=key, size=size: self._free(key, size))
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, key: int, size: int) -> None:
        if self._alive.pop(key, None) is not None:
            self.live -= size

    def reset_peak(self) -> None:
        self.peak = self.live


# On meta tensors most operators run torch's meta kernels written in Python (torch._refs), a few milliseconds
# each; a planner runs thousands of them. A functional operator's outputs are new tensors whose shapes, strides
# and dtypes depend only on its arguments' (no data exists), so on plain meta tensors, and on FakeTensorMode's
# (whose dispatch hashes every argument), each distinct call is run once and later ones get fresh empty tensors
# of the same layout. Views, in-place operators, random or data-dependent ones always run, and so do calls on
# DTensors or on fake tensors that hold a constant.
_META_LAYOUTS: dict[tuple, tuple[tuple, ...]] = {}
_ALWAYS_RUN = {torch.Tag.nondeterministic_seeded, torch.Tag.dynamic_output_shape, torch.Tag.data_dependent_output}
_PLAIN = (torch.Tensor, torch.nn.Parameter)
_DICT_VALUES = type({}.values())


def _meta_result(func, args, kwargs, inputs: list[torch.Tensor]):
    key = _layout_key(func, args, kwargs, inputs)
    if key is None:
        return func(*args, **kwargs)
    layouts = _META_LAYOUTS.get(key)
    if layouts is None:
        out = func(*args, **kwargs)
        outputs = (out,) if isinstance(out, torch.Tensor) else out
        made = [id(t.untyped_storage()) for t in outputs]  # aten._unsafe_view returns its input's storage
        new = len(set(made)) == len(made) and {id(t.untyped_storage()) for t in inputs}.isdisjoint(made)
        if new and all(type(t) in _PLAIN or (type(t) is FakeTensor and t.constant is None) for t in outputs):
            _META_LAYOUTS[key] = tuple((t.shape, t.stride(), t.dtype, t.device) for t in outputs)
        return out
    mode = inputs[0].fake_mode if type(inputs[0]) is FakeTensor else None
    outputs = tuple(_empty(shape, stride, dtype, device, mode) for shape, stride, dtype, device in layouts)
    return outputs[0] if isinstance(func._schema.returns[0].type, torch.TensorType) and len(outputs) == 1 else outputs


def _empty(shape, stride, dtype, device, mode: FakeTensorMode | None) -> torch.Tensor:
    """A new tensor of that layout: on meta, or a FakeTensor of `mode` on `device` (meta storage, as the mode
    makes them)."""
    if mode is None:
        return torch.empty_strided(shape, stride, dtype=dtype, device="meta")
    with in_kernel_invocation_manager(mode):
        return FakeTensor(mode, torch.empty_strided(shape, stride, dtype=dtype, device="meta"), device)


def _layout_key(func, args, kwargs, inputs: list[torch.Tensor]) -> tuple | None:
    """What a functional operator's output layouts depend on, or None where the memo does not apply."""
    schema = func._schema
    if (
        not inputs
        or schema.is_mutable
        or not schema.returns
        or any(r.alias_info is not None or not isinstance(r.type, torch.TensorType) for r in schema.returns)
        or _ALWAYS_RUN.intersection(func.tags)
        or not (_all_meta(inputs) or _all_fake(inputs))
    ):
        return None
    try:
        key = (func, _arg_key(args), _arg_key(tuple(sorted(kwargs.items()))))
        hash(key)
    except TypeError:
        return None
    return key


def _all_meta(inputs: list[torch.Tensor]) -> bool:
    return all(type(t) in _PLAIN and t.is_meta for t in inputs)


def _all_fake(inputs: list[torch.Tensor]) -> bool:
    """Fake tensors of one mode, none holding a constant (whose results the mode computes)."""
    mode = getattr(inputs[0], "fake_mode", None)
    return all(type(t) is FakeTensor and t.fake_mode is mode and t.constant is None for t in inputs)


def _arg_key(x):
    """An argument as the key of _META_LAYOUTS; TypeError for a tensor subclass the memo does not cover
    (a DTensor dispatches its own way)."""
    if isinstance(x, torch.Tensor):
        if type(x) not in (*_PLAIN, FakeTensor):
            raise TypeError(f"no layout key for a {type(x).__name__}")
        return ("tensor", x.shape, x.stride(), x.storage_offset(), x.dtype, x.device)
    if isinstance(x, (tuple, list)):
        return tuple(_arg_key(item) for item in x)
    return x


def _no_data(t: torch.Tensor) -> bool:
    """Meta tensors, and FakeTensorMode's (meta storage under another device's name)."""
    return t.is_meta or isinstance(t, FakeTensor)


def _tensors(x) -> list[torch.Tensor]:
    """The tensors in an operator's arguments or results (nested tuples and lists, as foreach ops take); a
    DTensor is its local shard."""
    found = []
    _collect_tensors(x, found)
    return found


def _collect_tensors(x, found: list[torch.Tensor]) -> None:
    if isinstance(x, torch.Tensor):
        found.append(x.to_local() if type(x) not in _PLAIN and fsdp.is_dtensor(x) else x)
    elif isinstance(x, (tuple, list, _DICT_VALUES)):
        for item in x:
            _collect_tensors(item, found)


class _FlashAttentionOnMeta(torch.autograd.Function):
    """What FlashAttention-2 allocates on CUDA, on meta tensors: forward, the output and a fp32
    log-sum-exp per query; backward, the three gradients, its fp32 dq accumulator and row sums and,
    when there are fewer kv heads than query heads, dk and dv per query head before they are summed.
    (Memory-efficient attention, which the cached passes with a mask take, allocates no more.)"""

    @staticmethod
    def forward(ctx, q, k, v):
        B, H, T, D = q.shape
        out = q.new_empty(B, T, H, D).transpose(1, 2)  # the kernel writes [B, T, H, D]
        ctx.save_for_backward(q, k, v, out, q.new_empty(B, H, T, dtype=torch.float32))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        B, H, T, D = q.shape
        workspace = [q.new_empty(B, T, H, D, dtype=torch.float32), q.new_empty(B, H, T, dtype=torch.float32)]
        if k.shape[1] != H:
            workspace += [q.new_empty(B, k.shape[2], H, D), q.new_empty(B, k.shape[2], H, D)]
        del workspace
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


@contextmanager
def flash_attention_on_meta():
    """While active, F.scaled_dot_product_attention on meta tensors allocates what the fused CUDA kernels
    do (_FlashAttentionOnMeta), and so does the sampler's paged FlexAttention; meta tensors would otherwise take
    the math fallback and materialize [B, heads, T, T] scores. A module attribute, not a mode, so gradient checkpointing's recomputation
    in backward sees it too."""
    original = F.scaled_dot_product_attention

    def flash(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        if not _no_data(q):
            return original(
                q,
                k,
                v,
                attn_mask=attn_mask,
                dropout_p=dropout_p,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=enable_gqa,
            )
        return _FlashAttentionOnMeta.apply(q, k, v)

    original_flex = kv_cache.paged_flex_attention

    def flex(q, k, v, block_mask):
        if not _no_data(q):
            return original_flex(q, k, v, block_mask)
        q.new_empty(*q.shape[:3], dtype=torch.float32)  # the kernel's log-sum-exp per query, freed with it
        return torch.empty_like(q)

    F.scaled_dot_product_attention, kv_cache.paged_flex_attention = flash, flex
    try:
        yield
    finally:
        F.scaled_dot_product_attention, kv_cache.paged_flex_attention = original, original_flex


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind tensors (tied weights count once; a DTensor's local shard)."""
    storages = {id(t.untyped_storage()): t.untyped_storage().nbytes() for t in _tensors(list(tensors))}
    return sum(storages.values())
