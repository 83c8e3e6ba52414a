"""GRPO training: model, LoRA, rollout, reward and loss wired into one loop.

    python train.py                                  # the offline demo: SmolLM2-135M learns arithmetic
    python train.py --preset atr-grpo-qwen3-1.7b     # a paper's run (needs the model and data/prepare.py)
    python train.py --preset atr-grpo-qwen3-1.7b --plan   # its memory, phase by phase, without loading it
    python train.py --resume runs/NAME               # continue a run from its last checkpoint
    torchrun --nproc-per-node 8 train.py --preset gppo-qwen3-8b   # data parallel over 8 GPUs (README)
    torchrun --nproc-per-node 8 train.py --preset gppo-qwen3-8b-full   # every weight, sharded over 8 GPUs

The file reads in the order a run executes: one step (prompts -> G completions each -> rewards ->
group-normalized advantages -> optimizer steps over mini-batches of the rollout), then the loop around
it (evaluation, logging, checkpoints), then building the model and the command line. The settings and
their flags live in config.py, the files of a run directory in rundir.py. With LoRA only the
adapters train and the frozen base doubles as the reference policy; with --lora-rank 0 every weight
trains, sharded by FSDP2 (fsdp.py), and the reference policy is a frozen copy kept only when the loss
asks for it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import signal
import sys
import time
import warnings
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import config
import distributed
import eval as evaluation
import fsdp
import loggers
import lora
import loss
import memory
import reward
import rollout
import rundir
import scoring
import weights
from config import Config
from data import load_problems, render_prompt, stop_ids, user_message


# ----------------------------------------------------------------------------- one step


def train_step(model, optimizer, tokenizer, problems: list[dict], cfg: Config, step: int,
               world: distributed.World | None = None, reference=None) -> tuple[dict, list]:
    """One GRPO step on `problems`; returns its metrics line and the per-token records (empty unless logged).

    With several processes (world), `problems` is the whole step's, the same on every rank, and each rank
    samples and trains on its slice of whole prompts; the metrics and records are the whole step's.
    reference is a full run's frozen reference policy (see build).
    """
    world = world or distributed.SOLO
    watch = Stopwatch()
    mine = world.prompts(len(problems))
    out = sample(model, tokenizer, problems[mine], cfg, step, first_prompt=mine.start)
    watch.lap("rollout")
    rewards, correct, by_function = score(out, problems[mine], cfg, step)
    watch.lap("reward")
    lengths = out.completion_mask.sum(1).float()
    columns = [rewards, correct, lengths, out.truncated.float(), *by_function.values()]
    rows = world.cat(torch.stack(columns, 1))  # [N of the step, 4 + reward functions]
    # from the whole step's rewards: one process's advantages, whatever they normalize over
    my_rows = slice(mine.start * cfg.group_size, mine.stop * cfg.group_size)
    advantages = loss.advantages(rows[:, 0], cfg.group_size, cfg.loss)[my_rows]  # [N of this rank]
    records = [] if cfg.log_tokens else None
    update = policy_update(model, optimizer, out, advantages, cfg, step, records, world, reference)
    watch.lap("update")
    seconds = torch.tensor([watch.laps["rollout"], watch.laps["update"]], dtype=torch.float64, device="cpu")
    tokens = torch.tensor([lengths.sum().item(), out.pad_mask.sum().item()], dtype=torch.float64, device="cpu")
    slowest, tokens = world.max(seconds), world.sum(tokens)
    records = [] if records is None else sum(world.gather(records), [])
    reward_mean, accuracy, completion_length, truncated, *function_means = rows.mean(0).tolist()
    return {"step": step, "reward": reward_mean, "accuracy": accuracy,
            **{f"rewards/{name}": mean for name, mean in zip(by_function, function_means)},
            "completion_length": completion_length,
            "truncated": truncated, **update, "step_seconds": watch.total, "reward_seconds": watch.laps["reward"],
            "rollout_tokens_per_s": float(tokens[0] / slowest[0]),
            # every row is trained on once per mini-batch pass, prompt included
            "train_tokens_per_s": float(tokens[1] / slowest[1])}, records


def sample(model, tokenizer, problems: list[dict], cfg: Config, step: int, first_prompt: int = 0) -> rollout.Rollout:
    """G completions for each problem, with the sampling policy's log-probs, in calls of rollout_batch prompts.
    first_prompt is the index of problems[0] in the step: a prompt's samples depend on it, not on the process.
    A sharded model samples with its whole weights, gathered for the rollout (fsdp.whole)."""
    prompts = [render_prompt(tokenizer, p["problem"], cfg.template, cfg.system_prompt) for p in problems]
    model.eval()  # no LoRA dropout while sampling: the old log-probs must be the sampling policy's
    with oom_hint("the rollout", f"lower --rollout-batch (now {cfg.rollout_batch} prompts per call)"), \
            fsdp.whole(model) as policy:
        return rollout.generate(policy, prompts, samples_per_prompt=cfg.group_size,
                                max_new_tokens=cfg.max_new_tokens,
                                temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
                                stop_ids=stop_ids(model.config, tokenizer), seed=cfg.seed * 1_000_003 + step,
                                tokenizer=tokenizer, max_rows=cfg.rollout_batch * cfg.group_size or None,
                                first_prompt=first_prompt, cuda_graphs=cfg.cuda_graphs)


def score(out: rollout.Rollout, problems: list[dict], cfg: Config, step: int = 0
          ) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """(rewards [N], correct [N], {name: values [N]} of each reward function when there are several), on the
    model's device. The reward is the weighted sum of the --reward-fn functions (scoring.py) plus the format
    bonus; correct is the answer checker's verdict, whatever the reward is made of."""
    rows = [p for p in problems for _ in range(cfg.group_size)]
    functions = scoring.functions(cfg.reward_fn, cfg.reward_weights, cfg.reward_timeout)
    columns = {"prompts": [user_message(p["problem"], cfg.template) for p in rows],
               "completion_ids": out.completions, **scoring.columns_of(rows)}
    totals, by_name = functions(out.texts, columns, where=f"step {step}", group_size=cfg.group_size)
    checked = functions.name_of(reward.math_reward)  # the checker already ran: its verdicts are the accuracy
    correct = by_name[checked] if checked else reward.reward(out.texts, [p["answer"] for p in rows])
    if cfg.format_weight:
        totals = [total + cfg.format_weight * reward.has_format(text, cfg.template)
                  for total, text in zip(totals, out.texts)]

    def tensor(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=out.old_logp.device)

    by_function = {name: tensor(values) for name, values in by_name.items()} if len(by_name) > 1 else {}
    return tensor(totals), (tensor(correct) >= 1).float(), by_function


