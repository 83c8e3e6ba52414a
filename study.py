"""A laptop-scale replication: do clip rules differ beyond seed noise? Arms x seeds of train.py, one table.

    python study.py                                    # 5 arms x 3 seeds, about 75 min on 2 CPU cores
    python study.py --steps 2 --seeds 1 --arms grpo,atr --out runs/study-smoke
    python study.py --seeds 5 -- --lora-rank 8         # flags after -- go to every train.py run

The papers behind loss.py rank trust regions by a few points of accuracy from one seed each. Here every
arm (a set of train.py flags: the rule and its size) is trained with the same seeds; seed s gives every
arm the same prompts in the same order and the same held-out problems, so an arm's gap to grpo is
paired seed by seed and its standard error comes from the spread over seeds. The default task, two-digit
plus or minus one-digit numbers, starts the 135M model near 6%, and four optimizer steps per rollout
move the policy away from the one that sampled, so the regions actually clip (the table shows how much).

Each (arm, seed) is one train.py subprocess writing OUT/runs/ARM-sSEED (metrics.jsonl, summary.json and
per-token records in tokens/ for `python loss.py calibrate`), its output in OUT/logs/. Run again with
the same flags, a study skips finished runs, resumes runs that have a checkpoint and restarts the rest.
At the end it writes OUT/table.md, OUT/results.json and OUT/figures/seed-S/ (plot.py, the arms overlaid).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import config
import rundir
from eval import strict_json
from loss import MU_LABELS  # the old-probability buckets of the metrics

HERE = Path(__file__).resolve().parent

ARMS = {  # name -> the train.py flags that make it
    "grpo": ["--rule", "grpo"],  # ratio clip [0.8, 1.2]
    "dapo": ["--rule", "dapo"],  # clip-higher [0.8, 1.28]
    "atr": ["--rule", "atr", "--delta", "0.07"],  # ATR-GRPO's KL3 region
    "kl-atomic": ["--rule", "kl-atomic"],  # GPPO's best cell, at its default delta f(0.8)
    "limits": ["--rule", "interval", "--ratio-limits", "0.5,10"],  # the review's control: [0.5, 10] alone
    "sapo": ["--rule", "sapo"],  # a soft gate instead of a region
}
DEFAULT_ARMS = "grpo,dapo,atr,kl-atomic,limits"

# study flag -> (default, help); each is passed to train.py under the same name
TRAIN_FLAGS = {
    "steps": (10, "training steps per run"),
    "dataset": ("two_digit", "training set"),
    "eval_dataset": ("two_digit_test", "held-out set, the same for every arm"),
    "prompts_per_step": (4, "prompts per step"),
    "group_size": (8, "completions per prompt"),
    "updates_per_rollout": (4, "optimizer steps per rollout; above 1 the regions can clip"),
    "max_new_tokens": (16, "completion length cap"),
    "lr": (3e-4, "learning rate"),
    "eval_problems": (64, "held-out problems (the first N of the set, the same for every run)"),
    "eval_k": (2, "samples per held-out problem"),
    "eval_every": (0, "also evaluate every N steps (0: before and after only)"),
    "log_tokens": (2000, "per-token records per step, for loss.py calibrate"),
    "checkpoint_every": (5, "checkpoint every N steps, where a killed study resumes"),
}


# ----------------------------------------------------------------------------- statistics


def mean_se(values) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); the error is nan below 2 values."""
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return math.nan, math.nan
    return float(x.mean()), float(x.std(ddof=1) / math.sqrt(x.size)) if x.size > 1 else math.nan


def paired_gap(arm, baseline) -> tuple[float, float, float]:
    """Mean of the per-seed differences arm - baseline, its standard error across seeds, and z = mean / se."""
    gap, se = mean_se(np.asarray(arm, dtype=float) - np.asarray(baseline, dtype=float))
    return gap, se, gap / se if se > 0 else math.nan


def run_numbers(metrics: list[dict], summary: dict) -> dict:
    """One run's figures for the table: held-out accuracy before/after, final entropy, clip rates.

    Clip rates count every token whose gradient a clip stopped (the region's below and above, plus
    ratio limits or dual clip), averaged over the run's completion tokens; per bucket, over the tokens
    whose old probability falls in it. Every step samples the same number of completions, so a step's
    tokens are proportional to its mean completion length.
    """
    steps = [m for m in metrics if "clip_low_frac" in m]
    if not steps:
        raise ValueError("the run logged no training steps")
    tokens = np.array([m["completion_length"] for m in steps], dtype=float)
    clip = np.array([m["clip_low_frac"] + m["clip_high_frac"] + m.get("limit_clip_frac", 0.0) for m in steps])
    by_bucket = {}
    for label in MU_LABELS:
        count = tokens * np.array([m[f"mu[{label}]/share"] for m in steps])
        rate = np.array([m[f"mu[{label}]/clip_frac"] + m.get(f"mu[{label}]/limit_frac", 0.0) for m in steps])
        by_bucket[label] = float((rate * count).sum() / count.sum()) if count.sum() > 0 else math.nan
    return {"before": summary["before"]["accuracy"], "after": summary["after"]["accuracy"],
            "final_entropy": steps[-1]["entropy"], "clip": float((clip * tokens).sum() / tokens.sum()),
            "clip_by_bucket": by_bucket}


