"""A GPU check within a time budget: the HBM bandwidth, CUDA-graph parity and decode steps against the
bytes they must move, each LoRA preset's memory plan run on the device within its budget, a two-step
train.py run under a memory cap, and rollout speed and a LoRA training step against transformers (+ peft),
on random-weight Qwen3-1.7B and Qwen3-8B, sampled and trained with LoRA adapters as the trainer has them.

    python3 bench/gpu_check.py                                  # all of it, caps 512 and 4096, 540 s
    python3 bench/gpu_check.py --models Qwen3-1.7B --presets atr-grpo-qwen3-1.7b --budget-s 300 --out DIR
    python3 bench/gpu_check.py --device cpu --tiny --out DIR    # the dry run that test_rollout.py does

Needs torch and transformers only (peft for the training reference, skipped without it; the train.py run
makes its tokenizer with conftest.make_tokenizer, which needs tokenizers and pytest): no network, no
checkpoint, no .venv. Speed and memory depend on shapes, not weight values, so the models are Qwen3 shapes
(bench/qwen3_shapes.py) with seeded random bf16 weights and rank-32 LoRA adapters on all seven projections
(B nonzero, so the adapters do work). In order:
1. bandwidth: a device-to-device copy of 2 GiB, timed (read + written bytes per second), beside the HBM
   bandwidth of the device's datasheet (HBM_GBPS, by device name). The roofline below is at the datasheet
   figure, or at the copy's where the device is not in the table.
2. for each model: parity, the fixed-shape decode loop replayed from CUDA graphs against the same loop run
   eagerly over the same pool (greedy and sampled, rows ending at scattered steps): the same tokens. On the
   CPU, EagerGraph stands in for the graphs, so the script takes the same branches. Then decode steps at
   (rows, context) (DECODE_SHAPES): the step the sampler replays from its graph, each row attending over
   `context` slots of its own blocks, ms per step against decode_step_bytes (every weight and adapter read
   once, the keys and values of the context read, the new ones and the logits written) at the bandwidth:
   the roofline's ms and the share of it reached.
3. presets: each LoRA preset in configs/ whose model has a shape of bench/qwen3_shapes.py, in its budget
   (PRESET_BUDGET_GB: 1.7B in 40 GB, 8B in 80 GB): the memory plan (memory.fit for 512-token prompts, as
   `train.py --plan`), then its phases run on the device at the plan's sizes, in the plan's order (weights;
   LoRA state with AdamW's moments; the KV pool; one training micro-batch beside the step's data; the
   frozen passes where the loss needs them; a sampler call; an evaluation call), with the allocator capped
   at the budget less what the process holds outside it (the CUDA context): each row's peak against the
   plan's figure for the phase, and whether the reserved peak fits the budget. A preset whose plan is
   another's (the same model and sizes) is not run again.
4. train.py: a subprocess `train.py --preset atr-grpo-qwen3-1.7b` on a random Qwen3-1.7B checkpoint made
   on the spot (config.json, safetensors and a tokenizer, in a temporary directory), 2 steps of 2 prompts,
   with --gpu-memory 40 and the allocator capped at the same 40 GB (TRAIN_RUN_CAP's wrapper sets the
   per-process fraction before train.py runs): its exit status, its own peak memory and its last metrics.
5. for each model: rollout at each cap, 128-token prompts, 32 prompts x 8 samples (8 x 8 above cap 1024):
   ours over a KV pool that holds every row (a warm-up call captures the graphs, which later calls reuse),
   forced length and long tail (rows stop at bench/rollout.py's seeded log-normal lengths), against
   transformers' generate with a static cache and torch.compile after a compile warm-up. Each run of
   ours also records the memory plan's peak for it (weights, adapters and pool as allocated, plus
   memory.sampling_phase) next to torch.cuda.max_memory_allocated; forced runs record their roofline at
   the mean context. Then one LoRA training micro-batch (bench/model.py's steps and GPU shapes) against
   transformers + peft.
The parts that answer whether the trainer fits and runs (1-4) come before the comparisons (5), which take
the most time. Every row is printed as it finishes and DIR/gpu_check.json is rewritten after each, so a run
cut short keeps what it measured. Before each run the time it will take is estimated from the runs so far (a
kind's first run from its first_s: COMPILE_S for a compile warm-up, PLAN_S for a memory plan, TRAIN_RUN_S for
the train.py run); a run that would end past --budget-s is skipped and recorded so. Each row records the peak
memory allocated and reserved (graph pools stay reserved). Exit status 1 when parity fails or one of our
runs fails (a preset's phase that runs out of memory under its cap, the train.py run exiting non-zero); a
failing reference run is only recorded.
"""

from __future__ import annotations

import os

# Before torch starts CUDA, as train.py does: the sampler's pool and the activations do not fragment memory.
if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import argparse  # noqa: E402
import gc  # noqa: E402
import importlib.metadata  # noqa: E402
import importlib.util  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from datetime import datetime, timezone  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from qwen3_shapes import QWEN3, QWEN3_COMMON, QWEN3_TINY  # noqa: E402

import config  # noqa: E402
import lora  # noqa: E402
import rollout  # noqa: E402
from engine import memory, sizes  # noqa: E402
from engine.decode_weights import PROJECTION_GROUPS  # noqa: E402
from engine.graphs import Batch, CudaGraph, EagerGraph  # noqa: E402
from engine.pool import Pool, default_block_size, pool_attention  # noqa: E402
from engine.scheduler import SamplerStats  # noqa: E402
from model import ModelConfig, Transformer  # noqa: E402


