"""What train.py (GRPO) and sft.py (the SFT warm start) share: the model, tokenizer and optimizer a run
trains (build, with the parameters it steps: trainable), the learning-rate schedule and the clipped
optimizer step.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path

import torch

import config
import lora
import loss
from config import Config
from infra import fsdp, weights


def build(cfg: Config, init_adapter: str | None = None, model_dir: Path | None = None):
    """Model, tokenizer, optimizer and reference policy (from model_dir, cfg.model resolved, when given).

    With LoRA: fresh adapters (or those of init_adapter) on the frozen base, which is also the reference
    policy (None is returned).
    With --lora-rank 0 every weight trains: fp32 master weights (under bf16 compute) sharded by FSDP2 over
    the process group (fsdp.py; one process is a group of one), and the reference is a frozen sharded
    copy in the compute dtype when the loss needs ref_logp, else None.
    """
    device, dtype = config.resolve_device(cfg)
    source = cfg.model if model_dir is None else str(model_dir)
    tokenizer = weights.load_tokenizer(source)
    reference = None
    if cfg.lora_rank:
        model = weights.from_pretrained(source, dtype=dtype, device=device)
        model.requires_grad_(False)
        torch.manual_seed(cfg.seed)  # adapter initialization
        lora.inject(
            model, cfg.lora_rank, cfg.lora_alpha, targets=tuple(cfg.lora_targets.split(",")), dropout=cfg.lora_dropout
        )
        if init_adapter:  # a resumed run's checkpoint then replaces these weights
            lora.load(model, init_adapter)
    else:
        model = fsdp.shard(weights.from_pretrained(source, dtype=fsdp.master_dtype(dtype), device=device), dtype)
        if "ref_logp" in loss.required_inputs(cfg.loss):
            frozen = weights.from_pretrained(source, dtype=dtype, device=device).requires_grad_(False)
            reference = fsdp.shard(frozen, dtype)
    model.gradient_checkpointing = cfg.gradient_checkpointing == "on" or (
        cfg.gradient_checkpointing == "auto" and device.type == "cuda"
    )
    optimizer = torch.optim.AdamW(trainable(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, tokenizer, optimizer, reference


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: the adapters with LoRA, every weight without."""
    return list(lora.parameters(model)) if lora.lora_modules(model) else list(model.parameters())


def learning_rate(peak: float, schedule: str, warmup_steps: int, total_steps: int, step: int) -> float:
    """The rate of step `step` (1-based): linear warmup to `peak` over warmup_steps, then constant, or a
    cosine or linear decay that would reach 0 one step after the last (so the last step still learns)."""
    if step <= warmup_steps:
        return peak * step / warmup_steps
    if schedule == "constant":
        return peak
    progress = (step - warmup_steps - 1) / max(1, total_steps - warmup_steps)  # 0 at the first decayed step
    return peak * (0.5 * (1 + math.cos(math.pi * progress)) if schedule == "cosine" else 1 - progress)


def optimizer_step(model, optimizer, total_loss: torch.Tensor, cfg: Config, step: int) -> float | None:
    """Clip and apply the accumulated gradient; a non-finite loss or norm skips the update (returns None)."""
    grad_norm = fsdp.clip_grad_norm(trainable(model), cfg.grad_clip)
    finite = bool(torch.isfinite(total_loss) & torch.isfinite(grad_norm))  # one device sync
    if finite:
        optimizer.step()
    else:
        warnings.warn(
            f"step {step}: non-finite loss ({float(total_loss)}) or gradient norm ({float(grad_norm)}); update skipped"
        )
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm) if finite else None
