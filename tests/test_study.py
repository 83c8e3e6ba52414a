"""study.py: its statistics against a hand computation, its resume rules, and a tiny grid end to end."""

import json
import math
import os
import signal
import sys
import threading
import time

import numpy as np
import pytest

import config
from data import load_problems
from loss import MU_LABELS
from research import study


def step(tokens, low, high, limit, bucket_rates, bucket_shares, entropy=1.0, rate=None, rate_tokens=0):
    record = {
        "step": 1,
        "completion_length": tokens,
        "clip_low_frac": low,
        "clip_high_frac": high,
        "limit_clip_frac": limit,
        "entropy": entropy,
        "clip_rate": rate,
        "clip_rate_tokens": rate_tokens,
    }
    for label, bucket_rate, share in zip(MU_LABELS, bucket_rates, bucket_shares):
        record |= {
            f"mu[{label}]/clip_frac": bucket_rate,
            f"mu[{label}]/limit_frac": 0.0,
            f"mu[{label}]/share": share,
            f"mu[{label}]/clip_rate": rate,
            f"mu[{label}]/clip_rate_tokens": rate_tokens,
        }
    return record


def test_run_numbers_weight_steps_by_their_tokens():
    metrics = [
        step(
            100, 0.10, 0.00, 0.00, [0.5, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2], entropy=0.9, rate=0.4, rate_tokens=30
        ),
        step(
            300, 0.00, 0.20, 0.10, [0.0, 0, 0, 0, 0], [0.1, 0.3, 0.2, 0.2, 0.2], entropy=0.7, rate=0.2, rate_tokens=10
        ),
        step(200, 0.0, 0.0, 0.0, [0.0] * 5, [0.2] * 5, entropy=0.7),
    ]  # no acting token: no rate
    summary = {"before": {"accuracy": 0.1}, "after": {"accuracy": 0.3}}
    numbers = study.run_numbers(metrics, summary)
    # every token: (100 * 0.1 + 300 * 0.3 + 200 * 0) / 600; bucket <0.01: 20 tokens at 0.5, 30 + 40 at 0 -> 10 / 90
    assert numbers["clip_all"] == pytest.approx(100 / 600)
    assert numbers["clip_all_by_bucket"]["<0.01"] == pytest.approx(10 / 90)
    assert numbers["clip_all_by_bucket"][">0.9"] == 0.0
    # acting tokens after the first update: (30 * 0.4 + 10 * 0.2) / 40
    assert numbers["clip"] == pytest.approx(0.35) and numbers["clip_by_bucket"]["0.1-0.5"] == pytest.approx(0.35)
    assert (numbers["before"], numbers["after"], numbers["final_entropy"]) == (0.1, 0.3, 0.7)


def numbers(after, clip=0.1, before=0.1):
    return {
        "before": before,
        "after": after,
        "final_entropy": 0.5,
        "clip": clip,
        "clip_all": clip / 2,
        "clip_by_bucket": {label: clip for label in MU_LABELS},
    }


