"""Training-path throughput and peak memory, side by side in one run: two benchmarks.

logprobs: model.py + lora.py against transformers + peft. One step = forward + backward of the
per-token log-probabilities GRPO trains on, with LoRA r=32 (alpha 64) on all seven linear projections
and gradient checkpointing on both sides. Ours calls model.token_logprobs (vocabulary projection in
chunks, never [B, T, V] at once); transformers returns full logits, turned into log-probabilities row
by row as TRL's GRPO trainer does. Rows are left-padded by up to T/8 tokens, as batched prompts are.
CPU (default): SmolLM2-135M-Instruct fp32, 4 x 128 tokens. GPU (--device cuda): Qwen3-1.7B shapes,
16 x 2048 tokens, and Qwen3-8B shapes, 8 x 2048 tokens, random bf16 weights. --device meta only
builds the GPU models with their adapters and runs our forward + backward on the meta device, a
check that runs anywhere; it also counts the grpo pass's FLOPs and tensor memory there.

grpo: the training pass of the demo's step (`make train`): 8 prompts of 54-55 tokens x 8 completions of
10-16 of 16 tokens, SmolLM2-135M-Instruct with the demo's LoRA (r 16, alpha 32, seven projections),
forward, log-probs with the entropy, loss.policy_loss and backward, as train.py's policy_update.
"shared prompts" runs each prompt once for its 8 rows (engine/shared_prompts.py's hidden_shared, as train.py does);
"whole rows" runs every row with its own copy of its prompt (model.hidden), the pass without sharing. fp32 without
checkpointing on the CPU, bf16 with it on a GPU, as the trainer's defaults.

Each side runs in its own process, so its peak memory is its own. On CPU both processes stay
alive and take turns, one timed step each, so load from other programs hits both alike; on the
GPU they run one after the other. The best of --steps timed steps counts. Memory:
- CUDA: torch.cuda.max_memory_allocated, reset after the warm-up step; includes the weights.
- CPU: the peak resident set size (VmHWM in /proc/self/status), reset after the warm-up step by
  writing 5 to /proc/self/clear_refs (Linux); includes the weights and the Python/torch runtime.
  "step" is the most bytes of tensors that one more step holds at once, counted by counting.LiveBytes
  (the planner's counter) on an untimed step: what a step adds. (The resident size is a poor measure
  of it: the allocator keeps freed memory, so a step's rise above the warm-up's varies from run to run.)

    .venv/bin/python bench/model.py [--device cpu|cuda|meta] [--steps 2] [--bench logprobs grpo]
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from qwen3_shapes import QWEN3, QWEN3_COMMON, QWEN3_TINY  # noqa: E402

import lora  # noqa: E402
import loss  # noqa: E402
import model as modeling  # noqa: E402
from engine import counting, memory  # noqa: E402
from engine.shared_prompts import hidden_shared  # noqa: E402
from infra import weights  # noqa: E402

RANK, ALPHA = 32, 64
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SIDES = ("model.py + lora.py", "transformers + peft")
GRPO_SIDES = ("shared prompts", "whole rows")
DEMO_PROMPTS, DEMO_GROUP, DEMO_NEW_TOKENS = 8, 8, 16

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
    logp = torch.stack(
        [
            torch.log_softmax(row.float(), -1).gather(-1, targets[:, None]).squeeze(-1)
            for row, targets in zip(logits, ids[:, 1:])
        ]
    )  # [B, T-1]
    loss_mask = pad_mask[:, 1:]
    (-(logp * loss_mask).sum() / loss_mask.sum()).backward()
    model.zero_grad(set_to_none=True)


def build_demo(device: str) -> modeling.Transformer:
    """The demo's model and adapters, in the trainer's dtype and checkpointing for the device (on meta:
    its architecture, ModelConfig's defaults, without weights)."""
    if device == "meta":
        with torch.device("meta"):
            model = modeling.Transformer(modeling.ModelConfig())
    else:
        model = weights.from_pretrained(
            None, dtype=torch.bfloat16 if device == "cuda" else torch.float32, device=device
        )
    lora.inject(model, 16, 32.0)
    model.gradient_checkpointing = device == "cuda"
    return model.train()


def demo_batch(device) -> dict[str, torch.Tensor]:
    """A step of the demo's shape: 8 prompts of 54-55 tokens, left-padded, and 8 completions of 10-16
    tokens each, right-padded; rows prompt-major, as the sampler returns them."""
    g = torch.Generator().manual_seed(0)
    U, G, P, C, vocab = DEMO_PROMPTS, DEMO_GROUP, 55, DEMO_NEW_TOKENS, 49152
    prompt_mask = torch.arange(P)[None] >= P - torch.randint(54, 56, (U,), generator=g)[:, None]
    completion_mask = torch.arange(C)[None] < torch.randint(10, 17, (U * G,), generator=g)[:, None]
    batch = dict(
        prompt_ids=torch.randint(3, vocab, (U, P), generator=g) * prompt_mask,
        prompt_mask=prompt_mask,
        owner=torch.arange(U).repeat_interleave(G),
        completion_ids=torch.randint(3, vocab, (U * G, C), generator=g) * completion_mask,
        completion_mask=completion_mask,
        old_logp=-torch.rand(U * G, C, generator=g),
        advantages=torch.randn(U * G, generator=g),
    )
    return {name: value.to(device) for name, value in batch.items()}


def grpo_step(model, batch: dict, shared: bool) -> None:
    """train.py's policy_update forward, loss and backward on the whole step, its prompts shared or not. On the meta
    device the loss is memory.py's surrogate (loss.policy_loss asks questions of the values)."""
    owner, mask = batch["owner"], batch["completion_mask"]
    if shared:
        h = hidden_shared(model, batch["prompt_ids"], batch["prompt_mask"], owner, batch["completion_ids"], mask)
        ids, start = torch.cat([batch["prompt_ids"][owner, -1:], batch["completion_ids"]], 1), 1
    else:
        ids = torch.cat([batch["prompt_ids"][owner], batch["completion_ids"]], 1)
        h = model.hidden(ids, torch.cat([batch["prompt_mask"][owner], mask], 1))
        start = batch["prompt_ids"].shape[1]
    logp, entropy = model.hidden_logprobs(h, ids, start=start, with_entropy=True)
    if logp.is_meta:
        value = memory._surrogate_loss(logp, batch["old_logp"], batch["advantages"], mask)
    else:
        value, _ = loss.policy_loss(logp, batch["old_logp"], batch["advantages"], mask, loss.LossConfig())
    value.backward()
    model.zero_grad(set_to_none=True)


def count_grpo_on_meta() -> dict[str, tuple[float, int]]:
    """(GFLOP, peak bytes of tensors) of the demo's training pass, each side counted on the meta device:
    the work and the memory a step adds, the same on any machine and under any load."""
    from torch.utils.flop_counter import FlopCounterMode

    model, batch, counts = build_demo("meta"), demo_batch("meta"), {}
    for side in GRPO_SIDES:
        # attention counted as the math kernel's matrix products (LiveBytes answers the padding check on meta)
        with counting.LiveBytes(), FlopCounterMode(display=False) as flops:
            grpo_step(model, batch, shared=side == GRPO_SIDES[0])
        with counting.flash_attention_on_meta(), counting.LiveBytes() as tracker:  # and as the fused kernels allocate
            grpo_step(model, batch, shared=side == GRPO_SIDES[0])
        counts[side] = (flops.get_total_flops() / 1e9, tracker.peak)
    return counts


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


def side_step(side: str, model_name: str, device_name: str, batch: int, seq: int):
    """What one side times: a function of no arguments that runs one step."""
    device = torch.device(device_name)
    if side in GRPO_SIDES:
        model, data = build_demo(device_name), demo_batch(device)
        return lambda: grpo_step(model, data, shared=side == GRPO_SIDES[0])
    model = build_ours(model_name, device_name) if side == SIDES[0] else build_peft(model_name, device_name)
    step = ours_step if side == SIDES[0] else peft_step
    ids, pad_mask = random_batch(batch, seq, model.config.vocab_size, device)
    return lambda: step(model, ids, pad_mask)


def worker(side: str, model_name: str, device_name: str, batch: int, seq: int, conn) -> None:
    """One side in its own process: build, warm up, then time one step per "step" message received.
    Answers each with the seconds taken and, on "stop", with its memory figures."""
    device = torch.device(device_name)
    step = side_step(side, model_name, device_name, batch, seq)
    step()  # warm-up: first-call allocations, kernel selection
    in_use = current_and_reset_peak(device)
    conn.send("ready")
    while conn.recv() == "step":
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        conn.send(time.perf_counter() - start)
    peak = peak_memory(device)
    if device.type == "cuda":
        added = peak - in_use
    else:  # the tensors one more (untimed) step allocates at its peak, counted as the memory plan counts them
        with counting.LiveBytes() as tracker:
            step()
        added = tracker.peak
    conn.send({"peak": peak, "step": added})


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


def compare(model_name: str, device: str, batch: int, seq: int, steps: int, sides=SIDES) -> None:
    """Run both sides and print tokens/s (of `batch` x `seq` tokens a step), peak and step memory, and the
    first side's ratios to the second's."""
    if device == "cuda":  # one side at a time: each needs the GPU memory to itself
        results = {side: run_sides([side], model_name, device, batch, seq, steps)[side] for side in sides}
    else:
        results = run_sides(sides, model_name, device, batch, seq, steps)
    mib = lambda n: "n/a" if n is None else f"{n / 2**20:,.0f}"  # noqa: E731
    print(f"{'side':<22} {'tokens/s':>9} {'peak MiB':>10} {'step MiB':>10}")
    for side, r in results.items():
        print(f"{side:<22} {r['tokens_per_s']:>9,.0f} {mib(r['peak']):>10} {mib(r['step']):>10}")
    ours, theirs = results[sides[0]], results[sides[1]]
    ratio = lambda key: "n/a" if ours[key] is None else f"{ours[key] / theirs[key]:.2f}x"  # noqa: E731
    print(
        f"{'first / second':<22} {ours['tokens_per_s'] / theirs['tokens_per_s']:>8.2f}x "
        f"{ratio('peak'):>10} {ratio('step'):>10}"
    )


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
        print(
            f"{name}: built on meta, {params / 1e9:.2f}B parameters, {ours_lora / 1e6:.1f}M LoRA parameters "
            f"(same as peft), forward + backward ran"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("--device", choices=["cpu", "cuda", "meta"], default="cpu")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per side; the best one counts")
    parser.add_argument(
        "--models",
        nargs="+",
        choices=list(QWEN3),
        default=list(QWEN3),
        help="GPU and meta: which Qwen3 shapes (one at a time fits a short device session)",
    )
    parser.add_argument(
        "--bench",
        nargs="+",
        choices=["logprobs", "grpo"],
        default=["logprobs", "grpo"],
        help="which benchmarks (default: both)",
    )
    args = parser.parse_args()
    if args.device == "meta":
        if "logprobs" in args.bench:
            check_on_meta(args.models)
        if "grpo" not in args.bench:
            return
        counts = count_grpo_on_meta()
        print("the demo's training pass, counted on meta:")
        for side, (gflop, peak) in counts.items():
            print(f"  {side:<15} {gflop:>8,.0f} GFLOP {peak / 2**20:>8,.0f} MiB of tensors at its peak")
        (shared_flops, shared_bytes), (whole_flops, whole_bytes) = counts.values()
        print(f"  shared / whole  {shared_flops / whole_flops:>7.2f}x {shared_bytes / whole_bytes:>11.2f}x")
        return
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if "logprobs" in args.bench and args.device == "cuda":
        for name in args.models:
            batch, seq = GPU_BATCHES[name]
            print(
                f"\n{where}: {name} random bf16 weights, {batch} x {seq} tokens, LoRA r={RANK} on all linear "
                "layers, gradient checkpointing"
            )
            compare(name, "cuda", batch, seq, args.steps)
    elif "logprobs" in args.bench:
        batch, seq = 4, 128
        print(
            f"{where}: SmolLM2-135M-Instruct fp32, {batch} x {seq} tokens, LoRA r={RANK} on all linear layers, "
            "gradient checkpointing"
        )
        compare("SmolLM2-135M-Instruct", "cpu", batch, seq, args.steps)
    if "grpo" in args.bench:
        rows = DEMO_PROMPTS * DEMO_GROUP
        print(
            f"\n{where}: the demo's training pass, SmolLM2-135M-Instruct, {DEMO_PROMPTS} prompts of 54-55 tokens "
            f"x {DEMO_GROUP} completions of 10-16 tokens, LoRA r16 (tokens/s: of the {rows} rows' completions)"
        )
        compare("SmolLM2-135M-Instruct", args.device, rows, DEMO_NEW_TOKENS, args.steps, sides=GRPO_SIDES)


if __name__ == "__main__":
    main()
