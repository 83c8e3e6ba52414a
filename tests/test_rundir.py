"""A run on disk under misuse, end to end on a tiny random model (rundir.py, stopping.py): one writer at a
time, Ctrl-C and SIGKILL, checkpoints that survive a crash, a damaged file or a full disk, resumes that
reproduce the run and record what they change, exports that never replace a user's folder."""

import errno
import json
import os
import re
import signal
import time
from pathlib import Path

import pytest
import torch
import transformers

import lora
import train
from conftest import event_lines, latest_step, launch, launch_as_typed, metric_lines, run_training, tiny_args
from infra import weights

pytestmark = pytest.mark.usefixtures("varied_rewards")


# ----------------------------------------------------------------------------- one writer, interrupts


def test_a_run_has_one_writer_and_sigkill_loses_only_steps_after_the_last_checkpoint(tiny_model_dir, tmp_path, capsys):
    """While a run trains, a second start of it, a resume and an export are refused in one line naming its
    process; once that process is killed, its lock is gone with it and the run resumes."""
    args = tiny_args(
        tiny_model_dir,
        tmp_path,
        "killed",
        "--steps",
        "1000000",
        "--checkpoint-every",
        "1",
        "--eval-problems",
        "1",
        "--eval-k",
        "1",
    )
    proc = launch(args, tmp_path / "killed.log")
    run_dir = tmp_path / "killed"
    deadline = time.time() + 120
    try:
        while not (run_dir / "latest").exists() or latest_step(run_dir) < 3:
            assert proc.poll() is None and time.time() < deadline, "training did not reach step 3"
            time.sleep(0.2)
        for second in (args, ["--resume", str(run_dir)], ["--resume", str(run_dir), "--export", str(tmp_path / "x")]):
            with pytest.raises(SystemExit) as exit_info:
                train.main(second)
            err = capsys.readouterr().err.strip()
            assert exit_info.value.code == 2 and err == (
                f"train.py: {run_dir} is in use by process {proc.pid} (a train.py run, resume or export writes it); "
                "wait for that process to end, or stop it"
            ), err
        assert proc.poll() is None and not (tmp_path / "x").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    saved_step = latest_step(run_dir)
    assert saved_step >= 3
    state = run_training(["--resume", str(run_dir), "--steps", str(saved_step + 1)])
    assert state["step"] == saved_step + 1
    assert [line["step"] for line in metric_lines(run_dir)] == list(range(1, saved_step + 2))


def test_ctrl_c_checkpoints_the_step_in_progress_and_resumes(tiny_model_dir, tmp_path):
    args = tiny_args(
        tiny_model_dir,
        tmp_path,
        "interrupted",
        "--steps",
        "1000000",
        "--checkpoint-every",
        "1000",
        "--eval-problems",
        "1",
        "--eval-k",
        "1",
    )
    proc = launch_as_typed(args, tmp_path / "interrupted.log")  # as typed: one run in a fresh interpreter
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.time() < deadline, "training did not reach step 2"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    log = (tmp_path / "interrupted.log").read_text()
    assert proc.returncode == 130 and "Traceback" not in log, log[-2000:]  # stopped, not finished
    assert log.strip().splitlines()[-1].endswith(f"continue with: python train.py --resume {tmp_path / 'interrupted'}")
    # a redirected log gets plain lines: no progress bar's carriage returns or cursor moves
    assert (
        "\r" not in log
        and "\x1b" not in log
        and re.search(r"^step 2/1000000: reward \S+, accuracy \S+, \S+ s$", log, re.M)
    ), log[-2000:]
    saved_step = latest_step(tmp_path / "interrupted")  # no periodic checkpoint was due: Ctrl-C wrote it
    assert saved_step >= 2 and len(metric_lines(tmp_path / "interrupted")) == saved_step
    state = run_training(["--resume", str(tmp_path / "interrupted"), "--steps", str(saved_step + 1)])
    assert state["step"] == saved_step + 1


def test_a_second_ctrl_c_interrupts_at_once_without_a_traceback(tiny_model_dir, tmp_path):
    args = tiny_args(
        tiny_model_dir,
        tmp_path,
        "twice",
        "--steps",
        "1000000",
        "--eval-problems",
        "1",
        "--eval-k",
        "1",
        "--max-new-tokens",
        "64",
    )
    log = tmp_path / "twice.log"
    proc = launch(args, log)
    metrics = tmp_path / "twice" / "metrics.jsonl"
    deadline = time.time() + 120
    while not metrics.exists() or not metrics.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in log.read_text(), log.read_text()[-2000:]
    assert log.read_text().strip().splitlines()[-1].endswith(f"--resume {tmp_path / 'twice'}")
    assert run_training(["--resume", str(tmp_path / "twice"), "--steps", "1"])["step"] >= 1


