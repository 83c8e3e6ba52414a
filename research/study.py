"""Clip rules trained end to end: arms x seeds of train.py, the power of the design stated before its gaps.

    python -m research.study                           # 7 arms x 3 seeds x 10 steps (make grid)
    python -m research.study --steps 2 --seeds 1 --arms grpo,atr --out runs/study-smoke
    python -m research.study --setting gentle --seeds 5 -- --lora-rank 8    # flags after -- go to every train.py run

The papers behind loss.py rank trust regions by a few points of accuracy from one seed each. Here every
arm (a set of train.py flags: the rule and its size) is trained with the same seeds; seed s gives every
arm the same prompts in the same order and the same held-out problems, so an arm's gap to grpo is
paired seed by seed and its standard error comes from the spread over seeds: the seed is the unit.
Before any gap the table says which gap its test detects with 80% power (5% two-sided over the table's
family, Holm), and a gap is called a difference when Holm's test rejects. A clip-rate gap that follows
from the regions (one contains the other at every old probability) is stated by construction, not
tested. With a few seeds the detectable gaps are tens of points: the main table of the study is
counterfactual.py's, which holds everything but the rule fixed. This file also holds what both share:
the arms, the settings (binding, atr-step, gentle), the -eq arms' calibration and the statistics.

The default task, two-digit plus or minus one-digit numbers, starts the 135M model near 6%. Arms ending
in -eq run at the delta that clips grpo's rate (of the acting tokens: advantage not 0, after a
rollout's first update) on grpo-s0's per-token records, which therefore runs first.

Each (arm, seed) is one train.py subprocess writing OUT/runs/ARM-sSEED (metrics.jsonl, summary.json and
per-token records in tokens/ for `python -m research.calibrate`), its output in OUT/logs/; --workers run at
once. Run again with the same flags, a study skips finished runs, resumes runs that have a checkpoint
and restarts the rest. At the end it writes OUT/table.md, OUT/results.json (with OUT/calibration.json's
deltas and target) and OUT/figures/seed-S/ (plot.py, the arms overlaid).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

import config
import loss
from infra import rundir
from infra.rundir import strict_json
from loss import MU_LABELS  # the old-probability buckets of the metrics
from research import calibrate

ROOT = Path(__file__).resolve().parent.parent

ARMS = {  # name -> the train.py flags that make it
    "grpo": ["--rule", "grpo"],  # ratio clip [0.8, 1.2]
    "dapo": ["--rule", "dapo"],  # clip-higher [0.8, 1.28]
    "atr": ["--rule", "atr", "--delta", "0.07"],  # ATR-GRPO's KL3 region
    "kl-atomic": ["--rule", "kl-atomic"],  # GPPO's best cell alone, at its default delta f(0.8)
    "gppo": ["--rule", "kl-atomic", "--ratio-limits", "0.5,10"],  # GPPO as its paper runs it: the cell and [0.5, 10]
    "limits": ["--rule", "interval", "--ratio-limits", "0.5,10"],  # the review's control: [0.5, 10] alone
    "sapo": ["--rule", "sapo"],  # a soft gate instead of a region
}
EQUAL_RATE = "-eq"  # ARM-eq: ARM at the delta that clips grpo's rate on grpo's per-token records
DEFAULT_ARMS = "grpo,atr,kl-atomic,gppo,limits,atr-eq,kl-atomic-eq"

# The regimes (docs/study.md compares their optimizer steps with the papers'). Each optimizer step takes
# prompts_per_step x group_size / updates_per_rollout completions. "binding", the default, steps on 32, as
# ATR-GRPO's (batch 8 x accumulation 4) does, and takes two steps per rollout, the fewest at which a region
# can act (the first step's ratios are 1). "atr-step" is ATR-GRPO's rollout as well: 16 prompts x 8 in four
# steps of 32. GPPO steps on 128 completions, 8 steps a rollout; on two CPU cores that is out of reach.
# "gentle": 4 prompts x 8 in four steps of 8.
SETTINGS = {
    "binding": {"prompts_per_step": 8, "updates_per_rollout": 2, "lr": 3e-4},
    "atr-step": {"prompts_per_step": 16, "updates_per_rollout": 4, "lr": 3e-4},
    "gentle": {"prompts_per_step": 4, "updates_per_rollout": 4, "lr": 3e-4},
}


# study flag -> (default, help); each is passed to train.py under the same name (None: from --setting)
TRAIN_FLAGS = {
    "steps": (10, "training steps per run"),
    "dataset": ("two_digit", "training set"),
    "eval_dataset": ("two_digit_test", "held-out set, the same for every arm"),
    "prompts_per_step": (None, "prompts per step (default: the setting's)"),
    "group_size": (8, "completions per prompt"),
    "updates_per_rollout": (None, "optimizer steps per rollout; above 1 the regions can clip (default: the setting's)"),
    "max_new_tokens": (16, "completion length cap"),
    "lr": (None, "learning rate (default: the setting's)"),
    "eval_problems": (64, "held-out problems (the first N of the set, the same for every run)"),
    "eval_k": (2, "samples per held-out problem"),
    "eval_every": (0, "also evaluate every N steps (0: before and after only)"),
    "log_tokens": (2000, "per-token records per step, for calibrate.py and the -eq arms"),
    "checkpoint_every": (5, "checkpoint every N steps, where a killed study resumes"),
}
FLAG_TYPES = {"prompts_per_step": int, "updates_per_rollout": int, "lr": float}


def arm_flags(arm: str, deltas: dict[str, float] | None = None) -> list[str]:
    """The train.py flags of an arm; an -eq arm is its base arm at the delta calibrated for it."""
    if not arm.endswith(EQUAL_RATE):
        return list(ARMS[arm])
    if deltas is None or arm not in deltas:
        raise ValueError(f"arm {arm}: its delta is calibrated on grpo's per-token records, which are not there yet")
    base = ARMS[arm[: -len(EQUAL_RATE)]]
    if "--delta" in base:  # the base arm's own size gives way to the calibrated one
        at = base.index("--delta")
        base = base[:at] + base[at + 2 :]
    return base + ["--delta", f"{deltas[arm]:.6g}"]


def all_arms() -> list[str]:
    """Every arm name: ARMS, and ARM-eq for each arm whose rule has a delta."""
    return list(ARMS) + [arm + EQUAL_RATE for arm, flags in ARMS.items() if arm != "grpo" and _has_delta(flags)]


def _has_delta(flags: list[str]) -> bool:
    return config.parse_args(flags)[0].loss.delta is not None


def check_arms(parser: argparse.ArgumentParser, text: str) -> list[str]:
    arms = [arm.strip() for arm in text.split(",") if arm.strip()]
    known = all_arms()
    if not arms or len(set(arms)) != len(arms) or any(arm not in known for arm in arms):
        parser.error(f"--arms {text}: need distinct arms of {', '.join(known)}")
    if any(arm.endswith(EQUAL_RATE) for arm in arms) and "grpo" not in arms:
        parser.error(f"--arms {text}: the -eq arms are calibrated on grpo's records; include grpo")
    return arms


def calibrate_arms(records: dict[str, np.ndarray], shared: list[str], arms: list[str], source: str) -> dict:
    """grpo's clip rate on its own records (the acting tokens: advantage not 0, after a rollout's first update)
    and, for each -eq arm, the delta at which its rule clips that rate of the same tokens. An arm no delta
    brings to the rate (its ratio limits alone clip more) is left out, with the reason."""
    acting = calibrate.acting_tokens(records)
    stopped = records["region_low"] | records["region_high"] | records["limit"]
    target = float(stopped[acting].mean()) if acting.any() else math.nan
    calibration = {"source": source, "tokens": int(acting.sum()), "target": target, "deltas": {}, "unreachable": {}}
    for arm in arms:
        if not arm.endswith(EQUAL_RATE):
            continue
        if not acting.any():
            calibration["unreachable"][arm] = (
                "grpo's records hold no token a clip can act on (no advantage != 0 after a rollout's first update)"
            )
            continue
        cfg, _, _ = config.parse_args(shared + ARMS[arm[: -len(EQUAL_RATE)]])
        try:
            calibration["deltas"][arm] = calibrate.calibrate_to(records, cfg.loss, target)
        except ValueError as error:
            calibration["unreachable"][arm] = str(error)
    return calibration


# ----------------------------------------------------------------------------- statistics

ALPHA, POWER = 0.05, 0.8  # two-sided level over a table's family of tests, and the power of its detectable gap


def mean_se(values) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n)); the error is nan below 2 values."""
    x = np.asarray(values, dtype=float).ravel()
    if x.size == 0:
        return math.nan, math.nan
    # x.mean() and x.std(ddof=1), spelled as the same reductions without numpy's per-call overhead: a power
    # simulation makes tens of thousands of these on a few dozen values
    mean = np.add.reduce(x) / x.size
    if x.size < 2:
        return float(mean), math.nan
    deviation = x - mean
    return float(mean), math.sqrt(np.add.reduce(deviation * deviation) / (x.size - 1)) / math.sqrt(x.size)