def test_table_statistics_match_a_hand_computation():
    results = {
        "grpo": {0: numbers(0.30), 1: numbers(0.40), 2: numbers(0.50)},
        "atr": {0: numbers(0.35), 1: numbers(0.50), 2: numbers(0.50, clip=0.4)},
    }
    grpo, atr = study.arm_rows(results)
    # grpo after: mean 0.4, sample sd 0.1, se 0.1 / sqrt(3)
    assert grpo["after"] == pytest.approx((0.4, 0.1 / math.sqrt(3)))
    assert grpo["gaps"] is None
    # per-seed gaps 0.05, 0.10, 0.00: mean 0.05, sd 0.05, se 0.05 / sqrt(3), t = sqrt(3) on 2 df
    after = atr["gaps"]["after"]
    assert (after.gap, after.se, after.t, after.n) == pytest.approx((0.05, 0.05 / math.sqrt(3), math.sqrt(3), 3))
    # two-sided p of t = sqrt(3) on 2 df: theta = atan(sqrt(3/2)), P(|T| <= t) = sin(theta) = sqrt(3/5)
    assert after.p == pytest.approx(1 - math.sqrt(3 / 5))
    # clip gaps 0, 0, 0.3: mean 0.1, sd sqrt(0.03), se 0.1, t 1; entropy gaps all 0: t 0, p 1
    assert atr["clip"][0] == pytest.approx(0.2)
    assert (atr["gaps"]["clip"].gap, atr["gaps"]["clip"].se, atr["gaps"]["clip"].t) == pytest.approx((0.1, 0.1, 1.0))
    assert atr["gaps"]["final_entropy"].p == 1.0
    # atr's region [0.671, 1.422] holds grpo's [0.8, 1.2]: its clip-rate gap is by construction, not tested
    assert atr["gaps"]["clip"].by_construction and math.isnan(atr["gaps"]["clip"].p_holm)
    # the family is the 2 tested gaps: the gap its t test at 0.05 / 2 detects with 80% power
    k = study.power_multiplier(3, 2)
    assert after.mde == pytest.approx(k * after.se) and not after.called
    table = study.markdown_table([grpo, atr], problems=64, k=2)
    assert table.index("Power first") < table.index("| arm | train.py flags")
    assert "The unit is the seed" in table and "1 clip-rate gaps follow from the regions" in table
    assert f"| atr | {after.mde * 100:.1f} | {atr['gaps']['final_entropy'].mde:.3f} | by construction |" in table
    assert "| atr | `--rule atr --delta 0.07` | 3 | 10.0 ± 0.0 | 45.0 ± 5.0 | +5.0 ± 2.9 | +1.7 |" in table
    assert "| grpo | 0.500 ± 0.000 | - | 10.0 ± 0.0 | - | 5.0 ± 0.0 | 10.0 | 10.0 | 10.0 | 10.0 | 10.0 |" in table
    assert (
        "| atr | 0.500 ± 0.000 | +0.000 ± 0.000 | 20.0 ± 10.0 | +10.0 ± 10.0 (by construction) | 10.0 ± 5.0 |" in table
    )


def test_one_seed_has_no_error_bar():
    rows = study.arm_rows({"grpo": {0: numbers(0.3)}, "dapo": {0: numbers(0.4)}})
    assert math.isnan(rows[0]["after"][1]) and math.isnan(rows[1]["gaps"]["after"].se)
    assert not rows[1]["gaps"]["after"].called
    assert "| dapo | `--rule dapo` | 1 | 10.0 | 40.0 | +10.0 | - | - |" in study.markdown_table(rows)


def test_student_t_against_printed_tables():
    # two-sided 5% and one-sided 80% points of Student's t, as printed in statistics tables
    for df, upper, power in ((1, 12.706, 1.376), (2, 4.303, 1.061), (5, 2.571, 0.920), (29, 2.045, 0.854)):
        assert study.t_quantile(0.975, df) == pytest.approx(upper, abs=1e-3)
        assert study.t_quantile(0.8, df) == pytest.approx(power, abs=1e-3)
        assert study.t_cdf(study.t_quantile(0.3, df), df) == pytest.approx(0.3, abs=1e-12)
    assert study.t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert study.t_cdf(-2.0, 4) == pytest.approx(1 - study.t_cdf(2.0, 4))
    assert study.t_quantile(0.975, 2000) == pytest.approx(study.normal_quantile(0.975), abs=2e-3)  # the normal's
    assert (study.normal_quantile(0.975), study.normal_quantile(0.8)) == pytest.approx((1.95996, 0.84162), abs=1e-5)


