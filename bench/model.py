"""Training-path throughput and peak memory: model.py + lora.py against transformers + peft, in one run.

One step = forward + backward of the per-token log-probabilities GRPO trains on, with LoRA r=32
(alpha 64) on all seven linear projections and gradient checkpointing on both sides. Ours calls
model.token_logprobs (vocabulary projection in chunks, never [B, T, V] at once); transformers
returns full logits, turned into log-probabilities row by row as TRL's GRPO trainer does. Rows are
left-padded by up to T/8 tokens, as batched prompts are.

CPU (default): SmolLM2-135M-Instruct fp32, 4 x 128 tokens. GPU (--device cuda): Qwen3-1.7B shapes,
16 x 2048 tokens, and Qwen3-8B shapes, 8 x 2048 tokens, random bf16 weights. --device meta only
builds the GPU models with their adapters and runs our forward + backward on the meta device, a
check that runs anywhere.

Each side runs in its own process, so its peak memory is its own. On CPU both processes stay
alive and take turns, one timed step each, so load from other programs hits both alike; on the
GPU they run one after the other. The best of --steps timed steps counts. Memory:
- CUDA: torch.cuda.max_memory_allocated, reset after the warm-up step; includes the weights.
- CPU: the peak resident set size (VmHWM in /proc/self/status), reset after the warm-up step by
  writing 5 to /proc/self/clear_refs (Linux); includes the weights and the Python/torch runtime.
  "step" is that peak minus the resident size just before the timed steps: what a step adds.

    .venv/bin/python bench/model.py [--device cpu|cuda|meta] [--steps 2]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import lora  # noqa: E402
import model as modeling  # noqa: E402
import weights  # noqa: E402
from qwen3_shapes import QWEN3, QWEN3_COMMON, QWEN3_TINY  # noqa: E402

RANK, ALPHA = 32, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("model.py + lora.py", "transformers + peft")

GPU_BATCHES = {"Qwen3-1.7B": (16, 2048), "Qwen3-8B": (8, 2048)}  # (sequences, tokens each)


# ----------------------------------------------------------------------------- the two sides


def build_hf(model_name: str, device: str):
    """The transformers model: SmolLM2 from the converted checkpoint, Qwen3 from its shapes with seeded
    random weights (the same seed gives the same weights in every process)."""
    from transformers import AutoModelForCausalLM, Qwen3Config

    if model_name == "SmolLM2-135M-Instruct":
        return AutoModelForCausalLM.from_pretrained(weights.resolve_checkpoint(None), dtype=torch.float32)
    torch.manual_seed(0)
    with torch.device(device):
        config = Qwen3Config(**{**QWEN3_COMMON, **{**QWEN3, **QWEN3_TINY}[model_name]})
        return AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)


def ours_from_hf(hf_model) -> modeling.Transformer:
    """Our model holding the transformers model's weight tensors: same weights, no second copy."""
    cfg = modeling.ModelConfig.from_hf(hf_model.config.to_dict())
    with torch.device("meta"):
        ours = modeling.Transformer(cfg)
    ours.load_state_dict(hf_model.state_dict(), strict=True, assign=True)
    if cfg.tie_word_embeddings:
        ours.lm_head.weight = ours.model.embed_tokens.weight
    return ours


def build_ours(model_name: str, device: str) -> modeling.Transformer:
    if model_name == "SmolLM2-135M-Instruct":
        model = weights.from_pretrained(None)
    else:
        model = ours_from_hf(build_hf(model_name, device))
    lora.inject(model, RANK, ALPHA, TARGETS)
    model.gradient_checkpointing = True
    return model.train()


def build_peft(model_name: str, device: str):
    from peft import LoraConfig, get_peft_model

    hf = build_hf(model_name, device)
    hf.config.use_cache = False
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return get_peft_model(hf, LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)).train()


def ours_step(model, ids, pad_mask):
    logp, _ = model.token_logprobs(ids, pad_mask)  # [B, T]
    loss_mask = pad_mask.clone()
    loss_mask[:, 0] = False  # the first token has no prediction
    (-(logp * loss_mask).sum() / loss_mask.sum()).backward()
    model.zero_grad(set_to_none=True)


