"""Counterfactual updates: every clip rule applied to the same rollout from the same state, one table.

    python -m research.counterfactual                       # the study's main table (make study runs it)
    python -m research.counterfactual --points 0,2 --rollouts 3 --out runs/cf-smoke
    python -m research.counterfactual --setting gentle --out runs/counterfactual-gentle

Trained end to end, two rules differ in their rollouts, their data order's luck and their seeds' noise,
and a few seeds cannot separate that from the rule. Here the rule is the only difference. A grpo pilot
run (train.py's train_step, the study's settings) keeps its state, LoRA adapters and AdamW moments, at a
few steps, the points. From each point, each rollout (--rollout-prompts prompts of the training set, by
default a pilot step's, --group-size completions each) is sampled once; then, for every arm, the state is
restored and train.policy_update applies the arm's update to that rollout: the same mini-batches in the
same order, the same optimizer state, only the loss differs. Every rollout has prompts and random streams
of its own (run_point), so rollouts are the independent units of the paired tests; the lines record their
prompts, and rollouts that share one are clustered (prompt_clusters). What each update did is measured
on the rollout and with one fresh sample:

    kl              KL(new || old) over the whole vocabulary at each completion position, mean per token
    entropy         change of the policy's entropy (nats) at those positions, exact over the vocabulary
    correct, wrong  change of log pi(completion) of the correct and of the wrong completions, mean over them
    rare, rare+     probability moved to the sampled tokens with mu < 0.1, summed per completion token: all
                    of them, and those with positive advantage (mu = pi_old(token))
    clip, clip_all  share of the acting tokens (advantage not 0, updates after the rollout's first, where
                    w = 1 and nothing clips) that a clip stopped; and the same share over every token
    reward          mean reward of fresh samples (--fresh-samples per prompt, the same random streams for
                    every arm) minus that of the policy before the update on the same streams

Every difference to grpo is paired by rollout: its standard error shrinks with the number of independent
rollouts. A gap is called a difference when Holm's test over the table's family rejects; the table states
the gap each test detects with 80% power, and marks the clip-rate gaps that follow from the regions (an
arm's region holding grpo's at every old probability) as by construction, outside the family. Arms ending
in -eq run at the delta that gives their rule grpo's clip rate on the pilot's token records
(calibrate.calibrate_to).

OUT/pilot holds the pilot (metrics.jsonl, tokens/, points/step-N); OUT/rollouts/point-P.jsonl a line
per rollout drawn with every arm's effects (the points run in --workers processes at once);
OUT/calibration.json, OUT/table.md, OUT/results.json and OUT/figures/ (plot.py). Run again with the
same flags, it skips the rollouts done and the pilot's points saved.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import config
import lora
import loss
import train
from data import load_problems
from engine import sizes
from infra import rundir
from infra.rundir import strict_json
from research import calibrate, study

ROOT = Path(__file__).resolve().parent.parent

# measure -> (table heading, scale, digits); the scale turns it into the table's unit
MEASURES = {
    "kl": ("KL(new‖old) 1e-3 nats/token", 1e3, 2),
    "entropy": ("entropy change 1e-3 nats", 1e3, 1),
    "correct": ("Δ log π correct", 1, 3),
    "wrong": ("Δ log π wrong", 1, 3),
    "rare": ("mass to μ<0.1 1e-3", 1e3, 2),
    "rare+": ("of it A>0 1e-3", 1e3, 2),
    "clip": ("clipped % (acting, after 1st)", 100, 1),
    "clip_all": ("clipped % (all tokens)", 100, 1),
    "reward": ("fresh reward gain %", 100, 1),
}
RARE = 0.1  # "rare" tokens: old probability below this
DEFAULT_ARMS = "grpo,atr,kl-atomic,gppo"  # limits and the -eq arms: --arms grpo,...,limits,atr-eq,kl-atomic-eq


# ----------------------------------------------------------------------------- the state an update starts from


@dataclasses.dataclass
class State:
    """The trainable state, LoRA weights and optimizer moments, copied so every arm starts from it exactly."""

    weights: dict[str, torch.Tensor]
    optimizer: dict

    @classmethod
    def of(cls, model, optimizer) -> State:
        return cls(
            {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad},
            copy.deepcopy(optimizer.state_dict()),
        )

    def restore(self, model, optimizer) -> None:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.requires_grad:
                    p.copy_(self.weights[name])
        # a deep copy: load_state_dict keeps the tensors it is given, and the update would change ours in place
        optimizer.load_state_dict(copy.deepcopy(self.optimizer))
        optimizer.zero_grad(set_to_none=True)


def save_point(path: Path, model, optimizer) -> None:
    """The state at a point of the pilot, written under a temporary name and renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lora.save(model, tmp / "adapter")
    torch.save(optimizer.state_dict(), tmp / "optimizer.pt")
    shutil.rmtree(path, ignore_errors=True)
    os.replace(tmp, path)


