"""A run's per-token records, and clip rules compared at equal clip rate over them.

    python -m research.calibrate runs/NAME --rules grpo,atr,kl-atomic,interval --target-rate 0.02

train.py --log-tokens N writes, each step, a seeded sample of N tokens of policy_loss's records
(old probability mu, ratio w, advantage, which clip stopped it, the update of the rollout it is from) to
RUN/tokens/step-STEP.npz. calibrate_delta finds the delta at which a rule stops a given share of
recorded tokens, counted as policy_loss counts them (outside the region and pushed outward); the report
puts rules side by side at equal clip rate and at equal expected log-width, with each rule's clip rate
per old-probability bucket. Rates are over the acting tokens: advantage not 0, after a rollout's first
update (where w = 1 and nothing clips). This works on run directories, not on a batch, so it is a file
of its own; loss.py keeps the rules and their bounds.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

import loss


class _Recorded(NamedTuple):
    """Recorded tokens in the forms the region tests take, float64 [n]; outward: A*(w-1) > 0, or all."""

    old_logp: Tensor
    log_w: Tensor
    w: Tensor
    outward: Tensor

    @classmethod
    def of(cls, mu, w, advantages: Tensor | None) -> _Recorded:
        mu, w = loss.as_probabilities("mu", mu), torch.as_tensor(w, dtype=torch.float64)
        if w.shape != mu.shape or not (w > 0).all():
            raise ValueError(f"w must be positive with mu's shape {tuple(mu.shape)}, got {tuple(w.shape)}")
        outward = torch.ones_like(w, dtype=torch.bool) if advantages is None else advantages.double() * (w - 1) > 0
        return cls(mu.log(), w.log(), w, outward)

    def clipped(self, cfg: loss.LossConfig) -> Tensor:
        """Tokens outside the region or the ratio limits and pushed outward: what policy_loss stops."""
        outside = ~loss.inside(loss.get_rule(cfg.rule), self.log_w, self.old_logp, cfg)
        if cfg.ratio_limits is not None:
            outside |= (self.w < cfg.ratio_limits[0]) | (self.w > cfg.ratio_limits[1])
        return outside & self.outward


def calibrate_delta(
    rule: str | tuple[str, str], mu, w, target_clip_frac: float, *, advantages: Tensor | None = None, **options
) -> float:
    """The smallest delta whose region clips at most target_clip_frac of recorded (mu, w) pairs.

    Without advantages a token counts as clipped when it is outside the region; with them, only when
    it is also pushed outward (what policy_loss reports). Asymmetric rules keep delta_high/delta fixed;
    for gspo pass sequence ratios as w. Bisection: regions grow with delta, so the fraction only falls.
    """
    cfg = loss.LossConfig(rule=rule, **options)
    spec = loss.get_rule(cfg.rule)
    if spec.needs or cfg.delta is None:
        why = f"it needs {', '.join(spec.needs)}" if spec.needs else "it has no delta"
        raise ValueError(f"rule {rule!r} cannot be calibrated on (mu, w) pairs: {why}")
    if not 0 <= target_clip_frac <= 1:
        raise ValueError(f"target_clip_frac must be in [0, 1], got {target_clip_frac}")
    tokens = _Recorded.of(mu, w, advantages)
    high_per_low = cfg.delta_high / cfg.delta if cfg.delta else 1.0

    def clip_frac(delta: float) -> float:
        resized = dataclasses.replace(cfg, delta=delta, delta_high=delta * high_per_low)
        return tokens.clipped(resized).double().mean().item()

    low, high = 0.0, cfg.delta or 1.0
    while clip_frac(high) > target_clip_frac:
        if high > 1e6:  # e.g. DCPO never admits w > 10
            raise ValueError(f"target_clip_frac={target_clip_frac} is unreachable for rule {rule!r}")
        high *= 2
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (low, middle) if clip_frac(middle) <= target_clip_frac else (middle, high)
    return high


def expected_log_width(rule: str | tuple[str, str], delta: float | None, mu, **options) -> float:
    """Mean over mu of log(hi) - log(lo), each side clamped to +-loss.LOG_RATIO_CAP (the loss sees no further)."""
    lo, hi = loss.ratio_bounds(rule, delta, mu, **options)
    return (hi.log().clamp(max=loss.LOG_RATIO_CAP) - lo.log().clamp(min=-loss.LOG_RATIO_CAP)).mean().item()


def delta_for_width(rule: str | tuple[str, str], width: float, mu, **options) -> float | None:
    """The delta whose expected log-width over mu equals `width`; None where no delta reaches it."""
    low, high = 0.0, loss.LossConfig(rule=rule, **options).delta or 1.0
    while expected_log_width(rule, high, mu, **options) < width:
        if high > 1e6:
            return None
        high *= 2
    for _ in range(40):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_log_width(rule, middle, mu, **options) < width else (low, middle)
    return high


# ----------------------------------------------------------------------------- per-token records


def write_token_records(path: Path, records: list[dict], n: int, seed: int) -> None:
    """Concatenate policy_loss records, keep a seeded sample of n tokens (all if fewer), write one .npz
    atomically (a temporary file, then a rename: a crash never leaves half a file)."""
    if not records or n < 1:
        raise ValueError(f"write_token_records needs records and n >= 1, got {len(records)} records and n={n}")
    columns = {name: np.concatenate([r[name] for r in records]) for name in records[0]}
    total = len(columns["mu"])
    if n < total:
        keep = np.sort(np.random.default_rng(seed).choice(total, n, replace=False))
        columns = {name: column[keep] for name, column in columns.items()}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".tmp")
    with open(partial, "wb") as f:  # a file object: np.savez would add .npz to a name
        np.savez_compressed(f, **columns)
    os.replace(partial, path)


def read_token_records(run_dir: str | Path) -> dict[str, np.ndarray]:
    """All of a run's records, run_dir/tokens/step-*.npz, as columns with a `step` column added."""
    files = sorted(Path(run_dir, "tokens").glob("step-*.npz"))
    if not files:
        raise FileNotFoundError(
            f"{Path(run_dir, 'tokens')} holds no step-*.npz files: per-token records are "
            "written by train.py --log-tokens N"
        )
    parts = []
    for file in files:
        with np.load(file) as data:
            part = dict(data)
        part["step"] = np.full(len(part["mu"]), int(file.stem.split("-")[1]), dtype=np.int64)
        parts.append(part)
    return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}