def test_power_and_holm_against_a_hand_calculation():
    # 30 paired rollouts, one test: the noncentral t puts 80% power a little above the usual approximation
    # t(0.975, 29) + t(0.8, 29) = 2.899, which the exact power at that gap shows short of 80%
    critical = study.t_quantile(0.975, 29)
    approximate = critical + study.t_quantile(0.8, 29)
    assert study.t_test_power(approximate, 29, critical) == pytest.approx(0.80, abs=0.005)
    assert study.power_multiplier(30, 1) == pytest.approx(approximate, abs=0.01)
    # 27 tests: the approximation's 4.28 se is detected 79% of the time, the exact gap is larger
    critical = study.t_quantile(1 - 0.05 / 54, 29)
    assert critical + study.t_quantile(0.8, 29) == pytest.approx(4.28, abs=0.01)
    assert study.t_test_power(4.28, 29, critical) == pytest.approx(0.79, abs=0.005)
    assert study.t_test_power(study.power_multiplier(30, 27), 29, critical) == pytest.approx(0.8, abs=1e-6)
    assert study.power_multiplier(30, 27) > 4.28
    # the normal limit: a z test at 5% two-sided finds a gap of 2.80 standard errors 80% of the time
    assert study.power_multiplier(2001, 1) == pytest.approx(1.95996 + 0.84162, abs=2e-3)
    assert math.isnan(study.power_multiplier(1, 1))
    # Holm on p = 0.01, 0.04, 0.03: sorted 0.01 * 3, 0.03 * 2, 0.04 * 1, each at least the one before; a gap
    # is called where its Holm p is below 0.05
    family = [study.Comparison(gap, 0.1, 30, gap / 0.1, p) for gap, p in ((0.3, 0.01), (0.25, 0.04), (0.27, 0.03))]
    study.judge(family)
    assert [c.p_holm for c in family] == pytest.approx([0.03, 0.06, 0.06])
    assert [c.mde for c in family] == pytest.approx([study.power_multiplier(30, 3) * 0.1] * 3)
    assert [c.called for c in family] == [True, False, False]
    assert family[0].ci95 == pytest.approx(study.t_quantile(0.975, 29) * 0.1)
    # a gap by construction leaves the family: the other two are Holm's over 2 tests
    family = [study.Comparison(gap, 0.1, 30, gap / 0.1, p) for gap, p in ((0.3, 0.01), (0.25, 0.04), (0.27, 0.03))]
    family[0].by_construction = True
    study.judge(family)
    assert math.isnan(family[0].p_holm) and not family[0].called and math.isnan(family[0].mde)
    assert [c.p_holm for c in family[1:]] == pytest.approx([0.06, 0.06])
    exact = study.paired([0.2, 0.2, 0.2])  # every pair differs by the same amount: exact, called
    study.judge([exact])
    assert exact.p == 0.0 and exact.called
    # the held-out floor: 80% power, 5% two-sided, one test: (1.960 + 0.842) sqrt(2 p (1-p) / (n k) / seeds)
    floor = study.held_out_floor(0.2, problems=64, k=2, seeds=3, tests=1)
    assert floor == pytest.approx((1.95996 + 0.84162) * math.sqrt(2 * 0.16 / 128 / 3), rel=1e-4)


def called_share(units: int, tests: int, draws: int, seed: int) -> float:
    """How often paired() and judge(), as the tables use them, call a true gap of the stated detectable size
    (power_multiplier true standard errors) in a family of `tests` whose other gaps are 0."""
    rng = np.random.default_rng(seed)
    shift = study.power_multiplier(units, tests) / math.sqrt(units)  # in units of one pair's sd
    called = 0
    for _ in range(draws):
        differences = rng.standard_normal((tests, units))
        differences[0] += shift
        family = [study.paired(row) for row in differences]
        study.judge(family)
        called += family[0].called
    return called / draws


@pytest.mark.parametrize("units, tests", [(30, 27), (3, 18)])
def test_the_stated_detectable_gap_is_called_80_percent_of_the_time(units, tests):
    """The counterfactual table's design (30 rollouts, 27 tests) and the grid's (3 seeds, 18 tests): at the
    detectable gap the tables state, the procedure calls it 0.80 +- 0.02 of the time. 3,000 draws put the
    share's standard error at 0.0073, so a share outside 0.78-0.82 would be a wrong figure, not chance."""
    assert called_share(units, tests, draws=3000, seed=units) == pytest.approx(0.80, abs=0.02)


def test_clustered_pairs_keep_the_tests_level():
    """Pairs that share a cluster (rollouts drawn from the same prompts) are not independent: counted one by one,
    their t test rejects a true null far more often than 5%; counted by cluster, at 5%."""
    rng = np.random.default_rng(0)
    clusters = [c for c in range(10) for _ in range(3)]  # 30 pairs, 10 clusters of 3
    naive = clustered = 0
    for _ in range(2000):
        differences = np.repeat(rng.standard_normal(10), 3) + 0.3 * rng.standard_normal(30)  # no true gap
        naive += study.paired(differences).p < 0.05
        c = study.paired(differences, clusters)
        clustered += c.p < 0.05
    assert c.n == 10
    assert naive / 2000 > 0.2 and clustered / 2000 == pytest.approx(0.05, abs=0.015)
    with pytest.raises(ValueError, match="clusters: 2 keys for 3 differences"):
        study.paired([0.1, 0.2, 0.3], [0, 1])