def t_cdf(t: float, df: int) -> float:
    """P(T <= t) for Student's t with integer df >= 1: the finite series of Abramowitz & Stegun 26.7.3-4."""
    if df < 1:
        raise ValueError(f"df={df}: Student's t needs df >= 1")
    theta = math.atan2(abs(t), math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2:  # odd: A = 2/pi (theta + sin cos (1 + 2/3 cos^2 + 2*4/(3*5) cos^4 + ...)), df - 2 powers of cos
        term = total = 1.0
        for k in range(3, df - 1, 2):
            term *= (k - 1) / k * c2
            total += term
        a = 2 / math.pi * (theta + (math.sin(theta) * math.cos(theta) * total if df > 1 else 0.0))
    else:  # even: A = sin (1 + 1/2 cos^2 + 1*3/(2*4) cos^4 + ...)
        term = total = 1.0
        for k in range(2, df - 1, 2):
            term *= (k - 1) / k * c2
            total += term
        a = math.sin(theta) * total
    return 0.5 + 0.5 * a if t >= 0 else 0.5 - 0.5 * a


@functools.lru_cache(maxsize=None)
def t_quantile(p: float, df: int) -> float:
    """The t with P(T <= t) = p, by bisection on atan(t / sqrt(df)) (the CDF is monotone in it); cached, as
    every comparison of a family asks for the same few."""
    if not 0 < p < 1:
        raise ValueError(f"p={p}: must be in (0, 1)")
    low, high = -math.pi / 2, math.pi / 2
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(math.sqrt(df) * math.tan(middle), df) < p else (low, middle)
    return math.sqrt(df) * math.tan((low + high) / 2)


_normal_cdf = np.vectorize(lambda x: 0.5 * math.erfc(-x / math.sqrt(2)))


def t_test_power(shift: float, df: int, critical: float) -> float:
    """P(|T'| > critical) for the noncentral t, T' = (Z + shift) / sqrt(V / df) with V ~ chi2(df): the power of
    a two-sided t test at that critical value when the true gap is `shift` true standard errors. Exact up to
    the quadrature: the trapezoid rule over the chi density of sqrt(V) on 4,001 points (error below 1e-6)."""
    root = np.linspace(0.0, math.sqrt(df) + 12.0, 4001)  # sqrt(V)
    log_norm = (df / 2 - 1) * math.log(2) + math.lgamma(df / 2)
    with np.errstate(divide="ignore"):
        density = (
            np.exp((df - 1) * np.log(root) - root**2 / 2 - log_norm) if df > 1 else np.exp(-(root**2) / 2 - log_norm)
        )
    scale = critical * root / math.sqrt(df)  # the critical value in units of Z
    reject = _normal_cdf(shift - scale) + _normal_cdf(-shift - scale)
    return float(np.trapezoid(density * reject, root))


@functools.lru_cache(maxsize=None)
def power_multiplier(n: int, tests: int, alpha: float = ALPHA, power: float = POWER) -> float:
    """k such that a true paired gap of k standard errors is found with `power` by the two-sided t test over n
    pairs at alpha / tests, Holm's first and strictest level (Bonferroni): the exact noncentral t (t_test_power),
    not the usual approximation t(1 - alpha / (2 tests)) + t(power), which falls short of the power it names
    (at 30 pairs and 27 tests it gives 4.28 se, detected 79% of the time). nan below 2 pairs."""
    if n < 2:
        return math.nan
    critical = t_quantile(1 - alpha / (2 * max(tests, 1)), n - 1)
    low, high = 0.0, 200.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if t_test_power(middle, n - 1, critical) < power else (low, middle)
    return (low + high) / 2


@dataclasses.dataclass
class Comparison:
    """A paired gap: its mean over the independent units (pairs, or clusters of pairs), standard error, units n,
    t = gap / se and two-sided p; after judge(), Holm's adjusted p, the detectable gap (mde), whether the gap is
    called a difference, and the half-width of its own 95% interval (ci95, not adjusted for the family).
    by_construction: the gap's direction follows from the rules' regions (region_contains), so it is stated,
    not tested: no Holm p, no call, and it is not in the family."""

    gap: float
    se: float
    n: int
    t: float
    p: float
    p_holm: float = math.nan
    mde: float = math.nan
    called: bool = False
    ci95: float = math.nan
    by_construction: bool = False


def paired(differences, clusters=None) -> Comparison:
    """The paired comparison of per-pair differences (nan pairs, where a measure is undefined, left out).

    With clusters (one hashable key per pair), pairs that share a key are not independent: each cluster's
    mean difference is one unit, so the standard error and the t test's degrees of freedom count clusters."""
    x = np.asarray(differences, dtype=float)
    keep = ~np.isnan(x)
    if clusters is not None:
        if len(clusters) != x.size:
            raise ValueError(f"clusters: {len(clusters)} keys for {x.size} differences")
        by_cluster: dict = {}
        for key, value in zip((k for k, kept in zip(clusters, keep) if kept), x[keep]):
            by_cluster.setdefault(key, []).append(value)
        x = np.array([np.mean(values) for values in by_cluster.values()], dtype=float)
    else:
        x = x[keep]
    gap, se = mean_se(x)
    if x.size < 2:
        return Comparison(gap, se, int(x.size), math.nan, math.nan)
    if se == 0:  # every unit differs by the same amount: exact
        t = 0.0 if gap == 0 else math.copysign(math.inf, gap)
    else:
        t = gap / se
    p = 1.0 if t == 0 else 2 * (1 - t_cdf(abs(t), x.size - 1)) if math.isfinite(t) else 0.0
    return Comparison(gap, se, int(x.size), t, p)


def paired_gap(arm, baseline) -> tuple[float, float, float]:
    """Mean of the per-seed differences arm - baseline, its standard error across seeds, and t = mean / se."""
    c = paired(np.asarray(arm, dtype=float) - np.asarray(baseline, dtype=float))
    return c.gap, c.se, c.t


def judge(family: list[Comparison], alpha: float = ALPHA, power: float = POWER) -> None:
    """Holm's adjusted p over the family's tests (the comparisons with a p that are not by construction); a gap
    is called a difference when its Holm p is below alpha. Each tested gap's mde is the gap that test detects
    with `power`: power_multiplier at Holm's strictest level, alpha over the number of tests, times its se
    (Holm's later steps are less strict, so it detects that gap at least that often)."""
    tested = sorted((c for c in family if not c.by_construction and not math.isnan(c.p)), key=lambda c: c.p)
    running = 0.0
    for rank, c in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * c.p))
        c.p_holm = running
    for c in family:
        c.ci95 = t_quantile(0.975, c.n - 1) * c.se if c.n >= 2 else math.nan
        if c.by_construction or math.isnan(c.p):
            c.p_holm, c.mde, c.called = math.nan, math.nan, False
            continue
        c.mde = power_multiplier(c.n, len(tested), alpha, power) * c.se
        c.called = bool(c.gap != 0 and c.p_holm < alpha)