def policy_update(model, optimizer, out: rollout.Rollout, advantages: torch.Tensor, cfg: Config, step: int,
                  records: list | None = None, world: distributed.World | None = None, reference=None) -> dict:
    """updates_per_rollout optimizer steps over shuffled mini-batches of the rollout's rows, each the sum of
    grad_accum micro-batches. Metrics: token-weighted means over micro-batches; *_min / *_max are extremes;
    start_ratio_min / _max are the first mini-batch's, before this step's first update (the numerical floor).

    With several processes, `out` holds this rank's rows of the step, which are rows world.rank * N ..
    of the step's. The shuffle is of the whole step's rows, the same on every rank, and each rank trains
    on its own rows of each mini-batch: the mini-batches are one process's, and with the normalizers
    summed over the ranks and the gradients too, so is every update. Every rank runs as many micro-batches
    as the largest share of a mini-batch needs: a sharded model's passes are collectives, and a rank with
    no rows left runs one row at weight 0 (its gradient is exactly 0) to meet the others.
    """
    world = world or distributed.SOLO
    inputs = frozen_inputs(model, out, cfg, reference)  # what the loss needs of the policy before it moves
    advantages = advantages.to(out.old_logp.device)
    N, first = len(advantages), world.rank * len(advantages)
    order = torch.randperm(N * world.size, generator=torch.Generator().manual_seed(cfg.seed + step), device="cpu")
    minibatches = order.chunk(cfg.updates_per_rollout)
    mine = [(m[(m >= first) & (m < first + N)] - first).to(advantages.device) for m in minibatches]
    # the normalizers of each optimizer step: its tokens and sequences on all ranks
    num_tokens = world.sum(torch.stack([out.completion_mask[rows].sum() for rows in mine]))
    model.train()
    per_update, grad_norms = [], []
    params = trainable(model)
    for update, (minibatch, step_rows, step_tokens) in enumerate(zip(mine, minibatches, num_tokens)):
        totals = {"num_tokens": step_tokens, "num_seqs": len(step_rows)}
        # micro-batches of the size one rank's average share needs: the largest share takes more of them
        micro_rows = math.ceil(len(step_rows) / world.size / cfg.grad_accum)
        largest_share = int(torch.bincount(step_rows // N, minlength=world.size).max())
        losses, metrics = [], []
        for rows in minibatch.tensor_split(math.ceil(largest_share / micro_rows)):
            idle = len(rows) == 0
            if idle and not fsdp.is_sharded(model):
                continue
            if idle:
                rows = torch.zeros(1, dtype=torch.long, device=advantages.device)
            with oom_hint(f"a training micro-batch of {len(rows)} rows", f"raise --grad-accum (now {cfg.grad_accum})"):
                value, micro_metrics = micro_batch_loss(model, out, advantages, inputs, rows, cfg, totals,
                                                        None if idle else records)
                value = value * 0 if idle else value
                value.backward()
            losses.append(value.detach())
            if not idle:
                metrics.append(micro_metrics)
                if records is not None:  # which update of the rollout a record is from: the first cannot clip
                    records[-1]["update"] = np.full(len(records[-1]["mu"]), update, dtype=np.int32)
        local_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=advantages.device)
        total_loss = distributed.sum_gradients(params, world, local_loss)
        grad_norms.append(optimizer_step(model, optimizer, total_loss, cfg, step))
        per_update.append(metrics)
    # every rank's micro-batches, update by update
    per_update = [sum(updates, []) for updates in zip(*world.gather(per_update))]
    summary, start = merge_metrics(sum(per_update, [])), merge_metrics(per_update[0])
    applied = [norm for norm in grad_norms if norm is not None]
    summary.update(start_ratio_min=start["ratio_min"], start_ratio_max=start["ratio_max"],
                   grad_norm=float(np.mean(applied)) if applied else None,
                   skipped_updates=len(grad_norms) - len(applied), **clip_rates(sum(per_update[1:], [])))
    return summary


def clip_rates(metrics: list[dict]) -> dict:
    """How often the clips act: of the tokens with non-zero advantage in these micro-batches (a step's updates
    after the rollout's first, where w = 1 and nothing clips), the fraction any clip stopped, overall and per
    old-probability bucket (clip_rate, mu[BUCKET]/clip_rate; None without such tokens), and how many tokens
    each is over (*_tokens). clip_low_frac and the other *_frac keep the older count over every token."""
    rates = {}
    for prefix in ["", *(f"mu[{label}]/" for label in loss.MU_LABELS)]:
        counts = np.array([m["tokens"] * m[f"{prefix}active_share"] for m in metrics], dtype=np.float64)
        clipped = float(np.array([m[f"{prefix}active_clip_frac"] for m in metrics]) @ counts) if metrics else 0.0
        rates[f"{prefix}clip_rate"] = clipped / float(counts.sum()) if counts.sum() else None  # a float, not numpy
        rates[f"{prefix}clip_rate_tokens"] = int(round(counts.sum()))
    return rates


def micro_batch_loss(model, out: rollout.Rollout, advantages: torch.Tensor, inputs: dict, rows: torch.Tensor,
                     cfg: Config, totals: dict, records: list | None) -> tuple[torch.Tensor, dict]:
    """The loss of some rows of the rollout (their share of the optimizer step's loss) and their metrics."""
    ids, pad, start, c = window(out, rows)
    h = model.hidden(ids, pad)  # [rows, W, hidden]
    logp, entropy = model.hidden_logprobs(h, ids, start=start, temperature=cfg.temperature, with_entropy=True)
    mask = out.completion_mask[rows, :c]  # [rows, c], like every per-token tensor below
    given = {name: value[rows, :c] for name, value in inputs.items()}
    live = {"hidden": completion_states(h, start), "lm_head_weight": model.lm_head.weight,
            "temperature": cfg.temperature}  # what a rule may ask of the policy being trained
    given |= {name: value for name, value in live.items() if name in loss.required_inputs(cfg.loss)}
    value, metrics = loss.policy_loss(logp, given.pop("old_logp"), advantages[rows], mask, cfg.loss,
                                      **totals, records=records, **given)
    metrics["entropy"] = float((entropy * mask).sum() / mask.sum().clamp(min=1))
    metrics["tokens"] = int(mask.sum())
    return value, metrics


def optimizer_step(model, optimizer, total_loss: torch.Tensor, cfg: Config, step: int) -> float | None:
    """Clip and apply the accumulated gradient; a non-finite loss or norm skips the update (returns None)."""
    grad_norm = fsdp.clip_grad_norm(trainable(model), cfg.grad_clip)
    finite = bool(torch.isfinite(total_loss) & torch.isfinite(grad_norm))  # one device sync
    if finite:
        optimizer.step()
    else:
        warnings.warn(f"step {step}: non-finite loss ({float(total_loss)}) or gradient norm ({float(grad_norm)}); "
                      "update skipped")
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm) if finite else None