# ----------------------------------------------------------------------------- calibrate from a run


def acting_tokens(records: dict[str, np.ndarray]) -> np.ndarray:
    """Bool mask of the records a clip can act on: non-zero advantage and, where the records say which update
    of the rollout they are from (train.py writes `update`), not the first one, where w = 1."""
    acting = records["advantage"] != 0
    return acting & (records["update"] > 0) if "update" in records else acting


def calibrate_to(records: dict[str, np.ndarray], cfg: loss.LossConfig, target_rate: float) -> float:
    """The delta at which cfg's rule (its other fields as they are: ratio limits, delta_high/delta) stops
    target_rate of the acting tokens of a run's records, counted as policy_loss counts them."""
    acting = acting_tokens(records)
    mu, w, adv = (torch.as_tensor(records[name][acting], dtype=torch.float64) for name in ("mu", "w", "advantage"))
    options = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.name != "rule"}
    return calibrate_delta(cfg.rule, mu, w, target_rate, advantages=adv, **options)


def calibration_report(
    records: dict[str, np.ndarray],
    rules: list[str],
    target_rate: float,
    ratio_limits: tuple[float, float] = (0.5, 10.0),
) -> list[str]:
    """Lines comparing rules at equal clip rate and at equal expected log-width (the first rule's).

    Rates are over the acting tokens (acting_tokens: non-zero advantage, after a rollout's first update);
    each rule's rate over every recorded token follows in brackets. A rule with a delta
    is calibrated to target_rate; one without a delta but with an interval (the `interval` arm) is not
    calibratable and is reported at ratio_limits.
    """
    for rule in rules:
        spec = loss.get_rule(loss.LossConfig(rule=rule).rule)
        if spec.needs or spec.bounds is None:
            raise ValueError(
                f"rule {rule!r} cannot be calibrated on per-token records: "
                + (f"it needs {', '.join(spec.needs)}" if spec.needs else "it has no trust region")
            )
    acting = torch.as_tensor(acting_tokens(records))
    if not acting.any():
        raise ValueError("the records hold no token a clip can act on (all advantages zero, or one update per rollout)")
    mu, w, adv = (torch.as_tensor(records[name], dtype=torch.float64) for name in ("mu", "w", "advantage"))
    every_token = _Recorded.of(mu, w, adv)
    mu, w, adv = mu[acting], w[acting], adv[acting]
    tokens = _Recorded.of(mu, w, adv)
    bucket = torch.bucketize(mu, torch.tensor(loss.MU_EDGES, dtype=torch.float64))
    mu_quantiles = torch.quantile(mu, (torch.arange(1000, dtype=torch.float64) + 0.5) / 1000)  # for E[width]
    lines = [
        f"{len(mu)} acting tokens (advantage not 0, after a rollout's first update) of {len(acting)} recorded, "
        f"from {len(np.unique(records['step']))} steps; clip rate = acting tokens outside the region and pushed "
        f"outward (as policy_loss counts), [over every recorded token]; target {target_rate:.2%}",
        "equal width: E over the acting tokens' mu of log(hi) - log(lo), each side within "
        f"+-{loss.LOG_RATIO_CAP:g}, equal to {rules[0]}'s",
    ]
    reference_width = None
    for rule in rules:
        if loss.LossConfig(rule=rule).delta is None:
            delta, options = None, {"ratio_limits": ratio_limits}
            head = f"{rule}: not calibratable (no delta), at limits {ratio_limits[0]:g},{ratio_limits[1]:g}"
        else:
            delta, options = calibrate_delta(rule, mu, w, target_rate, advantages=adv), {}
            head = f"{rule}: delta {delta:.6g}"
        rule_cfg = loss.LossConfig(rule=rule, delta=delta, **options)
        clipped, everywhere = tokens.clipped(rule_cfg).double(), every_token.clipped(rule_cfg).double()
        by_bucket = [
            clipped[bucket == i].mean().item() if (bucket == i).any() else math.nan for i in range(len(loss.MU_LABELS))
        ]
        intervals = [loss.ratio_bounds(rule, delta, m, **options) for m in (0.5, 0.05, 0.005)]
        width = expected_log_width(rule, delta, mu_quantiles, **options)
        reference_width = width if reference_width is None else reference_width
        equal = delta_for_width(rule, reference_width, mu_quantiles) if delta is not None else None
        lines += [
            f"{head}  clips {clipped.mean().item():.2%} [{everywhere.mean().item():.2%}]  E[log width] {width:.4g}",
            "  interval at mu 0.5 / 0.05 / 0.005: "
            + "  ".join(f"[{lo.item():.4g}, {hi.item():.4g}]" for lo, hi in intervals),
            "  clip rate by old probability: "
            + "  ".join(f"{label} {rate:.2%}" for label, rate in zip(loss.MU_LABELS, by_bucket)),
            f"  delta for equal width {reference_width:.4g}: "
            + (f"{equal:.6g}" if equal is not None else "none (no delta, or out of reach)"),
        ]
    return lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="calibrate.py",
        description="Compare clip rules at equal clip rate on a run's per-token records.",
        allow_abbrev=False,
    )
    parser.add_argument("run_dir", type=Path, help="a run directory with tokens/step-*.npz (train.py --log-tokens)")
    parser.add_argument("--rules", default="grpo,atr,kl-atomic,interval", help="comma-separated rules")
    parser.add_argument("--target-rate", type=float, required=True, help="clip rate to calibrate each delta to")
    parser.add_argument("--ratio-limits", default="0.5,10", help="lo,hi of the interval rule")
    args = parser.parse_args(argv)
    rules = [rule for rule in args.rules.split(",") if rule]
    try:
        limits = loss.LossConfig(rule="interval", ratio_limits=args.ratio_limits).ratio_limits
        if not rules or not 0 <= args.target_rate <= 1:
            raise ValueError(
                f"--rules {args.rules!r} --target-rate {args.target_rate}: expected rule names and a rate in [0, 1]"
            )
        records = read_token_records(args.run_dir)
        print("\n".join(calibration_report(records, rules, args.target_rate, limits)))
    except (ValueError, FileNotFoundError) as error:
        parser.error(str(error))


if __name__ == "__main__":
    main()