def load_bench(name: str):
    """bench/NAME.py as the module bench_NAME: its plain name belongs to the file it measures."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_model, bench_rollout = load_bench("model"), load_bench("rollout")
PROMPT_LEN = 128
COMPILE_S = 120.0  # the estimate of a first torch.compile warm-up (a kind not yet timed), before one is timed
PLAN_S = 40.0  # the estimate of a first memory plan (the planner's meta runs, on the host's CPU)
TRAIN_RUN_S = 240.0  # the estimate of the train.py run: a checkpoint written, a plan, 2 steps, 3 evaluations
DEFAULT_OUT = "runs/gpu-check"
# HBM bandwidth in GB/s (10^9 bytes) from the datasheets, by a part of torch.cuda.get_device_name(); the first
# that matches counts, so a variant comes before its family
HBM_GBPS = (
    ("H200", 4800.0),
    ("H100 NVL", 3900.0),
    ("H100 PCIe", 2000.0),
    ("H100", 3350.0),  # SXM5, HBM3
    ("A100-SXM4-80GB", 2039.0),
    ("A100 80GB PCIe", 1935.0),
    ("A100", 1555.0),  # the 40 GB parts
)
# (rows, context): decode steps timed, each row attending over `context` slots (a power of two of blocks)
DECODE_SHAPES = ((1, 512), (16, 4096), (64, 4096), (256, 1024))
DECODE_SHAPES_TINY = ((1, 32), (4, 64))
PRESET_BUDGET_GB = {"Qwen3-1.7B": 40.0, "Qwen3-8B": 80.0}
TINY_BUDGET_GB = 1.125  # leaves 12.5 MB of plan after memory.RESERVED and SLACK: a tiny pool
TINY_PRESET_FLAGS = ("--max-new-tokens", "16", "--prompts-per-step", "8")
TRAIN_RUN_PRESET, TRAIN_RUN_SHAPE = "atr-grpo-qwen3-1.7b", "Qwen3-1.7B"
TRAIN_RUN_METRICS = ("step", "step_seconds", "rollout_tokens_per_s", "train_tokens_per_s")  # of its last step
TRAIN_RUN_FLAGS = (
    "--dataset",
    "arithmetic",
    "--eval-dataset",
    "arithmetic_test",
    "--steps",
    "2",
    "--prompts-per-step",
    "2",
    "--updates-per-rollout",
    "2",
    "--eval-problems",
    "1",
    "--eval-k",
    "1",
    "--checkpoint-every",
    "100",
)
# `python3 -c TRAIN_RUN_CAP PEAKS_FILE FRACTION train.py ARGS...`: train.py as its own __main__, in a process whose
# allocator is capped at FRACTION of the GPU first (0: no cap); the process's peaks are written to PEAKS_FILE
TRAIN_RUN_CAP = """
import json, runpy, sys
import torch
peaks_file, fraction = sys.argv[1], float(sys.argv[2])
sys.argv = sys.argv[3:]
if fraction:
    torch.cuda.set_per_process_memory_fraction(fraction)
try:
    runpy.run_path(sys.argv[0], run_name="__main__")
finally:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = torch.cuda.memory_stats()
        peaks = dict(allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
                     ooms=stats.get("num_ooms", 0), alloc_retries=stats.get("num_alloc_retries", 0))
        open(peaks_file, "w").write(json.dumps(peaks))