def frozen_inputs(model, out: rollout.Rollout, cfg: Config, reference=None) -> dict[str, torch.Tensor]:
    """Per-token inputs of the loss taken before the policy moves, each [N, C, ...] completion-aligned.

    old_logp: the sampler's, or recomputed by the training pass (recompute_old_logp); ref_logp: the
    reference policy's (reference_policy), when the loss asks for it; old_hidden: the sampling policy's final
    states at the positions that predict each completion token, when the rule asks for them. The passes run
    without gradient, in eval mode (no LoRA dropout), in micro-batches of the training size.
    """
    needs = loss.required_inputs(cfg.loss)
    _, dtype = config.resolve_device(cfg)  # the compute dtype (a full run's weights are fp32 under bf16)
    recompute = cfg.recompute_old_logp == "on" or (cfg.recompute_old_logp == "auto" and dtype != torch.float32)
    passes = {"old_logp": recompute, "ref_logp": "ref_logp" in needs, "old_hidden": "old_hidden" in needs}
    N, C = out.completion_mask.shape
    results = {name: None for name, wanted in passes.items() if wanted}
    if not results:
        return {"old_logp": out.old_logp}
    model.eval()
    with torch.no_grad():
        for rows in torch.arange(N, device=out.completion_mask.device).chunk(cfg.updates_per_rollout * cfg.grad_accum):
            ids, pad, start, c = window(out, rows)
            h = model.hidden(ids, pad) if passes["old_logp"] or passes["old_hidden"] else None
            chunk = {}
            if passes["old_logp"]:
                chunk["old_logp"] = model.hidden_logprobs(h, ids, start=start, temperature=cfg.temperature)[0]
            if passes["old_hidden"]:
                chunk["old_hidden"] = completion_states(h, start)
            if passes["ref_logp"]:
                with reference_policy(model, reference) as ref:
                    h_ref = ref.hidden(ids, pad)
                    chunk["ref_logp"] = ref.hidden_logprobs(h_ref, ids, start=start, temperature=cfg.temperature)[0]
            for name, value in chunk.items():
                if results[name] is None:
                    results[name] = value.new_zeros(N, C, *value.shape[2:])
                results[name][rows, :c] = value
    if reference is not None:
        fsdp.reshard(reference)  # its root stays gathered after a pass without backward
    return {"old_logp": out.old_logp, **results}


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
    return h[:, start - 1:-1]