CONTAINMENT_MU = np.logspace(-8, 0, 161)  # old probabilities at which two regions are compared


def region_contains(outer, inner) -> bool:
    """Whether outer's ratio interval (a loss.LossConfig's) holds inner's at every old probability of
    CONTAINMENT_MU, to a relative 1e-6 (the bisected bounds' error). Then on the same ratios outer stops a
    subset of the tokens inner stops, and "outer clips less" follows from the regions. False for a rule
    without a region (sapo)."""
    try:
        (outer_lo, outer_hi), (inner_lo, inner_hi) = (
            loss.ratio_bounds(
                c.rule,
                c.delta,
                torch.as_tensor(CONTAINMENT_MU),
                delta_high=c.delta_high,
                tv_half=c.tv_half,
                kl_two_sided=c.kl_two_sided,
                ratio_limits=c.ratio_limits,
            )
            for c in (outer, inner)
        )
    except ValueError:
        return False
    return bool((outer_lo <= inner_lo * (1 + 1e-6)).all() and (outer_hi >= inner_hi * (1 - 1e-6)).all())


def normal_quantile(p: float) -> float:
    """The x with P(Z <= x) = p for a standard normal Z, by bisection on its CDF (erf)."""
    if not 0 < p < 1:
        raise ValueError(f"p={p}: must be in (0, 1)")
    low, high = -40.0, 40.0
    for _ in range(200):
        middle = (low + high) / 2
        low, high = (middle, high) if 0.5 * (1 + math.erf(middle / math.sqrt(2))) < p else (low, middle)
    return (low + high) / 2