def arm_rows(results: dict[str, dict[int, dict]], baseline: str = "grpo") -> list[dict]:
    """Per arm: means over seeds with standard errors, and gaps to the baseline arm paired by seed
    (held-out accuracy after training, final entropy, clipped fraction)."""
    rows = []
    for arm, by_seed in results.items():
        seeds = sorted(by_seed)
        column = {key: [by_seed[s][key] for s in seeds] for key in ("before", "after", "final_entropy", "clip")}
        row = {"arm": arm, "seeds": len(seeds), **{key: mean_se(values) for key, values in column.items()},
               "clip_by_bucket": {label: float(np.nanmean([by_seed[s]["clip_by_bucket"][label] for s in seeds]))
                                  if any(not math.isnan(by_seed[s]["clip_by_bucket"][label]) for s in seeds)
                                  else math.nan for label in MU_LABELS}}
        shared = [s for s in seeds if s in results.get(baseline, {})] if arm != baseline else []
        row["gaps"] = {key: paired_gap([by_seed[s][key] for s in shared], [results[baseline][s][key] for s in shared])
                       for key in ("after", "final_entropy", "clip")} if shared else None
        rows.append(row)
    return rows


def _pct(x: float, se: float | None = None, sign: str = "") -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 100:{sign}.1f}" + (f" ± {se * 100:.1f}" if se is not None and not math.isnan(se) else "")


def _z(z: float) -> str:
    return "-" if math.isnan(z) else f"{z:+.1f}"


def _gap(row: dict, key: str, scale: float, digits: int) -> str:
    """'gap ± se (z)' to the baseline, '-' for the baseline itself."""
    if row["gaps"] is None:
        return "-"
    gap, se, z = row["gaps"][key]
    text = f"{gap * scale:+.{digits}f}" + ("" if math.isnan(se) else f" ± {se * scale:.{digits}f}")
    return text + ("" if math.isnan(z) else f" (z {z:+.1f})")


def markdown_table(rows: list[dict], baseline: str = "grpo") -> str:
    """Two markdown tables: held-out accuracy with the paired gap, then the diagnostics."""
    lines = ["| arm | train.py flags | seeds | held-out before % | after % | after - " + baseline + " % | z |",
             "| --- | --- | --: | --: | --: | --: | --: |"]
    for r in rows:
        gap, se, z = r["gaps"]["after"] if r["gaps"] else (math.nan, math.nan, math.nan)
        lines.append(f"| {r['arm']} | `{' '.join(ARMS.get(r['arm'], []))}` | {r['seeds']} | {_pct(*r['before'])} "
                     f"| {_pct(*r['after'])} | {_pct(gap, se, '+')} | {_z(z)} |")
    lines += ["", f"| arm | final entropy | - {baseline} | clipped % | - {baseline} | "
              + " | ".join(f"clipped % at mu {b}" for b in MU_LABELS) + " |",
              "| --- | --: | --: | --: | --: | " + " | ".join("--:" for _ in MU_LABELS) + " |"]
    for r in rows:
        entropy, entropy_se = r["final_entropy"]
        entropy_text = f"{entropy:.3f}" + (f" ± {entropy_se:.3f}" if not math.isnan(entropy_se) else "")
        buckets = " | ".join(_pct(r["clip_by_bucket"][b]) for b in MU_LABELS)
        lines.append(f"| {r['arm']} | {entropy_text} | {_gap(r, 'final_entropy', 1, 3)} | {_pct(*r['clip'])} "
                     f"| {_gap(r, 'clip', 100, 1)} | {buckets} |")
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- runs


def train_flags(args: argparse.Namespace) -> list[str]:
    """The train.py flags every run of the study shares."""
    flags = [] if args.model is None else ["--model", args.model]
    for name in TRAIN_FLAGS:
        flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + args.train_args


def run_command(run_dir: Path, arm: str, seed: int, shared: list[str]) -> list[str] | None:
    """The train.py command that finishes this run, or None when it is finished already."""
    if (run_dir / "summary.json").is_file():
        return None
    train = [sys.executable, str(HERE / "train.py")]
    if rundir.has_checkpoint(run_dir):  # continue from there
        return train + ["--resume", str(run_dir)]
    shutil.rmtree(run_dir, ignore_errors=True)  # a start that died before its first checkpoint
    return train + shared + ARMS[arm] + ["--seed", str(seed), "--run-name", run_dir.name,
                                         "--out-dir", str(run_dir.parent)]