def test_ctrl_c_during_an_evaluation_exits_cleanly_and_the_run_resumes(tiny_model_dir, tmp_path):
    args = tiny_args(
        tiny_model_dir,
        tmp_path,
        "eval-stop",
        "--steps",
        "1",
        "--eval-problems",
        "0",
        "--eval-k",
        "8",
        "--max-new-tokens",
        "64",
    )
    log = tmp_path / "eval-stop.log"
    proc = launch(args, log)
    deadline = time.time() + 120
    while "eval before" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in log.read_text(), log.read_text()[-2000:]
    assert log.read_text().splitlines()[-1].endswith(f"--resume {tmp_path / 'eval-stop'}")  # the run, not "RUN"
    state = run_training(["--resume", str(tmp_path / "eval-stop"), "--eval-problems", "2"])
    assert state["step"] == 1 and state["before"]["problems"] == 2


# ----------------------------------------------------------------------------- checkpoints and resumes


def test_resume_reproduces_an_uninterrupted_run(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "straight", "--steps", "4"))
    run_training(tiny_args(tiny_model_dir, tmp_path, "split", "--steps", "2"))
    run_training(["--resume", str(tmp_path / "split"), "--steps", "4"])
    straight, split = metric_lines(tmp_path / "straight"), metric_lines(tmp_path / "split")
    assert [line["step"] for line in split] == [1, 2, 3, 4]
    assert split == straight
    assert event_lines(tmp_path / "split") == [{"step": 2, "event": "resume", "changed": {"steps": [2, 4]}}]
    assert json.loads((tmp_path / "split" / "config.json").read_text())["steps"] == 4


def test_interrupted_checkpoint_write_keeps_the_previous_one(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "crash", "--steps", "2"))
    run_dir = tmp_path / "crash"
    # a crash while writing the next checkpoint leaves a partial temp folder and extra metric lines
    partial = run_dir / ".checkpoint-000004.tmp"
    partial.mkdir()
    (partial / "trainer.pt").write_bytes(b"truncated")
    with (run_dir / "metrics.jsonl").open("a") as f:  # a logged step 3, then a line cut by the kill
        f.write(json.dumps({"step": 3, "reward": 123.0}) + "\n" + '{"step": 4, "rew')
    state = run_training(["--resume", str(run_dir), "--steps", "3"])
    assert state["step"] == 3
    assert [line["step"] for line in metric_lines(run_dir)] == [1, 2, 3]
    assert metric_lines(run_dir)[-1]["reward"] != 123.0


def test_the_two_newest_checkpoints_are_kept_and_a_damaged_one_falls_back(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "two", "--steps", "4", "--checkpoint-every", "1"))
    run_dir = tmp_path / "two"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000004"]
    (run_dir / "checkpoint-000004" / "adapter" / "adapter_model.safetensors").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="checkpoint-000004"):
        state = run_training(["--resume", str(run_dir), "--steps", "5"])
    assert state["step"] == 5


def test_a_resume_without_latest_takes_the_newest_checkpoint(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "pointer", "--steps", "2"))
    (tmp_path / "pointer" / "latest").unlink()
    with pytest.warns(
        UserWarning, match="latest is missing; resuming from the newest checkpoint folder, checkpoint-000002"
    ):
        state = run_training(["--resume", str(tmp_path / "pointer"), "--steps", "3"])
    assert state["step"] == 3


def test_a_run_is_never_silently_restarted_or_overwritten(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "once", "--steps", "1"))
    with pytest.raises(FileExistsError, match="--resume"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "once", "--steps", "2"))
    (tmp_path / "early").mkdir()  # a run that died before its first checkpoint has nothing to resume
    (tmp_path / "early" / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_training(["--resume", str(tmp_path / "early")])


def test_a_resumed_run_refuses_settings_that_name_another_run(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "first", "--steps", "1"))
    for flags in (["--preset", "atr-grpo-qwen3-1.7b"], ["--run-name", "other"], ["--out-dir", "elsewhere"]):
        with pytest.raises(ValueError, match="cannot change"):
            run_training(["--resume", str(tmp_path / "first"), *flags])