def test_regions_that_hold_grpo_s_clip_less_by_construction():
    def loss_of(*flags):
        return config.parse_args(list(flags))[0].loss

    grpo = loss_of(*study.ARMS["grpo"])
    for arm in ("atr", "kl-atomic", "gppo", "limits", "dapo"):  # each holds [0.8, 1.2] at every mu
        assert study.region_contains(loss_of(*study.ARMS[arm]), grpo), arm
    assert study.region_contains(grpo, grpo)
    assert not study.region_contains(grpo, loss_of(*study.ARMS["atr"]))
    assert not study.region_contains(loss_of("--rule", "atr", "--delta", "0.02"), grpo)  # [0.811, 1.216]
    assert not study.region_contains(loss_of("--rule", "sapo"), grpo)  # no region at all


def test_equal_rate_arms_are_calibrated_on_grpo_records():
    rng = np.random.default_rng(0)
    n = 4000
    records = {
        "mu": rng.uniform(1e-3, 1, n).astype(np.float32),
        "w": np.exp(0.3 * rng.standard_normal(n)),
        "advantage": rng.choice([-1.0, 0.0, 1.0], n),
        "update": rng.integers(0, 4, n),
    }
    w, adv = records["w"], records["advantage"]
    outward = adv * (w - 1) > 0
    records |= {"region_low": outward & (w < 0.8), "region_high": outward & (w > 1.2), "limit": np.zeros(n, bool)}
    calibration = study.calibrate_arms(records, [], ["grpo", "atr", "atr-eq", "dapo-eq"], source="pilot")
    acting = (adv != 0) & (records["update"] > 0)
    target = (records["region_low"] | records["region_high"])[acting].mean()
    assert calibration["target"] == pytest.approx(target) and calibration["tokens"] == acting.sum()
    assert set(calibration["deltas"]) == {"atr-eq", "dapo-eq"}
    # dapo at its calibrated delta keeps clip-higher's ratio 0.28 / 0.2 and clips grpo's rate of the same tokens
    delta = calibration["deltas"]["dapo-eq"]
    clipped = outward & ((w < 1 - delta) | (w > 1 + 1.4 * delta))
    assert clipped[acting].mean() <= target + 1e-9 and delta < 0.2
    assert study.arm_flags("atr-eq", calibration["deltas"]) == [
        "--rule",
        "atr",
        "--delta",
        f"{calibration['deltas']['atr-eq']:.6g}",
    ]
    with pytest.raises(ValueError, match="calibrated"):
        study.arm_flags("atr-eq")


def test_runs_resume_from_what_they_left(tmp_path):
    runs = tmp_path / "runs"
    done, checkpointed, died = runs / "grpo-s0", runs / "atr-s0", runs / "dapo-s0"
    for run in (done, checkpointed, died):
        run.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    (checkpointed / "latest").write_text("checkpoint-000002")
    assert study.run_command(done, study.ARMS["grpo"], 0, []) is None
    resumed = ["--resume", str(checkpointed)]
    assert study.run_command(checkpointed, study.ARMS["atr"], 0, ["--steps", "9"])[2:] == resumed
    (checkpointed / "latest").unlink()  # a lost pointer: the checkpoint folders still make it a run
    (checkpointed / "checkpoint-000002").mkdir()
    assert study.run_command(checkpointed, study.ARMS["atr"], 0, ["--steps", "9"])[2:] == resumed
    fresh = study.run_command(died, study.ARMS["dapo"], 0, ["--steps", "9"])
    assert not died.exists()  # a start that left no checkpoint begins again
    assert fresh[2:] == [
        "--steps",
        "9",
        "--rule",
        "dapo",
        "--seed",
        "0",
        "--run-name",
        "dapo-s0",
        "--out-dir",
        str(runs),
    ]


def test_stopping_the_study_lets_the_run_checkpoint(tmp_path):
    ready, done = tmp_path / "ready", tmp_path / "done"
    child = (
        "import signal, sys, time\n"
        "def stop(*_):\n    time.sleep(0.3); open(sys.argv[2], 'w').write('checkpointed'); sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop); open(sys.argv[1], 'w').close(); time.sleep(60)"
    )

    def kill_the_study_once_the_run_is_up():
        while not ready.exists():
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=kill_the_study_once_the_run_is_up, daemon=True).start()
    with pytest.raises(SystemExit, match="stopped; the run checkpointed"):
        study.run_train([sys.executable, "-c", child, str(ready), str(done)], tmp_path / "log")
    assert done.read_text() == "checkpointed"  # the study waited for it
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


