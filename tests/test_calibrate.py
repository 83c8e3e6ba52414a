"""Tests for calibrate.py: per-token records written and read back, and deltas calibrated to a clip rate."""

import math

import numpy as np
import pytest
import torch

from loss import LossConfig, policy_loss, ratio_bounds
from research.calibrate import calibrate_delta, calibration_report, main, read_token_records, write_token_records
from test_loss import random_tokens

f64 = torch.float64


def test_calibrate_delta_reaches_the_target_clip_fraction():
    g = torch.Generator().manual_seed(11)
    mu = torch.empty(1000, dtype=f64).uniform_(1e-3, 1, generator=g)
    w = torch.exp(0.3 * torch.randn(1000, dtype=f64, generator=g))
    delta = calibrate_delta("grpo", mu, w, 0.1)
    assert delta == pytest.approx((w - 1).abs().sort().values[899].item(), rel=1e-9)  # 100 tokens above it
    delta = calibrate_delta("kl3", mu, w, 0.1)
    assert delta == pytest.approx((w - 1 - w.log()).sort().values[899].item(), rel=1e-9)
    delta = calibrate_delta(("kl", "atomic"), mu, w, 0.05)
    assert delta == pytest.approx((mu * w.log().abs()).sort().values[949].item(), rel=1e-9)
    adv = torch.randn(1000, dtype=f64, generator=g)
    delta = calibrate_delta("grpo", mu, w, 0.1, advantages=adv)
    outward_distance = torch.where(adv * (w - 1) > 0, (w - 1).abs(), 0)
    assert delta == pytest.approx(outward_distance.sort().values[899].item(), rel=1e-9)


def test_records_agree_with_the_metrics_and_round_trip(tmp_path):
    logp, old_logp, adv, mask = random_tokens(B=8, T=16, seed=14, spread=1.0, min_prob=1e-3)
    cfg = LossConfig(rule="kl-atomic", ratio_limits=(0.7, 1.5), dual_clip=3.0)
    records = []
    for rows in (slice(0, 5), slice(5, 8)):
        _, metrics = policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows], cfg, records=records)
        r = records[-1]
        assert len(r["mu"]) == mask[rows].sum()
        assert r["region_low"].mean() == pytest.approx(metrics["clip_low_frac"], abs=1e-12)
        assert r["region_high"].mean() == pytest.approx(metrics["clip_high_frac"], abs=1e-12)
        assert r["limit"].mean() == pytest.approx(metrics["limit_clip_frac"], abs=1e-12)
        assert not (r["region_low"] & r["limit"]).any() and not (r["region_high"] & r["limit"]).any()
        np.testing.assert_allclose(r["mu"], old_logp[rows][mask[rows]].exp().numpy(), rtol=1e-6)
        np.testing.assert_allclose(r["w"], (logp - old_logp)[rows][mask[rows]].exp().detach().numpy(), rtol=1e-6)
    assert all(records[0][k].any() for k in ("region_low", "region_high", "limit"))
    total = int(mask.sum())
    write_token_records(tmp_path / "run" / "tokens" / "step-000003.npz", records, n=10**6, seed=0)
    write_token_records(tmp_path / "run" / "tokens" / "step-000007.npz", records, n=20, seed=0)
    assert not list((tmp_path / "run" / "tokens").glob("*.tmp"))
    back = read_token_records(tmp_path / "run")
    assert len(back["mu"]) == total + 20 and (back["step"] == np.repeat([3, 7], [total, 20])).all()
    for name in ("mu", "w", "advantage", "region_low", "region_high", "limit"):
        assert np.array_equal(back[name][:total], np.concatenate([r[name] for r in records])), name
    assert back["region_low"].dtype == bool and back["mu"].dtype == np.float32
    write_token_records(tmp_path / "again.npz", records, n=20, seed=0)
    assert np.array_equal(np.load(tmp_path / "again.npz")["w"], back["w"][total:])  # seeded sample
    with pytest.raises(FileNotFoundError, match="--log-tokens"):
        read_token_records(tmp_path / "empty")


def synthetic_run(tmp_path, n=5000, seed=15):
    """A run's records drawn from a loss at atr delta 0.07: old probabilities log-uniform, w log-normal."""
    g = torch.Generator().manual_seed(seed)
    old_logp = torch.empty(1, n, dtype=f64).uniform_(math.log(1e-3), math.log(0.95), generator=g)
    log_w = 0.2 * torch.randn(1, n, dtype=f64, generator=g)
    adv = torch.randn(1, n, dtype=f64, generator=g)
    records = []
    _, metrics = policy_loss(
        old_logp + log_w,
        old_logp,
        adv,
        torch.ones(1, n, dtype=torch.bool),
        LossConfig(rule="atr", delta=0.07),
        records=records,
    )
    write_token_records(tmp_path / "tokens" / "step-000001.npz", records, n=n, seed=0)
    return metrics["clip_low_frac"] + metrics["clip_high_frac"]


def test_calibration_recovers_a_known_delta_from_a_run(tmp_path, capsys):
    rate = synthetic_run(tmp_path)
    records = read_token_records(tmp_path)
    mu, w, adv = (torch.as_tensor(records[k], dtype=f64) for k in ("mu", "w", "advantage"))
    assert calibrate_delta("atr", mu, w, rate, advantages=adv) == pytest.approx(0.07, rel=5e-3)
    main([str(tmp_path), "--rules", "atr,grpo,kl-atomic,interval", "--target-rate", str(rate)])
    out = capsys.readouterr().out
    assert float(out.split("atr: delta ")[1].split()[0]) == pytest.approx(0.07, rel=5e-3)
    assert "interval: not calibratable" in out and "<0.01" in out
    lines = out.splitlines()
    grpo = lines.index(next(line for line in lines if line.startswith("grpo: delta")))
    assert f"clips {rate:.2%}" in lines[grpo]
    # grpo at its equal-width delta has atr's log-width at atr's delta (both intervals are constant)
    lo, hi = ratio_bounds("atr", float(out.split("atr: delta ")[1].split()[0]), 0.5)
    equal = float(lines[grpo + 3].split(": ")[1])
    assert math.log((1 + equal) / (1 - equal)) == pytest.approx(torch.log(hi / lo).item(), rel=1e-5)


def test_calibration_errors(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--target-rate", "0.02"])  # no records
    synthetic_run(tmp_path, n=200)
    with pytest.raises(ValueError, match="needs old_hidden"):
        calibration_report(read_token_records(tmp_path), ["kl_full"], 0.02)
    with pytest.raises(ValueError, match="no trust region"):
        calibration_report(read_token_records(tmp_path), ["sapo"], 0.02)
    with pytest.raises(ValueError, match="no delta"):
        calibrate_delta("interval", [0.5], [1.0], 0.1)