def test_a_resume_records_what_it_changes_and_refuses_what_the_adapters_cannot_follow(tiny_model_dir, tmp_path, capsys):
    run_training(tiny_args(tiny_model_dir, tmp_path, "changed", "--steps", "2"))
    run_dir = tmp_path / "changed"
    with pytest.raises(ValueError, match="--lora-rank cannot change them"):
        run_training(["--resume", str(run_dir), "--lora-rank", "8"])
    run_training(["--resume", str(run_dir), "--steps", "3", "--lr", "0.005", "--lora-rank", "4"])  # 4: the run's own
    assert "; changed: --steps 2 -> 3, --lr 0.01 -> 0.005" in capsys.readouterr().err
    saved = json.loads((run_dir / "config.json").read_text())
    assert saved["lr"] == 0.005 and saved["steps"] == 3 and saved["resume"] is None
    run_training(["--resume", str(run_dir), "--steps", "4"])  # a plain resume keeps the new learning rate
    assert event_lines(run_dir) == [
        {"step": 2, "event": "resume", "changed": {"steps": [2, 3], "lr": [0.01, 0.005]}},
        {"step": 3, "event": "resume", "changed": {"steps": [3, 4]}},
    ]
    assert [line["step"] for line in metric_lines(run_dir)] == [1, 2, 3, 4]


def test_a_damaged_config_json_is_named(tiny_model_dir, tmp_path, capsys):
    run_training(tiny_args(tiny_model_dir, tmp_path, "damaged", "--steps", "1"))
    saved = tmp_path / "damaged" / "config.json"
    capsys.readouterr()
    for text, message in (('{"steps": 2', "not valid JSON"), ('{"stepz": 2}', "unknown settings stepz")):
        saved.write_text(text)
        with pytest.raises(SystemExit) as exit_info:
            train.main(["--resume", str(tmp_path / "damaged")])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.startswith(f"train.py: {saved}: {message}") and err.count("\n") == 1


# ----------------------------------------------------------------------------- writing files


def test_a_finished_run_exports_again_without_training_or_evaluating(tiny_model_dir, tmp_path, monkeypatch):
    run_training(tiny_args(tiny_model_dir, tmp_path, "done", "--steps", "2"))
    run_dir = tmp_path / "done"
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "config.toml")}
    monkeypatch.setattr(train.evaluation, "held_out", lambda *a, **k: pytest.fail("an export-only run evaluated"))
    monkeypatch.setattr(train, "train_step", lambda *a, **k: pytest.fail("an export-only run trained"))
    state = run_training(["--resume", str(run_dir), "--steps", "0", "--export", str(tmp_path / "export")])
    assert state["step"] == 2 and {name: (run_dir / name).read_bytes() for name in before} == before
    policy = lora.load(weights.from_pretrained(str(tiny_model_dir)), run_dir / "checkpoint-000002" / "adapter")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = torch.randint(0, policy.config.vocab_size, (1, 7))
    torch.testing.assert_close(exported(ids).logits, policy(ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"--steps 0 trains and evaluates nothing; add --export DIR"):
        run_training(["--resume", str(run_dir), "--steps", "0"])


def test_an_export_never_replaces_a_users_folder(tiny_model_dir, tmp_path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="mine"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "export", "--steps", "1", "--export", str(folder)))
    assert (folder / "notes.txt").read_text() == "keep me" and not (tmp_path / "export").exists()


def test_json_files_are_strict_when_a_standard_error_is_undefined(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "strict", "--steps", "1", "--eval-problems", "1"))

    def refuse(constant):
        raise AssertionError(f"non-standard JSON constant {constant}")

    summary = json.loads((tmp_path / "strict" / "summary.json").read_text(), parse_constant=refuse)
    assert summary["after"]["se"] is None
    for line in (tmp_path / "strict" / "metrics.jsonl").read_text().splitlines():
        json.loads(line, parse_constant=refuse)


def test_a_full_disk_is_one_line_naming_the_file_and_the_run_resumes(tiny_model_dir, tmp_path, monkeypatch, capsys):
    real_save = train.rundir.torch.save

    def save(obj, f):
        if obj["state"]["step"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_save(obj, f)

    monkeypatch.setattr(train.rundir.torch, "save", save)
    run_dir = tmp_path / "full"
    with pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(tiny_model_dir, tmp_path, "full", "--steps", "3"))
    assert exit_info.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        f"train.py: cannot write {run_dir / 'checkpoint-000002'}: No space left on device; the run keeps its last "
        f"checkpoint: continue with python train.py --resume {run_dir}"
    )
    assert not list(run_dir.glob(".*.tmp")) and latest_step(run_dir) == 0
    monkeypatch.setattr(train.rundir.torch, "save", real_save)
    assert run_training(["--resume", str(run_dir)])["step"] == 3