def held_out_floor(accuracy: float, problems: int, k: int, seeds: int, tests: int) -> float:
    """The accuracy gap the held-out sampling alone lets through at 80% power (normal quantiles, family
    Bonferroni): each run's accuracy is a mean of problems x k Bernoulli draws, so the variance of a gap
    between two runs is 2 p (1 - p) / (problems k) at most (less over problems of mixed difficulty), and
    seeds average it. Training noise comes on top: this is what even a deterministic trainer could not beat."""
    z = normal_quantile(1 - ALPHA / (2 * max(tests, 1))) + normal_quantile(POWER)
    return z * math.sqrt(2 * accuracy * (1 - accuracy) / (problems * k) / seeds)


def run_numbers(metrics: list[dict], summary: dict) -> dict:
    """One run's figures for the table: held-out accuracy before/after, final entropy, clip rates.

    clip: of the acting tokens (advantage not 0) in the updates after each rollout's first, the share any
    clip stopped (train.py's clip_rate, weighted by its clip_rate_tokens); clip_all: the tokens whose
    gradient a clip stopped, over all completion tokens, first updates included (steps weighted by
    their mean completion length: each samples the same number of completions). Per bucket of old
    probability the same two, over the bucket's tokens.
    """
    steps = [m for m in metrics if "clip_low_frac" in m]
    if not steps:
        raise ValueError("the run logged no training steps")
    tokens = np.array([m["completion_length"] for m in steps], dtype=float)
    clip = np.array([m["clip_low_frac"] + m["clip_high_frac"] + m.get("limit_clip_frac", 0.0) for m in steps])
    all_by_bucket, by_bucket = {}, {}
    for label in MU_LABELS:
        count = tokens * np.array([m[f"mu[{label}]/share"] for m in steps])
        rate = np.array([m[f"mu[{label}]/clip_frac"] + m.get(f"mu[{label}]/limit_frac", 0.0) for m in steps])
        all_by_bucket[label] = float((rate * count).sum() / count.sum()) if count.sum() > 0 else math.nan
        by_bucket[label] = _weighted_rate(steps, f"mu[{label}]/")
    return {
        "before": summary["before"]["accuracy"],
        "after": summary["after"]["accuracy"],
        "final_entropy": steps[-1]["entropy"],
        "clip": _weighted_rate(steps, ""),
        "clip_all": float((clip * tokens).sum() / tokens.sum()),
        "clip_by_bucket": by_bucket,
        "clip_all_by_bucket": all_by_bucket,
    }