def peft_step(model, ids, pad_mask):
    positions = (pad_mask.long().cumsum(1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=pad_mask.long(), position_ids=positions).logits[:, :-1]
    # One row at a time, so only one [T, V] fp32 block exists at once (TRL's selective_log_softmax).
    logp = torch.stack([torch.log_softmax(row.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
                        for row, targets in zip(logits, ids[:, 1:])])  # [B, T-1]
    loss_mask = pad_mask[:, 1:]
    (-(logp * loss_mask).sum() / loss_mask.sum()).backward()
    model.zero_grad(set_to_none=True)


def random_batch(batch: int, seq: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids [B, T] and pad_mask [B, T], row b left-padded by a random count below T/8."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (batch, seq), generator=g)
    pads = torch.randint(0, seq // 8, (batch,), generator=g)
    pad_mask = torch.arange(seq)[None] >= pads[:, None]
    return ids.masked_fill(~pad_mask, 0).to(device), pad_mask.to(device)


# ----------------------------------------------------------------------------- measuring


def current_and_reset_peak(device: torch.device) -> int | None:
    """Memory in use now, in bytes; from here on the peak counts afresh."""
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    clear_refs = Path("/proc/self/clear_refs")
    if not clear_refs.exists():
        return None
    clear_refs.write_text("5")  # resets VmHWM to the current resident size
    return _proc_status_bytes("VmRSS")


def peak_memory(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated()
    return _proc_status_bytes("VmHWM") if Path("/proc/self/status").exists() else None


def _proc_status_bytes(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise ValueError(f"/proc/self/status has no {field} line")


def worker(side: str, model_name: str, device_name: str, batch: int, seq: int, conn) -> None:
    """One side in its own process: build, warm up, then time one step per "step" message received.
    Answers each with the seconds taken and, on "stop", with its memory figures."""
    device = torch.device(device_name)
    model = build_ours(model_name, device_name) if side == SIDES[0] else build_peft(model_name, device_name)
    step = ours_step if side == SIDES[0] else peft_step
    ids, pad_mask = random_batch(batch, seq, model.config.vocab_size, device)
    step(model, ids, pad_mask)  # warm-up: first-call allocations, kernel selection
    in_use = current_and_reset_peak(device)
    conn.send("ready")
    while conn.recv() == "step":
        start = time.perf_counter()
        step(model, ids, pad_mask)
        if device.type == "cuda":
            torch.cuda.synchronize()
        conn.send(time.perf_counter() - start)
    peak = peak_memory(device)
    conn.send({"peak": peak, "step": None if peak is None or in_use is None else peak - in_use})


def run_sides(sides, model_name: str, device: str, batch: int, seq: int, steps: int) -> dict:
    """Start one worker per side, then alternate their timed steps so that load from other processes
    on the machine hits every side alike. The best step counts."""
    context = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    for side in sides:
        ours_end, worker_end = context.Pipe()
        processes.append(context.Process(target=worker, args=(side, model_name, device, batch, seq, worker_end)))
        processes[-1].start()
        pipes[side] = ours_end
    for pipe in pipes.values():
        pipe.recv()  # "ready"
    seconds = {side: [] for side in sides}
    for _ in range(steps):
        for side, pipe in pipes.items():
            pipe.send("step")
            seconds[side].append(pipe.recv())
    results = {}
    for side, pipe in pipes.items():
        pipe.send("stop")
        results[side] = {"tokens_per_s": batch * seq / min(seconds[side]), **pipe.recv()}
    for process in processes:
        process.join()
    return results


def compare(model_name: str, device: str, batch: int, seq: int, steps: int) -> None:
    if device == "cuda":  # one side at a time: each needs the GPU memory to itself
        results = {side: run_sides([side], model_name, device, batch, seq, steps)[side] for side in SIDES}
    else:
        results = run_sides(SIDES, model_name, device, batch, seq, steps)
    mib = lambda n: "n/a" if n is None else f"{n / 2**20:,.0f}"  # noqa: E731
    print(f"{'side':<22} {'tokens/s':>9} {'peak MiB':>10} {'step MiB':>10}")
    for side, r in results.items():
        print(f"{side:<22} {r['tokens_per_s']:>9,.0f} {mib(r['peak']):>10} {mib(r['step']):>10}")
    ours, theirs = results[SIDES[0]], results[SIDES[1]]
    ratio = lambda key: "n/a" if ours[key] is None else f"{ours[key] / theirs[key]:.2f}x"  # noqa: E731
    print(f"{'ours / theirs':<22} {ours['tokens_per_s'] / theirs['tokens_per_s']:>8.2f}x "
          f"{ratio('peak'):>10} {ratio('step'):>10}")


def check_on_meta(models: list[str]) -> None:
    """Build both Qwen3 sides on the meta device and run our step there: shapes and wiring only."""
    for name in models:
        ours, theirs = build_ours(name, "meta"), build_peft(name, "meta")
        ours_lora = sum(p.numel() for p in lora.parameters(ours))
        peft_lora = sum(p.numel() for p in theirs.parameters() if p.requires_grad)
        if ours_lora != peft_lora:
            raise RuntimeError(f"{name}: {ours_lora} LoRA parameters here, {peft_lora} in peft")
        ids, _ = random_batch(2, 64, ours.config.vocab_size, "meta")
        ours.token_logprobs(ids)[0].sum().backward()  # no pad_mask: checking it needs real values
        params = sum(p.numel() for p in ours.parameters())
        print(f"{name}: built on meta, {params / 1e9:.2f}B parameters, {ours_lora / 1e6:.1f}M LoRA parameters "
              f"(same as peft), forward + backward ran")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     allow_abbrev=False)
    parser.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side; the best one counts")
    parser.add_argument("--models", nargs="+", choices=list(QWEN3), default=list(QWEN3),
                        help="GPU and meta: which Qwen3 shapes (one at a time fits a short device session)")
    args = parser.parse_args()
    if args.device == "meta":
        check_on_meta(args.models)
    elif args.device == "cuda":
        for name in args.models:
            batch, seq = GPU_BATCHES[name]
            print(f"\n{torch.cuda.get_device_name()}: {name} random bf16 weights, {batch} x {seq} tokens, "
                  f"LoRA r={RANK} on all linear layers, gradient checkpointing")
            compare(name, "cuda", batch, seq, args.steps)
    else:
        batch, seq = 4, 128
        print(f"CPU, {torch.get_num_threads()} threads: SmolLM2-135M-Instruct fp32, {batch} x {seq} tokens, "
              f"LoRA r={RANK} on all linear layers, gradient checkpointing")
        compare("SmolLM2-135M-Instruct", "cpu", batch, seq, args.steps)


if __name__ == "__main__":
    main()