def test_other_settings_in_the_same_directory_are_refused_once_a_run_started(tmp_path):
    study.check_settings(tmp_path, {"train_flags": ["--steps", "2"], "arms": {}})
    study.check_settings(tmp_path, {"train_flags": ["--steps", "3"], "arms": {}})  # no run started: new settings
    (tmp_path / "runs" / "grpo-s0" / "checkpoint-000001").mkdir(parents=True)
    study.check_settings(tmp_path, {"train_flags": ["--steps", "3"], "arms": {"grpo": []}})  # more arms: fine
    with pytest.raises(SystemExit, match="other train.py flags"):
        study.check_settings(tmp_path, {"train_flags": ["--steps", "2"], "arms": {}})


def test_bad_train_flags_fail_in_one_line_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "study"
    for extra, message in (
        (["--", "--top-k", "-3"], "study.py: arm grpo: --top-k -3: must be >= 0"),
        (["--", "--bogus"], "train.py: unrecognized arguments: --bogus"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            study.main(["--arms", "grpo", "--out", str(out), *extra])
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and err.startswith(message), err
    assert not out.exists()


def test_a_run_that_refuses_to_start_is_not_run_again(tmp_path):
    log = tmp_path / "log"
    refuse = "import sys; print('train.py: --model x: neither a local directory nor a hub id'); sys.exit(2)"
    with pytest.raises(SystemExit, match="a run refused to start: train.py: --model x: neither"):
        study.run_train([sys.executable, "-c", refuse], log)


def test_bad_arms_are_refused_before_anything_runs(capsys):
    for argv in (["--arms", "grpo,nope"], ["--arms", "grpo,grpo"], ["--arms", "atr,atr-eq"], ["--seeds", "0"]):
        with pytest.raises(SystemExit):
            study.parse_args(argv)
    assert "--seeds 0" in capsys.readouterr().err
    assert (study.parse_args([]).updates_per_rollout, study.parse_args(["--setting", "gentle", "--lr", "1e-4"]).lr) == (
        study.SETTINGS["binding"]["updates_per_rollout"],
        1e-4,
    )
    assert study.parse_args(["--steps", "3", "--", "--lora-rank", "4"]).train_args == ["--lora-rank", "4"]


def test_the_study_task_is_held_out_and_balanced():
    train, test = load_problems("two_digit"), load_problems("two_digit_test")
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    assert len(train) + len(test) == 2 * 90 * 9
    assert [p["kind"] for p in test[:4]] == ["add21", "sub21", "add21", "sub21"]
    assert all(0 <= int(p["answer"]) <= 108 for p in train + test)


@pytest.mark.usefixtures("forked_commands")
def test_a_tiny_study_runs_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model's ops are too small to share among threads
    out = tmp_path / "study"
    argv = [
        "--model",
        str(tiny_model_dir),
        "--steps",
        "2",
        "--seeds",
        "1",
        "--arms",
        "grpo,atr,atr-eq",
        "--out",
        str(out),
        "--prompts-per-step",
        "2",
        "--group-size",
        "2",
        "--max-new-tokens",
        "4",
        "--eval-problems",
        "3",
        "--eval-k",
        "2",
        "--log-tokens",
        "16",
        "--updates-per-rollout",
        "2",
        "--checkpoint-every",
        "1",
        "--",
        "--lora-rank",
        "4",
    ]
    study.main(argv)
    table = (out / "table.md").read_text()
    for arm in ("grpo", "atr"):
        assert f"| {arm} |" in table
        assert (out / "runs" / f"{arm}-s0" / "summary.json").is_file()
        assert sorted(p.name for p in (out / "runs" / f"{arm}-s0" / "tokens").glob("*.npz")) == [
            "step-000001.npz",
            "step-000002.npz",
        ]
    results = json.loads((out / "results.json").read_text())
    assert set(results["runs"]) == {"grpo", "atr"} and 0 <= results["runs"]["atr"]["0"]["after"] <= 1
    # a random model solves nothing: no token can clip, so no delta reaches grpo's rate, and the arm says why
    assert "no token a clip can act on" in results["calibration"]["unreachable"]["atr-eq"]
    assert results["arms"]["atr"] == study.ARMS["atr"] and "atr-eq" not in results["arms"]
    figures = list((out / "figures" / "seed-0").glob("*.png"))
    assert figures and all(f.stat().st_size > 1000 for f in figures)
    log = (out / "logs" / "grpo-s0.log").read_text()
    study.main(argv)  # finished runs are not run again
    assert (out / "logs" / "grpo-s0.log").read_text() == log