def load_point(path: Path, model, optimizer) -> None:
    lora.load(model, path / "adapter")
    optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=False))


# ----------------------------------------------------------------------------- the pilot


def run_pilot(cfg: config.Config, out: Path, points: list[int]) -> None:
    """Train grpo (cfg) to the last point with train.py's step, saving the state at every point and each
    step's metrics and per-token records as a train.py run would; resumes from the newest point saved."""
    pilot = out / "pilot"
    saved = [p for p in points if (pilot / "points" / f"step-{p}" / "optimizer.pt").is_file()]
    if len(saved) == len(points):
        return
    train_set = load_problems(cfg.dataset)
    model, tokenizer, optimizer, _ = train.build(cfg)  # LoRA: the reference is the frozen base
    cfg = sizes.resolve_automatic(cfg, model, tokenizer, train_set)
    start = max(saved, default=0)
    if saved:
        load_point(pilot / "points" / f"step-{start}", model, optimizer)
    pilot.mkdir(parents=True, exist_ok=True)
    rundir.write_json(pilot / "config.json", config.flat_config(cfg))
    rundir.truncate_metrics(pilot / "metrics.jsonl", start)
    if start in points and start not in saved:
        save_point(pilot / "points" / f"step-{start}", model, optimizer)
    for step in range(start + 1, max(points) + 1):
        started = time.time()
        problems = train.batch_of(train_set, (step - 1) * cfg.prompts_per_step, cfg.prompts_per_step, cfg.seed)
        record, records = train.train_step(model, optimizer, tokenizer, problems, cfg, step)
        if records:
            calibrate.write_token_records(
                pilot / "tokens" / f"step-{step:06d}.npz", records, cfg.log_tokens, seed=cfg.seed * 1_000_003 + step
            )
        with (pilot / "metrics.jsonl").open("a") as f:
            f.write(rundir.to_json(record) + "\n")
        if step in points:
            save_point(pilot / "points" / f"step-{step}", model, optimizer)
        print(
            f"pilot step {step}/{max(points)}: reward {record['reward']:.2f}, clip rate "
            f"{_percent(record['clip_rate'])} ({time.time() - started:.0f} s)",
            flush=True,
        )


