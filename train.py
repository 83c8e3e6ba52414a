"""GRPO training: model, LoRA, rollout, reward and loss wired into one loop.

    python train.py                                  # the offline demo: SmolLM2-135M learns arithmetic
    python train.py --preset atr-grpo-qwen3-1.7b     # a paper's run (needs the model and data/prepare.py)
    python train.py --preset atr-grpo-qwen3-1.7b --plan   # its memory, phase by phase, without loading it
    python train.py --resume runs/NAME               # continue a run from its last checkpoint
    python train.py --init-adapter runs/SFT/adapter  # GRPO from the adapter of sft.py's supervised stage
    torchrun --nproc-per-node 8 train.py --preset gppo-qwen3-8b   # data parallel over 8 GPUs (README)
    torchrun --nproc-per-node 8 train.py --preset gppo-qwen3-8b-full   # every weight, sharded over 8 GPUs

The file reads in the order a run executes: one step (prompts -> G completions each -> rewards ->
group-normalized advantages -> optimizer steps over mini-batches of the rollout), then the loop around
it (evaluation, logging, checkpoints), then building the model and the command line. The settings and
their flags live in config.py, the run directory's files and a run's start in rundir.py, the sizes the
memory plan chooses and the sampler's pool in sizes.py, the held-out evaluation in eval.py. With LoRA only the
adapters train and the frozen base doubles as the reference policy; with --lora-rank 0 every weight
trains, sharded by FSDP2 (fsdp.py), and the reference policy is a frozen copy kept only when the loss
asks for it.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import time
import warnings
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

# Before torch starts CUDA: the caching allocator grows and shrinks segments in place instead of carving
# fixed ones, so the KV pool, the training activations and AdamW's state do not fragment the GPU's memory.
if not (os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or os.environ.get("PYTORCH_ALLOC_CONF")):
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True"

import numpy as np
import torch
from tqdm import tqdm

import config
import eval as evaluation
import lora
import loss
import reward
import rollout
from config import Config
from data import load_problems, opens_thought, render_prompt, stop_ids, thinking_note, user_message
from engine import memory, sizes
from engine.packing import token_budget_micro_batches
from engine.pool import sampling_policy
from engine.scheduler import SamplerStats
from engine.shared_prompts import hidden_shared
from grading import sandbox, scoring
from infra import distributed, fsdp, rundir, weights
from infra.errors import USER_ERRORS, inside_training, oom_hint
from infra.stopping import Interrupted, Stopped, StopRequest, exit_interrupted
from infra.training import build, learning_rate, optimizer_step, trainable
from research import calibrate

# ----------------------------------------------------------------------------- one step


class Scores(NamedTuple):
    """A rollout's grades, each per row on the model's device."""

    reward: torch.Tensor  # [N] the weighted sum of the reward functions, plus the format bonus
    correct: torch.Tensor  # [N] 1 where the built-in verdict says correct, whatever the reward is made of
    by_function: dict[str, torch.Tensor]  # {name: [N]} each reward function's values, when there are several
    code: torch.Tensor  # [N, 2 + reasons] is it a code problem, the share of its tests passed, why it failed

    def mapped(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Scores:
        """The grades with fn applied to each tensor, [N, ...] to [M, ...]: rows picked or sent between ranks."""
        by_function = {name: fn(values) for name, values in self.by_function.items()}
        return Scores(fn(self.reward), fn(self.correct), by_function, fn(self.code))


def train_step(
    model,
    optimizer,
    tokenizer,
    problems: list[dict],
    cfg: Config,
    step: int,
    world: distributed.World | None = None,
    reference=None,
    pool: rollout.Pool | None = None,
) -> tuple[dict, list]:
    """One GRPO step: G completions of each problem, their rewards, the group-normalized advantages, and the
    policy's updates on them. Returns the step's metrics line and its per-token records (empty unless
    --log-tokens).

    With several processes (world), `problems` is the whole step's, the same on every rank; each rank samples
    and trains on its slice of whole prompts (under dynamic sampling, its slice of each call's prompts and its
    share of the groups kept: dynamic_sample), and the advantages and metrics are the whole step's.
    reference is a full run's frozen reference policy (see build).
    """
    world = world or distributed.SOLO
    watch = Stopwatch()
    open_thought = opens_thought(tokenizer, cfg.thinking == "on")
    mine = world.prompts(cfg.prompts_per_step)  # this rank's groups of the step, whole prompts
    if cfg.dynamic_sampling:
        out, scores, sampled = dynamic_sample(model, tokenizer, problems, cfg, step, open_thought, watch, world, pool)
    else:
        out = sample(model, tokenizer, problems[mine], cfg, step, first_prompt=mine.start, pool=pool)
        watch.lap("rollout")
        scores, sampled = score(out, problems[mine], cfg, step, open_thought), {}
        watch.lap("reward")
    rewards = world.cat(scores.reward)  # [N of the step]: a batch-wide std normalizes over every rank's rows
    my_rows = slice(mine.start * cfg.group_size, mine.stop * cfg.group_size)
    advantages = loss.advantages(rewards, cfg.group_size, cfg.loss)[my_rows]  # [N of this rank]
    update, records = policy_update(model, optimizer, out, advantages, cfg, step, world, reference, cfg.log_tokens)
    watch.lap("update")
    metrics = step_metrics(step, out, scores, update, watch, cfg, world, thought_lengths(out, tokenizer, open_thought))
    return metrics | sampled, records


def dynamic_sample(
    model,
    tokenizer,
    problems: list[dict],
    cfg: Config,
    step: int,
    open_thought: bool,
    watch: Stopwatch,
    world: distributed.World | None = None,
    pool: rollout.Pool | None = None,
) -> tuple[rollout.Rollout, Scores, dict]:
    """DAPO's dynamic sampling: sampler calls on successive slices of prompts_per_step problems (call k's
    prompts are the step's prompts k*n .., so each draws from its own random streams and a run repeats), until
    n = prompts_per_step groups have rewards that differ or dynamic_sampling calls are spent. The step keeps n
    groups: those whose rewards differ in the order sampled, then, when too few did, equal-reward groups of the
    first calls (zero advantage) to keep the step's size. Returns this rank's share of them as one rollout, with
    their scores, and the counts logged (dynamic/groups_sampled, dynamic/groups_kept, dynamic/calls).

    With several processes each call's prompts are split as a plain step's are: rank r of W samples call k's
    prompts k*n + r*n/W .. k*n + (r+1)*n/W - 1, so the call's groups in rank order are one process's in its
    order. After each call the ranks gather every group's "rewards differ" flag, and each rank takes the same
    decisions from the same flags: every rank makes the same calls and keeps the same groups in the same order,
    those one process with the same seed keeps. The kept groups are then dealt out as a plain step's prompts
    are (dealt), so the advantages, the mini-batches and the update are one process's too, and the counts are
    the step's."""
    world = world or distributed.SOLO
    n, G = cfg.prompts_per_step, cfg.group_size
    mine = world.prompts(n)  # this rank's prompts of each call
    calls, differ = [], []  # this rank's (rollout, scores) per call; per call [n] bool over every rank's groups
    for call in range(cfg.dynamic_sampling):
        first = call * n + mine.start
        batch = problems[first : call * n + mine.stop]
        out = sample(model, tokenizer, batch, cfg, step, first_prompt=first, pool=pool)
        watch.lap("rollout")
        scores = score(out, batch, cfg, step, open_thought)
        watch.lap("reward")
        calls.append((out, scores))
        groups = scores.reward.view(-1, G)  # [n / W, G]
        differ.append(world.cat(groups.amax(1) != groups.amin(1)).cpu())  # [n]: the call's groups in step order
        if int(torch.cat(differ).sum()) >= n:
            break
    flags = torch.cat(differ)  # [calls * n]: group g of call k at k * n + g, the same on every rank
    kept = torch.cat([flags.nonzero()[:, 0], (~flags).nonzero()[:, 0]])[:n]  # [n] the step's groups, in order
    out, scores = dealt(calls, kept, cfg, world, tokenizer)
    watch.lap("rollout")
    counts = {"dynamic/groups_sampled": len(flags), "dynamic/groups_kept": min(n, int(flags.sum()))}
    return out, scores, counts | {"dynamic/calls": len(calls)}


