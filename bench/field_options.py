"""What the field's options cost on the demo, and the sampler-trainer mismatch with an fp32 and a bf16 sampler.

    OMP_NUM_THREADS=1 .venv/bin/python bench/field_options.py [--steps 3] [--out DIR]   # the cost per option
    OMP_NUM_THREADS=1 .venv/bin/python bench/field_options.py --mismatch [--steps 3] [--prompts 8]  # mismatch only

Cost: the demo's train.train_step (SmolLM2-135M, LoRA, 8 prompts x 8 samples, fp32, one thread) once per setting
and step: the demo as it is, the demo again (a control: its fraction is the noise), then each option alone
(dynamic sampling with up to 3 calls, overlong mask, overlong penalty:8, the old log-probs recomputed, which
makes the mismatch free, tis-token with its recomputation, top-entropy 0.2). Every setting trains its own run
from the same fresh adapters, with its own adapters and optimizer swapped into the one model, and the settings
take turns step by step (ABCD ABCD ...), so a drift of the machine's load hits every setting alike. Step k of
every setting samples the same prompts with the same random streams (dynamic sampling's first call included).
One untimed demo step comes first: the process's first step pays one-off allocations.

Per setting: the median step seconds over the steps, its rollout, reward and update laps, the seconds of the
mismatch's no-gradient forward (inside the update; free when the old log-probs are recomputed), and the
fraction the option adds to the demo's step: the median over steps of (setting's step k) / (demo's step k) - 1,
with its smallest and largest. The machine's load average is printed with the table.

Mismatch (--mismatch): the demo's rollouts sampled by the fp32 policy and by a bf16 copy of it, each scored by
the fp32 training pass (train.sampler_mismatch on every row): mean and max |d log p|, k3 KL(sampler ||
trainer), the fraction of tokens with ratio outside [0.5, 2], and tis-token's weights at cap 2
(loss.correction_weight: mean, min, max, the fraction truncated). Figures: docs/field-options.md.
DIR/field_options.json holds the tables.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import os
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import config  # noqa: E402
import eval as evaluation  # noqa: E402
import loss  # noqa: E402
import train  # noqa: E402
from data import load_problems  # noqa: E402
from engine import sizes  # noqa: E402
from infra import rundir, weights  # noqa: E402

SETTINGS = {  # name: the flags that differ from the demo's
    "demo": {},
    "demo, again": {},
    "dynamic-sampling 3": {"dynamic_sampling": 3},
    "overlong mask": {"overlong": "mask"},
    "overlong penalty:8": {"overlong": "penalty:8"},
    "recompute-old-logp on": {"recompute_old_logp": "on"},
    "rollout-correction tis-token": {"rollout_correction": "tis-token"},
    "top-entropy-quantile 0.2": {"top_entropy_quantile": 0.2},
}
LAPS = ("rollout", "reward", "update")


@dataclasses.dataclass
class Run:
    """One setting's training run on the shared model: its settings, its adapters between steps, its optimizer."""

    cfg: config.Config
    adapters: list[torch.Tensor]
    optimizer: torch.optim.Optimizer


def demo(base: dict):
    """The demo's config with `base`, its model and tokenizer (no optimizer: each run makes its own), and the
    problems it trains on (the training set less the validation split, as train.py draws them)."""
    cfg = config.make_config(base)
    model, tokenizer, _, _ = train.build(cfg, model_dir=weights.resolve_checkpoint(cfg.model or None))
    held_out = {name: load_problems(name) for name in evaluation.load_eval_sets(cfg)}
    problems, _ = rundir.validation_split(load_problems(cfg.dataset), held_out, cfg.seed)
    return sizes.resolve_automatic(cfg, model, tokenizer, problems), model, tokenizer, problems