def _weighted_rate(steps: list[dict], prefix: str) -> float:
    """A rate train.py logs per step with its token count (clip_rate, clip_rate_tokens), over the run; nan
    where no step has it (one update per rollout, or metrics that do not log the rate)."""
    pairs = [
        (m[f"{prefix}clip_rate"], m[f"{prefix}clip_rate_tokens"])
        for m in steps
        if m.get(f"{prefix}clip_rate") is not None
    ]
    count = sum(n for _, n in pairs)
    return sum(rate * n for rate, n in pairs) / count if count else math.nan


GAP_KEYS = ("after", "final_entropy", "clip")
CLIP_KEYS = ("clip",)  # the gaps a containment of regions decides (region_contains)


def arm_rows(
    results: dict[str, dict[int, dict]], baseline: str = "grpo", flags: dict[str, list[str]] | None = None
) -> list[dict]:
    """Per arm: means over seeds with standard errors, and gaps to the baseline arm paired by seed (held-out
    accuracy after training, final entropy, clip rate), all the table's tested gaps judged as one family.
    The unit is the seed: each seed is its own training run, with its own prompts, streams and held-out draws.
    An arm whose region holds the baseline's at every old probability (flags: each arm's train.py flags,
    default ARMS) has its clip-rate gap by construction, stated and not tested."""
    flags = flags or {}
    base_loss = config.parse_args(flags.get(baseline, ARMS.get(baseline, [])))[0].loss if baseline in results else None
    rows = []
    for arm, by_seed in results.items():
        seeds = sorted(by_seed)
        column = {
            key: [by_seed[s][key] for s in seeds] for key in ("before", "after", "final_entropy", "clip", "clip_all")
        }
        row = {
            "arm": arm,
            "seeds": len(seeds),
            **{key: mean_se(values) for key, values in column.items()},
            "clip_by_bucket": {
                label: float(np.nanmean([by_seed[s]["clip_by_bucket"][label] for s in seeds]))
                if any(not math.isnan(by_seed[s]["clip_by_bucket"][label]) for s in seeds)
                else math.nan
                for label in MU_LABELS
            },
        }
        shared = [s for s in seeds if s in results.get(baseline, {})] if arm != baseline else []
        row["gaps"] = (
            {key: paired([by_seed[s][key] - results[baseline][s][key] for s in shared]) for key in GAP_KEYS}
            if shared
            else None
        )
        own_flags = flags.get(arm, ARMS.get(arm))
        if row["gaps"] and own_flags is not None and base_loss is not None:
            contains = region_contains(config.parse_args(own_flags)[0].loss, base_loss)
            for key in CLIP_KEYS:
                row["gaps"][key].by_construction = contains
        rows.append(row)
    judge([row["gaps"][key] for row in rows if row["gaps"] for key in GAP_KEYS])
    return rows


def _pct(x: float, se: float | None = None, sign: str = "") -> str:
    if math.isnan(x):
        return "-"
    return f"{x * 100:{sign}.1f}" + (f" ± {se * 100:.1f}" if se is not None and not math.isnan(se) else "")


def _gap(c: Comparison, scale: float, digits: int) -> str:
    """'gap ± se' to the baseline, * when called a difference; '-' for the baseline itself."""
    if math.isnan(c.gap):
        return "-"
    text = f"{c.gap * scale:+.{digits}f}" + ("" if math.isnan(c.se) else f" ± {c.se * scale:.{digits}f}")
    return text + (" *" if c.called else " (by construction)" if c.by_construction else "")


def _number(x: float, digits: int = 1, scale: float = 100) -> str:
    return "-" if math.isnan(x) else f"{x * scale:.{digits}f}"


def power_lines(rows: list[dict], problems: int, k: int) -> list[str]:
    """What the design can detect, stated before any gap: per arm the gap its test finds with 80% power."""
    family = [c for row in rows if row["gaps"] for c in row["gaps"].values()]
    tests = sum(1 for c in family if not c.by_construction and not math.isnan(c.p))
    seeds = max(row["seeds"] for row in rows)
    multiplier = power_multiplier(seeds, tests)
    accuracy = float(np.nanmean([row["after"][0] for row in rows]))
    floor = held_out_floor(accuracy, problems, k, seeds, tests) if 0 < accuracy < 1 else math.nan
    construction = len(family) - tests
    lines = [
        f"Power first. The unit is the seed: {seeds} seeds, each arm's run paired with grpo's of the same seed "
        f"(the same prompts in the same order, the same held-out problems); held-out {problems} problems x {k} "
        f"samples. The family is the table's {tests} tested gaps (accuracy, entropy and clip rate of each arm"
        + (
            f"; {construction} clip-rate gaps follow from the regions and are stated by construction"
            if construction
            else ""
        )
        + f"), two-sided at 5% over it with Holm's correction: a gap is called a difference (*) when its Holm p "
        f"is below 0.05. A gap of {_number(multiplier, 2, 1)} of its standard errors is detected with 80% power "
        f"(paired t, {seeds - 1} df, at Holm's strictest level 0.05 / {tests}; exact noncentral t). The held-out "
        f"sampling alone (binomial, at the mean accuracy {_number(accuracy)}%) puts a floor of {_number(floor)} "
        f"points under a detectable accuracy gap.",
        "",
        "| arm | detectable accuracy gap, points | detectable entropy gap | detectable clip-rate gap, points |",
        "| --- | --: | --: | --: |",
    ]
    for row in rows:
        if row["gaps"]:
            g = row["gaps"]
            clip = "by construction" if g["clip"].by_construction else _number(g["clip"].mde)
            lines.append(
                f"| {row['arm']} | {_number(g['after'].mde)} | {_number(g['final_entropy'].mde, 3, 1)} | {clip} |"
            )
    return lines


