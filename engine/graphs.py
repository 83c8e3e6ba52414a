"""The decode loop's fixed-shape steps replayed from CUDA graphs, kept by the pool across calls and steps.

In fixed-shape mode (engine/sampler.py) rows come in power-of-two buckets and attention reads a
power-of-two number of blocks, so a graph captured once per (rows, span) replays every step of that
shape. Capturing does not synchronize or empty the allocator's cache: CudaGraph calls
CUDAGraph.capture_begin on a side stream rather than using the torch.cuda.graph context manager, which
does both. EagerGraph stands in for it on any device, which is how the CPU tests run this path.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engine.decode_weights import DecodeWeights
from engine.kv_cache import KVPool, PagedRows, decode_step
from engine.scheduler import SamplerStats
from model import Transformer


@dataclass
class Batch:
    """The rows in flight on the device, in the Scheduler's order, padded in fixed-shape mode to a row bucket
    with dead rows (block table of block 0, output row N, done). Each [R]: tokens (last drawn, fed next),
    done, length (slots filled), position (tokens drawn), out_row; table [R, table_width] int32."""

    tokens: torch.Tensor
    done: torch.Tensor
    length: torch.Tensor
    position: torch.Tensor
    out_row: torch.Tensor
    table: torch.Tensor

    def copy_(self, other: Batch) -> Batch:
        for name in self.__dataclass_fields__:
            getattr(self, name).copy_(getattr(other, name))
        return self


class Graphs:
    """The pool's fixed-shape steps replayed from graphs: static rows and logits per row bucket, one graph
    per (rows, span), all sharing one memory pool (they never run at once). They read the pool's blocks
    and decode weights at fixed addresses, so they serve every later call and step of the pool, for the
    model they were captured with (the pool makes new Graphs when it serves another)."""

    def __init__(self, kv: KVPool, graph_class: type):
        self.kv, self.graph_class, self.failed = kv, graph_class, False
        self.batches: dict[int, Batch] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.captured: dict[tuple[int, int], object] = {}
        self.mempool = None

    def clear(self) -> None:
        self.captured.clear()

    def bind(self, batch: Batch) -> Batch:
        """The static rows of this batch's bucket, holding the batch's values: graphs read these addresses."""
        R = len(batch.tokens)
        if R not in self.batches:
            self.batches[R] = Batch(*(getattr(batch, name).clone() for name in Batch.__dataclass_fields__))
            return self.batches[R]
        return self.batches[R].copy_(batch)

    def step(
        self, model: Transformer, batch: Batch, span: int, weights: DecodeWeights, stats: SamplerStats
    ) -> torch.Tensor:
        """decode_step's logits for the bound batch (bind), replayed from the graph of its (rows, span), which is
        captured first if this is the shape's first step."""
        R, graph_class = len(batch.tokens), self.graph_class
        key = (R, span)
        if key not in self.captured:
            if R not in self.logits:
                self.logits[R] = torch.empty(R, model.config.vocab_size, dtype=model.dtype, device=model.device)
            logits, rows = self.logits[R], PagedRows(self.kv, batch.table, batch.length)
            if self.mempool is None:
                self.mempool = graph_class.new_mempool()
            graph = graph_class()
            graph.capture(lambda: logits.copy_(decode_step(model, batch.tokens, rows, span, weights)), self.mempool)
            self.captured[key] = graph
            stats.captures += 1
        self.captured[key].replay()
        return self.logits[R]


class CudaGraph:
    """One decode step as a CUDA graph: warmed up twice, then captured, on a side stream, into the pool's
    shared memory pool. It calls CUDAGraph.capture_begin / capture_end itself: the torch.cuda.graph
    context manager would synchronize and empty the allocator's cache at every capture."""

    @staticmethod
    def new_mempool():
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], object], mempool) -> None:
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # kernel choice and workspace allocation, outside the graph
                fn()
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=mempool)
            try:
                fn()
            except BaseException:
                try:  # end the capture so the stream is usable again; the first error is the one to report
                    self.graph.capture_end()
                except Exception:  # noqa: BLE001
                    pass
                raise
            self.graph.capture_end()
        current.wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A stand-in for CudaGraph on any device: `capture` runs the step once (as a capture's warm-up does) and
    `replay` runs it again. It exercises all that graphs change about the loop (static rows updated in
    place, logits read from a static buffer, graphs kept per (rows, span) across calls and steps)."""

    @staticmethod
    def new_mempool():
        return None

    def capture(self, fn: Callable[[], object], mempool) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()
