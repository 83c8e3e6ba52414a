"""What the field's options cost on the demo, and the sampler-trainer mismatch with an fp32 and a bf16 sampler.

    OMP_NUM_THREADS=1 .venv/bin/python bench/field_options.py [--steps 3] [--out DIR]   # the cost per option
    OMP_NUM_THREADS=1 .venv/bin/python bench/field_options.py --mismatch [--steps 3] [--prompts 8]  # mismatch only

Cost: the demo's train.train_step (SmolLM2-135M, LoRA, 8 prompts x 8 samples, fp32, one thread) on its first
--steps steps' prompts, once per setting: the demo as it is, then each option alone (dynamic sampling with up
to 3 calls, overlong mask, overlong penalty:8, the old log-probs recomputed, which makes the mismatch free,
tis-token with its recomputation, top-entropy 0.2). Each setting starts from the same fresh adapters, so the
steps sample alike until an option changes the update. Per setting: the median step seconds, its rollout,
reward and update laps, and the fraction of the demo's step time the option adds. Dynamic sampling's cost is
the extra sampler calls, logged as dynamic/calls.

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
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import config  # noqa: E402
import loss  # noqa: E402
import train  # noqa: E402
from data import load_problems  # noqa: E402
from engine import sizes  # noqa: E402

SETTINGS = {  # name: the flags that differ from the demo's
    "demo": {},
    "dynamic-sampling 3": {"dynamic_sampling": 3},
    "overlong mask": {"overlong": "mask"},
    "overlong penalty:8": {"overlong": "penalty:8"},
    "recompute-old-logp on": {"recompute_old_logp": "on"},
    "rollout-correction tis-token": {"rollout_correction": "tis-token"},
    "top-entropy-quantile 0.2": {"top_entropy_quantile": 0.2},
}


def demo(settings: dict):
    """The demo's config with `settings`, its model, tokenizer and optimizer, and its training problems."""
    cfg = config.make_config(settings)
    model, tokenizer, optimizer, _ = train.build(cfg)
    problems = load_problems(cfg.dataset)
    return sizes.resolve_automatic(cfg, model, tokenizer, problems), model, tokenizer, optimizer, problems


def step_costs(steps: int) -> dict:
    """Per setting: median seconds of its steps and of their laps, and dynamic sampling's calls."""
    table = {}
    for name, settings in SETTINGS.items():
        cfg, model, tokenizer, optimizer, problems = demo(settings)
        lines = []
        for step in range(1, steps + 1):
            calls = max(1, cfg.dynamic_sampling)
            batch = train.batch_of(problems, (step - 1) * cfg.prompts_per_step * calls, cfg.prompts_per_step * calls, 0)
            lines.append(train.train_step(model, optimizer, tokenizer, batch, cfg, step)[0])
        table[name] = {
            key: statistics.median(line[key] for line in lines)
            for key in ("step_seconds", "reward_seconds", "dynamic/calls")
            if key in lines[0]
        }
        print(f"{name:32s} {table[name]['step_seconds']:6.2f} s/step", flush=True)
    base = table["demo"]["step_seconds"]
    for row in table.values():
        row["added_fraction"] = row["step_seconds"] / base - 1
    return table


def mismatch(steps: int, prompts: int) -> dict:
    """The mismatch of an fp32 and of a bf16 sampler against the fp32 training pass, over `steps` rollouts of
    `prompts` prompts each."""
    cfg, model, tokenizer, _, problems = demo({"recompute_old_logp": "off", "prompts_per_step": prompts})
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3, help="steps (rollouts) per setting")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout of the mismatch (the demo's 8)")
    parser.add_argument("--mismatch", action="store_true", help="only the fp32 / bf16 sampler mismatch")
    parser.add_argument("--out", type=Path, default=None, help="write DIR/field_options.json")
    args = parser.parse_args()
    result = {"mismatch": mismatch(args.steps, args.prompts)}
    if not args.mismatch:
        result["cost"] = step_costs(args.steps)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "field_options.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
