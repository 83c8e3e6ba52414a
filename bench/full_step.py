"""One GPU, every weight: a full-parameter training step of random-weight Qwen3-1.7B against its memory plan.

    python3 bench/full_step.py [--model Qwen3-1.7B] [--rows 16] [--tokens 4608] [--out DIR]
    python3 bench/full_step.py --device cpu --tiny --out DIR     # the dry run test_fsdp.py does

What train.py does with --lora-rank 0 on one GPU: fp32 weights sharded by FSDP2 over a world of one
(infra/fsdp.py), computing in bf16 block by block, gradient checkpointing on, AdamW on every weight. Measured:
- the gather for the sampler (fsdp.whole: the whole model in bf16), its seconds and peak memory;
- a warm-up step, then timed steps, each one micro-batch of `rows` x `tokens` (forward, entropy, a GRPO
  surrogate loss, backward, clip, AdamW): tokens/s, and the peak allocated memory
  (torch.cuda.max_memory_allocated, null on the CPU) against engine/memory.py's plan of the same step, whose
  training micro-batch and optimizer step are its two highest phases here.
Speed and memory depend on shapes, not weight values (bench/qwen3_shapes.py). One table is printed,
DIR/full_step.json holds it. A step that fails stops the run with its traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

from qwen3_shapes import QWEN3, QWEN3_COMMON, QWEN3_TINY  # noqa: E402

from engine import memory  # noqa: E402
from infra import (
    distributed,  # noqa: E402
    fsdp,  # noqa: E402
)
from model import ModelConfig, Transformer  # noqa: E402


def model_config(name: str) -> ModelConfig:
    shape = {**QWEN3_COMMON, **QWEN3.get(name, {}), **QWEN3_TINY.get(name, {})}
    return ModelConfig.from_hf(shape)


def build(cfg: ModelConfig, device: torch.device, compute: torch.dtype) -> Transformer:
    """Seeded random weights in the master dtype on the device, sharded over the world of one."""
    torch.manual_seed(0)
    with torch.device(device):
        model = Transformer(cfg).to(fsdp.master_dtype(compute))
    model = fsdp.shard(model, compute)
    model.gradient_checkpointing = True
    return model


def train_step(model: Transformer, optimizer, ids: torch.Tensor, prompt_len: int) -> None:
    """train.py's micro-batch (model.hidden, hidden_logprobs with entropy, a clipped ratio loss), one update."""
    model.train()
    h = model.hidden(ids)
    logp, _ = model.hidden_logprobs(h, ids, start=prompt_len, with_entropy=True)
    ratio = torch.exp(logp - logp.detach())
    advantages = torch.linspace(-1, 1, len(ids), device=ids.device)[:, None]
    loss = -torch.minimum(ratio * advantages, ratio.clamp(0.8, 1.2) * advantages).mean()
    loss.backward()
    fsdp.clip_grad_norm(list(model.parameters()), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def planned(cfg: ModelConfig, rows: int, prompt_len: int, new_tokens: int, compute: torch.dtype) -> dict:
    """memory.py's peak bytes of the training micro-batch and of the optimizer step for this shape."""
    work = memory.Workload(
        dtype=compute,
        lora_rank=0,
        prompt_len=prompt_len,
        max_new_tokens=new_tokens,
        group_size=1,
        prompts_per_step=rows,
        micro_batch_rows=rows,
        rollout_prompts=1,
        eval_prompts=1,
        eval_k=1,
    )
    with memory.planning(cfg, work) as planner:
        return {"train": planner.peak("train", rows), "optimizer": planner.peak("optimizer")}


def timed(device: torch.device, fn) -> tuple[float, int | None]:
    """(seconds, peak allocated bytes or None on the CPU) of fn()."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, torch.cuda.max_memory_allocated() if device.type == "cuda" else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="Qwen3-1.7B", choices=[*QWEN3, *QWEN3_TINY])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--rows", type=int, default=16, help="rows per micro-batch (ATR's 1.7B setup: 16 to 32)")
    parser.add_argument("--tokens", type=int, default=4608, help="tokens per row: 512 prompt + 4,096 new")
    parser.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    parser.add_argument("--tiny", action="store_true", help="a tiny Qwen3, 2 rows x 64 tokens: a dry run")
    parser.add_argument("--out", type=Path, default=None, help="folder for full_step.json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device here (use --device cpu --tiny for a dry run)")
    name, rows, tokens = ("Qwen3-tiny", 2, 64) if args.tiny else (args.model, args.rows, args.tokens)
    prompt_len = min(512, tokens // 8)
    compute = torch.bfloat16 if device.type == "cuda" else torch.float32
    cfg = model_config(name)
    plan = planned(cfg, rows, prompt_len, tokens - prompt_len, compute)
    report = {
        "model": name,
        "device": str(device),
        "rows": rows,
        "tokens_per_row": tokens,
        "planned_bytes": plan,
        "steps": [],
    }
    with distributed.joined(device, 600, group=True):
        model = build(cfg, device, compute)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        ids = torch.randint(0, cfg.vocab_size, (rows, tokens), generator=torch.Generator().manual_seed(0)).to(device)

        def gather():
            with fsdp.whole(model) as whole:
                assert whole.lm_head.weight.dtype == compute

        report["gather_seconds"], report["gather_peak_bytes"] = timed(device, gather)
        for step in range(args.steps + 1):
            seconds, peak = timed(device, lambda: train_step(model, optimizer, ids, prompt_len))
            report["steps"].append(
                {
                    "warm_up": step == 0,
                    "seconds": seconds,
                    "tokens_per_s": rows * tokens / seconds,
                    "peak_allocated_bytes": peak,
                }
            )
    timed_steps = [s for s in report["steps"] if not s["warm_up"]]
    report["tokens_per_s"] = max(s["tokens_per_s"] for s in timed_steps)
    measured = [s["peak_allocated_bytes"] for s in timed_steps if s["peak_allocated_bytes"] is not None]
    report["peak_allocated_bytes"] = max(measured) if measured else None
    planned_peak = max(plan.values())
    print(f"{name} full-parameter step, {rows} rows x {tokens} tokens on {device}:")
    print(f"  gather for the sampler: {report['gather_seconds']:.3f} s")
    print(f"  tokens/s: {report['tokens_per_s']:.0f} (best of {len(timed_steps)} steps)")
    peak = report["peak_allocated_bytes"]
    print(
        f"  peak allocated: {'n/a on the CPU' if peak is None else f'{peak / memory.GB:.2f} GB'}; planned "
        f"{planned_peak / memory.GB:.2f} GB (train {plan['train'] / memory.GB:.2f}, optimizer "
        f"{plan['optimizer'] / memory.GB:.2f})"
    )
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "full_step.json").write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
