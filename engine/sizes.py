"""The run's sizes: what the memory plan (memory.py) chooses where the settings leave a size at 0, and the
sampler's KV pool those sizes give.

Five sizes decide a step's memory: prompts in flight in the sampler (--rollout-batch), rows per training
micro-batch (--grad-accum) or its tokens when rows are packed by length (--micro-batch-tokens), prompts per
evaluation call (--eval-batch) and the KV pool's blocks (--kv-blocks). On a GPU, fit measures the real step on
the meta device and chooses them within the budget, the training micro-batches packed up to the tokens of the
rows it chooses; on the CPU every row of a step fits in one call and one micro-batch. Under torchrun each rank
plans its share, and the most cautious rank's sizes are everyone's. `python train.py --plan` prints the plan
without loading any weight. The pool is allocated once per run and kept: every rollout and evaluation samples
over it.
"""

from __future__ import annotations

import dataclasses
import math

import torch

import config
import loss
from config import Config
from data import render_prompt
from engine import memory
from engine.pool import Pool, default_block_size, pool_attention
from engine.scheduler import group_blocks
from infra import distributed, fsdp
from infra.errors import oom_hint


def resolve_sizes(
    cfg: Config,
    model,
    tokenizer,
    train_set: list[dict],
    world: distributed.World,
    eval_sets: dict[str, list[dict]] | None = None,
) -> Config:
    """resolve_automatic for one rank's share of a step (its prompts), the same on every rank: where the
    sizes come from the memory plan, the most cautious rank's (GPUs may differ in memory)."""
    share = dataclasses.replace(cfg, prompts_per_step=cfg.prompts_per_step // world.size, world_size=world.size)
    share = resolve_automatic(share, model, tokenizer, train_set, eval_sets)
    sizes = [share.rollout_batch, share.eval_batch, share.kv_blocks, -share.grad_accum, share.micro_batch_tokens]
    # the fewest rows in flight, the smallest pool, the most micro-batches, the fewest tokens in one
    rollout_batch, eval_batch, kv_blocks, negated_accum, micro_batch_tokens = world.min(
        torch.tensor(sizes, device="cpu")
    ).tolist()
    return dataclasses.replace(
        share,
        prompts_per_step=cfg.prompts_per_step,
        world_size=cfg.world_size,
        rollout_batch=rollout_batch,
        eval_batch=eval_batch,
        kv_blocks=kv_blocks,
        grad_accum=-negated_accum,
        micro_batch_tokens=micro_batch_tokens,
    )


def resolve_automatic(
    cfg: Config, model, tokenizer, train_set: list[dict], eval_sets: dict[str, list[dict]] | None = None
) -> Config:
    """Fill the sizes left at 0: from the memory plan on a GPU; on the CPU all of a step's prompts in flight, one
    micro-batch, 16 evaluation prompts per call and a pool that holds every row at full length."""
    prompt_len, eval_len = prompt_lengths(cfg, tokenizer, train_set, eval_sets)
    if model.device.type != "cuda":
        cfg = dataclasses.replace(
            cfg,
            rollout_batch=cfg.rollout_batch or cfg.prompts_per_step,
            grad_accum=cfg.grad_accum or 1,
            eval_batch=cfg.eval_batch or 16,
        )
        if not cfg.kv_blocks:
            block = default_block_size(model)
            need = max(
                cfg.rollout_batch * group_blocks(prompt_len, cfg.group_size, cfg.max_new_tokens, block),
                cfg.eval_batch * group_blocks(eval_len, cfg.eval_k, cfg.max_new_tokens, block),
            )
            cfg = dataclasses.replace(cfg, kv_blocks=1 + need)
        return cfg
    budget = memory.gpu_memory_bytes(str(model.device), cfg.gpu_memory)
    # the kind this GPU's self-check chose (the pool made later takes the same), so a fallback is planned
    attention = pool_attention(model.device, model.dtype)
    return planned_config(
        cfg, model.config, budget, prompt_len=prompt_len, eval_prompt_len=eval_len, attention=attention
    )


def prompt_lengths(
    cfg: Config, tokenizer, train_set: list[dict], eval_sets: dict[str, list[dict]] | None = None
) -> tuple[int, int]:
    """Tokens of the longest training prompt and of the longest evaluation prompt (the training one without
    evaluation sets), as the sampler sees them."""

    def longest(problems):
        return max(
            (
                len(render_prompt(tokenizer, p["problem"], cfg.template, cfg.system_prompt, cfg.thinking == "on"))
                for p in problems
            ),
            default=1,
        )

    train_len = longest(train_set)
    return train_len, max((longest(problems) for problems in (eval_sets or {}).values()), default=train_len)


def planned_config(
    cfg: Config,
    model_cfg,
    budget: int,
    prompt_len: int = memory.Workload.prompt_len,
    eval_prompt_len: int = 0,
    planner: memory.Planner | None = None,
    attention: str = "auto",
) -> Config:
    """cfg with rollout_batch, grad_accum, eval_batch and kv_blocks chosen by the memory plan where they are 0,
    for a sampler whose attention is `attention` (engine.pool.pool_attention); where it chooses grad_accum and
    micro_batch_tokens is 0, the training micro-batches pack rows up to the tokens of its chosen rows (the
    frozen passes keep them)."""
    free = tuple(
        size
        for size, flag in (
            ("micro_batch_rows", cfg.grad_accum),
            ("micro_batch_tokens", cfg.micro_batch_tokens),
            ("rollout_prompts", cfg.rollout_batch),
            ("eval_prompts", cfg.eval_batch),
        )
        if not flag
    )
    work = memory.fit(model_cfg, workload(cfg, prompt_len, eval_prompt_len, attention), budget, free, planner)
    return dataclasses.replace(
        cfg,
        rollout_batch=cfg.rollout_batch or work.rollout_prompts,
        grad_accum=cfg.grad_accum or math.ceil(work.minibatch_rows / work.micro_batch_rows),
        micro_batch_tokens=cfg.micro_batch_tokens or work.micro_batch_tokens,
        eval_batch=cfg.eval_batch or work.eval_prompts,
        kv_blocks=cfg.kv_blocks or work.pool_blocks,
    )


def workload(
    cfg: Config, prompt_len: int = memory.Workload.prompt_len, eval_prompt_len: int = 0, attention: str = "auto"
) -> memory.Workload:
    """What one step of this config asks of one GPU, its prompts_per_step being that rank's share; sizes left
    at 0 start at their largest, for fit to choose (with --grad-accum 0, training packs rows by length, its
    budget a mini-batch at full length); the sampler's attention is `attention`."""
    _, dtype = config.resolve_device(cfg)
    minibatch_rows = math.ceil(cfg.prompts_per_step * cfg.group_size / cfg.updates_per_rollout)
    full_length = minibatch_rows * (prompt_len + cfg.max_new_tokens)
    micro_batch_tokens = cfg.micro_batch_tokens or (0 if cfg.grad_accum else full_length)
    needs = loss.required_inputs(cfg.loss)
    return memory.Workload(
        dtype=dtype,
        lora_rank=cfg.lora_rank,
        world_size=cfg.world_size or distributed.world_size(),
        lora_targets=tuple(cfg.lora_targets.split(",")),
        gradient_checkpointing=cfg.gradient_checkpointing != "off",
        prompt_len=prompt_len,
        eval_prompt_len=eval_prompt_len,
        max_new_tokens=cfg.max_new_tokens,
        group_size=cfg.group_size,
        prompts_per_step=cfg.prompts_per_step,
        updates_per_rollout=cfg.updates_per_rollout,
        shuffle=cfg.shuffle,
        rollout_prompts=cfg.rollout_batch or cfg.prompts_per_step,
        micro_batch_rows=math.ceil(minibatch_rows / cfg.grad_accum) if cfg.grad_accum else minibatch_rows,
        micro_batch_tokens=micro_batch_tokens,
        pool_blocks=cfg.kv_blocks,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        top_k=cfg.top_k,
        recompute_old_logp=cfg.recompute_old_logp == "on"
        or (cfg.recompute_old_logp == "auto" and dtype != torch.float32)
        or "sampler_logp" in needs,  # a rollout correction recomputes them (train.frozen_inputs)
        ref_logp="ref_logp" in needs,
        old_hidden="old_hidden" in needs,
        eval_prompts=cfg.eval_batch or 16,
        entropy_grad=cfg.loss.entropy_coef > 0,
        sampler_calls=max(1, cfg.dynamic_sampling),
        eval_k=cfg.eval_k,
        eval_temperature=cfg.eval_temperature,
        attention=attention,
    )


def plan(cfg: Config) -> bool:
    """Print the memory each phase of a step takes on the GPU (a CUDA one, bf16 unless --dtype says
    otherwise), without loading weights; True if it fits. With several processes (--world-size, or
    torchrun's), one rank's: its share of the step's prompts and, in a full run, its shards."""
    config.validate(cfg, need_device=False)
    processes = cfg.world_size or distributed.world_size()
    cfg = dataclasses.replace(cfg, prompts_per_step=cfg.prompts_per_step // processes, world_size=processes)
    if cfg.dtype == "auto":
        cfg = dataclasses.replace(cfg, dtype="bfloat16")  # the plan is for a GPU, where auto means bf16
    model_cfg = memory.model_config(cfg.model)
    budget = memory.gpu_memory_bytes(None if cfg.device in ("auto", "cpu") else cfg.device, cfg.gpu_memory)
    with memory.planning(model_cfg, workload(cfg)) as planner:  # one planner for the choice and the table
        try:
            chosen = planned_config(cfg, model_cfg, budget, planner=planner)
        except ValueError as error:  # some phase does not fit even at one row or prompt per call
            print(error)
            chosen = cfg
        else:
            packing = f" --micro-batch-tokens {chosen.micro_batch_tokens}" * bool(chosen.micro_batch_tokens)
            print(
                f"chosen: --rollout-batch {chosen.rollout_batch} --grad-accum {chosen.grad_accum}{packing} "
                f"--eval-batch {chosen.eval_batch} --kv-blocks {chosen.kv_blocks}"
            )
        text, fits = memory.report(model_cfg, workload(chosen), budget, planner)
    print(text)  # its last line: plan: peak X GB of Y GB (fits), or (does not fit: ...)
    return fits


def sampler_pool(cfg: Config, model, tokenizer, train_set: list[dict], eval_sets: dict[str, list[dict]]) -> Pool:
    """The run's KV pool: allocated once, before the first step, and reused by every rollout and evaluation.
    A sharded model's pool is made for its gathered weights (their compute dtype) and released until each
    rollout binds it (engine.pool.sampling_policy); given a resident copy (pool.resident), its graphs survive
    the steps."""
    prompt_len, eval_len = prompt_lengths(cfg, tokenizer, train_set, eval_sets)
    with oom_hint("the sampler's KV pool", f"lower --kv-blocks (now {cfg.kv_blocks})"), fsdp.whole(model) as policy:
        pool = Pool(policy, cfg.kv_blocks, max_len=max(prompt_len, eval_len) + cfg.max_new_tokens)
        if policy is not model:
            pool.release()
        return pool