def markdown_table(rows: list[dict], baseline: str = "grpo", problems: int = 0, k: int = 0) -> str:
    """The power statement, then two markdown tables: held-out accuracy with the paired gap, the diagnostics."""
    lines = power_lines(rows, problems, k) + [""] if any(row["gaps"] for row in rows) and problems else []
    lines += [
        f"| arm | train.py flags | seeds | held-out before % | after % | after - {baseline} % | t | Holm p |",
        "| --- | --- | --: | --: | --: | --: | --: | --: |",
    ]
    for r in rows:
        c = r["gaps"]["after"] if r["gaps"] else Comparison(math.nan, math.nan, 0, math.nan, math.nan)
        t = "-" if math.isnan(c.t) else f"{c.t:+.1f}"
        holm = "-" if math.isnan(c.p_holm) else f"{c.p_holm:.2f}"
        lines.append(
            f"| {r['arm']} | `{' '.join(r.get('flags', ARMS.get(r['arm'], [])))}` | {r['seeds']} "
            f"| {_pct(*r['before'])} | {_pct(*r['after'])} | {_gap(c, 100, 1)} | {t} | {holm} |"
        )
    lines += [
        "",
        f"| arm | final entropy | - {baseline} | clipped % (acting, after 1st) | - {baseline} "
        f"| clipped % (all tokens) | " + " | ".join(f"at mu {b}" for b in MU_LABELS) + " |",
        "| --- | --: | --: | --: | --: | --: | " + " | ".join("--:" for _ in MU_LABELS) + " |",
    ]
    for r in rows:
        entropy, entropy_se = r["final_entropy"]
        entropy_text = f"{entropy:.3f}" + (f" ± {entropy_se:.3f}" if not math.isnan(entropy_se) else "")
        buckets = " | ".join(_pct(r["clip_by_bucket"][b]) for b in MU_LABELS)
        none = Comparison(math.nan, math.nan, 0, math.nan, math.nan)
        lines.append(
            f"| {r['arm']} | {entropy_text} | {_gap(r['gaps']['final_entropy'] if r['gaps'] else none, 1, 3)} "
            f"| {_pct(*r['clip'])} | {_gap(r['gaps']['clip'] if r['gaps'] else none, 100, 1)} "
            f"| {_pct(*r['clip_all'])} | {buckets} |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- runs


def add_train_flags(parser: argparse.ArgumentParser, skip: tuple[str, ...] = ()) -> None:
    """--setting, --model and the TRAIN_FLAGS (but `skip`) on a parser; resolve_setting fills the rest."""
    parser.add_argument(
        "--setting",
        choices=tuple(SETTINGS),
        default="binding",
        help="prompts per step, updates per rollout and learning rate: "
        + "; ".join(
            f"{name} {v['prompts_per_step']}, {v['updates_per_rollout']} and {v['lr']:g}"
            for name, v in SETTINGS.items()
        )
        + " (default: %(default)s)",
    )
    parser.add_argument("--model", default=None, help="model for train.py (default: the offline SmolLM2-135M)")
    for name, (default, text) in TRAIN_FLAGS.items():
        if name not in skip:
            parser.add_argument(
                f"--{name.replace('_', '-')}",
                type=FLAG_TYPES.get(name, type(default)),
                default=default,
                help=text if default is None else f"{text} (default: %(default)s)",
            )


def resolve_setting(args: argparse.Namespace) -> None:
    """Flags left at None take the setting's values."""
    for name, value in SETTINGS[args.setting].items():
        if getattr(args, name) is None:
            setattr(args, name, value)


def train_flags(args: argparse.Namespace, exclude: tuple[str, ...] = ()) -> list[str]:
    """The train.py flags every run of the study shares."""
    flags = [] if args.model is None else ["--model", args.model]
    for name in TRAIN_FLAGS:
        if name not in exclude:
            flags += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    return flags + args.train_args


def run_command(run_dir: Path, arm_flags: list[str], seed: int, shared: list[str]) -> list[str] | None:
    """The train.py command that finishes this run, or None when it is finished already."""
    if (run_dir / "summary.json").is_file():
        return None
    train = [sys.executable, str(ROOT / "train.py")]
    if rundir.has_checkpoint(run_dir):  # continue from there
        return train + ["--resume", str(run_dir)]
    shutil.rmtree(run_dir, ignore_errors=True)  # a start that died before its first checkpoint
    return (
        train + shared + arm_flags + ["--seed", str(seed), "--run-name", run_dir.name, "--out-dir", str(run_dir.parent)]
    )


class Runs:
    """train.py processes running at once, each with its output appended to a log.

    Stopping the study (Ctrl-C, which reaches the runs as well, or SIGTERM, passed on to them) lets every
    run finish its step and checkpoint before the study exits: a study restarted at once never races one.
    A failed run lets the others finish, then stops the study with its log's name.
    """

    AGAIN = "Run the same command again to continue the study."

    def __enter__(self):
        self.running, self.stop, self.failed = {}, [], None
        self.previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _on_signal(self, signum, frame):
        if not self.stop:
            self.stopped_logs = [str(log) for _, log in self.running.values()]
        self.stop.append(signum)
        if signum == signal.SIGTERM:
            for process, _ in self.running.values():
                process.send_signal(signal.SIGTERM)

    @property
    def accepting(self) -> bool:
        return not self.stop and self.failed is None

    def start(self, name: str, command: list[str], log: Path) -> None:
        with log.open("a") as f:
            self.running[name] = (subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT), log)

    def wait(self, all_of_them: bool = False) -> list[str]:
        """Wait until a run (every run) ends; the names of those that ended well. Raises SystemExit once none
        is running after a stop or a failure."""
        ended = []
        while self.running and not (ended and not all_of_them):
            for name, (process, log) in list(self.running.items()):
                if process.poll() is None:
                    continue
                del self.running[name]
                if process.returncode == 0:
                    ended.append(name)
                elif self.failed is None and not self.stop:
                    self.failed = (process.returncode, log)
            if self.running:
                time.sleep(0.2)
        if not self.running and self.stop:
            logs = ", ".join(self.stopped_logs)
            raise SystemExit(f"study.py: stopped; the run checkpointed (output in {logs}). {self.AGAIN}")
        if not self.running and self.failed is not None:
            code, log = self.failed
            if code == 2:  # train.py refused its settings or a file: running it again would not help
                last = log.read_text().strip().splitlines()[-1:] or ["(no output)"]
                raise SystemExit(f"study.py: a run refused to start: {last[0]} (output in {log})")
            raise SystemExit(f"study.py: a run failed (exit status {code}); its output is in {log}. {self.AGAIN}")
        return ended