def test_rewriting_the_metrics_on_a_full_disk_leaves_no_temporary_file(tmp_path, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n{"step": 2}\n')

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", full)
    with pytest.raises(train.rundir.WriteError, match=f"cannot write {metrics}: No space left on device"):
        train.rundir.truncate_metrics(metrics, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.jsonl"]
    with pytest.raises(train.rundir.WriteError, match="metrics.jsonl"):
        monkeypatch.setattr(Path, "open", lambda *_, **__: full(None))
        train.rundir.append_metrics(metrics, {"step": 3})


def test_saved_files_follow_the_umask(tiny_model_dir, tmp_path):
    previous = os.umask(0o022)
    try:
        run_training(tiny_args(tiny_model_dir, tmp_path, "shared", "--steps", "1", "--export", str(tmp_path / "x")))
    finally:
        os.umask(previous)
    for path in [
        tmp_path / "x",
        tmp_path / "shared" / "best",
        *(tmp_path / "x").iterdir(),
        *(tmp_path / "shared" / "best").iterdir(),
        *(tmp_path / "shared").glob("checkpoint-*/adapter/*"),
    ]:
        assert path.stat().st_mode & 0o777 == (0o755 if path.is_dir() else 0o644), path


# ----------------------------------------------------------------------------- settings given and derived


def test_a_resume_with_another_rule_takes_its_sizes_and_records_them(tiny_model_dir, tmp_path, capsys):
    run_training(tiny_args(tiny_model_dir, tmp_path, "rule", "--steps", "1", "--updates-per-rollout", "2"))
    run_dir = tmp_path / "rule"
    written = (run_dir / "config.toml").read_text()
    assert "# delta_high = 0.2  (derived: from --delta 0.2)" in written and "# rollout_batch = 2  (derived: " in written
    # a flag on top of the run's config.toml derives again what the run did not give
    wider, _, _ = train.config.parse_args(["--config", str(run_dir / "config.toml"), "--delta", "0.3"])
    assert wider.loss.delta_high == 0.3
    other, _, _ = train.config.parse_args(
        [
            "--config",
            str(run_dir / "config.toml"),
            "--prompts-per-step",
            "4",
            "--group-size",
            "4",
            "--max-new-tokens",
            "32",
        ]
    )
    assert (other.rollout_batch, other.kv_blocks, other.loss.norm_len) == (0, 0, 32)
    gspo, _, _ = train.config.parse_args(["--config", str(run_dir / "config.toml"), "--rule", "gspo"])
    assert gspo.loss.aggregation == "seq-mean-token-mean"
    capsys.readouterr()
    run_training(["--resume", str(run_dir), "--rule", "dapo", "--steps", "2"])
    assert "changed: --steps 1 -> 2, --rule grpo -> dapo, --delta-high 0.2 -> 0.28" in capsys.readouterr().err
    saved = json.loads((run_dir / "config.json").read_text())
    assert (saved["rule"], saved["delta"], saved["delta_high"]) == ("dapo", 0.2, 0.28)
    assert event_lines(run_dir)[-1] == {
        "step": 1,
        "event": "resume",
        "changed": {"steps": [1, 2], "rule": ["grpo", "dapo"], "delta_high": [0.2, 0.28]},
    }
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--resume", str(run_dir), "--steps", "3", "--print-config"])
    printed = capsys.readouterr().out
    assert (
        exit_info.value.code == 0
        and 'rule = "dapo"  # ' in printed
        and "# delta_high = 0.28  (derived: from --delta 0.2 x rule dapo's" in printed
    )


def test_a_resume_reports_each_evaluation_on_its_own_set_and_a_finished_run_asks_for_more_steps(
    tiny_model_dir, tmp_path, capsys
):
    train.main(tiny_args(tiny_model_dir, tmp_path, "sets", "--steps", "1"))
    capsys.readouterr()
    train.main(["--resume", str(tmp_path / "sets"), "--steps", "2", "--eval-problems", "2"])
    out = capsys.readouterr().out
    assert re.search(
        r"held-out accuracy: before [\d.]+% \(n=3, k=2\) -> after [\d.]+% \(n=2, k=2\): not comparable, the held-out "
        r"set changed on resume",
        out,
    ), out
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--resume", str(tmp_path / "sets")])
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        f"train.py: --resume {tmp_path / 'sets'}: the run finished its 2 steps; give --steps N with N above 2 to "
        "train it further (or --steps 0 --export DIR to export it)\n"
    )