def run_train(command: list[str], log: Path) -> None:
    """One train.py run to its end, its output appended to log.

    Stopping the study (Ctrl-C, which reaches the run as well, or SIGTERM, passed on to it) lets the run
    finish its step and checkpoint before the study exits: a study restarted at once never races it.
    """
    stop = []

    def on_signal(signum, frame):
        stop.append(signum)
        if signum == signal.SIGTERM:
            process.send_signal(signal.SIGTERM)

    with log.open("a") as f:
        process = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=HERE)
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        code = process.wait()  # a handled signal does not interrupt the wait (PEP 475)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    again = "Run the same command again to continue the study."
    if stop:
        raise SystemExit(f"study.py: stopped; the run checkpointed (output in {log}). {again}")
    if code == 2:  # train.py refused its settings or a file: running it again would not help
        last = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
        raise SystemExit(f"study.py: a run refused to start: {last[0]} (output in {log})")
    if code != 0:
        raise SystemExit(f"study.py: a run failed (exit status {code}); its output is in {log}. {again}")


def read_run(run_dir: Path) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return run_numbers(metrics, json.loads((run_dir / "summary.json").read_text()))


def check_flags(args: argparse.Namespace) -> None:
    """Every arm's train.py command is parsed and checked as train.py would, before anything is written:
    a bad flag is one line now, not a failed run and a study folder holding the bad flags."""
    for arm in args.arms:
        try:
            config.parse_args([*train_flags(args), *ARMS[arm], "--seed", str(args.seeds - 1)])
        except ValueError as error:
            print(f"study.py: arm {arm}: {error}", file=sys.stderr)
            raise SystemExit(2) from None


def check_settings(out: Path, settings: dict) -> None:
    """A study directory holds one grid's settings; other settings there would mix runs silently (a
    folder none of whose runs got to a checkpoint takes new settings)."""
    path = out / "study.json"
    started = any(rundir.has_checkpoint(run) or (run / "summary.json").is_file() for run in out.glob("runs/*"))
    if path.is_file() and started:
        before = json.loads(path.read_text())
        if before["train_flags"] != settings["train_flags"]:
            raise SystemExit(f"study.py: {out} holds a study run with other train.py flags "
                             f"({' '.join(before['train_flags'])}); pass the same flags or another --out")
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def run_grid(args: argparse.Namespace) -> dict[str, dict[int, dict]]:
    check_flags(args)
    shared = train_flags(args)
    check_settings(args.out, {"train_flags": shared, "arms": {arm: ARMS[arm] for arm in args.arms}})
    (args.out / "logs").mkdir(exist_ok=True)
    plan = [(arm, seed) for seed in range(args.seeds) for arm in args.arms]  # seed-major: early rows compare arms
    started = time.time()
    for i, (arm, seed) in enumerate(plan, 1):
        run_dir = args.out / "runs" / f"{arm}-s{seed}"
        command = run_command(run_dir, arm, seed, shared)
        if command is None:
            continue
        log = args.out / "logs" / f"{run_dir.name}.log"
        print(f"[{i}/{len(plan)}] {run_dir.name} ({time.time() - started:.0f} s into the study): "
              f"{' '.join(command[1:])}", flush=True)
        run_train(command, log)
    return {arm: {seed: read_run(args.out / "runs" / f"{arm}-s{seed}") for seed in range(args.seeds)}
            for arm in args.arms}


def plot(out: Path, arms: list[str], seeds: int) -> None:
    """plot.py's figures, one folder per seed, the arms overlaid (the same prompts for each)."""
    for seed in range(seeds):
        runs = [str(out / "runs" / f"{arm}-s{seed}") for arm in arms]
        subprocess.run([sys.executable, str(HERE / "plot.py"), *runs, "--out", str(out / "figures" / f"seed-{seed}")],
                       check=True, cwd=HERE, stdout=subprocess.DEVNULL)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = config.OneLineErrors(prog="study.py", description=__doc__.split("\n")[0], allow_abbrev=False,
                                     epilog="Flags after -- are passed to every train.py run.")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm, 0..N-1 (default: %(default)s)")
    parser.add_argument("--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(ARMS)} "
                                                             "(default: %(default)s)")
    parser.add_argument("--out", type=Path, default=Path("runs/study"), help="study directory (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model for train.py (default: the offline SmolLM2-135M)")
    for name, (default, text) in TRAIN_FLAGS.items():
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(default), default=default,
                            help=f"{text} (default: %(default)s)")
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.train_args = argv[cut + 1:]
    args.arms = [arm.strip() for arm in args.arms.split(",") if arm.strip()]
    unknown = [arm for arm in args.arms if arm not in ARMS]
    if unknown or not args.arms or len(set(args.arms)) != len(args.arms):
        parser.error(f"--arms {','.join(args.arms)}: need distinct arms of {', '.join(ARMS)}")
    if args.seeds < 1:
        parser.error(f"--seeds {args.seeds}: must be >= 1")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    results = run_grid(args)
    table = markdown_table(arm_rows(results))
    (args.out / "table.md").write_text(table)
    (args.out / "results.json").write_text(json.dumps(strict_json(results), indent=1, allow_nan=False) + "\n")
    plot(args.out, args.arms, args.seeds)
    print(table + f"\n{args.out}: table.md, results.json, figures/, runs/ ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