def _percent(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{100 * x:.1f}%"


# ----------------------------------------------------------------------------- one rollout, every arm


@dataclasses.dataclass
class View:
    """The policy at a rollout's completion positions, each [N, C]: log-probs of the sampled tokens, entropy,
    and the final hidden states [N, C, H] (what the exact KL over the vocabulary needs)."""

    logp: torch.Tensor
    entropy: torch.Tensor
    hidden: torch.Tensor


@torch.no_grad()
def view(model, out, cfg: config.Config) -> View:
    """One forward pass over the rollout, in eval mode, in chunks of the training micro-batch's rows."""
    model.eval()
    (N, C), device = out.completion_mask.shape, out.completion_mask.device
    logp, entropy = torch.zeros(N, C, device=device), torch.zeros(N, C, device=device)
    hidden = torch.zeros(N, C, model.config.hidden_size, device=device)
    for rows in torch.arange(N, device=device).chunk(cfg.updates_per_rollout * cfg.grad_accum):
        ids, pad, start, c = train.window(out, rows)
        h = model.hidden(ids, pad)
        logp[rows, :c], entropy[rows, :c] = model.hidden_logprobs(
            h, ids, start=start, temperature=cfg.temperature, with_entropy=True
        )
        hidden[rows, :c] = train.completion_states(h, start).float()
    return View(logp, entropy, hidden)


def fresh_reward(model, tokenizer, problems: list[dict], cfg: config.Config, samples: int, stream: int) -> float:
    """Mean reward of `samples` fresh completions per prompt; `stream` names the random streams (rollout.py:
    the same stream and weights give the same samples, so arms differ only where their policies do)."""
    fresh_cfg = dataclasses.replace(cfg, group_size=samples)
    rewards, *_ = train.score(train.sample(model, tokenizer, problems, fresh_cfg, stream), problems, fresh_cfg)
    return float(rewards.mean())


def effects(
    out,
    advantages: torch.Tensor,
    correct: torch.Tensor,
    before: View,
    after: View,
    records: list[dict],
    lm_head_weight: torch.Tensor,
    temperature: float,
) -> dict:
    """What one update did to the policy, measured on the rollout it was computed from (see the file's top)."""
    mask = out.completion_mask
    tokens = mask.sum()
    kl = loss.full_vocab_kl(after.hidden, before.hidden, lm_head_weight, temperature=temperature)  # KL(new || old)
    change = torch.where(mask, after.logp - before.logp, 0).sum(1)  # [N] change of log pi(completion)
    mu = out.old_logp.exp()
    moved = torch.where(mask & (mu < RARE), after.logp.exp() - mu, 0)  # [N, C]
    positive = advantages[:, None] > 0
    rates = clip_rates(records)
    return {
        "kl": float(kl[mask].mean()),
        "entropy": float((after.entropy - before.entropy)[mask].mean()),
        "correct": _mean_or_nan(change[correct > 0]),
        "wrong": _mean_or_nan(change[correct == 0]),
        "rare": float(moved.sum() / tokens),
        "rare+": float((moved * positive).sum() / tokens),
        **rates,
    }


def _mean_or_nan(x: torch.Tensor) -> float:
    return float(x.mean()) if x.numel() else math.nan


def clip_rates(records: list[dict]) -> dict:
    """From one update's per-token records (every token of every update): the clipped share of the acting
    tokens (calibrate.acting_tokens), overall and per old-probability bucket, and of every token."""
    columns = {name: np.concatenate([r[name] for r in records]) for name in records[0]}
    stopped = columns["region_low"] | columns["region_high"] | columns["limit"]
    acting = calibrate.acting_tokens(columns)
    bucket = np.digitize(columns["mu"], loss.MU_EDGES, right=True)  # the buckets of torch.bucketize in loss.py
    by_bucket = {
        f"clip[{label}]": float(stopped[acting & (bucket == i)].mean()) if (acting & (bucket == i)).any() else math.nan
        for i, label in enumerate(loss.MU_LABELS)
    }
    return {
        "clip": float(stopped[acting].mean()) if acting.any() else math.nan,
        "clip_all": float(stopped.mean()),
        **by_bucket,
    }


def counterfactual_rollout(
    model,
    optimizer,
    tokenizer,
    state: State,
    arms: dict[str, config.Config],
    problems: list[dict],
    stream: int,
    fresh_samples: int,
) -> dict:
    """Sample one rollout from `state`, apply every arm's update to it from that same state, and measure each.

    stream names the rollout's random streams and mini-batch order (the `step` of train.sample and
    policy_update); stream + 1 those of the fresh samples. Returns the rollout's line of OUT/rollouts/.
    A rollout whose groups all have equal rewards has no acting token: every rule's loss and gradient are
    zero, every arm makes the same update, and the line says "skipped" instead of measuring it.
    """
    base = next(iter(arms.values()))
    state.restore(model, optimizer)
    out = train.sample(model, tokenizer, problems, base, stream)
    rewards, correct, *_ = train.score(out, problems, base)
    advantages = loss.advantages(rewards, base.group_size, base.loss)
    if not advantages.any():
        return {"reward": float(rewards.mean()), "accuracy": float(correct.mean()), "acting": 0.0, "skipped": True}
    before = view(model, out, base)
    no_update = fresh_reward(model, tokenizer, problems, base, fresh_samples, stream + 1)
    line = {
        "reward": float(rewards.mean()),
        "accuracy": float(correct.mean()),
        "acting": float((advantages != 0).float().mean()),
        "fresh_reward_before": no_update,
        "arms": {},
    }
    for name, cfg in arms.items():
        state.restore(model, optimizer)
        _, records = train.policy_update(model, optimizer, out, advantages, cfg, stream, keep_records=True)
        after = view(model, out, cfg)
        measured = effects(out, advantages, correct, before, after, records, model.lm_head.weight, cfg.temperature)
        measured["reward"] = fresh_reward(model, tokenizer, problems, cfg, fresh_samples, stream + 1) - no_update
        line["arms"][name] = measured
    state.restore(model, optimizer)
    return line


# ----------------------------------------------------------------------------- arms and settings


def arm_configs(
    shared: list[str], arms: list[str], deltas: dict[str, float], rollout_prompts: int | None = None
) -> dict[str, config.Config]:
    """The train.py Config of every arm: the shared flags, then the arm's (an -eq arm: its base's at its
    calibrated delta), with rollout_prompts prompts per rollout (None: the pilot's --prompts-per-step).
    They differ in the loss alone."""
    cfgs = {}
    for arm in arms:
        flags = study.arm_flags(arm, deltas)
        cfg, _, _ = config.parse_args(shared + flags)
        prompts = rollout_prompts or cfg.prompts_per_step
        cfgs[arm] = dataclasses.replace(
            cfg,
            prompts_per_step=prompts,
            rollout_batch=min(cfg.rollout_batch or prompts, prompts),
            grad_accum=cfg.grad_accum or 1,
            eval_batch=cfg.eval_batch or 16,
        )
    first = next(iter(cfgs.values()))
    for arm, cfg in cfgs.items():
        assert dataclasses.replace(cfg, loss=first.loss) == first, f"arm {arm} changes more than the loss"
    return cfgs


def calibrated_deltas(out: Path, shared: list[str], arms: list[str]) -> dict:
    """grpo's clip rate on the pilot's records (acting tokens) and the delta giving each -eq arm that rate;
    kept in OUT/calibration.json, so a resumed run uses the same deltas."""
    path = out / "calibration.json"
    if path.is_file():
        return json.loads(path.read_text())
    records = calibrate.read_token_records(out / "pilot")
    calibration = study.calibrate_arms(records, shared, arms, source=str(out / "pilot"))
    rundir.write_json(path, calibration)
    return calibration


# ----------------------------------------------------------------------------- the table


def read_rollouts(path: Path) -> list[dict]:
    """A point's lines of OUT/rollouts/, a partial last line (a killed run) dropped."""
    if not path.is_file():
        return []
    lines = []
    for line in path.read_text().splitlines():
        try:
            lines.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return lines


def prompt_clusters(lines: list[dict]) -> list[int]:
    """One cluster id per rollout line: rollouts that share a prompt (through any chain of shared prompts) are
    one cluster, the independent unit of the paired tests. Each rollout draws prompts of its own (run_point),
    so the clusters are the rollouts; lines written before rollouts recorded their prompts shared draw d's
    prompts and streams at every point, and cluster by draw."""
    parent = list(range(len(lines)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first_with: dict = {}
    for i, line in enumerate(lines):
        for key in line.get("prompts") or [("draw", line["draw"])]:
            if key in first_with:
                parent[root(i)] = root(first_with[key])
            else:
                first_with[key] = i
    return [root(i) for i in range(len(lines))]


CLIP_MEASURES = ("clip", "clip_all")  # the measures a containment of regions decides (study.region_contains)


def summarize(
    lines: list[dict], arms: list[str], baseline: str = "grpo", regions: dict[str, loss.LossConfig] | None = None
) -> dict:
    """Per arm and measure: mean and se over rollouts; per arm other than the baseline and measure: the paired
    gap to it, clustered by prompt (prompt_clusters), judged with every other tested gap of the table as one
    family. An arm whose region (regions: each arm's LossConfig) holds the baseline's at every old probability
    has its clip-rate gaps by construction: stated, not tested."""
    columns = list(MEASURES) + [f"clip[{label}]" for label in loss.MU_LABELS]
    values = {
        arm: {m: np.array([line["arms"][arm][m] for line in lines], dtype=float) for m in columns} for arm in arms
    }
    means = {
        arm: {m: study.mean_se(v[~np.isnan(v)]) for m, v in by_measure.items()} for arm, by_measure in values.items()
    }
    clusters = prompt_clusters(lines)
    gaps = {
        arm: {m: study.paired(values[arm][m] - values[baseline][m], clusters) for m in MEASURES}
        for arm in arms
        if arm != baseline and baseline in values
    }
    for arm, by_measure in gaps.items():
        if regions and study.region_contains(regions[arm], regions[baseline]):
            for m in CLIP_MEASURES:
                by_measure[m].by_construction = True
    study.judge([c for by_measure in gaps.values() for c in by_measure.values()])
    return {"means": means, "gaps": gaps, "rollouts": len(lines), "units": len(set(clusters))}


def markdown(summary: dict, arms: list[str], baseline: str = "grpo") -> str:
    """The effects table (mean ± se over rollouts), the gaps to the baseline, and the clip rate by bucket."""
    family = [c for by_measure in summary["gaps"].values() for c in by_measure.values()]
    head = "| arm | " + " | ".join(heading for heading, _, _ in MEASURES.values()) + " |"
    rule = "| --- | " + " | ".join("--:" for _ in MEASURES) + " |"
    lines = [head, rule]
    for arm in arms:
        cells = [_cell(*summary["means"][arm][m], scale, digits) for m, (_, scale, digits) in MEASURES.items()]
        lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    if summary["gaps"]:
        tests = [c for c in family if not c.by_construction and not math.isnan(c.p)]
        units = summary["units"]
        k = study.power_multiplier(units, len(tests))
        unit = (
            f"the rollout, {units} of them, each with prompts and random streams of its own"
            if units == summary["rollouts"]
            else f"the prompt cluster: {summary['rollouts']} rollouts in {units} clusters of rollouts sharing a prompt"
        )
        lines += [
            "",
            f"Paired gaps to {baseline} (arm - {baseline}, ± se). Unit of analysis: {unit}. * marks a gap called "
            f"a difference: Holm's adjusted p below 0.05 over the family of {len(tests)} tests (two-sided paired t, "
            f"{units - 1} df). A gap of {k:.2f} se is detected with 80% power (at Holm's strictest level, exact "
            "noncentral t). A clip-rate gap marked 'by construction' follows from the regions: the arm's region "
            f"holds {baseline}'s at every old probability, so on the same ratios it stops a subset of the tokens "
            f"{baseline} stops; it is stated, not tested.",
            "",
            head.replace("| arm |", f"| arm - {baseline} |"),
            rule,
        ]
        for arm, by_measure in summary["gaps"].items():
            cells = [_gap_cell(by_measure[m], scale, digits) for m, (_, scale, digits) in MEASURES.items()]
            lines.append(f"| {arm} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| arm | " + " | ".join(f"clipped % at μ {label}" for label in loss.MU_LABELS) + " |",
        "| --- | " + " | ".join("--:" for _ in loss.MU_LABELS) + " |",
    ]
    for arm in arms:
        lines.append(
            f"| {arm} | "
            + " | ".join(_cell(*summary["means"][arm][f"clip[{label}]"], 100, 1) for label in loss.MU_LABELS)
            + " |"
        )
    return "\n".join(lines) + "\n"


def _cell(mean: float, se: float, scale: float, digits: int) -> str:
    if math.isnan(mean):
        return "-"
    return f"{mean * scale:.{digits}f}" + ("" if math.isnan(se) else f" ± {se * scale:.{digits}f}")


def _gap_cell(c: study.Comparison, scale: float, digits: int) -> str:
    if math.isnan(c.gap):
        return "-"
    se = "" if math.isnan(c.se) else f" ± {c.se * scale:.{digits}f}"
    return f"{c.gap * scale:+.{digits}f}{se}" + (
        " *" if c.called else " (by construction)" if c.by_construction else ""
    )


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="counterfactual.py",
        description=__doc__.split("\n")[0],
        epilog="Flags after -- are passed to every arm's train.py config.",
    )
    parser.add_argument(
        "--arms",
        default=DEFAULT_ARMS,
        help=f"comma-separated, of {', '.join(study.all_arms())} (default: %(default)s); grpo comes first",
    )
    parser.add_argument("--points", default="0,5,10", help="pilot steps to start rollouts from (default: %(default)s)")
    parser.add_argument("--rollouts", type=int, default=10, help="measured rollouts per point (default: %(default)s)")
    parser.add_argument(
        "--rollout-prompts",
        type=int,
        default=None,
        help="prompts per measured rollout, each with --group-size completions (default: --prompts-per-step, "
        "so a measured update is a pilot step's)",
    )
    parser.add_argument(
        "--fresh-samples",
        type=int,
        default=4,
        help="fresh completions per prompt for the reward measure (default: %(default)s)",
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/counterfactual"), help="directory (default: %(default)s)"
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="points measured at once, each in a process of its own (default: %(default)s, for two "
        "CPU cores; with OMP_NUM_THREADS=1)",
    )
    parser.add_argument(
        "--max-draws",
        type=int,
        default=20,
        help="rollouts drawn per rollout wanted before a point whose rollouts never have an acting "
        "token is given up (default: %(default)s)",
    )
    parser.add_argument("--point", type=int, default=None, help=argparse.SUPPRESS)  # a worker's one point
    study.add_train_flags(parser, skip=PILOT_ONLY)
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.train_args = argv[cut + 1 :]
    args.argv = argv  # what a worker is started with
    try:
        args.points = sorted({int(p) for p in args.points.split(",") if p.strip()})
    except ValueError:
        parser.error(f"--points {args.points}: expected steps separated by commas")
    if not args.points or args.points[0] < 0:
        parser.error(f"--points {','.join(map(str, args.points))}: need steps >= 0")
    args.arms = study.check_arms(parser, args.arms)
    study.resolve_setting(args)
    if args.rollout_prompts is None:
        args.rollout_prompts = args.prompts_per_step
    if args.arms[0] != "grpo":
        parser.error(f"--arms {','.join(args.arms)}: grpo must come first, the baseline of every gap")
    if min(args.rollouts, args.rollout_prompts, args.fresh_samples, args.workers, args.max_draws) < 1:
        parser.error(
            f"--rollouts {args.rollouts}, --rollout-prompts {args.rollout_prompts}, --fresh-samples "
            f"{args.fresh_samples}, --workers {args.workers} and --max-draws {args.max_draws}: must be >= 1"
        )
    if args.point is not None and args.point not in args.points:
        parser.error(f"--point {args.point}: not one of --points")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    shared = study.train_flags(args, exclude=PILOT_ONLY)
    settings = {
        "train_flags": shared,
        "points": args.points,
        "rollout_prompts": args.rollout_prompts,
        "fresh_samples": args.fresh_samples,
    }
    if args.point is None:
        pilot_cfg, _, _ = config.parse_args(shared + ["--rule", "grpo", "--steps", str(max(args.points))])
        if not pilot_cfg.lora_rank:  # a point is saved and restored as LoRA adapters and their AdamW moments
            raise SystemExit("counterfactual.py: --lora-rank 0: the points are LoRA adapters; give a rank above 0")
        study.check_settings(
            args.out, settings | {"arms": args.arms}, keys=tuple(settings), started=(args.out / "pilot").exists()
        )
        run_pilot(pilot_cfg, args.out, args.points)
    equal_rate = any(arm.endswith(study.EQUAL_RATE) for arm in args.arms)
    calibration = calibrated_deltas(args.out, shared, args.arms) if equal_rate else {}
    arms = arm_configs(
        shared,
        [arm for arm in args.arms if arm not in calibration.get("unreachable", {})],
        calibration.get("deltas", {}),
        args.rollout_prompts,
    )
    if args.point is not None:  # one worker of run_points
        run_point(args, arms, args.point)
        return
    todo = [
        p
        for p in args.points
        if len(kept_rollouts(read_rollouts(rollout_file(args.out, p)), list(arms))[0]) < args.rollouts
    ]
    run_points(args, arms, todo)
    lines = {p: read_rollouts(rollout_file(args.out, p)) for p in args.points}
    kept = [line for p in args.points for line in kept_rollouts(lines[p], list(arms))[0][: args.rollouts]]
    skipped = {p: kept_rollouts(lines[p], list(arms))[1] for p in args.points}
    regions = {arm: cfg.loss for arm, cfg in arms.items()}
    summary = summarize(kept, list(arms), regions=regions) | {"skipped": skipped}
    summary["by_point"] = {
        p: summarize([line for line in kept if line["point"] == p], list(arms), regions=regions) for p in args.points
    }
    table = markdown(summary, list(arms))
    (args.out / "table.md").write_text(table)
    results = {
        "settings": settings,
        "measures": MEASURES,
        "calibration": calibration,
        "arms": {arm: study.arm_flags(arm, calibration.get("deltas", {})) for arm in arms},
        **summary,
        "seconds": time.time() - started,
    }
    (args.out / "results.json").write_text(json.dumps(strict_json(_plain(results)), indent=1, allow_nan=False) + "\n")
    from research import plot  # matplotlib loads only when the figures are drawn

    (args.out / "figures").mkdir(exist_ok=True)
    plot.plot_counterfactual(plot.load_counterfactual(args.out), args.out / "figures")
    print(table + f"\n{args.out}: table.md, results.json, figures/, rollouts/, pilot/ ({time.time() - started:.0f} s)")


PILOT_ONLY = ("steps", "eval_dataset", "eval_problems", "eval_k", "eval_every", "checkpoint_every")  # not arms' flags


def rollout_file(out: Path, point: int) -> Path:
    return out / "rollouts" / f"point-{point}.jsonl"


def kept_rollouts(lines: list[dict], arms: list[str]) -> tuple[list[dict], int]:
    """A point's measured rollouts with every arm, in draw order (the last line of a draw counts), and
    how many draws before the last of them were skipped for having no acting token."""
    by_draw = {line["draw"]: line for line in lines}
    kept = [line for _, line in sorted(by_draw.items()) if not line.get("skipped") and set(arms) <= set(line["arms"])]
    last = kept[-1]["draw"] if kept else max(by_draw, default=-1)
    return kept, sum(1 for draw, line in by_draw.items() if line.get("skipped") and draw <= last)


def run_points(args: argparse.Namespace, arms: dict[str, config.Config], points: list[int]) -> None:
    """The rollouts of these points: in this process with one worker, else one counterfactual.py process
    per point, --workers at a time (each a model of its own, one thread each on a CPU), output in OUT/logs/."""
    if args.workers == 1 or len(points) <= 1:
        for p in points:
            run_point(args, arms, p)
        return
    (args.out / "logs").mkdir(exist_ok=True)
    waiting, running = list(points), {}
    try:
        while waiting or running:
            while waiting and len(running) < args.workers:
                p = waiting.pop(0)
                log = args.out / "logs" / f"point-{p}.log"
                cut = args.argv.index("--") if "--" in args.argv else len(args.argv)  # before the train.py flags
                command = [*args.argv[:cut], "--point", str(p), *args.argv[cut:]]
                with log.open("a") as f:
                    running[p] = subprocess.Popen(
                        [sys.executable, "-m", "research.counterfactual", *command],
                        stdout=f,
                        stderr=subprocess.STDOUT,
                        cwd=ROOT,
                    )
                print(f"point {p}: a worker started, output in {log}", flush=True)
            time.sleep(1)
            for p, process in list(running.items()):
                if process.poll() is not None:
                    del running[p]
                    if process.returncode != 0:
                        raise SystemExit(
                            f"counterfactual.py: the worker of point {p} failed (exit status "
                            f"{process.returncode}); its output is in {args.out / 'logs'}/point-{p}.log"
                        )
                    print(f"point {p}: done", flush=True)
    finally:
        for process in running.values():  # stopped or failed: the others end too; a rerun continues
            process.terminate()
            process.wait()


def run_point(args: argparse.Namespace, arms: dict[str, config.Config], point: int) -> None:
    """Draw rollouts from the point's state until args.rollouts are measured, appending a line per draw.

    Every rollout has prompts and random streams of its own: the training set in an order of its own (seed
    + 1) is cut into one share per point, and draw d of a point takes the next prompts of its share and
    streams no other draw uses. Rollouts are then independent given the pilot's states, the unit the
    paired tests count (prompt_clusters checks it from the prompts each line records)."""
    path = rollout_file(args.out, point)
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = read_rollouts(path)
    # rewritten from what parsed: a torn last line goes
    path.write_text("".join(json.dumps(strict_json(line), allow_nan=False) + "\n" for line in lines))
    kept = len(kept_rollouts(lines, list(arms))[0])
    done = {line["draw"] for line in lines if line.get("skipped") or set(arms) <= set(line["arms"])}
    if kept >= args.rollouts:
        return
    base = next(iter(arms.values()))
    train_set = load_problems(base.dataset)
    slot, share = args.points.index(point), len(train_set) // len(args.points)
    draws = min(args.max_draws * args.rollouts, share // base.prompts_per_step)
    model, tokenizer, optimizer, _ = train.build(base)  # LoRA: the reference is the frozen base
    load_point(args.out / "pilot" / "points" / f"step-{point}", model, optimizer)
    state = State.of(model, optimizer)
    started = time.time()
    for draw in range(draws):
        if kept >= args.rollouts:
            return
        if draw in done:
            continue
        start = slot * share + draw * base.prompts_per_step
        problems = train.batch_of(train_set, start, base.prompts_per_step, base.seed + 1)
        stream = 1_000_000 + 2 * (slot * DRAWS_PER_POINT + draw)
        line = {
            "point": point,
            "draw": draw,
            "prompts": [problem["problem"] for problem in problems],
            **counterfactual_rollout(model, optimizer, tokenizer, state, arms, problems, stream, args.fresh_samples),
        }
        with path.open("a") as f:
            f.write(json.dumps(strict_json(line), allow_nan=False) + "\n")
        kept += not line.get("skipped")
        what = (
            "no acting token, skipped"
            if line.get("skipped")
            else f"grpo clips {_percent(line['arms']['grpo']['clip'])}"
        )
        print(
            f"point {point} draw {draw} ({kept}/{args.rollouts} kept): reward {line['reward']:.2f}, {what} "
            f"({time.time() - started:.0f} s)",
            flush=True,
        )
    if kept < args.rollouts:
        why = (
            f"its share of the training set ({share} prompts, {draws} rollouts of {base.prompts_per_step}) ran out"
            if draws < args.max_draws * args.rollouts
            else "the policy there gives no signal"
        )
        raise SystemExit(
            f"counterfactual.py: point {point}: {draws} rollouts drawn, {kept} with an acting token (a group of "
            f"mixed rewards); {why}"
        )


DRAWS_PER_POINT = 100_000  # stream names reserved per point: draw d of point slot s is stream pair s * this + d


def _plain(value):
    """Comparisons and tuples as JSON-ready dicts and lists."""
    if isinstance(value, study.Comparison):
        return dataclasses.asdict(value)
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


if __name__ == "__main__":
    main()
