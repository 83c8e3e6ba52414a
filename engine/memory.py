"""How much GPU memory a GRPO run needs, phase by phase, counted by running the real code on the meta device.

A hand formula for activation memory drifts from the code the day someone adds a cast or a mask. Here
every phase calls the same functions the trainer and the sampler call (model.hidden, hidden_logprobs,
backward, AdamW, the sampler's Pool, its decode loop's prefill, decode step and draw), on meta tensors:
shapes and dtypes are real, no data exists, so a plan of Qwen3-8B takes seconds of CPU time, without a
GPU or its weights.
`LiveBytes` (engine/counting.py), a dispatch mode, sees every tensor an operator returns and counts the bytes of each new
storage until it is freed; its peak is the phase's own peak. Blocks are identical, so each figure is
counted on models of 2 and 3 blocks and extended to the real depth (exactly: test_memory checks it), and
test_memory holds the counts within 15% of the same tracker on real CPU runs of a small model.

Phases, each peak = what is resident when it runs + the phase's own peak:
- weights: the model in the run's dtype (resident throughout);
- lora: adapters, their gradients and AdamW's two moments (fp32), plus the optimizer step's temporaries;
- pool: the sampler's KV pool, allocated once after them and resident throughout (blocks x block bytes);
- train: one micro-batch's forward and backward (model.hidden or shared_prompts.hidden_shared, hidden_logprobs, a
  loss), beside the step data, at the largest of the layouts it can take (prompts_per_pass: rows run
  whole, or with each of their prompts run once); a micro-batch of rows packed by length up to a token
  budget, at both ends of the budget (packed_shapes);
- frozen: the no-grad passes that recompute old log-probs, the reference policy's or old_hidden, one
  micro-batch, beside the step data, in the same layouts;
- rollout: one sampler call on CUDA's fixed-shape path (sampling_phase): its outputs and results, a
  prefill pass, the widest decode step and its draw, the graphs' static logits; under dynamic sampling,
  beside the earlier calls' rollouts, and no less than dealing the kept groups out to the ranks takes;
- eval: the same for an evaluation call (its prompts x eval_k samples, the longest evaluation prompt).
Step data are the rollout results kept for training ([N, P + C] ids and masks, [N, C] log-probs, and
[N, C, hidden] old_hidden for a rule that needs it).

fit sizes the free ones (micro-batch rows and a packed micro-batch's tokens, prompts in flight, the pool) and
estimates the sampler's rows in flight and decode passes for a stated length model (long_tail_lengths) by
running the sampler's own scheduler on the host (simulate_rollout; test_rollout checks it against real
calls), and the training micro-batches for the same lengths (training_passes).

A full-parameter run (lora_rank 0) is planned per rank of world_size, by running fsdp.shard's real code:
fully_shard over torch's "fake" process group of that many ranks (it communicates nothing), on
FakeTensorMode's tensors, since FSDP2 refuses meta parameters. `weights` are then rank 0's fp32 shards
(and a frozen reference's, when the loss needs ref_logp), `optimizer` adds its gradient and AdamW moment
shards, `train` and `frozen` gather the root and one block at a time as FSDP2 does, reduce-scatter the
gradients and free them, and `rollout` and `eval` hold the whole model gathered in the compute dtype
(fsdp.whole) besides the shards; the gradients are held only while training (train.py frees them after
each update). test_fsdp holds the sharded micro-batch equal to real CPU runs on one and two ranks.

Where the meta run differs from the code it stands for:
- scaled_dot_product_attention, whose allocations happen inside a CUDA kernel, is replaced by a stand-in
  that allocates what FlashAttention-2 does (output, log-sum-exp; in backward its fp32 accumulator and
  the per-query-head dk, dv of grouped-query attention), not the [T, T] math fallback meta would take.
  The sampler's paged attention (torch.nn.attention.varlen) has a meta implementation of its own.
- loss.policy_loss asks data-dependent questions (is the mask empty? metrics via .tolist()) that meta
  tensors cannot answer, so the train phase uses `_surrogate_loss`, the same tensor work on [rows, C]
  (log ratio, ratio, float64 region test, clip choice, masked sum). It is O(rows x C), tiny next to
  the activations. model.hidden's padding-layout check (torch.equal) is answered "valid" on meta.
- the rollout runs the steps that decide its peak instead of a whole call: a prefill pass of as many
  prompts as one holds, and the decode step at the rows in flight over a full row's span. A captured
  graph keeps its step's temporaries reserved, so they are counted on top of the draw.
- the CUDA caching allocator rounds blocks and fragments, and the CUDA context, cuBLAS workspaces and
  kernel-internal buffers are invisible to a dispatch mode: `fit` keeps SLACK of the budget and
  RESERVED bytes free for them.
- FSDP2 runs its CPU code path in a plan (a CPU mesh): the same buffers, but on CUDA its collectives run on
  their own streams, and memory freed on one stream returns to another a little later; the next block's
  gathered weights (0.44 GB for a Qwen3-8B block in bf16) can be held early. SLACK covers it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

import lora
import sampling
from engine import sampler
from engine.counting import LiveBytes, flash_attention_on_meta, storage_bytes
from engine.graphs import Batch
from engine.kv_cache import ATTENTION_KINDS, KVPool
from engine.packing import token_budget_micro_batches
from engine.pool import Pool
from engine.scheduler import Group, Row, SamplerStats, Scheduler, group_blocks
from engine.shared_prompts import hidden_shared
from infra import fsdp
from model import ModelConfig, Transformer

GB = 10**9  # decimal, as GPUs are sold: "40 GB" and "80 GB" cards hold a little more than this
DEFAULT_GPU_BYTES = 80 * GB
SLACK = 0.10  # share of the budget kept for allocator rounding and fragmentation
RESERVED = 1 * GB  # CUDA context, cuBLAS and attention workspaces: memory no dispatch mode sees
TRAIN_TOKENS = 8192  # automatic training micro-batches hold at least this many tokens (or one row)
ROWS_CAP = 1024  # the most rows in flight fit considers
PASSES_TOLERANCE = 0.02  # fit keeps the fewest prompts in flight within this share of the fewest decode passes
PREFILL_TOKENS = sampler.PREFILL_TOKENS

# The published config.json facts of the presets' models, so planning works offline.
_QWEN3 = dict(
    model_type="qwen3",
    vocab_size=151936,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    qk_norm=True,
    bos_token_id=151643,
    eos_token_id=151645,
)
_QWEN25 = dict(
    model_type="qwen2",
    vocab_size=152064,
    num_kv_heads=8,
    head_dim=128,
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    qkv_bias=True,
    bos_token_id=151643,
    eos_token_id=151643,
)
KNOWN_CONFIGS: dict[str, ModelConfig] = {
    "Qwen/Qwen3-1.7B": ModelConfig(
        **_QWEN3,
        hidden_size=2048,
        intermediate_size=6144,
        num_layers=28,
        num_heads=16,
        max_position_embeddings=40960,
        tie_word_embeddings=True,
    ),
    "Qwen/Qwen3-8B": ModelConfig(
        **_QWEN3,
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        max_position_embeddings=40960,
        tie_word_embeddings=False,
    ),
    "Qwen/Qwen3-8B-Base": ModelConfig(
        **{**_QWEN3, "eos_token_id": 151643},
        hidden_size=4096,
        intermediate_size=12288,
        num_layers=36,
        num_heads=32,
        max_position_embeddings=32768,
        tie_word_embeddings=False,
    ),
    # DAPO's model and its smaller siblings (qwen2: biased q, k, v; no q/k norm): the dapo preset's plan
    "Qwen/Qwen2.5-32B": ModelConfig(**_QWEN25, hidden_size=5120, intermediate_size=27648, num_layers=64, num_heads=40),
    "Qwen/Qwen2.5-14B": ModelConfig(**_QWEN25, hidden_size=5120, intermediate_size=13824, num_layers=48, num_heads=40),
    "Qwen/Qwen2.5-7B": ModelConfig(
        **{**_QWEN25, "num_kv_heads": 4, "rms_norm_eps": 1e-6},
        hidden_size=3584,
        intermediate_size=18944,
        num_layers=28,
        num_heads=28,
    ),
}

# What lowers each phase's memory, for the messages of report and fit.
PHASE_FLAGS = {
    "weights": "use a smaller model or --dtype bfloat16",
    "lora": "lower --lora-rank or --lora-targets",
    "pool": "the pool takes what the other phases leave",
    "optimizer": "shard over more processes (torchrun --nproc-per-node, --world-size for --plan) or train LoRA",
    "train": "raise --grad-accum (fewer rows per micro-batch)",
    "frozen": "raise --grad-accum (fewer rows per micro-batch)",
    "rollout": "lower --rollout-batch (prompts in flight in the sampler)",
    "eval": "lower --eval-batch (prompts in flight in an evaluation call)",
}
# What still lowers a phase that does not fit with one row / prompt per call.
PHASE_FLOOR_FLAGS = {
    "lora": PHASE_FLAGS["lora"],
    "optimizer": PHASE_FLAGS["optimizer"],
    "train": "raise --grad-accum or turn --gradient-checkpointing on",
    "frozen": "raise --grad-accum",
    "rollout": "lower --rollout-batch or --group-size",
    "eval": "lower --eval-batch or --eval-k",
}


def model_config(name_or_dir: str | None) -> ModelConfig:
    """The architecture of a model directory (its config.json), of a known hub id (offline), or of the
    default SmolLM2-135M-Instruct (None)."""
    if name_or_dir is None:
        return ModelConfig()
    config_file = Path(name_or_dir).expanduser() / "config.json"
    if config_file.is_file():
        return ModelConfig.from_hf(json.loads(config_file.read_text()))
    if name_or_dir in KNOWN_CONFIGS:
        return KNOWN_CONFIGS[name_or_dir]
    raise ValueError(
        f"model {name_or_dir!r}: no config.json there and not a known id; pass the model "
        f"directory, or one of: {', '.join(KNOWN_CONFIGS)}"
    )


@dataclass
class Workload:
    """What one training step does, in the sizes that decide memory. Field names follow train.py's flags."""

    dtype: torch.dtype = torch.bfloat16
    lora_rank: int = 16  # 0: every weight trains, sharded by FSDP2 over world_size ranks (fsdp.py)
    world_size: int = 1  # processes; the plan is one rank's
    lora_targets: tuple[str, ...] = lora.DEFAULT_TARGETS
    gradient_checkpointing: bool = True
    prompt_len: int = 512  # tokens of the longest prompt: the sampler left-pads every prompt to it
    eval_prompt_len: int = 0  # tokens of the longest evaluation prompt; 0 = prompt_len
    max_new_tokens: int = 1024
    group_size: int = 8
    prompts_per_step: int = 8
    updates_per_rollout: int = 1  # mini-batches per step
    sampler_calls: int = 1  # most sampler calls a step (--dynamic-sampling): the earlier calls' rollouts are held
    shuffle: str = "rows"  # mini-batches of random rows, or of whole prompt groups ("groups")
    rollout_prompts: int = 8  # prompts in flight in the sampler (their rows bound its batch)
    micro_batch_rows: int = 64  # rows per training micro-batch (and per frozen pass)
    # 0: training micro-batches of micro_batch_rows rows; else rows packed by length up to this many tokens, counted
    # as train.py's packing counts them (rows x the longest row's prompt + completion); the frozen passes keep rows
    micro_batch_tokens: int = 0
    pool_blocks: int = 0  # blocks of the sampler's KV pool (block 0 included); 0 = none chosen yet
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    with_entropy: bool = True  # hidden_logprobs(..., with_entropy=True), as train.py logs the entropy
    entropy_grad: bool = False  # entropy_coef > 0: the entropy is differentiated (an entropy bonus)
    recompute_old_logp: bool = False
    ref_logp: bool = False  # kl_beta > 0: a reference pass (the frozen base; a full run's frozen copy)
    old_hidden: bool = False  # the rule needs the sampling policy's hidden states [N, C, hidden] (kl_full)
    eval_prompts: int = 16  # prompts in flight in an evaluation call
    eval_k: int = 8
    eval_temperature: float = 1.0
    # the sampler's attention (engine.pool.pool_attention): "auto" is the best kind on CUDA; train.py passes the
    # kind its GPU's self-check chose, so a paged kernel that fails there is planned as the gather path it takes
    attention: str = "auto"

    def __post_init__(self):
        for name in (
            "world_size",
            "prompt_len",
            "max_new_tokens",
            "group_size",
            "prompts_per_step",
            "updates_per_rollout",
            "sampler_calls",
            "rollout_prompts",
            "micro_batch_rows",
            "eval_prompts",
            "eval_k",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"Workload.{name} must be >= 1, got {getattr(self, name)}")
        if self.micro_batch_tokens < 0:
            raise ValueError(f"Workload.micro_batch_tokens must be >= 0 (0: by rows), got {self.micro_batch_tokens}")
        if self.shuffle not in ("rows", "groups"):
            raise ValueError(f"Workload.shuffle must be 'rows' or 'groups', got {self.shuffle!r}")
        if self.lora_rank < 0:
            raise ValueError(f"Workload.lora_rank must be >= 0 (0: full-parameter), got {self.lora_rank}")
        if self.attention not in ("auto", *ATTENTION_KINDS):
            raise ValueError(f"Workload.attention must be auto or one of {ATTENTION_KINDS}, got {self.attention!r}")

    @property
    def full(self) -> bool:
        return self.lora_rank == 0

    @property
    def eval_len(self) -> int:
        return self.eval_prompt_len or self.prompt_len

    @property
    def step_rows(self) -> int:
        return self.prompts_per_step * self.group_size

    @property
    def minibatch_rows(self) -> int:
        return -(-self.step_rows // self.updates_per_rollout)  # the largest chunk torch.chunk makes


def meta_model(cfg: ModelConfig, work: Workload) -> Transformer:
    """The model with LoRA adapters (none for a full run) on the meta device, in the run's dtype: no memory,
    real shapes."""
    with torch.device("meta"):
        model = Transformer(cfg).to(work.dtype)
    if not work.full:
        lora.inject(model, work.lora_rank, 2.0 * work.lora_rank, targets=work.lora_targets)
    model.gradient_checkpointing = work.gradient_checkpointing
    return model


# ----------------------------------------------------------------------------- phases
# Each returns the bytes the phase allocates at its peak above what existed before it. They run the
# same calls on any device, so a test runs them on CPU tensors of a small model to check the meta plan.


def lora_state_phase(model: Transformer) -> tuple[int, int]:
    """(resident, peak) bytes of the adapters, their gradients and AdamW's state around one optimizer step.

    AdamW runs with foreach=True, its default on CUDA, whose temporaries span all the adapters at once.
    """
    return optimizer_phase(list(lora.parameters(model)))


def optimizer_phase(params: list[torch.nn.Parameter]) -> tuple[int, int]:
    """(resident, peak) bytes of params, their gradients and AdamW's state around one foreach optimizer step
    (of sharded parameters, each rank's shards). The gradients stay, for the training phase to add into."""
    with LiveBytes() as tracker:
        for p in params:
            p.grad = torch.zeros_like(p)
        optimizer = torch.optim.AdamW(params, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
    held = storage_bytes(params)
    return held + tracker.live, held + tracker.peak


def rollout_results(rows: int, prompt_len: int, new_tokens: int, device) -> list[torch.Tensor]:
    """The tensors of a rollout.Rollout of `rows` rows: what a step keeps from sampling for training."""
    T = prompt_len + new_tokens
    return [
        torch.zeros(rows, new_tokens, dtype=torch.long, device=device),  # completion_ids
        torch.zeros(rows, new_tokens, device=device),  # old_logp
        torch.zeros(rows, new_tokens, dtype=torch.bool, device=device),  # completion_mask
        torch.zeros(rows, T, dtype=torch.long, device=device),  # input_ids
        torch.zeros(rows, T, dtype=torch.bool, device=device),  # pad_mask
        torch.zeros(rows, dtype=torch.bool, device=device),  # finished
        torch.zeros(rows, dtype=torch.bool, device=device),
    ]  # truncated


def rollout_bytes(work: Workload, count: int) -> int:
    """Bytes of `count` rollouts of the step's rows (rollout_results)."""
    with LiveBytes() as tracker:
        kept = rollout_results(count * work.step_rows, work.prompt_len, work.max_new_tokens, torch.device("meta"))
    del kept
    return tracker.peak


def dealing(work: Workload) -> int:
    """Under dynamic sampling, the kept groups dealt out to the ranks after the last call (train.dealt), beside
    the earlier calls' rollouts: the last call's rollout, the padded copy of the rows one call sends and the rows
    arrived so far, then the step's rollout joined from those: at most 3 rollouts of step_rows rows (a rank
    sends at most its own rows of a call, and trains step_rows rows). 0 without dynamic sampling."""
    return rollout_bytes(work, 3) if work.sampler_calls > 1 else 0


def _surrogate_loss(logp, old_logp, advantages, mask):
    """loss.policy_loss's tensor work (grpo rule, token-mean) without its data-dependent checks and metrics."""
    log_ratio = torch.where(mask, logp - old_logp, 0).clamp(-20, 20)
    inside = log_ratio.detach().double().abs() <= 0.2
    adv = advantages[:, None].expand_as(logp)
    w = log_ratio.exp()
    stopped = ~inside & (adv * (w.detach() - 1) > 0)
    objective = adv * torch.where(stopped, w.detach(), w)
    return -torch.where(mask, objective, 0).sum() / mask.numel()


def prompts_per_pass(work: Workload, rows: int, phase: str) -> list[int]:
    """The numbers of distinct prompts a pass of `rows` rows must be planned for: each layout of train.py's
    policy_states that can occur and may be the largest. All distinct prompts run each row whole (as
    many prompts as rows); otherwise each prompt runs once (shared_prompts.hidden_shared), and the most prompts
    are the most tokens. Frozen passes and --shuffle groups take consecutive rows of the prompt-major
    rollout, from a group's first row: rows in whole groups span rows / G of them, other counts at
    most one more. --shuffle rows draws rows at random, and packed micro-batches take rows by length from
    any prompts: up to one prompt per row."""
    G, prompts = work.group_size, work.prompts_per_step
    if phase == "train" and (work.shuffle == "rows" or work.micro_batch_tokens):
        most = min(rows, prompts)
    else:
        most = min(prompts, rows // G if rows % G == 0 else 1 + -(-(rows - 1) // G))
    layouts = [rows] if most == rows else []  # every row alone
    if rows > 1:
        layouts.append(min(most, rows - 1))
    return layouts


def pass_tokens(work: Workload, rows: int) -> int:
    """Tokens a training micro-batch of `rows` rows runs at its largest layout (prompts_per_pass): rows x
    (P + C) with every row whole, else each of its prompts once and every row's completion."""
    P, C = work.prompt_len, work.max_new_tokens
    prompts = prompts_per_pass(work, rows, "train")[0]
    return rows * (P + C) if prompts == rows else prompts * P + rows * C


def packed_shapes(work: Workload, budget: int) -> list[tuple[int, int]]:
    """The (rows, completion tokens) a packed training micro-batch of `budget` tokens is planned at: the fewest
    rows, at full length (one when a full row is over the budget: it runs alone), and the most, of one
    completion token each (at most a rank's share of a mini-batch: of its step's rows, or of a mini-batch of
    every rank's). Under the budget a pass's memory has terms that stay (those of its tokens), that grow with
    its completion length (a shared prompt's attention mask) and that grow with its rows; each is largest at
    one of the two ends, and so is their sum (test_memory checks the shapes between them)."""
    P, C = work.prompt_len, work.max_new_tokens
    most = min(work.step_rows, work.world_size * work.minibatch_rows, budget // (P + 1))
    return [(max(1, budget // (P + C)), C), (max(1, most), 1)]


def train_layouts(work: Workload, size: int) -> list[tuple[int, int, int]]:
    """The (rows, completion tokens, distinct prompts) of each training pass the plan measures at `size`: rows
    per micro-batch, or a packed workload's token budget (packed_shapes), each at every layout that can be
    largest (prompts_per_pass)."""
    shapes = packed_shapes(work, size) if work.micro_batch_tokens else [(size, work.max_new_tokens)]
    return [(rows, c, prompts) for rows, c in shapes for prompts in prompts_per_pass(work, rows, "train")]


def _policy_states(model: Transformer, rows: int, prompts: int, work: Workload, completion: int | None = None):
    """train.py's policy_states for rows of full prompts and completions of `completion` tokens (default:
    max_new_tokens): (h, ids, start)."""
    device, P, C = model.device, work.prompt_len, completion or work.max_new_tokens
    if prompts == rows:
        ids = torch.zeros(rows, P + C, dtype=torch.long, device=device)
        return model.hidden(ids, torch.ones(rows, P + C, dtype=torch.bool, device=device)), ids, P
    completion_ids = torch.zeros(rows, C, dtype=torch.long, device=device)
    h = hidden_shared(
        model,
        torch.zeros(prompts, P, dtype=torch.long, device=device),
        torch.ones(prompts, P, dtype=torch.bool, device=device),
        torch.arange(rows, device=device) % prompts,
        completion_ids,
        torch.ones(rows, C, dtype=torch.bool, device=device),
    )
    return h, torch.zeros(rows, 1 + C, dtype=torch.long, device=device), 1


def train_phase(
    model: Transformer,
    rows: int,
    work: Workload,
    resizable=(),
    prompts: int | None = None,
    completion: int | None = None,
) -> int:
    """One training micro-batch of `rows` rows of `prompts` distinct prompts (default: all distinct) and
    completions of `completion` tokens (default: max_new_tokens): forward, loss and backward into existing
    gradients (the adapters', or every weight's shards). resizable: a sharded model's gathered weights
    (LiveBytes)."""
    device, C = model.device, completion or work.max_new_tokens
    for p in model.parameters() if work.full else lora.parameters(model):
        if p.grad is None:  # accumulation adds into the gradients a previous micro-batch left
            p.grad = torch.zeros_like(p)
    model.train()
    with LiveBytes(resizable) as tracker:
        old_logp = torch.zeros(rows, C, device=device)
        mask = torch.ones(rows, C, dtype=torch.bool, device=device)
        advantages = torch.ones(rows, device=device)
        h, ids, start = _policy_states(model, rows, prompts or rows, work, C)
        logp, entropy = model.hidden_logprobs(
            h,
            ids,
            start=start,
            temperature=work.temperature,
            with_entropy=work.with_entropy or work.entropy_grad,
            entropy_grad=work.entropy_grad,
        )
        bonus = entropy.mean() if work.entropy_grad else 0
        (_surrogate_loss(logp, old_logp, advantages, mask) - bonus).backward()
        del h, logp, entropy
    return tracker.peak


def frozen_phase(
    model: Transformer,
    rows: int,
    work: Workload,
    reference: Transformer | None = None,
    resizable=(),
    prompts: int | None = None,
) -> int:
    """One micro-batch of the no-grad passes (old log-probs, reference log-probs), as train.py runs them, of
    `rows` rows of `prompts` distinct prompts (default: all distinct); the reference pass runs on `reference`
    (a full run's frozen copy) or on the model (LoRA's base)."""
    passes = [model] * (work.recompute_old_logp + work.old_hidden) + [reference or model] * work.ref_logp
    model.eval()
    with LiveBytes(resizable) as tracker, torch.no_grad():
        kept = []
        for policy in passes:
            h, ids, start = _policy_states(policy, rows, prompts or rows, work)
            kept.append(policy.hidden_logprobs(h, ids, start=start, temperature=work.temperature)[0])
            del h
        del kept
    return tracker.peak


def sampling_phase(
    model: Transformer, work: Workload, prompts_in_flight: int, eval: bool = False, graphs: bool = True
) -> int:
    """One sampler call as rollout.generate makes it on CUDA (sampler.Loop, fixed shapes), beside the resident
    pool, at its widest moments:
    - the call's [N + 1, C] outputs and the results it returns for its N rows, throughout;
    - a prefill pass of as many prompts as PREFILL_TOKENS and the rows in flight allow, and its first draw;
    - the widest decode step (the rows in flight in their bucket, attending over a full row's span) and
      the draw after it. With graphs (CUDA's default), the static logits of the two largest row buckets
      are held too, and a captured graph keeps its step's temporaries reserved, so they count on top of
      the draw.
    """
    device, C = model.device, work.max_new_tokens
    G, P = (work.eval_k, work.eval_len) if eval else (work.group_size, work.prompt_len)
    temperature = work.eval_temperature if eval else work.temperature
    # an evaluation call holds its --eval-batch prompts, all of them in flight; a training call the step's prompts
    call_prompts = prompts_in_flight if eval else work.prompts_per_step
    rows = min(prompts_in_flight, call_prompts) * G
    pool = Pool(
        model, 2, max_len=P + C, attention=work.attention
    )  # the resident pool is counted apart: blocks x block bytes
    draw = partial(
        sampling.draw,
        keys=sampling.row_keys(0, 0, call_prompts, G, device),
        temperature=temperature,
        top_p=work.top_p,
        top_k=work.top_k,
    )
    stop = torch.zeros(1, dtype=torch.long, device=device)
    model.eval()
    with LiveBytes() as tracker, torch.inference_mode():
        loop = sampler.Loop(model, pool, [[0] * P] * call_prompts, G, C, draw, stop, rows, True, "off")
        results = rollout_results(call_prompts * G, P, C, device)
        groups = [Group(i, P, list(range(G))) for i in range(max(1, min(rows // G, PREFILL_TOKENS // P)))]
        for group in groups:
            group.rows = [Row(group, member, P, 1, [1] * -(-P // pool.block_size)) for member in range(G)]
        loop._prefill(groups, [row for group in groups for row in group.rows])
        prefill_peak = tracker.peak

        R = sampler.bucket(rows)
        static_logits = [
            torch.empty(r, model.config.vocab_size, dtype=model.dtype, device=device)
            for r in ({R, max(1, R // 2)} if graphs else ())
        ]
        zeros = torch.zeros(R, dtype=torch.long, device=device)
        batch = Batch(
            zeros, zeros.bool(), zeros, zeros, zeros, torch.zeros(R, pool.table_width, dtype=torch.int32, device=device)
        )
        tracker.reset_peak()
        logits = loop._decode(batch, loop._span(P + C))
        # freed on return, but a graph keeps them reserved
        step_temporaries = tracker.peak - tracker.live if graphs else 0
        tracker.reset_peak()
        draw(logits, rows=batch.out_row, position=batch.position)
        draw_peak = tracker.peak
        del loop, results, static_logits, logits
    return max(prefill_peak, draw_peak + step_temporaries)


def long_tail_lengths(rows: int, cap: int, seed: int = 0) -> list[int]:
    """The stated length model of the plan and of bench/rollout.py --long-tail: completion lengths of `rows` rows,
    log-normal with median cap/6 and sigma 0.9, in [1, cap] (most rows end early, a few run to the cap)."""
    g = torch.Generator().manual_seed(seed)
    drawn = torch.randn(rows, generator=g).mul(0.9).add(math.log(cap / 6)).exp()
    return drawn.round().clamp(1, cap).long().tolist()


def simulate_rollout(
    prompt_lens: list[int],
    G: int,
    lengths: list[int],
    blocks: int,
    block_size: int,
    max_rows: int,
    new_tokens: int,
    chunk: int = sampler.SYNC_EVERY,
) -> SamplerStats:
    """What a generate call with a pool of `blocks` blocks does when row i (prompt-major) ends after lengths[i]
    tokens: the Scheduler's decisions, in the order the sampler's loop takes them, with no model."""
    sched = Scheduler(blocks - 1, block_size, chunk, max_rows, new_tokens)
    for i, prompt_len in enumerate(prompt_lens):
        sched.add(Group(i, prompt_len, list(range(G))))
    stats = SamplerStats()
    while True:
        sched.finish([row for row in sched.running if row.position >= lengths[row.out_row(G)]])
        preempted, admitted = sched.sync()
        stats.preempted += len(preempted)
        stats.prefills += len(sampler.prefill_batches(admitted))
        if not sched.running:
            return stats
        steps = sched.chunk_steps()
        if not preempted:  # and the syncs that would decide nothing, at once
            steps += chunk * _quiet_chunks(sched, lengths, G, steps)
        stats.decode_steps += steps
        stats.row_steps += steps * len(sched.running)
        stats.rows_max = max(stats.rows_max, len(sched.running))
        sched.advance(steps)


def _quiet_chunks(sched: Scheduler, lengths: list[int], G: int, steps: int) -> int:
    """Whole chunks after the next `steps` decode steps whose syncs change nothing, after a sync that preempted
    nothing: no row reaches its length, none outgrows its blocks, chunk_steps stays a chunk, and the first
    waiting group stays refused (while no block moves, the free blocks and the rows' needs at full length
    stay and their growth at the sync after next only rises: _admits stays False)."""
    chunk, cap = sched.chunk, sched.new_tokens
    quiet = (max(cap - g.rows[0].position for g in sched.admitted) - steps) // chunk
    for group in sched.admitted:
        first = group.rows[0]
        room = len(first.blocks) * sched.block_size  # slots its blocks hold
        if room < group.prompt_len + cap - 1:
            quiet = min(quiet, (room - first.length - steps) // chunk)
        end = min(lengths[row.out_row(G)] for row in group.rows)
        quiet = min(quiet, (end - first.position - steps - 1) // chunk + 1)
        if quiet <= 0:
            return 0
    return quiet


# ----------------------------------------------------------------------------- the plan


def measure(model_cfg: ModelConfig, work: Workload) -> dict[str, int]:
    """Peak bytes of each phase (weights, lora or optimizer, pool, train, frozen, rollout, eval), counted on the
    meta device (a full run's sharded phases: per rank, on fake tensors)."""
    with planning(model_cfg, work) as planner:
        return {name: planner.peak(name, size, work.pool_blocks) for name, size in phase_sizes(work).items()}


def phase_sizes(work: Workload) -> dict[str, int]:
    """The size each phase runs at: rows per micro-batch (a packed training micro-batch: its token budget), or
    prompts in flight in the sampler."""
    return {
        "weights": 0,
        state_phase(work): 0,
        "pool": 0,
        "train": work.micro_batch_tokens or work.micro_batch_rows,
        "frozen": work.micro_batch_rows,
        "rollout": work.rollout_prompts,
        "eval": work.eval_prompts,
    }


def state_phase(work: Workload) -> str:
    """The phase of the trained state: LoRA's adapters ("lora"), or every weight's gradients and moments."""
    return "optimizer" if work.full else "lora"


@contextmanager
def planning(model_cfg: ModelConfig, work: Workload):
    """The Planner of a model and workload. A full run's runs fully_shard, so it lives inside a fake world
    (fake_world) that closes with the block; a LoRA run's is kept for the next call (Planner.of)."""
    if not work.full:
        yield Planner.of(model_cfg, work)
        return
    with fake_world(work.world_size) as mesh:
        yield Planner(model_cfg, work, mesh)


@contextmanager
def fake_world(size: int):
    """A DeviceMesh of `size` ranks on torch's "fake" process group, which answers every collective at once
    without moving data: one process plans rank 0 of a sharded run. Without a process group it is the
    default group for the block; inside a run (which plans for its own world) a fake group beside the real one."""
    if not dist.is_initialized():
        dist.init_process_group("fake", rank=0, world_size=size)
        try:
            yield init_device_mesh("cpu", (size,))
        finally:
            dist.destroy_process_group()
        return
    if dist.get_world_size() != size:
        raise ValueError(f"a plan for {size} processes cannot run inside a job of {dist.get_world_size()}")
    group = dist.new_group(backend="fake")
    try:
        yield DeviceMesh.from_group(group, "cpu")
    finally:
        dist.destroy_process_group(group)


class Planner:
    """Phase peaks of one model and workload, measured on meta models of 2 and 3 blocks and extended
    linearly to the real depth: every block allocates the same (the first is left out of the slope, as
    its input needs no gradient). It saves running 36 identical blocks for every figure fit asks for;
    test_memory checks the extension against a full-depth count. The sizes fit chooses are passed to
    measure, so the workload's own are ignored; the pool's bytes are blocks x block_bytes, exactly."""

    _recent: dict[str, Planner] = {}  # Planner.of's: report after fit measures nothing twice

    def __init__(self, model_cfg: ModelConfig, work: Workload, mesh: DeviceMesh | None = None):
        self.started = time.perf_counter()
        self.work, self.layers = work, model_cfg.num_layers
        depths = (self.layers,) if self.layers <= 3 else (2, 3)
        shallow = [dataclasses.replace(model_cfg, num_layers=d) for d in depths]
        if work.full and mesh is None:
            raise ValueError("a full run's Planner shards its models over a mesh: use memory.planning()")
        self.runs = [
            _ShardedRun(cfg, work, mesh) if work.full else _MetaRun(meta_model(cfg, work), work) for cfg in shallow
        ]
        self.block_size = self.runs[0].block_size
        self.block_bytes = KVPool.block_bytes(model_cfg, self.block_size, work.dtype)
        self._memo: dict[tuple[str, int], tuple[int, int]] = {}

    @classmethod
    def of(cls, model_cfg: ModelConfig, work: Workload) -> Planner:
        """The planner of a recent call with the same model and workload (sizes aside), or a new one."""
        sizes_aside = dict(micro_batch_rows=1, rollout_prompts=1, eval_prompts=1, pool_blocks=0)
        packed = int(work.micro_batch_tokens > 0)  # whether training packs is the workload's; its budget a size
        key = repr((model_cfg, dataclasses.replace(work, **sizes_aside, micro_batch_tokens=packed)))
        if key not in cls._recent:
            if len(cls._recent) >= 4:
                cls._recent.clear()
            cls._recent[key] = cls(model_cfg, work)
        return cls._recent[key]

    def measure(self, name: str, size: int = 0) -> tuple[int, int]:
        """(resident, own) bytes of phase `name` at `size`, the pool left out of resident. Under dynamic sampling
        the rollout's own peak is at least dealing's (of no block: taken after the extension)."""
        if (name, size) not in self._memo:
            values = [run.measure(name, size) for run in self.runs]
            if len(values) > 1:
                (r2, o2), (r3, o3) = values
                values = [(r2 + (self.layers - 2) * (r3 - r2), o2 + (self.layers - 2) * (o3 - o2))]
            resident, own = values[0]
            self._memo[name, size] = resident, max(own, dealing(self.work)) if name == "rollout" else own
        return self._memo[name, size]

    def held_and_own(self, name: str, size: int, pool_blocks: int) -> tuple[int, int]:
        """(resident, own) bytes of phase `name` with a pool of pool_blocks blocks, allocated after the trained
        state (LoRA's, or a full run's optimizer shards)."""
        state = state_phase(self.work)
        if name == "pool":
            return sum(self.measure(state)), pool_blocks * self.block_bytes
        held, own = self.measure(name, size)
        return held + (pool_blocks * self.block_bytes if name not in ("weights", state) else 0), own

    def peak(self, name: str, size: int = 0, pool_blocks: int = 0) -> int:
        """Peak bytes of phase `name` at `size`: what it holds when it starts plus its own peak."""
        return sum(self.held_and_own(name, size, pool_blocks))

    def floor_blocks(self, work: Workload) -> int:
        """The smallest pool that samples: one group of the longest prompt at full length, training's and
        evaluation's (Pool.check_fits refuses a call otherwise)."""
        C = work.max_new_tokens
        return 1 + max(
            group_blocks(work.prompt_len, work.group_size, C, self.block_size),
            group_blocks(work.eval_len, work.eval_k, C, self.block_size),
        )


class _MetaRun:
    """One meta model with its adapters' gradients and optimizer state in place."""

    def __init__(self, model: Transformer, work: Workload):
        self.model, self.work = model, work
        self.weights = storage_bytes(
            [t for name, t in model.state_dict(keep_vars=True).items() if ".lora_" not in name]
        )
        self.lora, self.lora_peak = (0, 0) if work.full else lora_state_phase(model)
        self.block_size = Pool(model, 2, attention=work.attention).block_size

    def step_data(self, rows: int) -> int:
        """Rollout results of `rows` rows, plus the frozen passes' [rows, C] fp32 outputs and, for a rule that
        needs them, the sampling policy's hidden states [rows, C, hidden] (old_hidden)."""
        w, device = self.work, self.model.device
        with LiveBytes() as tracker:
            kept = rollout_results(rows, w.prompt_len, w.max_new_tokens, device)
            frozen_outputs = w.recompute_old_logp + w.ref_logp
            kept += [torch.zeros(rows, w.max_new_tokens, device=device) for _ in range(frozen_outputs)]
            if w.old_hidden:
                kept.append(
                    torch.zeros(rows, w.max_new_tokens, self.model.config.hidden_size, dtype=w.dtype, device=device)
                )
        del kept
        return tracker.peak

    def earlier_rollouts(self) -> int:
        """Under dynamic sampling, what the last sampler call finds held: the step's earlier calls' rollouts
        (sampler_calls - 1 of step_rows rows each)."""
        return rollout_bytes(self.work, self.work.sampler_calls - 1)

    def measure(self, name: str, size: int) -> tuple[int, int]:
        """(resident, own) bytes of a phase, the pool left out: what is held when it starts, and its own peak."""
        w, model, resident = self.work, self.model, self.weights + self.lora
        with flash_attention_on_meta():
            if name == "weights":
                return 0, self.weights
            if name == "lora":
                return self.weights, self.lora_peak
            if name == "train":
                return resident + self.step_data(w.step_rows), max(
                    train_phase(model, rows, w, prompts=prompts, completion=c)
                    for rows, c, prompts in train_layouts(w, size)
                )
            if name == "frozen":
                if not (w.recompute_old_logp or w.ref_logp or w.old_hidden):
                    return 0, 0
                return resident + self.step_data(w.step_rows), max(
                    frozen_phase(model, size, w, prompts=prompts) for prompts in prompts_per_pass(w, size, name)
                )
            if name == "rollout":
                return resident + self.earlier_rollouts(), sampling_phase(model, w, size)
            if name == "eval":
                return resident, sampling_phase(model, w, size, eval=True)
        raise ValueError(f"unknown phase {name!r}")


def _fake(model: Transformer) -> Transformer:
    """A meta model given fake CPU storage (inside a FakeTensorMode), its tied weights tied again: to_empty
    makes a new tensor for each module that holds one."""
    model.to_empty(device="cpu")
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


class _ShardedRun:
    """One full-parameter model sharded by fsdp.shard over a fake world, on FakeTensorMode's tensors (FSDP2
    refuses meta parameters at its first forward, so these are meta storage under the CPU's name): rank 0's
    shards of the fp32 weights, gradients and AdamW moments, and what its sharded phases allocate. The
    sampler's phases run on the whole model in the compute dtype (a _MetaRun), which fsdp.whole gathers.

    FSDP2 gathers a group into storages it keeps and resizes in place, outside any operator; they are
    found by gathering each group once, and LiveBytes counts what they hold at each operator.
    """

    def __init__(self, model_cfg: ModelConfig, work: Workload, mesh: DeviceMesh):
        self.work, self.whole = work, _MetaRun(meta_model(model_cfg, work), work)
        self.block_size = self.whole.block_size
        with torch.device("meta"):  # cast on meta, given fake storage below (a fake module's .to() fails)
            policy = Transformer(model_cfg).to(fsdp.master_dtype(work.dtype))
            frozen = Transformer(model_cfg).to(work.dtype) if work.ref_logp else None  # train.build's copy
        self.mode = FakeTensorMode(allow_non_fake_inputs=True)  # to_empty reads the meta parameters
        with self.mode:
            self.model = fsdp.shard(_fake(policy), work.dtype, mesh)
            self.model.gradient_checkpointing = work.gradient_checkpointing
            self.reference = None
            if frozen is not None:
                self.reference = fsdp.shard(_fake(frozen), work.dtype, mesh).requires_grad_(False)
            self.resizable = [*self._gathered_storages(self.model), *self._gathered_storages(self.reference)]
            params = list(self.model.parameters())
            self.params = self.grads = storage_bytes(params)  # gradients: the same shards, in the same dtype
            self.reference_weights = storage_bytes(self.reference.parameters()) if self.reference else 0
            self.weights = self.params + self.reference_weights
            state, self.state_peak = optimizer_phase(params)
            self.moments = state - self.params - self.grads

    @staticmethod
    def _gathered_storages(model: Transformer | None) -> list:
        if model is None:
            return []
        for group in fsdp.groups(model):
            group.unshard()
        storages = [p.untyped_storage() for p in model.parameters()]
        fsdp.reshard(model)
        return storages

    def measure(self, name: str, size: int) -> tuple[int, int]:
        """(resident, own) bytes of a phase, as _MetaRun.measure: the gradients are held only while training
        (train.py frees them after each update), the gathered whole model only while sampling."""
        w, whole = self.work, self.whole
        held = self.weights + self.moments
        if name == "weights":
            return 0, self.weights
        if name == "optimizer":
            return self.reference_weights, self.state_peak
        if name in ("rollout", "eval"):  # the shards stay, and the sampler reads the whole model, gathered
            resident, own = whole.measure(name, size)
            return held + resident, own
        with self.mode, flash_attention_on_meta():
            if name == "train":
                own = max(
                    train_phase(self.model, rows, w, self.resizable, prompts, c)
                    for rows, c, prompts in train_layouts(w, size)
                )
                return held + self.grads + whole.step_data(w.step_rows), own
            if name == "frozen":
                if not (w.recompute_old_logp or w.ref_logp or w.old_hidden):
                    return 0, 0
                own = 0
                for prompts in prompts_per_pass(w, size, name):
                    own = max(own, frozen_phase(self.model, size, w, self.reference, self.resizable, prompts))
                    for model in (self.model, self.reference or self.model):
                        fsdp.reshard(model)  # a root stays gathered after a pass without backward
                return held + whole.step_data(w.step_rows), own
        raise ValueError(f"unknown phase {name!r}")


def usable_bytes(budget_bytes: int) -> int:
    """What the plan may fill of a GPU: the budget less SLACK of it and RESERVED."""
    return int(budget_bytes * (1 - SLACK)) - RESERVED


FREE_SIZES = ("micro_batch_rows", "micro_batch_tokens", "rollout_prompts", "eval_prompts")


def fit(
    model_cfg: ModelConfig,
    work: Workload,
    budget_bytes: int,
    free: tuple[str, ...] = FREE_SIZES,
    planner: Planner | None = None,
) -> Workload:
    """The workload with its `free` sizes chosen and the sampler's pool sized, every phase within
    usable_bytes(budget_bytes). The pool is resident, so it gets what the largest other phase leaves:
    - micro_batch_rows: the fewest rows whose pass runs TRAIN_TOKENS tokens (pass_tokens; at least one
      row): products of that many tokens keep a GPU's matrix units busy, so training speed hardly grows
      past it, while the sampler's grows with every row its pool holds. With --shuffle groups a row's
      prompt is shared by its group, so more rows make those tokens;
    - micro_batch_tokens, of a packed workload (micro_batch_tokens > 0): the tokens micro_batch_rows rows run
      at full length (rows x (P + C)), so packed micro-batches never hold more than the planned one, and
      shorter rows share a pass;
    - rollout_prompts (prompts in flight): of the powers of two up to the step's prompts (and the step's
      own count), the fewest whose pool samples the step within PASSES_TOLERANCE of the fewest decode
      passes for the length model (simulate_rollout): more rows in flight than that only add preemptions
      and sampling memory; eval_prompts then holds as many rows;
    - pool_blocks: all that is left.
    Sizes not in `free` are kept as given. Raises ValueError naming what lowers memory when no pool of
    one full-length group fits. planner: one planning() gave for this model and workload (else a new one).
    """
    if planner is not None:
        return _fit(planner, work, budget_bytes, free)
    with planning(model_cfg, work) as planner:
        return _fit(planner, work, budget_bytes, free)


def _fit(planner: Planner, work: Workload, budget_bytes: int, free: tuple[str, ...]) -> Workload:
    usable = usable_bytes(budget_bytes)
    for name in ("weights", state_phase(work)):
        if planner.peak(name) > usable:
            raise ValueError(_no_fit(name, planner.peak(name), usable, budget_bytes, _what_lowers(name, work)))
    micro = work.micro_batch_rows
    if "micro_batch_rows" in free:
        micro = next(
            (rows for rows in range(1, work.minibatch_rows) if pass_tokens(work, rows) >= TRAIN_TOKENS),
            work.minibatch_rows,
        )
    if "rollout_prompts" in free:
        most = min(work.prompts_per_step, max(1, ROWS_CAP // work.group_size))
        candidates = sorted({*(1 << k for k in range(most.bit_length()) if 1 << k <= most), most})
    else:
        candidates = [work.rollout_prompts]
    floor, trials = planner.floor_blocks(work), []
    while not trials:
        for prompts in candidates:
            eval_prompts = work.eval_prompts
            if "eval_prompts" in free:
                eval_prompts = max(1, prompts * work.group_size // work.eval_k)
            trial = dataclasses.replace(
                work,
                micro_batch_rows=micro,
                micro_batch_tokens=_budget(work, micro, free),
                rollout_prompts=prompts,
                eval_prompts=eval_prompts,
            )
            # the pool is kept through every phase, the optimizer step (the trained state's peak) included
            largest = max(
                (state_phase(work), "train", "frozen", "rollout", "eval"),
                key=lambda name: planner.peak(name, phase_sizes(trial)[name]),
            )
            blocks = (usable - planner.peak(largest, phase_sizes(trial)[largest])) // planner.block_bytes
            if blocks < floor:
                break  # more prompts in flight only need more memory
            trial = dataclasses.replace(trial, pool_blocks=blocks)
            trials.append((rollout_estimate(planner, trial).decode_steps, trial))
        if not trials:
            if "micro_batch_rows" in free and micro > 1:
                micro = max(1, micro // 2)
                continue
            trial = dataclasses.replace(
                work,
                micro_batch_rows=micro,
                micro_batch_tokens=_budget(work, micro, free),
                rollout_prompts=candidates[0],
            )
            need = planner.peak(largest, phase_sizes(trial)[largest]) + floor * planner.block_bytes
            raise ValueError(
                _no_fit(
                    f"{largest} with the smallest pool ({floor} blocks: one group of "
                    f"{work.group_size} rows at full length)",
                    need,
                    usable,
                    budget_bytes,
                    f"{_what_lowers(largest, work, floor=True)}, or lower --max-new-tokens",
                )
            )
    fewest = min(passes for passes, _ in trials)
    return next(trial for passes, trial in trials if passes <= (1 + PASSES_TOLERANCE) * fewest)


def _budget(work: Workload, micro: int, free: tuple[str, ...]) -> int:
    """A packed workload's token budget beside micro-batches of `micro` rows: their tokens at full length when
    the budget is free, else the workload's own (0 for a workload that does not pack)."""
    if work.micro_batch_tokens and "micro_batch_tokens" in free:
        return micro * (work.prompt_len + work.max_new_tokens)
    return work.micro_batch_tokens


def rollout_estimate(planner: Planner, work: Workload) -> SamplerStats:
    """simulate_rollout of one step with the plan's pool: the step's prompts, each as long as the longest,
    and completion lengths from long_tail_lengths."""
    stats = _long_tail_rollout(
        work.prompt_len,
        work.prompts_per_step,
        work.group_size,
        work.max_new_tokens,
        work.pool_blocks,
        planner.block_size,
        work.rollout_prompts,
    )
    return dataclasses.replace(stats)


@functools.lru_cache(maxsize=64)
def _long_tail_rollout(
    P: int, prompts: int, G: int, C: int, blocks: int, block_size: int, in_flight: int
) -> SamplerStats:
    """rollout_estimate's simulation, kept: report asks again for the one fit chose."""
    lengths = long_tail_lengths(prompts * G, C)
    return simulate_rollout([P] * prompts, G, lengths, blocks, block_size, in_flight * G, C)


class TrainingPasses(NamedTuple):
    """A step's training micro-batches on the rank that runs the most, by rows and packed, and the padded
    tokens (rows x the longest) of one of them, on average over every rank's."""

    by_rows: int
    packed: int
    row_pass_tokens: float
    packed_pass_tokens: float


def training_passes(work: Workload, budget: int, seed: int = 0) -> TrainingPasses:
    """The training micro-batches of one step by rows (micro_batch_rows each) and packed up to `budget` tokens,
    for rows of the longest prompt and completions of long_tail_lengths: the step's rows of every rank shuffled
    into updates_per_rollout mini-batches (by row, or by whole group with --shuffle groups), each rank's share
    of one split as train.micro_batch_plan splits it."""
    unit = work.group_size if work.shuffle == "groups" else 1
    ranks, rows = work.world_size, work.step_rows
    lengths = work.prompt_len + torch.tensor(long_tail_lengths(ranks * rows, work.max_new_tokens, seed))  # [R x N]
    units = torch.randperm(ranks * rows // unit, generator=torch.Generator().manual_seed(seed))
    by_rows, packed = [0, 0, 0], [0, 0, 0]  # the busiest rank's micro-batches, every rank's, their padded tokens
    for part in units.tensor_split(work.updates_per_rollout):
        minibatch = (part[:, None] * unit + torch.arange(unit)).flatten()
        shares = [minibatch[minibatch // rows == rank] for rank in range(ranks)]
        count = -(-max(map(len, shares)) // work.micro_batch_rows)
        sliced = [[b for b in share.tensor_split(count) if len(b)] for share in shares]
        by_rows = [a + b for a, b in zip(by_rows, _tally(sliced, lengths))]
        packed_shares = [token_budget_micro_batches(share, lengths[share], budget) for share in shares]
        packed = [a + b for a, b in zip(packed, _tally(packed_shares, lengths))]
    return TrainingPasses(by_rows[0], packed[0], by_rows[2] / by_rows[1], packed[2] / packed[1])


def _tally(splits: list[list[torch.Tensor]], lengths: torch.Tensor) -> tuple[int, int, int]:
    """Of each rank's micro-batches of one mini-batch: the most any rank runs, how many all run, and their padded
    tokens (rows x the longest of lengths)."""
    batches = sum(splits, [])
    return max(map(len, splits)), len(batches), sum(len(b) * int(lengths[b].max()) for b in batches)


def _training_estimate(w: Workload) -> str:
    """The report's line of training_passes: the micro-batches a step runs by rows and packed, with the
    padded tokens of a pass."""
    budget = w.micro_batch_tokens or w.micro_batch_rows * (w.prompt_len + w.max_new_tokens)
    step = training_passes(w, budget)
    rows = f"{w.micro_batch_rows} row{'s' * (w.micro_batch_rows > 1)} each"
    head = "training estimate, the same lengths:"
    if w.micro_batch_tokens:
        return (
            f"{head} {step.packed:,} micro-batch{'es' * (step.packed > 1)} a step packed up to {budget:,} tokens, "
            f"{step.packed_pass_tokens:,.0f} tokens a pass (by rows {step.by_rows:,} of {rows}, "
            f"{step.row_pass_tokens:,.0f} tokens a pass)"
        )
    return (
        f"{head} {step.by_rows:,} micro-batch{'es' * (step.by_rows > 1)} a step of {rows}, "
        f"{step.row_pass_tokens:,.0f} tokens a pass "
        f"(--micro-batch-tokens {budget}: {step.packed:,}, {step.packed_pass_tokens:,.0f} tokens a pass)"
    )


def _no_fit(phase: str, need: int, usable: int, budget: int, hint: str, floor: bool = False) -> str:
    at = " even at 1 row / prompt per call" if floor else ""
    return (
        f"memory plan: {phase} needs {need / GB:.1f} GB{at}, more than the {usable / GB:.1f} GB usable "
        f"of {budget / GB:.1f} GB; {hint}"
    )


def _measured(planner: Planner, work: Workload) -> tuple[Workload, dict[str, tuple[int, int]]]:
    """The workload with a pool (the smallest that samples when it has none) and each phase's (resident, own)."""
    if not work.pool_blocks:
        work = dataclasses.replace(work, pool_blocks=planner.floor_blocks(work))
    return work, {name: planner.held_and_own(name, size, work.pool_blocks) for name, size in phase_sizes(work).items()}


def report(
    model_cfg: ModelConfig, work: Workload, budget_bytes: int, planner: Planner | None = None
) -> tuple[str, bool]:
    """A table of the phases (own peak, peak with what is resident, what they hold), the sampler's estimate
    for the length model, ending `plan: peak X GB of Y GB (fits)` or `... (does not fit: PHASE needs Z GB;
    what lowers it)`. Returns (text, fits); fits means every phase's peak is within usable_bytes(budget_bytes).
    A workload without a pool (pool_blocks 0) is shown with the smallest one that samples.
    planner: as fit's; the time printed is then since its first measurement."""
    start = time.perf_counter()
    if planner is not None:
        start = min(start, planner.started)
        w, measured = _measured(planner, work)
    else:
        with planning(model_cfg, work) as planner:
            w, measured = _measured(planner, work)
    usable = usable_bytes(budget_bytes)
    slots = (w.pool_blocks - 1) * planner.block_size
    dtype = str(w.dtype).removeprefix("torch.")
    holds = {
        "weights": f"{model_cfg.num_layers} layers x {model_cfg.hidden_size} in {dtype}",
        "lora": f"r{w.lora_rank} on {len(w.lora_targets)} targets: fp32 adapters, gradients, AdamW moments",
        "pool": f"KV cache: {w.pool_blocks - 1:,} blocks of {planner.block_size} slots ({slots:,} tokens), kept",
        "train": f"{_train_text(w)}, checkpointing {'on' if w.gradient_checkpointing else 'off'}, "
        f"step data{' with old_hidden' * w.old_hidden}",
        "frozen": "no-grad log-prob passes" if measured["frozen"][1] else "none needed",
        "rollout": f"up to {w.rollout_prompts} prompts x {w.group_size} samples in flight, {w.prompt_len}-token "
        f"prompts, {w.max_new_tokens} new tokens",
        "eval": f"up to {w.eval_prompts} prompts x {w.eval_k} samples in flight, {w.eval_len}-token prompts",
    }
    if w.full:
        share = f"1/{w.world_size} of each" if w.world_size > 1 else "whole, one process"
        holds.update(
            weights=f"{model_cfg.num_layers} layers x {model_cfg.hidden_size}: fp32 weight shards ({share})"
            + (f", the frozen reference's {dtype} shards" if w.ref_logp else ""),
            optimizer=f"every weight's fp32 gradient and AdamW moment shards ({share})",
            train=holds["train"] + f", blocks gathered in {dtype} one at a time",
            rollout=holds["rollout"] + f", the whole model gathered in {dtype}",
            eval=holds["eval"] + f", the whole model gathered in {dtype}",
        )
    ranks = f"per rank of {w.world_size} processes" if w.world_size > 1 else "one process, a world of one"
    lines = [f"{ranks} (FSDP2)"] if w.full else []
    lines += [f"{'phase':<9}{'own GB':>8}{'peak GB':>9}  holds"]
    lines += [
        f"{name:<9}{own / GB:>8.2f}{(held + own) / GB:>9.2f}  {holds[name]}" for name, (held, own) in measured.items()
    ]
    estimate = rollout_estimate(planner, w)
    lines.append(
        f"rollout estimate, lengths log-normal (median {w.max_new_tokens // 6}, sigma 0.9, capped at "
        f"{w.max_new_tokens}) for the step's {w.step_rows} rows: rows in flight max {estimate.rows_max}, "
        f"mean {estimate.rows_mean:.0f}; {estimate.decode_steps:,} decode passes, {estimate.prefills} "
        f"prefill passes, {estimate.preempted} groups preempted"
    )
    lines.append(_training_estimate(w))
    lines.append(
        f"usable: {usable / GB:.1f} GB of {budget_bytes / GB:.1f} GB, after {SLACK:.0%} allocator slack and "
        f"{RESERVED / GB:.0f} GB for the CUDA context (planned in {time.perf_counter() - start:.1f} s)"
    )
    worst = max(measured, key=lambda name: sum(measured[name]))
    peak = sum(measured[worst])
    fits = peak <= usable
    verdict = "fits" if fits else f"does not fit: {worst} needs {peak / GB:.1f} GB; {_what_lowers(worst, work)}"
    lines.append(f"plan: peak {peak / GB:.1f} GB of {budget_bytes / GB:.1f} GB ({verdict})")
    return "\n".join(lines), fits


def _what_lowers(phase: str, work: Workload, floor: bool = False) -> str:
    """PHASE_FLAGS' advice (PHASE_FLOOR_FLAGS' with floor), without --dtype bfloat16 for weights that are already
    16-bit, and naming the token budget for packed training micro-batches."""
    if phase == "weights" and work.dtype.itemsize <= 2:
        return "use a smaller model"
    if phase == "train" and work.micro_batch_tokens:
        return "lower --micro-batch-tokens (fewer tokens per micro-batch)" + (
            " or turn --gradient-checkpointing on" if floor else ""
        )
    return (PHASE_FLOOR_FLAGS if floor else PHASE_FLAGS)[phase]


def _train_text(w: Workload) -> str:
    """The training passes planned, e.g. "16 rows x 4,608 tokens, or 16 rows of 15 prompts: ...", after
    "packed up to N tokens: " for a packed workload."""
    P, passes = w.prompt_len, []
    for rows, c, prompts in train_layouts(w, phase_sizes(w)["train"]):
        some_rows = f"{rows} row{'s' * (rows > 1)}"
        passes.append(
            f"{some_rows} x {P + c:,} tokens"
            if prompts == rows
            else f"{some_rows} of {prompts} prompt{'s' * (prompts > 1)}: {prompts} x {P:,} + {rows} x {c:,} tokens"
        )
    return f"packed up to {w.micro_batch_tokens:,} tokens: " * bool(w.micro_batch_tokens) + ", or ".join(passes)


def gpu_memory_bytes(device: str | None, given_gb: float | None) -> int:
    """The memory budget: given_gb (--gpu-memory) when given, else the GPU's total memory, else 80 GB."""
    if given_gb is not None:
        if given_gb * GB <= RESERVED:
            raise ValueError(f"--gpu-memory {given_gb}: not above the {RESERVED / GB:g} GB the CUDA context takes")
        return int(given_gb * GB)
    target = torch.device(device) if device not in (None, "auto") else torch.device("cuda")
    if target.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(target).total_memory
    return DEFAULT_GPU_BYTES