def fresh_run(settings: dict, base: dict, model, tokenizer, problems, adapters: list[torch.Tensor]) -> Run:
    """A run of the demo with `settings` over `base`, from copies of `adapters`, with its own AdamW."""
    cfg = sizes.resolve_automatic(config.make_config(base | settings), model, tokenizer, problems)
    optimizer = torch.optim.AdamW(train.trainable(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return Run(cfg, [a.clone() for a in adapters], optimizer)


@contextmanager
def swapped_in(model, run: Run):
    """The model with `run`'s adapters; what the step makes of them is kept in `run` afterwards."""
    params = train.trainable(model)
    with torch.no_grad():
        for param, saved in zip(params, run.adapters):
            param.copy_(saved)
    yield
    with torch.no_grad():
        for param, saved in zip(params, run.adapters):
            saved.copy_(param)


@contextmanager
def instrumented():
    """Every train_step's Stopwatch and the seconds of every sampler_mismatch call, as two lists that grow
    while the block runs (train.py looks both names up when it calls them)."""
    watches, mismatch_seconds = [], []
    stopwatch, mismatch = train.Stopwatch, train.sampler_mismatch

    class Kept(stopwatch):
        def __init__(self):
            super().__init__()
            watches.append(self)

    def timed(*args):
        start = time.perf_counter()
        result = mismatch(*args)
        mismatch_seconds.append(time.perf_counter() - start)
        return result

    train.Stopwatch, train.sampler_mismatch = Kept, timed
    try:
        yield watches, mismatch_seconds
    finally:
        train.Stopwatch, train.sampler_mismatch = stopwatch, mismatch


def step_costs(steps: int, base: dict | None = None) -> dict:
    """Per setting: median seconds of its steps, of their laps and of the mismatch's forward, dynamic
    sampling's calls, and the fraction it adds to the demo's step (median, min, max over the steps)."""
    base = base or {}
    cfg, model, tokenizer, problems = demo(base)
    pool = sizes.sampler_pool(cfg, model, tokenizer, problems, {})
    adapters = [p.detach().clone() for p in train.trainable(model)]  # the fresh ones every run starts from
    runs = {
        name: fresh_run(settings, base, model, tokenizer, problems, adapters) for name, settings in SETTINGS.items()
    }
    n, calls = cfg.prompts_per_step, max(max(1, run.cfg.dynamic_sampling) for run in runs.values())
    timings = {name: [] for name in runs}  # per step: its seconds and laps
    with instrumented() as (watches, mismatch_seconds):
        warmup = fresh_run({}, base, model, tokenizer, problems, adapters)
        with swapped_in(model, warmup):
            train.train_step(
                model, warmup.optimizer, tokenizer, train.batch_of(problems, 0, n, cfg.seed), cfg, 1, pool=pool
            )
        for step in range(1, steps + 1):
            batch = train.batch_of(problems, (step - 1) * n * calls, n * calls, cfg.seed)
            for name, run in runs.items():
                own = batch[: n * max(1, run.cfg.dynamic_sampling)]  # the others train on the first n
                with swapped_in(model, run):
                    line, _ = train.train_step(model, run.optimizer, tokenizer, own, run.cfg, step, pool=pool)
                laps = watches[-1].laps
                timings[name].append(
                    {"step": line["step_seconds"], **{lap: laps[lap] for lap in LAPS}, "mismatch": mismatch_seconds[-1]}
                    | ({"calls": line["dynamic/calls"]} if "dynamic/calls" in line else {})
                )
            print(
                f"step {step}/{steps}: " + ", ".join(f"{k} {v[-1]['step']:.1f} s" for k, v in timings.items()),
                flush=True,
            )
    demo_steps = [t["step"] for t in timings["demo"]]
    table = {}
    for name, rows in timings.items():
        fractions = [t["step"] / d - 1 for t, d in zip(rows, demo_steps)]
        table[name] = {f"{key}_seconds": statistics.median(t[key] for t in rows) for key in ("step", *LAPS, "mismatch")}
        if "calls" in rows[0]:
            table[name]["dynamic/calls"] = statistics.median(t["calls"] for t in rows)
        table[name] |= {
            "added_fraction": statistics.median(fractions),
            "added_fraction_min": min(fractions),
            "added_fraction_max": max(fractions),
        }
    return table


def cost_table(table: dict) -> str:
    """The cost table as markdown, one row per setting."""
    lines = [
        "| setting | step s | rollout s | reward s | update s | mismatch forward s | adds to the demo's step: median (min .. max) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, row in table.items():
        calls = f" ({row['dynamic/calls']:g} calls)" if "dynamic/calls" in row else ""
        lines.append(
            f"| {name}{calls} | {row['step_seconds']:.1f} | {row['rollout_seconds']:.1f} | {row['reward_seconds']:.2f} "
            f"| {row['update_seconds']:.1f} | {row['mismatch_seconds']:.2f} | {row['added_fraction']:+.1%} "
            f"({row['added_fraction_min']:+.1%} .. {row['added_fraction_max']:+.1%}) |"
        )
    return "\n".join(lines)


def mismatch(steps: int, prompts: int, base: dict | None = None) -> dict:
    """The mismatch of an fp32 and of a bf16 sampler against the fp32 training pass, over `steps` rollouts of
    `prompts` prompts each."""
    cfg, model, tokenizer, problems = demo((base or {}) | {"recompute_old_logp": "off", "prompts_per_step": prompts})
    samplers = {"float32": model, "bfloat16": copy.deepcopy(model).to(torch.bfloat16)}
    correction = loss.LossConfig(rollout_correction="tis-token", rollout_correction_cap=2.0)
    table = {}
    for dtype, sampler in samplers.items():
        rows = []
        for step in range(1, steps + 1):
            batch = train.batch_of(problems, (step - 1) * cfg.prompts_per_step, cfg.prompts_per_step, 0)
            out = train.sample(sampler, tokenizer, batch, cfg, step)
            out.old_logp = out.old_logp.float()
            trainer = train.frozen_inputs(model, out, dataclasses.replace(cfg, recompute_old_logp="on"))
            stats = train.sampler_mismatch(model, out, trainer, cfg)
            weight = loss.correction_weight(trainer["old_logp"], out.old_logp, out.completion_mask, correction)
            w = weight[out.completion_mask]
            stats |= {
                "tis_weight_mean": w.mean().item(),
                "tis_weight_min": w.min().item(),
                "tis_weight_max": w.max().item(),
                "tis_truncated_frac": (w == 2.0).double().mean().item(),
            }
            rows.append(stats)
        table[dtype] = {key: statistics.mean(row[key] for row in rows) for key in rows[0]}
        table[dtype]["mismatch/abs_max"] = max(row["mismatch/abs_max"] for row in rows)
        print(dtype, json.dumps(table[dtype]), flush=True)
    return table


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps (rollouts) per setting")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout of the mismatch (the demo's 8)")
    parser.add_argument("--mismatch", action="store_true", help="only the fp32 / bf16 sampler mismatch")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/field_options.json")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    load_before = os.getloadavg()
    if args.mismatch:
        result = {"mismatch": mismatch(args.steps, args.prompts)}
    else:
        result = {"cost": step_costs(args.steps)}
        print(cost_table(result["cost"]))
    result["load_average"] = {"before": load_before, "after": os.getloadavg()}  # 1, 5 and 15 minutes
    print(f"load average (1, 5, 15 min): before {load_before}, after {result['load_average']['after']}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "field_options.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