"""


class Check:
    """Times runs, records them as table rows with their peak memory, rewrites the JSON after each, skips
    what the budget cannot hold, and lets no failure stop the rest. bandwidth_gbps, once measured, gives the
    rows with step_bytes their roofline."""

    def __init__(self, device: torch.device, report: dict, out_file: Path, budget_s: float, clock=time.perf_counter):
        self.device, self.report, self.out_file, self.clock = device, report, out_file, clock
        self.start, self.budget_s = clock(), budget_s
        self.rows, self.failed = report.setdefault("rows", []), False
        self.rates: dict[str, float] = {}  # seconds per unit of work, by kind of run
        self.bandwidth_gbps: float | None = None

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def left_s(self) -> float:
        """Seconds of the budget not yet spent."""
        return self.budget_s - (self.clock() - self.start)

    def run(
        self,
        model: str,
        phase: str,
        side: str,
        fn,
        tokens=None,
        steps=None,
        ours: bool = True,
        work: float = 0.0,
        kind: str | None = None,
        planned=None,
        first_s: float = 0.0,
        step_bytes=None,
        fields=None,
    ):
        """fn() timed once; returns its result (None if it failed or was skipped). tokens and steps may be
        functions of the result; they give tokens/s and ms per decode step. work (in any unit) and kind
        estimate the time from earlier runs of the kind; first_s is the estimate of a kind's first run (a
        compile warm-up's), so even a first run is skipped when it cannot end within the budget; planned(result)
        gives the planned peak bytes. step_bytes (or a function of the result) is what one step must move: with
        ms per step and the bandwidth, the roofline's ms and the share of it reached. fields(result) gives
        entries of the kind's own, added to the row (and taking the place of its peaks where it names them)."""
        row = dict(
            model=model,
            phase=phase,
            side=side,
            seconds=None,
            tokens_per_s=None,
            ms_per_step=None,
            peak_allocated_bytes=None,
            peak_reserved_bytes=None,  # graph pools and the allocator's cache: what the GPU actually gives up
            planned_peak_bytes=None,
            step_bytes=None,
            roofline_ms=None,
            of_roofline=None,
            status="ok",
        )
        elapsed = self.clock() - self.start
        estimate = self.rates[kind] * work if kind in self.rates else first_s
        if elapsed + estimate > self.budget_s:
            row["status"] = f"skipped: budget ({elapsed:.0f} s spent, about {estimate:.0f} s more needed)"
            return self._record(row, None)
        self.free()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        result = None
        try:
            self.sync()
            start = self.clock()
            result = fn()
            self.sync()
            row["seconds"] = seconds = self.clock() - start
        except Exception as err:  # noqa: BLE001 - recorded in the table, and the check goes on
            traceback.print_exc()
            row["status"] = f"error: {type(err).__name__}: {str(err)[:300]}"
            self.failed |= ours
        if self.device.type == "cuda":
            row["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
            row["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        if row["status"] == "ok":
            tokens, steps, step_bytes = (x(result) if callable(x) else x for x in (tokens, steps, step_bytes))
            row["tokens_per_s"] = tokens / seconds if tokens else None
            row["ms_per_step"] = 1000 * seconds / steps if steps else None
            row["planned_peak_bytes"] = planned(result) if planned is not None else None
            if step_bytes:
                row["step_bytes"] = step_bytes
            if step_bytes and self.bandwidth_gbps and row["ms_per_step"]:
                row["roofline_ms"] = step_bytes / (self.bandwidth_gbps * 1e6)
                row["of_roofline"] = row["roofline_ms"] / row["ms_per_step"]
            row.update(fields(result) if fields is not None else {})
            if kind is not None and work:
                self.rates[kind] = max(self.rates.get(kind, 0.0), seconds / work)
        return self._record(row, result)

    def _record(self, row: dict, result):
        self.rows.append(row)
        print(format_row(row), flush=True)
        self.out_file.write_text(json.dumps(self.report, indent=2))
        return result

    def free(self) -> None:
        """Return to the GPU what earlier runs left, cyclic garbage included (an error's traceback holds its
        frame's tensors), so that it counts in no later peak. On the CPU, where no peak is measured, nothing:
        a full collection costs about a second there, with transformers' modules loaded, at every run."""
        if self.device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- the phases


def random_prompts(count: int, length: int, vocab: int, seed: int, varied: bool = False) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(length // 4, length + 1, (count,), generator=g).tolist() if varied else [length] * count
    return [torch.randint(3, vocab - 1, (n,), generator=g).tolist() for n in lengths]


def with_adapters(model) -> None:
    """Rank-32 LoRA on all seven projections, as the trainer injects it, with B nonzero (trained adapters)."""
    lora.inject(model, bench_model.RANK, bench_model.ALPHA)
    g = torch.Generator(device="cpu").manual_seed(0)
    with torch.no_grad():
        for module in lora.lora_modules(model).values():
            module.lora_B.weight.copy_(torch.randn(module.lora_B.weight.shape, generator=g) * 0.01)


def new_pool(ours, prompts: list[list[int]], samples: int, new_tokens: int) -> Pool:
    """A pool that holds every row at full length, with CUDA graphs on CUDA and their stand-in elsewhere."""
    graph_class = CudaGraph if ours.device.type == "cuda" else EagerGraph
    return Pool.for_groups(ours, [len(p) for p in prompts], samples, new_tokens, graph_class=graph_class)


def forced_generate(lengths: list[int], stop_id: int, *args, **kwargs):
    """rollout.generate with row i drawing stop_id as its lengths[i]-th token."""
    with bench_rollout.forced_lengths(lengths, stop_id):
        return rollout.generate(*args, **kwargs)


def check_parity(check: Check, name: str, ours, tiny: bool) -> dict:
    """The fixed-shape loop replayed from graphs (CUDA graphs, or EagerGraph on the CPU) against the same loop
    run eagerly over the same pool: the same tokens, greedy and sampled, rows ending at scattered steps."""
    vocab = ours.config.vocab_size
    prompts = random_prompts(4 if tiny else 8, 12 if tiny else 64, vocab, seed=1, varied=True)
    new_tokens = 16 if tiny else 96
    # rows end at scattered steps by a forced stop token (bench/rollout.py's forced_lengths): one stop id keeps
    # torch.isin off the sorting path (with a sync) that thousands of stop ids send it down
    stop_id = 3
    lengths = torch.randint(1, new_tokens + 1, (len(prompts) * 4,), generator=torch.Generator().manual_seed(2))
    pool = new_pool(ours, prompts, 4, new_tokens)
    variants = {"graphs": "on", "eager": "off"}
    result = {"compared": "graphs vs eager", "attention": pool.attention, "ok": True}
    for temperature in (0.0, 1.0):
        outs = [
            check.run(
                name,
                f"parity t={temperature:g} {variant}",
                "ours",
                lambda graphs=graphs: forced_generate(
                    lengths.tolist(),
                    stop_id,
                    ours,
                    prompts,
                    samples_per_prompt=4,
                    max_new_tokens=new_tokens,
                    temperature=temperature,
                    stop_ids=[stop_id],
                    seed=0,
                    fixed_shapes=True,
                    cuda_graphs=graphs,
                    pool=pool,
                ),
                tokens=lambda out: int(out.completion_mask.sum()),
                steps=lambda out: out.stats.decode_steps,
            )
            for variant, graphs in variants.items()
        ]
        if any(row["status"].startswith("skipped") for row in check.rows[-2:]):
            result[f"t={temperature:g}"], result["ok"] = "skipped: budget", None
            break
        same = None not in outs and outs[0].completions == outs[1].completions
        lengths = outs[0].completion_mask.sum(1) if outs[0] is not None else None
        result[f"t={temperature:g}"] = {
            "same_tokens": same,
            "max_old_logp_diff": (outs[0].old_logp - outs[1].old_logp).abs().max().item() if same else None,
            "lengths_min_max": None if lengths is None else [int(lengths.min()), int(lengths.max())],
            "captures": None if outs[0] is None else outs[0].stats.captures,
        }
        result["ok"] &= same
    check.failed |= result["ok"] is False
    verdict = {True: "ok", False: "FAILED", None: "skipped"}[result["ok"]]
    print(f"parity ({result['compared']}, {pool.attention} attention): {verdict} {result}", flush=True)
    return result


# ----------------------------------------------------------------------------- bandwidth and the bytes of a step


def datasheet_gbps(device_name: str) -> float | None:
    """The HBM bandwidth of a device's datasheet (HBM_GBPS), None for one not in the table."""
    return next((gbps for part, gbps in HBM_GBPS if part in device_name), None)


def copy_gbps(device: torch.device, nbytes: int, copies: int) -> float:
    """GB/s of a device-to-device copy of nbytes (bytes read plus bytes written), the fastest of `copies`
    after one untimed copy."""
    source = torch.ones(nbytes, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    seconds = []
    for _ in range(copies + 1):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        target.copy_(source)
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    return 2 * nbytes / min(seconds[1:]) / 1e9


def check_bandwidth(check: Check, tiny: bool) -> dict:
    """The copy's GB/s beside the datasheet's; the roofline takes the datasheet's where the device is known."""
    cuda = check.device.type == "cuda"
    name = torch.cuda.get_device_name() if cuda else "cpu"
    datasheet = datasheet_gbps(name) if cuda else None
    nbytes = 2**24 if tiny else 2**31
    measured = check.run(
        "device",
        f"bandwidth: copy of {nbytes // 2**20} MiB",
        "ours",
        lambda: copy_gbps(check.device, nbytes, copies=3 if tiny else 10),
        work=1,
        kind="bandwidth",
        fields=lambda gbps: {"copy_gbps": gbps, "datasheet_gbps": datasheet},
    )
    check.bandwidth_gbps = datasheet or measured
    return {"device": name, "datasheet_gbps": datasheet, "copy_gbps": measured, "roofline_gbps": check.bandwidth_gbps}


def decode_step_bytes(
    cfg: ModelConfig,
    rows: int,
    context: int,
    dtype: torch.dtype,
    lora_rank: int = 0,
    targets: tuple[str, ...] = lora.DEFAULT_TARGETS,
) -> dict[str, int]:
    """The bytes one decode step of `rows` rows must move at the least (engine.kv_cache.decode_step), by part:
    - weights: each projection's weight (and bias) and each norm's, read once; Qwen3's q and k norms as the one
      [heads + kv_heads, head_dim] copy per layer the step reads (DecodeWeights.qk_norms); lm_head's [vocab,
      hidden], and the rows' embeddings;
    - adapters: DecodeWeights' A [in, r x adapters] and B [r x adapters, outputs] of each projection group that
      has an adapter, in the model's dtype; B spans all the group's outputs, the zeros off its blocks included;
    - kv_read: each row's keys and values over `context` slots (its new token's included), every layer;
    - kv_write: the new token's keys and values; logits: [rows, vocab] written.
    The activations between operators ([rows, features]) are left out."""
    H, KV, D = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    hidden, inter, layers, vocab = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    outputs = dict(
        q_proj=H * D, k_proj=KV * D, v_proj=KV * D, o_proj=hidden, gate_proj=inter, up_proj=inter, down_proj=hidden
    )
    inputs = dict(
        q_proj=hidden, k_proj=hidden, v_proj=hidden, o_proj=H * D, gate_proj=hidden, up_proj=hidden, down_proj=inter
    )
    layer = sum(inputs[name] * outputs[name] for name in outputs) + 2 * hidden  # projections, the two RMSNorms
    layer += (H + KV) * D * cfg.qk_norm + (H + 2 * KV) * D * cfg.qkv_bias + hidden * cfg.o_bias
    adapters = 0
    for group in PROJECTION_GROUPS:
        rank = lora_rank * sum(name in targets for name in group)
        adapters += rank * (inputs[group[0]] + sum(outputs[name] for name in group))
    token_kv = layers * 2 * KV * D  # one token's keys and values, every layer
    elements = dict(
        weights=layers * layer + hidden + vocab * hidden + rows * hidden,  # + final norm, lm_head, embeddings
        adapters=layers * adapters,
        kv_read=rows * context * token_kv,
        kv_write=rows * token_kv,
        logits=rows * vocab,
    )
    return {part: count * dtype.itemsize for part, count in elements.items()}


def decode_batch(pool: Pool, rows: int, context: int) -> Batch:
    """`rows` rows that have filled context - 1 slots, each in blocks of its own, so that a step writes slot
    context - 1 and attends over `context` slots."""
    device, blocks = pool.model.device, -(-context // pool.block_size)
    table = torch.zeros(rows, pool.table_width, dtype=torch.int32, device=device)
    table[:, :blocks] = 1 + torch.arange(rows * blocks, dtype=torch.int32, device=device).view(rows, blocks)
    zeros = torch.zeros(rows, dtype=torch.long, device=device)
    g = torch.Generator(device=device).manual_seed(rows)
    tokens = torch.randint(3, pool.model.config.vocab_size, (rows,), generator=g, device=device)
    return Batch(
        tokens, zeros.bool(), torch.full_like(zeros, context - 1), zeros, torch.arange(rows, device=device), table
    )


def check_decode(check: Check, name: str, ours, tiny: bool) -> None:
    """The decode step the sampler replays from its graph (Graphs.step: the model's step, no draw) at each
    (rows, context) of DECODE_SHAPES, over one pool whose rows hold blocks of their own: a capture, then
    replays timed back to back, against decode_step_bytes at the roofline."""
    shapes = DECODE_SHAPES_TINY if tiny else DECODE_SHAPES
    block = default_block_size(ours)
    blocks = 1 + max(rows * -(-context // block) for rows, context in shapes)
    graph_class = CudaGraph if check.device.type == "cuda" else EagerGraph
    pool = check.run(
        name,
        f"decode: pool of {blocks} blocks",
        "ours",
        lambda: Pool(ours, blocks, max_len=max(context for _, context in shapes), graph_class=graph_class),
    )
    if pool is None:
        return
    weights, stats, replays = pool.decode_weights(), SamplerStats(), 3 if tiny else 20
    for rows, context in shapes:
        batch = pool.graphs.bind(decode_batch(pool, rows, context))
        span = -(-context // block) * block
        step_bytes = sum(decode_step_bytes(ours.config, rows, context, ours.dtype, bench_model.RANK).values())

        def steps(n: int) -> int:
            with torch.inference_mode():
                for _ in range(n):
                    pool.graphs.step(ours, batch, span, weights, stats)
            return n

        shape = f"decode {rows} rows x {context} context"
        if check.run(name, f"{shape}: capture", "ours", lambda: steps(1), work=1, kind=f"{name} decode capture"):
            check.run(
                name,
                shape,
                "ours",
                lambda: steps(replays),
                tokens=rows * replays,
                steps=replays,
                work=step_bytes * replays,
                kind=f"{name} decode",
                step_bytes=step_bytes,
            )
    del pool


# ----------------------------------------------------------------------------- the presets' memory plans


ARCHITECTURE = (  # the ModelConfig fields that make a shape
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "qkv_bias",
    "o_bias",
    "qk_norm",
)


def qwen3_shape(model_cfg: ModelConfig) -> str | None:
    """The bench/qwen3_shapes.py shape of model_cfg's architecture, None if it has none."""

    def architecture(cfg: ModelConfig) -> tuple:
        return tuple(getattr(cfg, field) for field in ARCHITECTURE)

    return next(
        (
            name
            for name, shape in QWEN3.items()
            if architecture(ModelConfig.from_hf({**QWEN3_COMMON, **shape})) == architecture(model_cfg)
        ),
        None,
    )


def presets_to_check() -> tuple[dict[str, str], dict[str, str]]:
    """({preset: shape} of the LoRA presets whose model has a Qwen3 shape, {preset: why not} of the others)."""
    shapes, left_out = {}, {}
    for preset in config.PRESETS:
        cfg = config.parse_args(["--preset", preset])[0]
        model_cfg = memory.KNOWN_CONFIGS.get(cfg.model)
        shape = None if model_cfg is None else qwen3_shape(model_cfg)
        if shape is None:
            left_out[preset] = f"{cfg.model}: no shape of bench/qwen3_shapes.py"
        elif cfg.lora_rank == 0:
            left_out[preset] = f"full-parameter, planned per rank of {cfg.world_size} (bench/full_step.py)"
        else:
            shapes[preset] = shape
    return shapes, left_out


class PresetPlan(NamedTuple):
    """A preset's memory plan: the workload at the sizes fit chose, each phase's planned peak, the budget."""

    work: memory.Workload
    peaks: dict[str, int]
    budget_bytes: int


def plan_preset(preset: str, model_cfg: ModelConfig, budget_gb: float, device: torch.device, tiny: bool) -> PresetPlan:
    """memory.fit of the preset for budget_gb, for the sampler's attention on this device, and every phase's peak
    at the sizes it chose: `train.py --preset PRESET --plan --gpu-memory GB` (512-token prompts; 64 in --tiny,
    with TINY_PRESET_FLAGS)."""
    flags = ["--preset", preset, "--gpu-memory", f"{budget_gb:g}", "--device", device.type]
    cfg = config.parse_args([*flags, *(TINY_PRESET_FLAGS if tiny else ())])[0]
    dtype = config.resolve_device(cfg)[1]
    prompt_len = 64 if tiny else memory.Workload.prompt_len
    work = sizes.workload(cfg, prompt_len=prompt_len, attention=pool_attention(device, dtype))
    budget = int(budget_gb * memory.GB)
    with memory.planning(model_cfg, work) as planner:
        fitted = memory.fit(model_cfg, work, budget, planner=planner)
        peaks = {
            phase: planner.peak(phase, size, fitted.pool_blocks) for phase, size in memory.phase_sizes(fitted).items()
        }
    return PresetPlan(fitted, peaks, budget)


def random_model(cfg: ModelConfig, dtype: torch.dtype, device: torch.device) -> Transformer:
    """A Transformer of cfg in dtype, made on the device (no copy elsewhere) with random weights."""
    with torch.device("meta"):
        model = Transformer(cfg).to(dtype)
    model.to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.02, generator=g)
    return model


def step_data(work: memory.Workload, hidden: int, device: torch.device) -> list[torch.Tensor]:
    """What a step holds from its rollout while its frozen and training passes run, as the plan counts it: the
    rollout's results, the frozen passes' [rows, C] log-probs and, for a rule that needs them, old_hidden."""
    rows, C = work.step_rows, work.max_new_tokens
    kept = memory.rollout_results(rows, work.prompt_len, C, device)
    kept += [torch.zeros(rows, C, device=device) for _ in range(work.recompute_old_logp + work.ref_logp)]
    if work.old_hidden:
        kept.append(torch.zeros(rows, C, hidden, dtype=work.dtype, device=device))
    return kept


def allocator_share(budget_bytes: int) -> tuple[float, int]:
    """(the share of the GPU's memory the caching allocator may reserve for a process to stay within
    budget_bytes, all of it for a budget past the GPU's; the bytes this process holds outside the allocator:
    the CUDA context), measured with the allocator's cache emptied. A process started like this one holds as
    much outside it."""
    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    outside = total - free - torch.cuda.memory_reserved()
    return min(1.0, max(0.0, (budget_bytes - outside) / total)), outside


@contextmanager
def capped(device: torch.device, budget_bytes: int):
    """Within the block the caching allocator may reserve no more than allocator_share(budget_bytes): beyond, an
    allocation runs out of memory. Yields the bytes held outside the allocator (0 off CUDA, where nothing is
    capped)."""
    if device.type != "cuda":
        yield 0
        return
    share, outside = allocator_share(budget_bytes)
    torch.cuda.set_per_process_memory_fraction(share)
    try:
        yield outside
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def within(device: torch.device, budget_bytes: int) -> dict:
    """The row's budget and whether the reserved peak since the last reset stays within it (None off CUDA)."""
    fits = torch.cuda.max_memory_reserved() <= budget_bytes if device.type == "cuda" else None
    return {"budget_bytes": budget_bytes, "fits": fits}


def check_preset(check: Check, shape: str, preset: str, model_cfg: ModelConfig, plan: PresetPlan) -> None:
    """The plan's phases on the device at its sizes, in its order, each row against the phase's planned peak,
    what the earlier phases left resident held throughout; the first that does not run ends the preset."""
    w, device, state = plan.work, check.device, {}

    def weights():
        state["model"] = random_model(model_cfg, w.dtype, device)
        state["model"].gradient_checkpointing = w.gradient_checkpointing

    def lora_state():
        lora.inject(state["model"], w.lora_rank, 2.0 * w.lora_rank, targets=w.lora_targets)
        memory.lora_state_phase(state["model"])  # its gradients stay, as a run's do
        # AdamW's two moments per adapter, which a run keeps from its first update on
        state["moments"] = [torch.zeros_like(p) for p in lora.parameters(state["model"]) for _ in range(2)]

    def pool():
        state["pool"] = Pool(
            state["model"], w.pool_blocks, max_len=w.prompt_len + w.max_new_tokens, attention=w.attention
        )

    def passes(phase: str):
        def run():
            kept = step_data(w, model_cfg.hidden_size, device)
            run_pass = memory.train_phase if phase == "train" else memory.frozen_phase
            for prompts in memory.prompts_per_pass(w, w.micro_batch_rows, phase):
                run_pass(state["model"], w.micro_batch_rows, w, prompts=prompts)
            del kept

        return run

    def sampling(eval: bool):
        return lambda: memory.sampling_phase(
            state["model"], w, w.eval_prompts if eval else w.rollout_prompts, eval=eval
        )

    phases = [
        ("weights", f"weights ({str(w.dtype).removeprefix('torch.')})", weights),
        ("lora", f"lora r{w.lora_rank} + AdamW state", lora_state),
        ("pool", f"pool of {w.pool_blocks} blocks", pool),
        ("train", f"train {w.micro_batch_rows} rows + step data", passes("train")),
        ("frozen", f"frozen {w.micro_batch_rows} rows + step data", passes("frozen")),
        ("rollout", f"rollout, {w.rollout_prompts} prompts in flight", sampling(False)),
        ("eval", f"eval, {w.eval_prompts} prompts in flight", sampling(True)),
    ]
    needs_frozen = w.recompute_old_logp or w.ref_logp or w.old_hidden
    for phase, what, fn in phases:
        if phase == "frozen" and not needs_frozen:
            continue
        check.run(
            shape,
            f"{preset}: {what}",
            "ours",
            fn,
            work=1,
            kind=f"preset {phase}",
            planned=lambda _: plan.peaks[phase],
            fields=lambda _: {"plan_phase": phase, **within(device, plan.budget_bytes)},
        )
        if check.rows[-1]["status"] != "ok":
            break
    state.clear()


def check_presets(check: Check, presets: dict[str, str], tiny: bool) -> dict:
    """Each preset's plan in its budget (PRESET_BUDGET_GB; TINY_BUDGET_GB on a tiny Qwen3 in --tiny), then its
    phases on the device under the cap (check_preset), once per distinct plan."""
    results, ran = {}, {}  # ran: (model, sizes) -> the preset that ran them
    for preset, shape in presets.items():
        model_cfg = memory.KNOWN_CONFIGS[config.PRESETS[preset]["model"]]
        budget_gb = TINY_BUDGET_GB if tiny else PRESET_BUDGET_GB[shape]
        if tiny:
            shape, model_cfg = "Qwen3-tiny", ModelConfig.from_hf({**QWEN3_COMMON, **QWEN3_TINY["Qwen3-tiny"]})
        plan = check.run(
            shape,
            f"{preset}: plan for {budget_gb:g} GB",
            "ours",
            lambda: plan_preset(preset, model_cfg, budget_gb, check.device, tiny),
            work=1,
            kind="plan",
            first_s=PLAN_S,
            planned=lambda plan: max(plan.peaks.values()),
        )
        if plan is None:
            continue
        w = plan.work
        results[preset] = {
            "shape": shape,
            "budget_bytes": plan.budget_bytes,
            "chosen": dict(
                rollout_prompts=w.rollout_prompts,
                micro_batch_rows=w.micro_batch_rows,
                eval_prompts=w.eval_prompts,
                pool_blocks=w.pool_blocks,
                attention=w.attention,
            ),
            "planned_peak_bytes": plan.peaks,
        }
        key = repr((model_cfg, w))
        if key in ran:
            results[preset]["same_plan_as"] = ran[key]
            continue
        ran[key] = preset
        with capped(check.device, plan.budget_bytes) as outside:
            results[preset]["outside_allocator_bytes"] = outside
            check_preset(check, shape, preset, model_cfg, plan)
    return results


# ----------------------------------------------------------------------------- train.py under a cap


def random_checkpoint(shape: str, path: Path, device: str) -> Path:
    """A checkpoint as train.py loads one (config.json, model.safetensors, tokenizer files) of a Qwen3 shape with
    random bf16 weights, and a byte-level BPE tokenizer trained on the spot with Qwen3's chat template
    (conftest.make_tokenizer)."""
    import transformers

    from conftest import QWEN3_CHAT_TEMPLATE, make_tokenizer

    tokenizer = make_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE, think_tokens=True)
    hf_config = transformers.Qwen3Config(
        **{**QWEN3_COMMON, **{**QWEN3, **QWEN3_TINY}[shape]},
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def train_run(check: Check, shape: str, budget_gb: float, new_tokens: int, log_file: Path) -> dict:
    """train.py TRAIN_RUN_PRESET for 2 steps on a random checkpoint of `shape` (in a temporary directory), as a
    subprocess under TRAIN_RUN_CAP, with --gpu-memory budget_gb and the allocator capped at the same budget
    (capped's share); it may run for what is left of the check's budget. Its output goes to log_file. Raises
    RuntimeError if it exits non-zero."""
    device, budget = check.device, int(budget_gb * memory.GB)
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        checkpoint = random_checkpoint(shape, Path(tmp) / "model", device.type)
        fraction = allocator_share(budget)[0] if device.type == "cuda" else 0.0
        peaks_file, runs = Path(tmp) / "peaks.json", Path(tmp) / "runs"
        argv = ["train.py", "--preset", TRAIN_RUN_PRESET, "--model", str(checkpoint), "--out-dir", str(runs)]
        argv += ["--run-name", "check", "--device", device.type, "--gpu-memory", f"{budget_gb:g}"]
        argv += ["--max-new-tokens", str(new_tokens), *TRAIN_RUN_FLAGS]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        with log_file.open("w") as log:
            process = subprocess.run(
                [sys.executable, "-c", TRAIN_RUN_CAP, str(peaks_file), repr(fraction), *argv],
                cwd=BENCH.parent,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=max(1.0, check.left_s()),
            )
        seconds = time.perf_counter() - start
        peaks = json.loads(peaks_file.read_text()) if peaks_file.is_file() else {}
        reserved = peaks.get("reserved")
        result = dict(
            exit_status=process.returncode,
            train_seconds=seconds,
            peak_allocated_bytes=peaks.get("allocated"),
            peak_reserved_bytes=reserved,
            budget_bytes=budget,
            fits=None if reserved is None else reserved <= budget,
            ooms=peaks.get("ooms"),
            cap_fraction=fraction,
            new_tokens=new_tokens,
        )
        if process.returncode:
            last = (log_file.read_text().strip().splitlines() or [""])[-1]
            peak = "" if reserved is None else f", {reserved / memory.GB:.1f} GB reserved at its peak"
            raise RuntimeError(
                f"train.py exited with status {process.returncode}{peak}, {peaks.get('ooms')} out-of-memory "
                f"errors, under a cap of {budget_gb:g} GB; its last line: {last}"
            )
        records = [json.loads(line) for line in (runs / "check" / "metrics.jsonl").read_text().splitlines()]
        result["steps"] = len(records)
        result["last_step"] = {key: records[-1].get(key) for key in TRAIN_RUN_METRICS}
        return result


def check_train_run(check: Check, out_dir: Path, tiny: bool) -> dict | None:
    """One row: the train.py run (train_run) of TRAIN_RUN_SHAPE in its preset's budget; a tiny Qwen3 with
    TINY_BUDGET_GB and 8 new tokens in --tiny. Its peaks are the subprocess's own."""
    shape = "Qwen3-tiny" if tiny else TRAIN_RUN_SHAPE
    budget_gb = TINY_BUDGET_GB if tiny else PRESET_BUDGET_GB[TRAIN_RUN_SHAPE]
    new_tokens = 8 if tiny else 1024
    return check.run(
        shape,
        f"train.py {TRAIN_RUN_PRESET}: 2 steps, cap {budget_gb:g} GB",
        "ours",
        lambda: train_run(check, shape, budget_gb, new_tokens, out_dir / "train_run.log"),
        work=1,
        kind="train.py",
        first_s=TRAIN_RUN_S,
        fields=lambda result: result,
    )


def rollout_shape(cap: int, tiny: bool) -> tuple[int, int, int]:
    """(prompts, samples, prompt length) of the rollout runs at a cap."""
    if tiny:
        return 2, 2, 8
    return (32, 8, PROMPT_LEN) if cap <= 1024 else (8, 8, PROMPT_LEN)


def planned_peak(ours, pool: Pool, prompts: int, samples: int, prompt_len: int, cap: int) -> int:
    """The memory plan's peak for a rollout of this shape: weights, adapters and pool as allocated (no
    optimizer in this script), plus memory.sampling_phase's transients counted on the meta device."""
    work = memory.Workload(
        dtype=ours.dtype,
        lora_rank=bench_model.RANK,
        prompt_len=prompt_len,
        max_new_tokens=cap,
        group_size=samples,
        prompts_per_step=prompts,
        rollout_prompts=prompts,
    )
    planner = memory.Planner.of(ours.config, work)
    resident = sum(p.numel() * p.element_size() for p in ours.parameters())
    resident += pool.kv.k.numel() * pool.kv.k.element_size() * 2
    return resident + planner.measure("rollout", prompts)[1]


def check_rollout(check: Check, name: str, hf, ours, cap: int, tiny: bool) -> None:
    """Ours and transformers (static cache + compile) at one cap, forced length and long tail."""
    prompts_n, samples, prompt_len = rollout_shape(cap, tiny)
    rows = prompts_n * samples
    prompts = random_prompts(prompts_n, prompt_len, ours.config.vocab_size, seed=2)
    lengths = bench_rollout.long_tail_lengths(rows, cap, seed=cap)
    mean = round(sum(lengths) / rows)
    shape = f"{prompts_n}x{samples} rows, cap {cap}"
    pool = check.run(name, f"rollout {shape}: pool", "ours", lambda: new_pool(ours, prompts, samples, cap))
    if pool is None:
        return
    compile_config = compile_settings(check.device)

    def ours_run(new_tokens, row_lengths):
        return lambda: bench_rollout.ours_generate(
            ours, prompts, samples, new_tokens, row_lengths, pool=pool, cuda_graphs="on"
        )

    def hf_run(row_lengths):
        return lambda: bench_rollout.hf_generate(
            hf, prompts, samples, cap, 0, row_lengths, cache_implementation="static", compile_config=compile_config
        )

    def steps(out) -> int:  # decode steps taken, from either side's output
        return out.stats.decode_steps if isinstance(out, rollout.Rollout) else out.shape[1] - prompt_len

    def planned(out) -> int:
        return planned_peak(ours, pool, prompts_n, samples, prompt_len, cap)

    def forced_step_bytes(lora_rank: int) -> int:  # at the mean context of a forced run's decode steps
        context = prompt_len + (cap + 1) // 2
        return sum(decode_step_bytes(ours.config, rows, context, ours.dtype, lora_rank).values())

    ours_kind, hf_kind = f"{name} ours rollout", f"{name} hf rollout"
    check.run(
        name,
        f"rollout {shape}, warm-up (graph captures)",
        "ours",
        ours_run(cap, lengths),
        ours=True,
        work=rows * mean,
        kind=ours_kind,
    )
    check.run(
        name,
        f"rollout {shape}, forced",
        "ours",
        ours_run(cap, None),
        tokens=rows * cap,
        steps=steps,
        work=rows * cap,
        kind=ours_kind,
        planned=planned,
        step_bytes=forced_step_bytes(bench_model.RANK),
    )
    check.run(
        name,
        f"rollout {shape}, long tail (mean {mean})",
        "ours",
        ours_run(cap, lengths),
        tokens=sum(lengths),
        steps=steps,
        work=rows * mean,
        kind=ours_kind,
        planned=planned,
    )
    # warm-up at the same static-cache shape (rows stop after 4 tokens): compile is not timed
    check.run(
        name,
        f"rollout {shape}, warm-up (compile)",
        "transformers",
        hf_run([4] * rows),
        ours=False,
        work=rows * 4,
        kind=f"{name} hf compile",
        first_s=COMPILE_S,
    )
    check.run(
        name,
        f"rollout {shape}, forced",
        "transformers",
        hf_run(None),
        tokens=rows * cap,
        steps=cap,
        ours=False,
        work=rows * cap,
        kind=hf_kind,
        step_bytes=forced_step_bytes(0),  # transformers' model carries no adapters
    )
    check.run(
        name,
        f"rollout {shape}, long tail (mean {mean})",
        "transformers",
        hf_run(lengths),
        tokens=sum(lengths),
        steps=steps,
        ours=False,
        work=rows * cap,
        kind=hf_kind,
    )


def compile_settings(device: torch.device):
    """transformers' torch.compile settings for the anchor. On the CPU the dry run passes them too (the eager
    backend: transformers may skip compiling there), so it takes the branch the GPU run takes."""
    from transformers import CompileConfig

    return CompileConfig() if device.type == "cuda" else CompileConfig(backend="eager", mode=None)


def check_training(check: Check, name: str, tiny: bool) -> None:
    """One LoRA micro-batch, ours against transformers + peft, one side at a time (best of 2 steps)."""
    batch, seq = (2, 64) if tiny else bench_model.GPU_BATCHES.get(name, (8, 2048))
    shape = f"train {batch}x{seq} LoRA r{bench_model.RANK}"
    sides = [("ours", bench_model.build_ours, bench_model.ours_step)]
    if importlib.util.find_spec("peft") is not None:
        sides.append(("transformers + peft", bench_model.build_peft, bench_model.peft_step))
    else:
        print("peft is not installed: the training step runs without its reference", flush=True)
    for side, build, step in sides:
        kind = f"{name} train {side}"
        model = check.run(
            name,
            f"{shape}: build",
            side,
            lambda: build(name, check.device.type),
            ours=side == "ours",
            work=1,
            kind=f"{name} build",
        )
        if model is None:
            continue
        ids, pad_mask = bench_model.random_batch(batch, seq, model.config.vocab_size, check.device)
        check.run(
            name,
            f"{shape}: warm-up step",
            side,
            lambda: step(model, ids, pad_mask),
            ours=side == "ours",
            work=batch * seq,
            kind=kind,
        )
        for _ in range(2):
            check.run(
                name,
                f"{shape}: step",
                side,
                lambda: step(model, ids, pad_mask),
                tokens=batch * seq,
                ours=side == "ours",
                work=batch * seq,
                kind=kind,
            )
        del model  # before the next side's is built


def build(check: Check, name: str):
    """(transformers' model, ours sharing its weights with the adapters of with_adapters), or None."""
    torch.manual_seed(0)
    built = check.run(
        name,
        "build (random weights, LoRA r32)",
        "ours",
        lambda: bench_rollout.build_qwen3(name, check.device.type),
        work=1,
        kind="build",
    )
    if built is not None:
        with_adapters(built[1])
    return built


def check_decoding(check: Check, name: str, tiny: bool) -> dict:
    """The first pass over a model: parity, and decode steps against the roofline."""
    built = build(check, name)
    if built is None:
        return {"built": False}
    ours = built[1]
    results = {
        "weights_bytes": sum(p.numel() * p.element_size() for p in ours.parameters()),
        "parity": check_parity(check, name, ours, tiny),
    }
    check_decode(check, name, ours, tiny)
    return results


def check_against_references(check: Check, name: str, caps: list[int], tiny: bool) -> None:
    """The second pass over a model: rollouts at each cap, then the training step, each against its reference."""
    built = build(check, name)
    if built is None:
        return
    hf, ours = built
    for cap in caps:
        check_rollout(check, name, hf, ours, cap, tiny)
    del hf, ours, built
    if check.device.type == "cuda":
        torch._dynamo.reset()  # drop the compiled graphs and their memory before training
    check.free()
    check_training(check, name, tiny)


# ----------------------------------------------------------------------------- report


def format_row(row: dict) -> str:
    def number(value, fmt):
        return "-" if value is None else format(value, fmt)

    peak = None if row["peak_allocated_bytes"] is None else row["peak_allocated_bytes"] / 2**30
    status = "" if row["status"] == "ok" else row["status"][:70]
    return (
        f"{row['model']:<11} {row['phase']:<52} {row['side']:<20} {number(row['seconds'], '8.2f')} "
        f"{number(row['tokens_per_s'], '10,.0f')} {number(row['ms_per_step'], '8.2f')} {number(peak, '9.2f')}"
        f"{notes(row)} {status}"
    )


def notes(row: dict) -> str:
    """What a row has beside the table's columns: the planned peak, the roofline, the budget (the reserved peak
    against it), train.py's exit status, the copy's bandwidth."""
    parts = []
    if row["planned_peak_bytes"] is not None:
        parts.append(f"plan {row['planned_peak_bytes'] / 2**30:.2f}")
    if row["roofline_ms"] is not None:
        parts.append(f"roofline {row['roofline_ms']:.2f} ms, {100 * row['of_roofline']:.0f}% of it")
    if row.get("fits") is not None:
        reserved, budget = row["peak_reserved_bytes"] / 2**30, row["budget_bytes"] / 2**30
        parts.append(f"reserved {reserved:.2f} of {budget:.2f}: {'fits' if row['fits'] else 'OVER BUDGET'}")
    if row.get("exit_status") is not None:
        parts.append(f"exit {row['exit_status']}")
    if row.get("copy_gbps") is not None:
        datasheet = "none" if row["datasheet_gbps"] is None else f"{row['datasheet_gbps']:,.0f}"
        parts.append(f"{row['copy_gbps']:,.0f} GB/s, datasheet {datasheet}")
    return f" ({'; '.join(parts)})" if parts else ""


def version_of(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


HEADER = f"{'model':<11} {'phase':<52} {'side':<20} {'seconds':>8} {'tokens/s':>10} {'ms/step':>8} {'peak GiB':>9}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--out", default=DEFAULT_OUT, help=f"directory for gpu_check.json (default: {DEFAULT_OUT})")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--models", nargs="+", choices=list(QWEN3), default=list(QWEN3))
    parser.add_argument("--caps", nargs="+", type=int, default=[512, 4096], help="max_new_tokens of the rollout runs")
    parser.add_argument(
        "--budget-s",
        type=float,
        default=540.0,
        help="seconds the check may take; runs that would end later are skipped (default: 540)",
    )
    presets, left_out = presets_to_check()
    parser.add_argument(
        "--presets",
        nargs="*",
        choices=list(presets),
        default=list(presets),
        help="presets whose memory plan runs in its budget (default: every LoRA preset of a Qwen3 shape)",
    )
    parser.add_argument(
        "--tiny", action="store_true", help="a tiny Qwen3, caps of 8 and 16 and a tiny memory budget: a dry run"
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for a dry run)")
    if args.budget_s <= 0:
        parser.error(f"--budget-s {args.budget_s}: must be > 0")
    device = torch.device(args.device)
    models, caps = (list(QWEN3_TINY), [8, 16]) if args.tiny else (args.models, args.caps)
    if args.tiny:
        torch.set_num_threads(1)  # tiny matrices gain nothing from more threads, and lose on a busy machine
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)

    import transformers

    report = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": version_of("peft"),
        "budget_s": args.budget_s,
        "bandwidth": None,
        "models": {},
        "presets": {},
        "train_run": None,
        "rows": [],
    }
    print(
        f"{report['device']}, torch {report['torch']}, transformers {report['transformers']}, "
        f"peft {report['peft']}, budget {args.budget_s:.0f} s\n{HEADER}",
        flush=True,
    )
    check = Check(device, report, out_dir / "gpu_check.json", args.budget_s)
    report["bandwidth"] = check_bandwidth(check, args.tiny)
    for name in models:
        report["models"][name] = check_decoding(check, name, args.tiny)
    report["presets"] = check_presets(check, {preset: presets[preset] for preset in args.presets}, args.tiny)
    report["presets"].update({preset: {"left_out": why} for preset, why in left_out.items()})
    report["train_run"] = check_train_run(check, out_dir, args.tiny)
    for name in models:
        check_against_references(check, name, caps, args.tiny)
    report["ok"] = not check.failed
    report["skipped"] = sum(row["status"].startswith("skipped") for row in check.rows)
    (out_dir / "gpu_check.json").write_text(json.dumps(report, indent=2))
    print(f"\n{HEADER}\n" + "\n".join(format_row(row) for row in check.rows))
    print(
        f"\n{'ok' if report['ok'] else 'FAILED'} ({report['skipped']} runs skipped for the budget): "
        f"{out_dir / 'gpu_check.json'}"
    )
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
