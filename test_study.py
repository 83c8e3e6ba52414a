"""study.py: its statistics against a hand computation, its resume rules, and a tiny grid end to end."""

import json
import math
import os
import signal
import sys
import threading
import time

import pytest

import study
from data import load_problems
from loss import MU_LABELS


def step(tokens, low, high, limit, bucket_rates, bucket_shares, entropy=1.0):
    record = {"step": 1, "completion_length": tokens, "clip_low_frac": low, "clip_high_frac": high,
              "limit_clip_frac": limit, "entropy": entropy}
    for label, rate, share in zip(MU_LABELS, bucket_rates, bucket_shares):
        record |= {f"mu[{label}]/clip_frac": rate, f"mu[{label}]/limit_frac": 0.0, f"mu[{label}]/share": share}
    return record


def test_run_numbers_weight_steps_by_their_tokens():
    metrics = [step(100, 0.10, 0.00, 0.00, [0.5, 0, 0, 0, 0], [0.2, 0.2, 0.2, 0.2, 0.2], entropy=0.9),
               step(300, 0.00, 0.20, 0.10, [0.0, 0, 0, 0, 0], [0.1, 0.3, 0.2, 0.2, 0.2], entropy=0.7)]
    summary = {"before": {"accuracy": 0.1}, "after": {"accuracy": 0.3}}
    numbers = study.run_numbers(metrics, summary)
    # (100 * 0.1 + 300 * 0.3) / 400 = 0.25; bucket <0.01: 20 tokens at 0.5, 30 at 0 -> 10 / 50 = 0.2
    assert numbers["clip"] == pytest.approx(0.25)
    assert numbers["clip_by_bucket"]["<0.01"] == pytest.approx(0.2)
    assert numbers["clip_by_bucket"][">0.9"] == 0.0
    assert (numbers["before"], numbers["after"], numbers["final_entropy"]) == (0.1, 0.3, 0.7)


def numbers(after, clip=0.1, before=0.1):
    return {"before": before, "after": after, "final_entropy": 0.5, "clip": clip,
            "clip_by_bucket": {label: clip for label in MU_LABELS}}


def test_table_statistics_match_a_hand_computation():
    results = {"grpo": {0: numbers(0.30), 1: numbers(0.40), 2: numbers(0.50)},
               "atr": {0: numbers(0.35), 1: numbers(0.50), 2: numbers(0.50, clip=0.4)}}
    grpo, atr = study.arm_rows(results)
    # grpo after: mean 0.4, sample sd 0.1, se 0.1 / sqrt(3)
    assert grpo["after"] == pytest.approx((0.4, 0.1 / math.sqrt(3)))
    assert grpo["gaps"] is None
    # per-seed gaps 0.05, 0.10, 0.00: mean 0.05, sd 0.05, se 0.05 / sqrt(3), z = sqrt(3)
    assert atr["gaps"]["after"] == pytest.approx((0.05, 0.05 / math.sqrt(3), math.sqrt(3)))
    # clip gaps 0, 0, 0.3: mean 0.1, sd sqrt(0.03), se 0.1, z 1
    assert atr["clip"][0] == pytest.approx(0.2)
    assert atr["gaps"]["clip"] == pytest.approx((0.1, 0.1, 1.0))
    table = study.markdown_table([grpo, atr])
    assert "| atr | `--rule atr --delta 0.07` | 3 | 10.0 ± 0.0 | 45.0 ± 5.0 | +5.0 ± 2.9 | +1.7 |" in table
    assert "| grpo | 0.500 ± 0.000 | - | 10.0 ± 0.0 | - | 10.0 | 10.0 | 10.0 | 10.0 | 10.0 |" in table
    assert "| atr | 0.500 ± 0.000 | +0.000 ± 0.000 | 20.0 ± 10.0 | +10.0 ± 10.0 (z +1.0) | 20.0 |" in table


def test_one_seed_has_no_error_bar():
    rows = study.arm_rows({"grpo": {0: numbers(0.3)}, "dapo": {0: numbers(0.4)}})
    assert math.isnan(rows[0]["after"][1]) and math.isnan(rows[1]["gaps"]["after"][1])
    assert "| dapo | `--rule dapo` | 1 | 10.0 | 40.0 | +10.0 | - |" in study.markdown_table(rows)