def merge_metrics(metrics: list[dict]) -> dict:
    """One step's metrics from its micro-batches': *_min and *_max are extremes, the rest token-weighted means.

    A mean over some of the tokens (a bucket's mu[BUCKET]/adv_sign, ...) is weighted by those tokens (tokens x
    the share loss.metric_share names), so the merged value is the whole step's whichever way its rows were
    split into micro-batches or ranks.
    """
    tokens = np.array([m["tokens"] for m in metrics], dtype=np.float64)
    merged = {}
    for key in metrics[0]:
        values = np.array([m[key] for m in metrics], dtype=np.float64)
        if key.endswith("_min") or key.endswith("_max"):
            merged[key] = float(values.min() if key.endswith("_min") else values.max())
            continue
        share = loss.metric_share(key)
        weights = tokens * [m[share] for m in metrics] if share else tokens
        merged[key] = float(values @ weights / weights.sum()) if weights.sum() else 0.0
    del merged["tokens"]
    return merged


@contextmanager
def oom_hint(what: str, advice: str):
    """Out of memory inside the block becomes an error that names the phase and the flag that lowers it."""
    try:
        yield
    except torch.OutOfMemoryError as error:
        raise torch.OutOfMemoryError(f"out of memory in {what}: {advice}") from error


class Stopwatch:
    """Seconds per named stage of a step, as laps of one clock."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps: dict[str, float] = {}

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.laps[name], self.last = now - self.last, now

    @property
    def total(self) -> float:
        return self.last - self.start


# ----------------------------------------------------------------------------- the run


def train(cfg: Config, world: distributed.World | None = None) -> dict:
    """Run (or resume) training; returns the final state with the before/after evaluations.

    With several processes every rank runs this loop in step; rank 0 alone writes files (metrics,
    checkpoints, exports), and the other ranks wait for it at a barrier before they go on.
    """
    world = world or distributed.SOLO
    writer = world.rank == 0
    config.validate(cfg)
    scoring.functions(cfg.reward_fn, cfg.reward_weights, cfg.reward_timeout)  # imports them: a typo fails now
    train_set, eval_sets = load_problems(cfg.dataset), load_eval_sets(cfg)
    run_dir = rundir.prepare_run_dir(cfg)
    # also the point no rank passes before every rank has checked its run directory
    distributed.check_same_settings(world, config.flat_config(cfg))
    model, tokenizer, optimizer, reference = build(cfg)
    if cfg.resume and cfg.steps == 0 and cfg.export:  # export only: no training, no evaluation
        return export_run(cfg, run_dir, model, tokenizer, optimizer, world)
    cfg = resolve_sizes(cfg, model, tokenizer, train_set, world)
    if writer:
        warn_if_inert(cfg)
        if cfg.world_size and cfg.world_size != world.size:
            warnings.warn(f"--world-size {cfg.world_size}: the run is meant for {cfg.world_size} processes and runs on "
                          f"{world.size}; every size the memory plan chooses is for {world.size}")
        run_dir.mkdir(parents=True, exist_ok=True)  # only now: a failed start leaves no empty run directory
    metrics_file = run_dir / "metrics.jsonl"

    def save(state: dict) -> None:
        rundir.save_checkpoint(run_dir, model, optimizer, state, world)

    state = open_run(cfg, run_dir, model, optimizer, world, save)
    with StopRequest() as stop, contextlib.closing(open_trackers(cfg, run_dir, state, list(eval_sets), writer)) \
            as trackers:
        if state["before"] is None:
            with stop.immediate():
                state["before"] = evaluate_held_out(model, tokenizer, eval_sets, cfg, "eval before", world)
            trackers.log_eval(state["before"], 0, "before")
        bar = tqdm(range(state["step"], cfg.steps), desc="train", unit="step", initial=state["step"], total=cfg.steps,
                   disable=not (writer and sys.stderr.isatty()))  # no bar's escapes in a redirected log
        for _ in bar:
            step = state["step"] + 1
            problems = batch_of(train_set, state["data_position"], cfg.prompts_per_step, cfg.seed)
            record, records = train_step(model, optimizer, tokenizer, problems, cfg, step, world, reference)
            state.update(step=step, data_position=state["data_position"] + cfg.prompts_per_step)
            if records and writer:
                loss.write_token_records(run_dir / "tokens" / f"step-{step:06d}.npz", records, cfg.log_tokens,
                                         seed=cfg.seed * 1_000_003 + step)
            if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
                with stop.immediate():
                    record["eval"] = evaluate_held_out(model, tokenizer, eval_sets, cfg, f"eval step {step}", world)
                rundir.keep_best(run_dir, model, state, record["eval"], writer, tokenizer)
            if writer:
                with metrics_file.open("a") as f:
                    f.write(rundir.to_json(record) + "\n")
                trackers.log_step(record)
                if bar.disable:  # a log file gets one plain line per step instead of the bar
                    print(f"step {step}/{cfg.steps}: reward {record['reward']:.3f}, accuracy {record['accuracy']:.3f}, "
                          f"{record['step_seconds']:.1f} s", file=sys.stderr)
            bar.set_postfix(reward=f"{record['reward']:.2f}", acc=f"{record['accuracy']:.2f}")
            # every rank stops after the same step, whichever of them the signal reached first
            stopping = bool(world.max(torch.tensor(float(stop.requested), device="cpu")))
            if step % cfg.checkpoint_every == 0 or stopping:
                save(state)
            if stopping:
                if writer:
                    print(f"stopped at step {step}; continue with: python train.py --resume {run_dir}",
                          file=sys.stderr)
                return state
        with stop.immediate():
            state["after"] = evaluate_held_out(model, tokenizer, eval_sets, cfg, "eval after", world)
        trackers.log_eval(state["after"], state["step"], "after")
    rundir.keep_best(run_dir, model, state, state["after"], writer, tokenizer)
    save(state)
    if writer:
        rundir.write_json(run_dir / "summary.json", {k: state[k] for k in ("before", "after", "best")})
    if cfg.export:
        with fsdp.whole(model) as whole_model:  # a sharded model is gathered on every rank, for rank 0 to write
            if writer:
                weights.save_pretrained(whole_model, cfg.export, tokenizer=tokenizer)
                print(f"exported {'merged ' if cfg.lora_rank else ''}weights to {cfg.export}", file=sys.stderr)
    if writer:
        print(f"run directory: {run_dir}", file=sys.stderr)
    world.barrier("waiting for rank 0 to write the summary and the export")
    return state


def open_run(cfg: Config, run_dir: Path, model, optimizer, world: distributed.World, save) -> dict:
    """The state a run starts from: a resumed run's checkpoint (the same on every rank, whatever the
    world size), or step 0 of a new run, checkpointed at once so a run stopped before its first step
    can resume."""
    writer = world.rank == 0
    if cfg.resume:
        state = rundir.load_checkpoint(run_dir, model, optimizer)
        world.barrier("loading the checkpoint")  # before rank 0 may write the next one
        if writer:
            rundir.truncate_metrics(run_dir / "metrics.jsonl", state["step"])
            rundir.write_text(run_dir / "config.toml", config.to_toml(cfg))  # the settings it now runs with
            print(f"resumed {run_dir} at step {state['step']}", file=sys.stderr)
        return state
    state = {"step": 0, "data_position": 0, "before": None, "best": None}
    if writer:
        rundir.write_json(run_dir / "config.json", config.flat_config(cfg))
        rundir.write_text(run_dir / "config.toml", config.to_toml(cfg))
        (run_dir / "metrics.jsonl").unlink(missing_ok=True)
        print(f"run directory: {run_dir}", file=sys.stderr)
    save(state)
    return state


def open_trackers(cfg: Config, run_dir: Path, state: dict, eval_sets: list[str], writer: bool) -> loggers.Loggers:
    """The --log trackers of the writing process (none on the others), with the evaluations logged so far."""
    earlier = [(state["before"], 0, "before")] if state["before"] else []
    if cfg.resume and cfg.log and writer:  # the results table goes on from the run's earlier evaluations
        for line in (run_dir / "metrics.jsonl").read_text().splitlines():
            record = json.loads(line)
            if record.get("eval"):
                earlier.append((record["eval"], record["step"], f"step {record['step']}"))
        if state.get("after"):  # a finished run trained further: its final evaluation so far
            earlier.append((state["after"], state["step"], "after"))
    return loggers.Loggers(cfg.log if writer else "", run_dir, config.flat_config(cfg), config.to_toml(cfg),
                           cfg.log_project, state["step"], bool(cfg.resume), eval_sets, earlier)


def export_run(cfg: Config, run_dir: Path, model, tokenizer, optimizer, world: distributed.World) -> dict:
    """--resume RUN --steps 0 --export DIR: the policy of the run's last checkpoint, merged and exported;
    nothing trains, nothing is evaluated, and the run directory is left as it was."""
    state = rundir.load_checkpoint(run_dir, model, optimizer)
    with fsdp.whole(model) as whole_model:  # a sharded model is gathered on every rank, for rank 0 to write
        if world.rank == 0:
            weights.save_pretrained(whole_model, cfg.export, tokenizer=tokenizer)
            print(f"exported the {'merged ' if cfg.lora_rank else ''}weights of {run_dir} at step {state['step']} "
                  f"to {cfg.export}", file=sys.stderr)
    world.barrier("waiting for rank 0 to write the export")
    return state


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


def load_eval_sets(cfg: Config) -> dict[str, list[dict]]:
    """The held-out sets by name, each cut to eval_problems when that is set."""
    names = [name.strip() for name in cfg.eval_dataset.split(",") if name.strip()]
    if not names:
        raise ValueError("--eval-dataset: no dataset given")
    sets = {name: load_problems(name) for name in names}
    return {name: problems[:cfg.eval_problems] if cfg.eval_problems else problems for name, problems in sets.items()}


def evaluate_held_out(model, tokenizer, eval_sets: dict[str, list[dict]], cfg: Config, desc: str,
                      world: distributed.World | None = None) -> dict:
    """Mean@k and Pass@k on each held-out set; with several sets, accuracy is their unweighted mean.

    With several processes each rank evaluates a slice of each set (with the samples one process draws
    for those problems) and the per-problem results are gathered.
    """
    world = world or distributed.SOLO
    if world.rank == 0 and not sys.stderr.isatty():  # a log file has no progress bar: say what runs
        sizes = ", ".join(f"{len(problems)} of {name}" for name, problems in eval_sets.items())
        print(f"{desc}: {sizes} x {cfg.eval_k} samples", file=sys.stderr)
    result = _held_out(model, tokenizer, eval_sets, cfg, desc, world)
    if world.rank == 0:
        se = f"{100 * result['se']:.1f}" if result["se"] is not None and math.isfinite(result["se"]) else "undefined"
        tqdm.write(f"{desc}: Mean@{cfg.eval_k} {100 * result['accuracy']:.1f}% (se {se}), Pass@{cfg.eval_k} "
                   f"{100 * result['pass@k']:.1f}%, {result['problems']} problems", file=sys.stderr)
    return result


def _held_out(model, tokenizer, eval_sets: dict[str, list[dict]], cfg: Config, desc: str,
              world: distributed.World) -> dict:
    results = {}
    with fsdp.whole(model) as policy:  # a sharded model's weights, gathered once for every set
        for name, problems in eval_sets.items():
            lo, hi = (len(problems) * r // world.size for r in (world.rank, world.rank + 1))
            mine = []
            if hi > lo:
                with oom_hint(f"evaluation on {name}", f"lower --eval-batch (now {cfg.eval_batch} prompts per call)"):
                    mine = evaluation.evaluate(policy, tokenizer, problems[lo:hi], k=cfg.eval_k,
                                               temperature=cfg.eval_temperature, top_p=cfg.top_p,
                                               max_new_tokens=cfg.max_new_tokens, template=cfg.template,
                                               system=cfg.system_prompt, batch_size=cfg.eval_batch, seed=cfg.seed,
                                               first_problem=lo, desc=f"{desc} {name}" if len(eval_sets) > 1 else desc,
                                               progress=world.rank == 0).problems
            summary = evaluation.summarize(sum(world.gather(mine), []), cfg.eval_k, seed=cfg.seed)
            mean = summary["mean@k"]
            results[name] = {"accuracy": mean.mean, "se": mean.se, "pass@k": summary["pass@k"].mean,
                             "problems": len(problems), "k": cfg.eval_k}
    if len(results) == 1:
        return next(iter(results.values()))
    parts = list(results.values())
    return {"accuracy": float(np.mean([p["accuracy"] for p in parts])),
            "se": math.sqrt(sum(p["se"] ** 2 for p in parts)) / len(parts),
            "pass@k": float(np.mean([p["pass@k"] for p in parts])),
            "problems": sum(p["problems"] for p in parts), "k": cfg.eval_k, "sets": results}


CLIP_SETTINGS = ("rule", "delta", "delta_high", "dual_clip", "ratio_limits", "tv_half", "kl_two_sided", "sapo_tau_pos",
                 "sapo_tau_neg", "cov_ratio", "clip_cov_bounds", "kl_cov_coef")


def warn_if_inert(cfg: Config) -> None:
    """A clip rule chosen for a run where no rule can act is said at the start; the default run says nothing."""
    default = loss.LossConfig()
    chosen = any(getattr(cfg.loss, name) != getattr(default, name) for name in CLIP_SETTINGS)
    if cfg.updates_per_rollout == 1 and chosen:
        warnings.warn("--updates-per-rollout 1: every update starts from the weights that sampled its rollout, so "
                      "the ratio w is 1 up to rounding and every clip rule gives the same update; use several "
                      "updates per rollout to compare rules", stacklevel=2)


class StopRequest:
    """While active, the first Ctrl-C (or SIGTERM) asks the loop to stop after the current step and
    checkpoint; a second one interrupts at once, and the last checkpoint stays as it was. Inside
    `immediate()` (evaluations, which hold nothing to save) the first one interrupts at once."""

    def __enter__(self):
        self.requested, self.interrupt_now = False, False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def immediate(self):
        return _Flag(self, "interrupt_now")

    def _handle(self, signum, frame):
        if self.requested or self.interrupt_now:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (press Ctrl-C again to abort without saving)", file=sys.stderr)


class _Flag:
    """Sets an attribute to True for the duration of a with block."""

    def __init__(self, owner, name: str):
        self.owner, self.name = owner, name

    def __enter__(self):
        setattr(self.owner, self.name, True)

    def __exit__(self, *exc):
        setattr(self.owner, self.name, False)


# ----------------------------------------------------------------------------- several processes


def resolve_sizes(cfg: Config, model, tokenizer, train_set: list[dict], world: distributed.World) -> Config:
    """resolve_automatic for one rank's share of a step (its prompts), the same on every rank: where the
    sizes come from the memory plan, the most cautious rank's (GPUs may differ in memory)."""
    share = dataclasses.replace(cfg, prompts_per_step=cfg.prompts_per_step // world.size, world_size=world.size)
    share = resolve_automatic(share, model, tokenizer, train_set)
    rollout_batch, eval_batch, negated_accum = world.min(  # the smallest calls, the most micro-batches
        torch.tensor([share.rollout_batch, share.eval_batch, -share.grad_accum], device="cpu")).tolist()
    return dataclasses.replace(share, prompts_per_step=cfg.prompts_per_step, world_size=cfg.world_size,
                               rollout_batch=rollout_batch,
                               eval_batch=eval_batch, grad_accum=-negated_accum)


# ----------------------------------------------------------------------------- building the model


def build(cfg: Config):
    """Model, tokenizer, optimizer and reference policy.

    With LoRA: fresh adapters on the frozen base, which is also the reference policy (None is returned).
    With --lora-rank 0 every weight trains: fp32 master weights (under bf16 compute) sharded by FSDP2 over
    the process group (fsdp.py; one process is a group of one), and the reference is a frozen sharded
    copy in the compute dtype when the loss needs ref_logp, else None.
    """
    device, dtype = config.resolve_device(cfg)
    tokenizer = weights.load_tokenizer(cfg.model)
    reference = None
    if cfg.lora_rank:
        model = weights.from_pretrained(cfg.model, dtype=dtype, device=device)
        model.requires_grad_(False)
        torch.manual_seed(cfg.seed)  # adapter initialization
        lora.inject(model, cfg.lora_rank, cfg.lora_alpha, targets=tuple(cfg.lora_targets.split(",")),
                    dropout=cfg.lora_dropout)
    else:
        model = fsdp.shard(weights.from_pretrained(cfg.model, dtype=fsdp.master_dtype(dtype), device=device), dtype)
        if "ref_logp" in loss.required_inputs(cfg.loss):
            frozen = weights.from_pretrained(cfg.model, dtype=dtype, device=device).requires_grad_(False)
            reference = fsdp.shard(frozen, dtype)
    model.gradient_checkpointing = cfg.gradient_checkpointing == "on" or (
        cfg.gradient_checkpointing == "auto" and device.type == "cuda")
    optimizer = torch.optim.AdamW(trainable(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, tokenizer, optimizer, reference


def trainable(model) -> list[torch.nn.Parameter]:
    """The parameters the optimizer steps: the adapters with LoRA, every weight without."""
    return list(lora.parameters(model)) if lora.lora_modules(model) else list(model.parameters())


def resolve_automatic(cfg: Config, model, tokenizer, train_set: list[dict]) -> Config:
    """Fill the sizes left at 0: from the memory plan on a GPU; on the CPU one call and one micro-batch."""
    if model.device.type != "cuda":
        return dataclasses.replace(cfg, rollout_batch=cfg.rollout_batch or cfg.prompts_per_step,
                                   grad_accum=cfg.grad_accum or 1, eval_batch=cfg.eval_batch or 16)
    longest = max(len(render_prompt(tokenizer, p["problem"], cfg.template, cfg.system_prompt)) for p in train_set)
    budget = memory.gpu_memory_bytes(str(model.device), cfg.gpu_memory)
    return planned_config(cfg, model.config, budget, prompt_len=longest)


def planned_config(cfg: Config, model_cfg, budget: int, prompt_len: int = memory.Workload.prompt_len,
                   planner: memory.Planner | None = None) -> Config:
    """cfg with rollout_batch, grad_accum and eval_batch chosen by the memory plan where they are 0."""
    work = memory.fit(model_cfg, workload(cfg, prompt_len), budget, planner)
    return dataclasses.replace(cfg, rollout_batch=cfg.rollout_batch or work.rollout_prompts,
                               grad_accum=cfg.grad_accum or math.ceil(work.minibatch_rows / work.micro_batch_rows),
                               eval_batch=cfg.eval_batch or work.eval_prompts)


def workload(cfg: Config, prompt_len: int = memory.Workload.prompt_len) -> memory.Workload:
    """What one step of this config asks of one GPU, its prompts_per_step being that rank's share; sizes left
    at 0 start at their largest, for fit to lower."""
    _, dtype = config.resolve_device(cfg)
    minibatch_rows = math.ceil(cfg.prompts_per_step * cfg.group_size / cfg.updates_per_rollout)
    return memory.Workload(
        dtype=dtype, lora_rank=cfg.lora_rank, world_size=cfg.world_size or distributed.world_size(),
        lora_targets=tuple(cfg.lora_targets.split(",")),
        gradient_checkpointing=cfg.gradient_checkpointing != "off", prompt_len=prompt_len,
        max_new_tokens=cfg.max_new_tokens, group_size=cfg.group_size, prompts_per_step=cfg.prompts_per_step,
        updates_per_rollout=cfg.updates_per_rollout, rollout_prompts=cfg.rollout_batch or cfg.prompts_per_step,
        micro_batch_rows=math.ceil(minibatch_rows / cfg.grad_accum) if cfg.grad_accum else minibatch_rows,
        temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k,
        recompute_old_logp=cfg.recompute_old_logp == "on" or (cfg.recompute_old_logp == "auto"
                                                             and dtype != torch.float32),
        ref_logp="ref_logp" in loss.required_inputs(cfg.loss), eval_prompts=cfg.eval_batch or 16,
        eval_k=cfg.eval_k, eval_temperature=cfg.eval_temperature)


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
            print(f"chosen: --rollout-batch {chosen.rollout_batch} --grad-accum {chosen.grad_accum} "
                  f"--eval-batch {chosen.eval_batch}")
        text, fits = memory.report(model_cfg, workload(chosen), budget, planner)
    print(text)  # its last line: plan: peak X GB of Y GB (fits), or (does not fit: ...)
    return fits


# ----------------------------------------------------------------------------- command line


USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, PermissionError)


def main(argv: list[str] | None = None) -> None:
    """Settings, data and paths are checked before anything loads; a mistake there prints one line and
    exits with status 2. A Ctrl-C exits with 130 and says how to continue."""
    warnings.formatwarning = lambda message, category, *_, **__: f"warning: {message}\n"  # no source line
    try:
        cfg, given, show_plan = config.parse_args(argv, description=__doc__)
        if show_plan:
            sys.exit(0 if plan(cfg) else 1)
        if cfg.resume:
            cfg = config.resumed_config(cfg, given)
        with distributed.joined(config.resolve_device(cfg)[0], cfg.dist_timeout, group=not cfg.lora_rank) as world:
            state = train(cfg, world)
    except USER_ERRORS as error:
        if _inside_training(error):
            raise
        print(f"train.py: {error}", file=sys.stderr)
        sys.exit(2)
    except scoring.RewardFunctionError as error:  # the user's function, not the trainer: no traceback
        print(f"train.py: {error}; the last checkpoint is kept (python train.py --resume RUN continues it)",
              file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        print("\ninterrupted; the last checkpoint is kept (python train.py --resume RUN continues it)", file=sys.stderr)
        sys.exit(130)
    if "after" in state and world.rank == 0:
        before, after, best = state["before"], state["after"], state["best"]
        print(f"best held-out accuracy {100 * best['accuracy']:.1f}% at step {best['step']}")
        print(f"held-out accuracy: before {100 * before['accuracy']:.1f}% -> after {100 * after['accuracy']:.1f}% "
              f"(n={after['problems']}, k={after['k']}, se {100 * (after['se'] or 0):.1f})")


def _inside_training(error: BaseException) -> bool:
    """Whether an error was raised inside a training step rather than by the checks before it: those are
    bugs or hardware trouble, and keep their traceback."""
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name in ("train_step", "evaluate_held_out"):
            return True
        tb = tb.tb_next
    return False


if __name__ == "__main__":
    main()