def run_train(command: list[str], log: Path) -> None:
    """One train.py run to its end, its output appended to log (see Runs)."""
    with Runs() as runs:
        runs.start(log.stem, command, log)
        runs.wait(all_of_them=True)


def read_run(run_dir: Path) -> dict:
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return run_numbers(metrics, json.loads((run_dir / "summary.json").read_text()))


def check_flags(args: argparse.Namespace) -> None:
    """Every arm's train.py command is parsed and checked as train.py would, before anything is written:
    a bad flag is one line now, not a failed run and a study folder holding the bad flags. An -eq arm is
    checked with its base arm's flags (its delta comes later, from the pilot's records)."""
    for arm in args.arms:
        try:
            base = ARMS[arm.removesuffix(EQUAL_RATE)]
            config.parse_args([*train_flags(args), *base, "--seed", str(args.seeds - 1)])
        except ValueError as error:
            print(f"study.py: arm {arm}: {error}", file=sys.stderr)
            raise SystemExit(2) from None


def check_settings(
    out: Path, settings: dict, keys: tuple[str, ...] = ("train_flags",), started: bool | None = None
) -> None:
    """A study directory holds one grid's settings; other settings there would mix runs silently. A folder
    where nothing started (by default: none of the grid's runs got to a checkpoint) takes new settings."""
    path = out / "study.json"
    if started is None:
        started = any(rundir.has_checkpoint(run) or (run / "summary.json").is_file() for run in out.glob("runs/*"))
    if path.is_file() and started:
        before = json.loads(path.read_text())
        for key in keys:
            if before.get(key) != settings[key]:
                shown = (
                    " ".join(before[key])
                    if isinstance(before.get(key), list) and key == "train_flags"
                    else before.get(key)
                )
                name = "train.py flags" if key == "train_flags" else key.replace("_", " ")
                raise SystemExit(
                    f"{sys.argv[0].split('/')[-1]}: {out} holds a study run with other {name} "
                    f"({shown}); pass the same or another --out"
                )
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(settings, indent=1) + "\n")


def grid_calibration(out: Path, shared: list[str], arms: list[str]) -> dict:
    """The -eq arms' deltas from grpo-s0's per-token records (the pilot), kept in OUT/calibration.json."""
    path = out / "calibration.json"
    if path.is_file():
        return json.loads(path.read_text())
    pilot = out / "runs" / "grpo-s0"
    calibration = calibrate_arms(calibrate.read_token_records(pilot), shared, arms, source=str(pilot))
    rundir.write_json(path, calibration)
    for arm, why in calibration["unreachable"].items():
        print(f"study.py: {arm} left out: {why}", flush=True)
    return calibration