def test_runs_resume_from_what_they_left(tmp_path):
    runs = tmp_path / "runs"
    done, checkpointed, died = runs / "grpo-s0", runs / "atr-s0", runs / "dapo-s0"
    for run in (done, checkpointed, died):
        run.mkdir(parents=True)
    (done / "summary.json").write_text("{}")
    (checkpointed / "latest").write_text("checkpoint-000002")
    assert study.run_command(done, "grpo", 0, []) is None
    assert study.run_command(checkpointed, "atr", 0, ["--steps", "9"])[2:] == ["--resume", str(checkpointed)]
    (checkpointed / "latest").unlink()  # a lost pointer: the checkpoint folders still make it a run
    (checkpointed / "checkpoint-000002").mkdir()
    assert study.run_command(checkpointed, "atr", 0, ["--steps", "9"])[2:] == ["--resume", str(checkpointed)]
    fresh = study.run_command(died, "dapo", 0, ["--steps", "9"])
    assert not died.exists()  # a start that left no checkpoint begins again
    assert fresh[2:] == ["--steps", "9", "--rule", "dapo", "--seed", "0", "--run-name", "dapo-s0",
                         "--out-dir", str(runs)]


def test_stopping_the_study_lets_the_run_checkpoint(tmp_path):
    ready, done = tmp_path / "ready", tmp_path / "done"
    child = ("import signal, sys, time\n"
             "def stop(*_):\n    time.sleep(0.3); open(sys.argv[2], 'w').write('checkpointed'); sys.exit(0)\n"
             "signal.signal(signal.SIGTERM, stop); open(sys.argv[1], 'w').close(); time.sleep(60)")

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
    for extra, message in ((["--", "--top-k", "-3"], "study.py: arm grpo: --top-k -3: must be >= 0"),
                           (["--", "--bogus"], "train.py: unrecognized arguments: --bogus")):
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
    for argv in (["--arms", "grpo,nope"], ["--arms", "grpo,grpo"], ["--seeds", "0"]):
        with pytest.raises(SystemExit):
            study.parse_args(argv)
    assert "--seeds 0" in capsys.readouterr().err
    assert study.parse_args(["--steps", "3", "--", "--lora-rank", "4"]).train_args == ["--lora-rank", "4"]


def test_the_study_task_is_held_out_and_balanced():
    train, test = load_problems("two_digit"), load_problems("two_digit_test")
    assert not {p["problem"] for p in train} & {p["problem"] for p in test}
    assert len(train) + len(test) == 2 * 90 * 9
    assert [p["kind"] for p in test[:4]] == ["add21", "sub21", "add21", "sub21"]
    assert all(0 <= int(p["answer"]) <= 108 for p in train + test)


def test_a_tiny_study_runs_end_to_end(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a tiny model's ops are too small to share among threads
    out = tmp_path / "study"
    argv = ["--model", str(tiny_model_dir), "--steps", "2", "--seeds", "1", "--arms", "grpo,atr", "--out", str(out),
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--eval-problems", "3",
            "--eval-k", "2", "--log-tokens", "16", "--updates-per-rollout", "2", "--checkpoint-every", "1",
            "--", "--lora-rank", "4"]
    study.main(argv)
    table = (out / "table.md").read_text()
    for arm in ("grpo", "atr"):
        assert f"| {arm} |" in table
        assert (out / "runs" / f"{arm}-s0" / "summary.json").is_file()
        assert sorted(p.name for p in (out / "runs" / f"{arm}-s0" / "tokens").glob("*.npz")) == \
            ["step-000001.npz", "step-000002.npz"]
    results = json.loads((out / "results.json").read_text())
    assert set(results) == {"grpo", "atr"} and 0 <= results["atr"]["0"]["after"] <= 1
    figures = list((out / "figures" / "seed-0").glob("*.png"))
    assert figures and all(f.stat().st_size > 1000 for f in figures)
    log = (out / "logs" / "grpo-s0.log").read_text()
    study.main(argv)  # finished runs are not run again
    assert (out / "logs" / "grpo-s0.log").read_text() == log