def dealt(
    calls: list[tuple[rollout.Rollout, Scores]], kept: torch.Tensor, cfg: Config, world: distributed.World, tokenizer
) -> tuple[rollout.Rollout, Scores]:
    """This rank's share of the step's kept groups, as one rollout and its scores. kept: [n] the groups in the
    step's order, k * n + g for group g of call k; rank r of W trains kept[r*n/W : (r+1)*n/W], a plain step's
    split. Each call's kept groups go from the rank that sampled them to the rank that trains them (moved)."""
    n, G = cfg.prompts_per_step, cfg.group_size
    share = n // world.size
    sampled_by, trained_by = kept % n // share, torch.arange(n, device="cpu") // share  # [n] each: a rank
    arrivals, origin = [], {}  # per call, the groups sent here; a kept group's place here -> (call, its index)
    for call, (out, scores) in enumerate(calls):
        sent = (kept // n == call) & (sampled_by == world.rank)  # in step order: by the rank that trains them
        here = ((kept // n == call) & (trained_by == world.rank)).nonzero()[:, 0]
        send = (torch.bincount(trained_by[sent], minlength=world.size) * G).tolist()
        receive = (torch.bincount(sampled_by[here], minlength=world.size) * G).tolist()
        arrivals.append(moved(out, scores, kept[sent] % n - world.rank * share, send, receive, cfg, world, tokenizer))
        here = here[torch.sort(sampled_by[here], stable=True).indices]  # as they arrive: by sender, then in order
        origin |= {place - world.rank * share: (call, index) for index, place in enumerate(here.tolist())}
    parts = []  # runs of consecutive groups of one call's arrivals, as their rows
    for call, index in (origin[place] for place in range(share)):
        rows = torch.arange(index * G, (index + 1) * G, device="cpu")
        if parts and parts[-1][0] == call:
            parts[-1] = (call, torch.cat([parts[-1][1], rows]))
        else:
            parts.append((call, rows))
    out = rollout.joined([(arrivals[call][0], rows) for call, rows in parts])
    out.stats = sum((sampled.stats for sampled, _ in calls), SamplerStats())  # the sampler calls this rank made

    def rows_of(pick) -> torch.Tensor:
        return torch.cat([pick(arrivals[call][1])[rows.to(out.old_logp.device)] for call, rows in parts])

    first = arrivals[0][1]
    scores = Scores(
        rows_of(lambda s: s.reward),
        rows_of(lambda s: s.correct),
        {name: rows_of(lambda s, name=name: s.by_function[name]) for name in first.by_function},
        rows_of(lambda s: s.code),
    )
    return out, scores


def moved(
    out: rollout.Rollout,
    scores: Scores,
    groups: torch.Tensor,
    send: list[int],
    receive: list[int],
    cfg: Config,
    world: distributed.World,
    tokenizer,
) -> tuple[rollout.Rollout, Scores]:
    """Prompt groups of this rank's rollout (groups: their indices in it), with their scores, sent to the ranks
    that train them (World.exchange): send[r] of their rows, in order, to rank r. Returns the rows the ranks
    sent here, receive[r] from rank r in rank order, padded to the widest prompt and completion of this call on
    any rank (the all-to-all moves rows of one width)."""
    G = cfg.group_size
    rows = (groups[:, None] * G + torch.arange(G, device="cpu")).flatten().to(out.old_logp.device)  # [groups * G]
    P, C = world.max(torch.tensor([out.prompt_len, out.completion_mask.shape[1]], device="cpu")).tolist()
    sent = rollout.joined([(out, rows)], (P, C))

    def exchange(tensor: torch.Tensor) -> torch.Tensor:
        return world.exchange(tensor, send, receive)

    return rollout.rows_moved(sent, exchange, tokenizer), scores.mapped(lambda values: exchange(values[rows]))


def step_metrics(
    step: int,
    out: rollout.Rollout,
    scores: Scores,
    update: dict,
    watch: Stopwatch,
    cfg: Config,
    world: distributed.World,
    thoughts: torch.Tensor,
) -> dict:
    """The step's metrics line: means over every rank's rows, the update's metrics, and throughput (the
    step's tokens over the slowest rank's seconds). thoughts: thought_lengths' [N, 3]."""
    lengths = out.completion_mask.sum(1).float()
    unclosed, think_length, answer_length = thoughts.T
    columns = {
        "reward": scores.reward,
        "accuracy": scores.correct,
        **{f"rewards/{name}": values for name, values in scores.by_function.items()},
        "completion_length": lengths,
        "truncated": out.truncated.float(),
        "think_unclosed_frac": unclosed,
        "think_length": think_length,
        "answer_length": answer_length,
    }
    if (penalty := overlong_penalty(out, cfg)) is not None:
        columns["overlong_penalty"] = penalty
    rows = world.cat(torch.cat([torch.stack(list(columns.values()), 1), scores.code], 1))  # [N of the step, ...]
    seconds = torch.tensor([watch.laps["rollout"], watch.laps["update"]], dtype=torch.float64, device="cpu")
    tokens = torch.tensor([lengths.sum().item(), out.pad_mask.sum().item()], dtype=torch.float64, device="cpu")
    slowest, tokens = world.max(seconds), world.sum(tokens)
    return {
        "step": step,
        **dict(zip(columns, rows[:, : len(columns)].mean(0).tolist())),
        **sandbox.step_metrics(rows[:, len(columns) :]),
        **update,
        "step_seconds": watch.total,
        "reward_seconds": watch.laps["reward"],
        "rollout_tokens_per_s": float(tokens[0] / slowest[0]),
        # every row is trained on once per epoch, prompt included
        "train_tokens_per_s": float(cfg.epochs * tokens[1] / slowest[1]),
    }


def sample(
    model,
    tokenizer,
    problems: list[dict],
    cfg: Config,
    step: int,
    first_prompt: int = 0,
    pool: rollout.Pool | None = None,
) -> rollout.Rollout:
    """G completions for each problem, with the sampling policy's log-probs: one sampler call, at most
    rollout_batch prompts in flight, over the run's KV pool. first_prompt is the index of problems[0] in
    the step: a prompt's samples depend on it, not on the process. A sharded model samples with its whole
    weights, gathered for the rollout (sampling_policy)."""
    prompts = [
        render_prompt(tokenizer, p["problem"], cfg.template, cfg.system_prompt, cfg.thinking == "on") for p in problems
    ]
    model.eval()  # no LoRA dropout while sampling: the old log-probs must be the sampling policy's
    hint = f"lower --rollout-batch (now {cfg.rollout_batch} prompts in flight) or --kv-blocks (now {cfg.kv_blocks})"
    with oom_hint("the rollout", hint), sampling_policy(model, pool) as policy:
        return rollout.generate(
            policy,
            prompts,
            samples_per_prompt=cfg.group_size,
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_p=cfg.top_p,
            top_k=cfg.top_k,
            stop_ids=stop_ids(model.config, tokenizer),
            seed=cfg.seed * 1_000_003 + step,
            tokenizer=tokenizer,
            max_rows=cfg.rollout_batch * cfg.group_size or None,
            first_prompt=first_prompt,
            cuda_graphs=cfg.cuda_graphs,
            pool=pool,
        )


def score(out: rollout.Rollout, problems: list[dict], cfg: Config, step: int = 0, open_thought: bool = False) -> Scores:
    """The rollout's grades (Scores). The reward is the weighted sum of the --reward-fn functions
    (scoring.py) plus the format bonus. correct is the built-in verdict (scoring.verdicts), whatever the
    reward is made of: the answer checker's on a math problem, every test passed on a code problem (task
    "code", run in sandbox.py within --code-timeout). It is graded here once, with --code-reward, and is the
    value of reward.math_reward and sandbox.code_reward when they are among the functions. The checker, the
    sandbox and the format bonus read only what follows a completion's last </think> (open_thought: the
    prompt opened a thought); a function of your own gets the whole completion and the open_thought column
    (reward.split_thinking). code holds, per row: is it a code problem, the share of its tests passed, and a
    one-hot of why it failed (sandbox.REASONS)."""
    rows = [p for p in problems for _ in range(cfg.group_size)]
    verdicts, grades = scoring.verdicts(  # grades: a code row's sandbox.Grade (None for math), the code metrics
        out.texts,
        rows,
        template=cfg.template,
        open_thought=open_thought,
        code_fraction=cfg.code_reward == "fraction",
        code_limits=sandbox.Limits(timeout=cfg.code_timeout),
    )
    is_code = [grade is not None for grade in grades]
    given = {
        "reward:math_reward": [None if c else v for v, c in zip(verdicts, is_code)],
        "sandbox:code_reward": [v if c else None for v, c in zip(verdicts, is_code)],
    }
    functions = scoring.functions(cfg.reward_fn, cfg.reward_weights, cfg.reward_timeout)
    columns = {
        "prompts": [user_message(p["problem"], cfg.template) for p in rows],
        "completion_ids": out.completions,
        "template": [cfg.template] * len(rows),
        **scoring.columns_of(rows),
        "open_thought": [open_thought] * len(rows),
    }
    totals, by_name = functions(out.texts, columns, where=f"step {step}", group_size=cfg.group_size, given=given)
    if cfg.format_weight:
        answers = [reward.split_thinking(text, open_thought).answer for text in out.texts]
        totals = [
            total + cfg.format_weight * (answer is not None and reward.has_format(answer, cfg.template))
            for total, answer in zip(totals, answers)
        ]
    penalty = overlong_penalty(out, cfg)
    if penalty is not None:
        totals = [total + value for total, value in zip(totals, penalty.tolist())]
    code = sandbox.metric_rows(grades)  # built on the host, then one copy to the device

    def tensor(values: list) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=out.old_logp.device)

    by_function = {name: tensor(values) for name, values in by_name.items()} if len(by_name) > 1 else {}
    return Scores(tensor(totals), (tensor(verdicts) >= 1).float(), by_function, tensor(code))


def overlong_penalty(out: rollout.Rollout, cfg: Config) -> torch.Tensor | None:
    """DAPO's soft overlong punishment per row [N] under --overlong penalty:L (None otherwise): 0 up to
    Lmax - L tokens, then ((Lmax - L) - |y|) / L, falling linearly to -1 at Lmax = max_new_tokens, which no
    completion passes (the sampler stops there)."""
    cache = config.overlong_cache(cfg.overlong, cfg.max_new_tokens)
    if cache is None:
        return None
    lengths = out.completion_mask.sum(1).double()  # [N]
    return ((cfg.max_new_tokens - cache - lengths) / cache).clamp(-1.0, 0.0).float()


def loss_mask(out: rollout.Rollout, cfg: Config) -> torch.Tensor:
    """The tokens the loss is over, [N, C] bool: the completions', less the truncated rows' under --overlong
    mask (TRL's mask_truncated_completions: a cut-off answer is neither rewarded nor punished)."""
    if cfg.overlong != "mask":
        return out.completion_mask
    return out.completion_mask & ~out.truncated[:, None]


def thought_lengths(out: rollout.Rollout, tokenizer, open_thought: bool) -> torch.Tensor:
    """Per row [N, 3]: 1 if its thought never closed, its thinking tokens and its answer tokens (the rest of
    the completion, stop token included). An answer after a </think> is re-encoded to count it, so the split
    of such a row is exact up to how the tokenizer merges across the tag."""
    lengths, finished = out.completion_mask.sum(1).tolist(), out.finished.tolist()
    stats = []
    for text, length, stopped in zip(out.texts, lengths, finished):
        thought = reward.split_thinking(text, open_thought)
        if thought.answer is None:
            stats.append((1.0, length, 0))
        elif thought.answer == text:  # no thought at all
            stats.append((0.0, 0, length))
        else:
            answer = min(length, len(tokenizer.encode(thought.answer, add_special_tokens=False)) + stopped)
            stats.append((0.0, length - answer, answer))
    return torch.tensor(stats, dtype=torch.float32, device=out.old_logp.device)


def policy_update(
    model,
    optimizer,
    out: rollout.Rollout,
    advantages: torch.Tensor,
    cfg: Config,
    step: int,
    world: distributed.World | None = None,
    reference=None,
    keep_records: bool = False,
) -> tuple[dict, list]:
    """epochs passes over the rollout's rows, each shuffled afresh into updates_per_rollout mini-batches (--shuffle:
    rows one by one, or whole prompt groups); one optimizer step per mini-batch, the sum of its micro-batches
    (micro_batch_plan). Returns the update's metrics and, with keep_records, every rank's per-token records.
    Metrics: token-weighted means over micro-batches; *_min / *_max are extremes; start_ratio_min / _max are
    the first mini-batch's, before this step's first update (the numerical floor); with several epochs,
    epoch[E]/* are each pass's clip rates; micro_batches is the training passes per optimizer step of the
    rank that runs the most, idle ones included.
    """
    world = world or distributed.SOLO
    frozen = frozen_inputs(model, out, cfg, reference)  # what the loss needs of the policy before it moves
    mismatch = sampler_mismatch(model, out, frozen, cfg, world)
    advantages = advantages.to(out.old_logp.device)
    records = [] if keep_records else None
    model.train()
    per_update, grad_norms, passes = [], [], []
    hint = (
        f"lower --micro-batch-tokens (now {cfg.micro_batch_tokens})"
        if cfg.micro_batch_tokens
        else f"raise --grad-accum (now {cfg.grad_accum})"
    )
    for update, (micro_batches, totals) in enumerate(micro_batch_plan(out, cfg, step, world, fsdp.is_sharded(model))):
        if cfg.overlong == "mask" and not totals["num_tokens"]:  # the mini-batch's rows all truncated, every rank's
            grad_norms.append(None)  # nothing to train on: a skipped update, and AdamW's moments do not move it
            per_update.append([])
            passes.append(0)
            continue
        losses, metrics = [], []
        passes.append(len(micro_batches))
        for rows, idle in micro_batches:
            with oom_hint(f"a training micro-batch of {len(rows)} rows", hint):
                logp, mask, inputs, entropy = policy_inputs(model, out, frozen, rows, cfg)
                if cfg.overlong == "mask" and not mask.any():  # every row truncated: a pass at weight 0, as idle
                    idle, mask = True, out.completion_mask[rows, : mask.shape[1]]
                value, micro = loss.policy_loss(
                    logp, inputs.pop("old_logp"), advantages[rows], mask, cfg.loss, **totals,
                    records=None if idle else records, **inputs,
                )  # fmt: skip
                value = value * 0 if idle else value  # an idle rank's pass meets the others' at weight 0
                value.backward()
            losses.append(value.detach())
            if not idle:
                micro["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
                micro["tokens"] = int(mask.sum())
                metrics.append(micro)
                if records is not None:  # which update of the rollout a record is from: the first cannot clip
                    records[-1]["update"] = np.full(len(records[-1]["mu"]), update, dtype=np.int32)
        local_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=advantages.device)
        total_loss = distributed.sum_gradients(trainable(model), world, local_loss)
        grad_norms.append(optimizer_step(model, optimizer, total_loss, cfg, step))
        per_update.append(metrics)
    ranks = world.gather((per_update, passes))
    per_update = [sum(updates, []) for updates in zip(*(metrics for metrics, _ in ranks))]  # update by update
    most_passes = np.max([counts for _, counts in ranks], axis=0)  # [updates]: the busiest rank's
    summary = update_metrics(per_update, grad_norms, cfg) | mismatch | {"micro_batches": float(most_passes.mean())}
    return summary, [] if records is None else sum(world.gather(records), [])


def micro_batch_plan(
    out: rollout.Rollout, cfg: Config, step: int, world: distributed.World, sharded: bool
) -> list[tuple[list[tuple[torch.Tensor, bool]], dict]]:
    """Per optimizer step: this rank's micro-batches as (rows, idle), and the loss's normalizers (the step's
    tokens and sequences on every rank).

    With several processes, `out` holds this rank's rows of the step, which are rows world.rank * N ..
    of the step's. The shuffle is of the whole step's rows, the same on every rank, and each rank trains
    on its own rows of each mini-batch: the mini-batches are one process's, and with the normalizers
    summed over the ranks and the gradients too, so is every update. A rank's share of a mini-batch is cut
    into micro-batches of the rows one rank's average share needs for grad_accum of them, or, with
    --micro-batch-tokens, packed by length (packed_micro_batches). A sharded model's passes are
    collectives, so every rank runs as many micro-batches as the busiest: a rank with fewer runs one row at
    weight 0 for each one it lacks (idle; its gradient is exactly 0).
    """
    N, device = len(out.completion_mask), out.completion_mask.device
    first = world.rank * N
    minibatches = shuffled_minibatches(N * world.size, cfg, step)  # epoch by epoch
    mine = [(m[(m >= first) & (m < first + N)] - first).to(device) for m in minibatches]
    tokens = loss_mask(out, cfg)  # [N, C]
    num_tokens = world.sum(torch.stack([tokens[rows].sum() for rows in mine]))
    if cfg.micro_batch_tokens:
        shares = [packed_micro_batches(out, rows, cfg.micro_batch_tokens) for rows in mine]
        # how this rank's rows pack says nothing of the others': where the counts must agree, one collective,
        # a max over the ranks of every mini-batch's count at once
        counts = [len(share) for share in shares]
        if sharded:
            counts = world.max(torch.tensor(counts, device="cpu")).tolist()
    else:
        shares, counts = [], []
        for minibatch, step_rows in zip(mine, minibatches):
            # micro-batches of the size one rank's average share needs: the largest share takes more of them
            micro_rows = math.ceil(len(step_rows) / world.size / cfg.grad_accum)
            largest_share = int(torch.bincount(step_rows // N, minlength=world.size).max())
            counts.append(math.ceil(largest_share / micro_rows))  # every rank knows every share: no collective
            shares.append([rows for rows in minibatch.tensor_split(counts[-1]) if len(rows)])
    plan = []
    for share, count, step_tokens, step_rows in zip(shares, counts, num_tokens, minibatches):
        idle = [(torch.zeros(1, dtype=torch.long, device=device), True)] * (count - len(share)) if sharded else []
        plan.append(([(rows, False) for rows in share] + idle, {"num_tokens": step_tokens, "num_seqs": len(step_rows)}))
    return plan


def packed_micro_batches(out: rollout.Rollout, rows: torch.Tensor, budget: int) -> list[torch.Tensor]:
    """Some rows of the rollout in micro-batches of at most `budget` tokens as the training pass runs them
    (engine.packing.token_budget_micro_batches, longest first). The pass pads its rows to their longest
    prompt (left) and longest completion (right), so a row counts the longest prompt among `rows` plus its
    own completion: rows x the longest such length bounds every micro-batch's padded tokens."""
    if not len(rows):
        return []
    P = out.prompt_len
    prompts, completions = out.pad_mask[rows, :P].sum(1), out.pad_mask[rows, P:].sum(1)  # [rows] each
    return token_budget_micro_batches(rows, prompts.max() + completions, budget)


def policy_inputs(
    model, out: rollout.Rollout, frozen: dict[str, torch.Tensor], rows: torch.Tensor, cfg: Config
) -> tuple[torch.Tensor, torch.Tensor, dict, torch.Tensor]:
    """The training forward over some rows of the rollout: (logp [rows, c], mask [rows, c], the loss's other
    inputs by name, entropy [rows, c]). The inputs are the frozen ones cut to these rows, plus what the rule
    asks of the policy being trained (its final states, the LM head, the temperature, the entropy)."""
    h, ids, start, c = policy_states(model, out, rows, cfg.group_size)
    needs = loss.required_inputs(cfg.loss)
    logp, entropy = model.hidden_logprobs(
        h, ids, start=start, temperature=cfg.temperature, with_entropy=True, entropy_grad=cfg.loss.entropy_coef > 0
    )  # an entropy bonus differentiates the entropy; an entropy selection reads its value
    live = {
        "hidden": completion_states(h, start),
        "lm_head_weight": model.lm_head.weight,
        "temperature": cfg.temperature,
        "entropy": entropy,
    }
    inputs = {name: value[rows, :c] for name, value in frozen.items()}
    inputs |= {name: value for name, value in live.items() if name in needs}
    return logp, loss_mask(out, cfg)[rows, :c], inputs, entropy


def update_metrics(per_update: list[list[dict]], grad_norms: list[float | None], cfg: Config) -> dict:
    """The update's metrics from every rank's micro-batch metrics, update by update (only the skipped updates
    when no micro-batch had a token to train on)."""
    if not any(per_update):
        return {"grad_norm": None, "skipped_updates": len(grad_norms)}
    summary, start = loss.merge_metrics(sum(per_update, [])), loss.merge_metrics(per_update[0])
    applied = [norm for norm in grad_norms if norm is not None]
    summary.update(
        start_ratio_min=start["ratio_min"],
        start_ratio_max=start["ratio_max"],
        grad_norm=float(np.mean(applied)) if applied else None,
        skipped_updates=len(grad_norms) - len(applied),
        **loss.clip_rates(sum(per_update[1:], [])),
    )
    if cfg.epochs > 1:  # where the clips happened: later passes start further from the sampling policy
        per_epoch = len(per_update) // cfg.epochs
        for epoch in range(cfg.epochs):
            merged = loss.merge_metrics(sum(per_update[epoch * per_epoch : (epoch + 1) * per_epoch], []))
            summary |= {f"epoch[{epoch + 1}]/{key}": merged[key] for key in CLIP_KEYS}
    return summary


CLIP_KEYS = ("clip_low_frac", "clip_high_frac", "limit_clip_frac")


def frozen_inputs(model, out: rollout.Rollout, cfg: Config, reference=None) -> dict[str, torch.Tensor]:
    """Per-token inputs of the loss taken before the policy moves, each [N, C, ...] completion-aligned.

    old_logp: the sampler's, or recomputed by the training pass (recompute_old_logp); ref_logp: the
    reference policy's (reference_policy), when the loss asks for it; old_hidden: the sampling policy's final
    states at the positions that predict each completion token, when the rule asks for them. The passes run
    without gradient, in eval mode (no LoRA dropout), in micro-batches of the training size.
    """
    needs = loss.required_inputs(cfg.loss)
    _, dtype = config.resolve_device(cfg)  # the compute dtype (a full run's weights are fp32 under bf16)
    recompute = (
        cfg.recompute_old_logp == "on"
        or (cfg.recompute_old_logp == "auto" and dtype != torch.float32)
        or "sampler_logp" in needs  # a rollout correction weighs the training pass's old log-probs by the sampler's
    )
    passes = {"old_logp": recompute, "ref_logp": "ref_logp" in needs, "old_hidden": "old_hidden" in needs}
    N, C = out.completion_mask.shape
    results = {name: None for name, wanted in passes.items() if wanted}
    sampler = {"sampler_logp": out.old_logp} if "sampler_logp" in needs else {}
    if not results:
        return {"old_logp": out.old_logp, **sampler}
    model.eval()
    with torch.no_grad():
        for rows in torch.arange(N, device=out.completion_mask.device).chunk(cfg.updates_per_rollout * cfg.grad_accum):
            if passes["old_logp"] or passes["old_hidden"]:
                h, ids, start, c = policy_states(model, out, rows, cfg.group_size)
            chunk = {}
            if passes["old_logp"]:
                chunk["old_logp"] = model.hidden_logprobs(h, ids, start=start, temperature=cfg.temperature)[0]
            if passes["old_hidden"]:
                chunk["old_hidden"] = completion_states(h, start)
            if passes["ref_logp"]:
                with reference_policy(model, reference) as ref:
                    h_ref, ids, start, c = policy_states(ref, out, rows, cfg.group_size)
                    chunk["ref_logp"] = ref.hidden_logprobs(h_ref, ids, start=start, temperature=cfg.temperature)[0]
            for name, value in chunk.items():
                if results[name] is None:
                    results[name] = value.new_zeros(N, C, *value.shape[2:])
                results[name][rows, :c] = value
    if reference is not None:
        fsdp.reshard(reference)  # its root stays gathered after a pass without backward
    return {"old_logp": out.old_logp, **results, **sampler}


def sampler_mismatch(
    model, out: rollout.Rollout, frozen: dict[str, torch.Tensor], cfg: Config, world: distributed.World | None = None
) -> dict[str, float]:
    """loss.mismatch of the sampler's old log-probs against the training pass's, of the same tokens, before the
    policy moves. With the old log-probs recomputed it reads them (free); otherwise it runs the training pass,
    without gradient and in eval mode, on the first prompt group of the first micro-batch's worth of rows (at
    most 1 / (updates_per_rollout x grad_accum) of the step's rows): a monitor, not an estimate over the step,
    which costs the forward of one group rather than a share of every step's time. With several processes each
    rank measures its own rows so, and the figures are those of every rank's tokens (ranks_mismatch);
    mismatch/rows says how many rows they are over."""
    if frozen["old_logp"] is not out.old_logp:
        return ranks_mismatch(out.old_logp, frozen["old_logp"], out.completion_mask, world)
    N = len(out.completion_mask)
    first = torch.arange(N, device=out.completion_mask.device).chunk(cfg.updates_per_rollout * max(1, cfg.grad_accum))[
        0
    ]
    rows = first[: cfg.group_size]  # [<= G]: the rows are prompt-major, so one whole group
    model.eval()
    with torch.no_grad():
        h, ids, start, c = policy_states(model, out, rows, cfg.group_size)
        trainer_logp = model.hidden_logprobs(h, ids, start=start, temperature=cfg.temperature)[0]  # [rows, c]
    return ranks_mismatch(out.old_logp[rows, :c], trainer_logp, out.completion_mask[rows, :c], world)


def ranks_mismatch(
    sampler_logp: torch.Tensor, trainer_logp: torch.Tensor, mask: torch.Tensor, world: distributed.World | None = None
) -> dict[str, float]:
    """loss.mismatch over the masked tokens [rows, c] of every rank's rows: the means (|d log p|, k3, the share
    outside [0.5, 2]) weighted by each rank's tokens, the largest of the ranks' maxima, and mismatch/rows, the
    rows of every rank."""
    world = world or distributed.SOLO
    stats = loss.mismatch(sampler_logp, trainer_logp, mask)
    tokens = float(mask.sum())
    means = [key for key in stats if key != "mismatch/abs_max"]
    # [tokens, rows, tokens x each mean], summed over the ranks: one collective
    sums = torch.tensor([tokens, len(mask), *(tokens * stats[key] for key in means)], dtype=torch.float64, device="cpu")
    sums = world.sum(sums)
    largest = world.max(torch.tensor([stats["mismatch/abs_max"]], dtype=torch.float64, device="cpu"))
    weighted = dict(zip(means, (sums[2:] / sums[0]).tolist()))
    return {key: float(largest[0]) if key == "mismatch/abs_max" else weighted[key] for key in stats} | {
        "mismatch/rows": int(sums[1])
    }


def shuffled_minibatches(rows: int, cfg: Config, step: int) -> list[torch.Tensor]:
    """The step's rows (of every rank) in epochs x updates_per_rollout mini-batches, epoch by epoch, each epoch
    shuffled afresh by the seed and the step: one row at a time (--shuffle rows), or a prompt group at a time,
    each group's G rows together (groups). The first epoch's order is a run's without --epochs."""
    generator, G = torch.Generator().manual_seed(cfg.seed + step), cfg.group_size
    minibatches = []
    for _ in range(cfg.epochs):
        if cfg.shuffle == "rows":
            minibatches += torch.randperm(rows, generator=generator, device="cpu").chunk(cfg.updates_per_rollout)
        else:
            groups = torch.randperm(rows // G, generator=generator, device="cpu")
            minibatches += [
                (part[:, None] * G + torch.arange(G, device="cpu")).flatten()
                for part in groups.tensor_split(cfg.updates_per_rollout)
            ]
    return minibatches


def policy_states(
    model, out: rollout.Rollout, rows: torch.Tensor, group_size: int
) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The policy's final states for some rows of the rollout, with the ids they are read against: (h, ids,
    start, c) such that model.hidden_logprobs(h, ids, start=start) are the rows' log-probs of their first c
    completion tokens, and completion_states(h, start) the states that predict them.

    Rows of one prompt group (row // group_size: the rollout is prompt-major) share their prompt: where
    any prompt has several rows here, each prompt runs once for all of them (hidden_shared, from the
    last prompt token on); where none has, each row runs whole (model.hidden over the window).
    """
    groups, owner = torch.unique(rows // group_size, return_inverse=True)
    if len(groups) == len(rows):
        ids, pad, start, c = window(out, rows)
        return model.hidden(ids, pad), ids, start, c
    P = out.prompt_len
    prompt_mask, completion_mask = out.pad_mask[groups * group_size, :P], out.pad_mask[rows, P:]
    first = int(prompt_mask.any(0).nonzero()[0])  # the columns some prompt uses
    c = int(completion_mask.any(0).nonzero()[-1]) + 1  # and some completion
    h = hidden_shared(
        model,
        out.input_ids[groups * group_size, first:P],
        prompt_mask[:, first:],
        owner,
        out.input_ids[rows, P : P + c],
        completion_mask[:, :c],
    )  # [rows, 1 + c, hidden]
    return h, out.input_ids[rows, P - 1 : P + c], 1, c  # the last prompt column is real in every row


@contextmanager
def reference_policy(model, reference):
    """The policy the KL penalty measures against: a full run's frozen copy, or the LoRA model's frozen base
    (its adapters off)."""
    if reference is not None:
        yield reference
        return
    with lora.disabled(model):
        yield model


def window(out: rollout.Rollout, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """The rows' input ids and pad mask, cut to the columns some row uses: (ids, pad, start, c).

    The window holds the last `start` prompt columns and the first c completion columns, so
    hidden_logprobs(h, ids, start=start) and every [N, C] per-token tensor's [rows, :c] line up.
    """
    used = out.pad_mask[rows].any(0).nonzero()[:, 0]
    first, last = int(used[0]), int(used[-1]) + 1
    start, c = out.prompt_len - first, last - out.prompt_len
    return out.input_ids[rows, first:last], out.pad_mask[rows, first:last], start, c


def completion_states(h: torch.Tensor, start: int) -> torch.Tensor:
    """The hidden states [rows, c, hidden] that predict the completion tokens (positions start-1 .. W-2)."""
    return h[:, start - 1 : -1]


class Stopwatch:
    """Seconds per named stage of a step, as laps of one clock; a stage's laps add up."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = self.laps.get(name, 0.0) + now - self.last, now  # a stage may recur

    @property
    def total(self) -> float:
        return self.last - self.start


# ----------------------------------------------------------------------------- the run


def train(cfg: Config, world: distributed.World | None = None) -> dict:
    """Run (or resume) training; returns the final state with the before/after evaluations.

    Every check that can run before the weights load does (settings, reward functions, data, the model's
    context and shape, paths); then the run directory's lock is taken, and a new run whose start fails
    (its trackers included) before its first step removes the folder it created. With several processes every rank runs this loop in
    step; rank 0 alone holds the lock and writes files (metrics, checkpoints, exports), and the other
    ranks wait for it at a barrier before they go on. Raises Stopped after a checkpoint on Ctrl-C.
    """
    world = world or distributed.SOLO
    writer = world.rank == 0
    start = check_start(cfg)
    run_dir = rundir.run_path(cfg)
    with rundir.RunLock(run_dir, resume=bool(cfg.resume), active=writer) as lock:
        # also the point no rank passes before rank 0 holds the run directory
        distributed.check_same_settings(world, config.flat_config(cfg))
        try:
            model, tokenizer, optimizer, reference = build(cfg, cfg.init_adapter, start["model_dir"])
            if cfg.resume and cfg.steps == 0 and cfg.export:  # export only: no training, no evaluation
                with rundir.writing(Path(cfg.export)):
                    return rundir.export_run(cfg, run_dir, model, tokenizer, optimizer, world)
            cfg = sizes.resolve_sizes(cfg, model, tokenizer, start["train_set"], world, start["eval_sets"])
            pool = sizes.sampler_pool(cfg, model, tokenizer, start["train_set"], start["eval_sets"])
            if writer:
                config.warn_if_inert(cfg)
                if note := thinking_note(tokenizer, cfg.thinking == "on"):
                    warnings.warn(note)
                if cfg.world_size and cfg.world_size != world.size:
                    warnings.warn(
                        f"--world-size {cfg.world_size}: the run is meant for {cfg.world_size} processes "
                        f"and runs on {world.size}; every size the memory plan chooses is for {world.size}"
                    )

            def save(state: dict) -> None:
                rundir.save_checkpoint(run_dir, model, optimizer, state, world)

            state = rundir.open_run(cfg, run_dir, model, optimizer, world, save)
            trackers = rundir.open_trackers(cfg, run_dir, state, list(start["eval_sets"]), writer)
        except BaseException:
            lock.discard()  # a new run that never stepped: a retry finds no folder in its way
            raise
        try:
            return run(cfg, world, run_dir, model, tokenizer, optimizer, reference, state, start, save, pool, trackers)
        except (rundir.WriteError, scoring.RewardFunctionError) as error:  # the run has a checkpoint to continue from
            error.run_dir = run_dir
            raise
        except KeyboardInterrupt:
            raise Interrupted(run_dir) from None


def check_start(cfg: Config) -> dict:
    """What a run needs before its weights load, each checked: the settings and reward functions, the
    datasets (every prompt fits the model's context, or its file and line is named), the model's
    config.json and tokenizer (the context, the LoRA rank), the export folder. Returns the data and the
    model directory."""
    config.validate(cfg)
    config.check_init_adapter(cfg)
    scoring.functions(cfg.reward_fn, cfg.reward_weights, cfg.reward_timeout)  # imports them: a typo fails now
    train_set, eval_sets = load_problems(cfg.dataset), evaluation.load_eval_sets(cfg)
    config.check_reward_functions(cfg, train_set, eval_sets)
    if cfg.export:
        weights.check_export_dir(cfg.export)  # before training, not after it
    model_dir = weights.resolve_checkpoint(cfg.model)  # the default converts once; a hub id downloads once
    model_cfg = memory.model_config(str(model_dir))
    config.check_model(cfg, model_cfg)
    tokenizer = weights.load_tokenizer(str(model_dir))
    for name, problems in [(cfg.dataset, train_set), *eval_sets.items()]:
        config.check_prompts(cfg, problems, tokenizer, model_cfg.max_position_embeddings, name)
    try_reward_functions(cfg, train_set[0])
    return {"train_set": train_set, "eval_sets": eval_sets, "model_dir": model_dir}


def try_reward_functions(cfg: Config, problem: dict) -> None:
    """Call each reward function of your own once, on the first training problem and an empty completion, as a
    step calls it: a wrong signature or a crash fails now, in one line, not after the model loads and the
    held-out evaluation runs. The built-in functions are the trainer's and are not called."""
    functions = scoring.functions(cfg.reward_fn, cfg.reward_weights, cfg.reward_timeout)
    built_in = {reward.math_reward: [None], sandbox.code_reward: [None]}
    columns = {
        "prompts": [user_message(problem["problem"], cfg.template)],
        "completion_ids": [[]],
        "template": [cfg.template],
        **scoring.columns_of([problem]),
        "open_thought": [False],
    }
    try:
        functions([""], columns, where="a trial call before training", given=built_in)
    except scoring.RewardFunctionError as error:
        raise ValueError(f"--reward-fn: {error}; fix the function, then start again") from None


def run(
    cfg: Config,
    world: distributed.World,
    run_dir: Path,
    model,
    tokenizer,
    optimizer,
    reference,
    state: dict,
    start: dict,
    save,
    pool: rollout.Pool,
    trackers,
) -> dict:
    """The loop of a started run: the evaluation before, the steps, the evaluation after, the summary."""
    writer = world.rank == 0
    eval_sets = start["eval_sets"]
    whole_sets = {name: load_problems(name) for name in eval_sets}  # not cut to --eval-problems: every problem
    train_set, validation = rundir.validation_split(start["train_set"], whole_sets, cfg.seed)
    if writer:
        rundir.write_json(
            run_dir / "validation.json",
            {"drawn_from": cfg.dataset, "seed": cfg.seed, "problems": [p["problem"] for p in validation]},
        )

    def keep_best(desc: str) -> dict | None:
        """The validation split's evaluation, and the best checkpoint kept on it (None without a split)."""
        if not validation:
            return None
        result = evaluation.held_out(model, tokenizer, {"validation": validation}, cfg, desc, world, pool)
        rundir.keep_best(run_dir, model, state, result, writer, tokenizer)
        return result

    with StopRequest() as stop, contextlib.closing(trackers):
        if state["before"] is None:
            with stop.immediate():
                state["before"] = evaluation.held_out(model, tokenizer, eval_sets, cfg, "eval before", world, pool)
            trackers.log_eval(state["before"], 0, "before")
        bar = tqdm(
            range(state["step"], cfg.steps),
            desc="train",
            unit="step",
            initial=state["step"],
            total=cfg.steps,
            disable=not (writer and sys.stderr.isatty()),
        )  # no bar's escapes in a redirected log
        for _ in bar:
            step = state["step"] + 1
            calls = max(1, cfg.dynamic_sampling)  # dynamic sampling may draw this many steps' prompts
            problems = batch_of(train_set, state["data_position"], cfg.prompts_per_step * calls, cfg.seed)
            lr = learning_rate(cfg.lr, cfg.lr_schedule, cfg.warmup_steps, cfg.steps, step)
            for group in optimizer.param_groups:  # a function of the step alone, so a resume needs no state
                group["lr"] = lr
            record, records = train_step(model, optimizer, tokenizer, problems, cfg, step, world, reference, pool)
            record["lr"] = lr
            drawn = cfg.prompts_per_step * record.get("dynamic/calls", 1)  # the prompts the sampler used
            state.update(step=step, data_position=state["data_position"] + drawn)
            if records and writer:
                path = run_dir / "tokens" / f"step-{step:06d}.npz"
                with rundir.writing(path):
                    calibrate.write_token_records(path, records, cfg.log_tokens, seed=cfg.seed * 1_000_003 + step)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                with stop.immediate():
                    record["eval"] = evaluation.held_out(
                        model, tokenizer, eval_sets, cfg, f"eval step {step}", world, pool
                    )
                    record["validation"] = keep_best(f"validation step {step}")
            if writer:
                rundir.append_metrics(run_dir / "metrics.jsonl", record)
                trackers.log_step(record)
                if bar.disable:  # a log file gets one plain line per step instead of the bar
                    print(
                        f"step {step}/{cfg.steps}: reward {record['reward']:.3f}, accuracy {record['accuracy']:.3f}, "
                        f"{record['step_seconds']:.1f} s{progress_note(record)}",
                        file=sys.stderr,
                    )
            bar.set_postfix(reward=f"{record['reward']:.2f}", acc=f"{record['accuracy']:.2f}")
            # every rank stops after the same step, whichever of them the signal reached first
            stopping = bool(world.max(torch.tensor(float(stop.requested), device="cpu")))
            if step % cfg.checkpoint_every == 0 or stopping:
                save(state)
            if stopping:
                bar.close()
                raise Stopped(run_dir, step)
        with stop.immediate():
            state["after"] = evaluation.held_out(model, tokenizer, eval_sets, cfg, "eval after", world, pool)
            keep_best("validation after")
        trackers.log_eval(state["after"], state["step"], "after")
    save(state)
    if writer:
        rundir.write_json(
            run_dir / "summary.json", {"step": state["step"], **{k: state[k] for k in ("before", "after", "best")}}
        )
    if cfg.export:
        with fsdp.whole(model) as whole_model:  # a sharded model is gathered on every rank, for rank 0 to write
            if writer:
                with rundir.writing(Path(cfg.export)):
                    weights.save_pretrained(whole_model, cfg.export, tokenizer=tokenizer)
                print(f"exported {'merged ' if cfg.lora_rank else ''}weights to {cfg.export}", file=sys.stderr)
    if writer:
        print(f"run directory: {run_dir}", file=sys.stderr)
    world.barrier("waiting for rank 0 to write the summary and the export")
    return state


MISMATCH_SHOWN = 1e-3  # k3 KL(sampler || trainer) per token above which the progress line shows it


def progress_note(record: dict) -> str:
    """What a step's plain progress line adds: the groups dynamic sampling kept of those it sampled, and the
    sampler-trainer mismatch once its k3 KL passes MISMATCH_SHOWN (fp32 sits near 1e-7, bf16 sampling higher)."""
    note = ""
    if "dynamic/calls" in record:
        note += f", groups kept {record['dynamic/groups_kept']}/{record['dynamic/groups_sampled']}"
    if record.get("mismatch/k3", 0.0) > MISMATCH_SHOWN:
        note += f", mismatch k3 {record['mismatch/k3']:.2e} (max |d log p| {record['mismatch/abs_max']:.2f})"
    return note


def batch_of(problems: list[dict], position: int, size: int, seed: int) -> list[dict]:
    """Problems position .. position+size of an endless stream: a fresh seeded shuffle each epoch.

    The order is a function of (seed, epoch) alone, so a resumed run needs only the position.
    """
    orders, batch = {}, []
    for index in range(position, position + size):
        epoch, offset = divmod(index, len(problems))
        if epoch not in orders:
            generator = torch.Generator().manual_seed(seed * 7919 + epoch)
            orders[epoch] = torch.randperm(len(problems), generator=generator, device="cpu")
        batch.append(problems[int(orders[epoch][offset])])
    return batch


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    """Settings, data and paths are checked before anything loads; a mistake there prints one line and
    exits with status 2, as does a file that cannot be written later (naming it). A Ctrl-C exits with
    130, also when the run stopped cleanly after its step, and says how to continue."""
    warnings.formatwarning = lambda message, category, *_, **__: f"warning: {message}\n"  # no source line
    first_rank = os.environ.get("RANK", "0") == "0"
    try:
        cfg, given, show_plan = config.parse_args(argv, description=__doc__)
        if cfg.resume:
            cfg = config.resumed_config(cfg, given)
            if not show_plan:
                config.check_finished(cfg)
        if show_plan:
            sys.exit(0 if sizes.plan(cfg) else 1)
        with distributed.joined(config.resolve_device(cfg)[0], cfg.dist_timeout, group=not cfg.lora_rank) as world:
            state = train(cfg, world)
    except USER_ERRORS as error:
        if inside_training(error):
            raise
        print(f"train.py: {_one_line(error)}", file=sys.stderr)
        sys.exit(2)
    except scoring.RewardFunctionError as error:  # the user's function, not the trainer: no traceback
        print(
            f"train.py: {error}; the last checkpoint is kept: fix the function, then continue with "
            f"python train.py --resume {error.run_dir} (which imports it again)",
            file=sys.stderr,
        )
        sys.exit(1)
    except Stopped as stop:
        if first_rank:
            print(str(stop), file=sys.stderr)
        exit_interrupted()
    except KeyboardInterrupt as interrupt:
        if first_rank:
            print(
                f"\n{interrupt}"
                if isinstance(interrupt, Interrupted)
                else "\ninterrupted before the run started: nothing was written",
                file=sys.stderr,
            )
        exit_interrupted()
    if "after" in state and world.rank == 0:  # an export-only resume trained and evaluated nothing
        before, after, best = state["before"], state["after"], state["best"]
        if best is not None:
            print(
                f"best validation accuracy {100 * best['accuracy']:.1f}% at step {best['step']} "
                f"({best['problems']} training problems held out of training, in validation.json; the adapter in best/)"
            )
        if _sample(before, after):  # a resume changed the held-out set: each figure says what it measured
            print(
                f"held-out accuracy: before {100 * before['accuracy']:.1f}%{_sample(before)} -> after "
                f"{100 * after['accuracy']:.1f}%{_sample(after)}: not comparable, the held-out set changed on resume"
            )
        else:
            print(
                f"held-out accuracy of the last policy: before {100 * before['accuracy']:.1f}% -> after "
                f"{100 * after['accuracy']:.1f}% (n={after['problems']}, k={after['k']}, "
                f"se {100 * (after['se'] or 0):.1f})"
            )


def _sample(result: dict, other: dict | None = None) -> str:
    """The sample an evaluation measured, as " (n=N, k=K)", where it differs from `other`'s (always without
    `other`); "" where it is the same."""
    if other is not None and (result["problems"], result["k"], result.get("sets", {}).keys()) == (
        other["problems"],
        other["k"],
        other.get("sets", {}).keys(),
    ):
        return ""
    return f" (n={result['problems']}, k={result['k']})"


def _one_line(error: BaseException) -> str:
    """An error as one line: an OSError from the system as "PATH: reason", not "[Errno 13] ...: 'PATH'"."""
    if isinstance(error, OSError) and not isinstance(error, rundir.WriteError) and error.filename and error.strerror:
        return f"{error.filename}: {error.strerror}"
    return str(error).replace("\n", " ")


if __name__ == "__main__":
    main()