def run_grid(args: argparse.Namespace) -> tuple[dict[str, dict[int, dict]], dict, dict[str, list[str]]]:
    """Every (arm, seed) run to its end, --workers at a time; returns the runs' numbers, the calibration and
    each arm's flags. grpo-s0 runs first: its per-token records calibrate the -eq arms, which wait for it."""
    check_flags(args)
    shared = train_flags(args)
    check_settings(args.out, {"train_flags": shared, "arms": args.arms})
    (args.out / "logs").mkdir(exist_ok=True)
    plan = [(arm, seed) for seed in range(args.seeds) for arm in args.arms]  # seed-major: early rows compare arms
    plan.sort(key=lambda run: run != ("grpo", 0))
    pilot = args.out / "runs" / "grpo-s0"
    calibration, flags = {}, {}
    started, total = time.time(), len(plan)
    with Runs() as runs:
        while runs.accepting and plan:
            ready = [
                run
                for run in plan
                if not run[0].endswith(EQUAL_RATE) or calibration or (pilot / "summary.json").is_file()
            ]
            if not ready or len(runs.running) >= args.workers:
                if not runs.running:
                    raise SystemExit(f"study.py: the -eq arms wait for {pilot}, which did not run")
                runs.wait()
                continue
            arm, seed = ready[0]
            plan.remove((arm, seed))
            if arm.endswith(EQUAL_RATE) and not calibration:
                calibration = grid_calibration(args.out, shared, args.arms)
            if arm in calibration.get("unreachable", {}):
                continue
            flags[arm] = arm_flags(arm, calibration.get("deltas"))
            run_dir = args.out / "runs" / f"{arm}-s{seed}"
            command = run_command(run_dir, flags[arm], seed, shared)
            if command is None:
                continue
            print(
                f"[{total - len(plan)}/{total}] {run_dir.name} ({time.time() - started:.0f} s into the study): "
                f"{' '.join(command[1:])}",
                flush=True,
            )
            runs.start(run_dir.name, command, args.out / "logs" / f"{run_dir.name}.log")
        runs.wait(all_of_them=True)
    results = {
        arm: {seed: read_run(args.out / "runs" / f"{arm}-s{seed}") for seed in range(args.seeds)}
        for arm in args.arms
        if arm in flags
    }
    return results, calibration, flags


def plot(out: Path, arms: list[str], seeds: int) -> None:
    """plot.py's figures, one folder per seed, the arms overlaid (the same prompts for each)."""
    from research import plot as plots  # matplotlib loads only when the figures are drawn

    for seed in range(seeds):
        paths = [out / "runs" / f"{arm}-s{seed}" for arm in arms]
        runs = [plots.load_run(path, name) for path, name in zip(paths, plots.run_names(paths))]
        (out / "figures" / f"seed-{seed}").mkdir(parents=True, exist_ok=True)
        plots.plot_runs(runs, out / "figures" / f"seed-{seed}", smooth=1)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = config.OneLineErrors(
        prog="study.py",
        description=__doc__.split("\n")[0],
        allow_abbrev=False,
        epilog="Flags after -- are passed to every train.py run.",
    )
    parser.add_argument("--seeds", type=int, default=3, help="seeds per arm, 0..N-1 (default: %(default)s)")
    parser.add_argument(
        "--arms", default=DEFAULT_ARMS, help=f"comma-separated, of {', '.join(all_arms())} (default: %(default)s)"
    )
    parser.add_argument("--out", type=Path, default=Path("runs/study"), help="study directory (default: %(default)s)")
    parser.add_argument(
        "--workers",
        type=int,
        default=2,
        help="train.py runs at once (default: %(default)s, for two CPU cores with OMP_NUM_THREADS=1)",
    )
    add_train_flags(parser)
    argv = sys.argv[1:] if argv is None else list(argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser.parse_args(argv[:cut])
    args.train_args = argv[cut + 1 :]
    args.arms = check_arms(parser, args.arms)
    if args.seeds < 1 or args.workers < 1:
        parser.error(f"--seeds {args.seeds} and --workers {args.workers}: must be >= 1")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    resolve_setting(args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    started = time.time()
    results, calibration, flags = run_grid(args)
    rows = arm_rows(results, flags=flags)
    for row in rows:
        row["flags"] = flags[row["arm"]]
    table = markdown_table(rows, problems=args.eval_problems, k=args.eval_k)
    (args.out / "table.md").write_text(table)
    summary = {
        "train_flags": train_flags(args),
        "arms": flags,
        "calibration": calibration,
        "runs": results,
        "rows": [
            {**row, "gaps": {key: dataclasses.asdict(c) for key, c in row["gaps"].items()} if row["gaps"] else None}
            for row in rows
        ],
    }
    (args.out / "results.json").write_text(json.dumps(strict_json(summary), indent=1, allow_nan=False) + "\n")
    plot(args.out, list(results), args.seeds)
    print(table + f"\n{args.out}: table.md, results.json, figures/, runs/ ({time.time() - started:.0f} s)")


if __name__ == "__main__":
    main()
