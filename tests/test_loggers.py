"""Tests for loggers.py: one run, configured from a TOML file and trained on a reward function of its own next to
the built-in one, logs to TensorBoard, W&B (offline) and trackio (local), each read back with its own reader; its
resume continues the same runs; eval.py --run evaluates it. conftest.py points the trackers at a temporary folder."""

import json
import os
import struct
import zlib
from pathlib import Path

import pytest

import config
import eval as evaluation
import train
from infra import loggers

HERE = Path(__file__).resolve().parent.parent


def test_metric_names_are_stable_and_every_tracker_takes_them():
    assert loggers.metric_name("reward") == "train/reward"
    assert loggers.metric_name("clip_low_frac") == "clip/low_frac"
    assert loggers.metric_name("rollout_tokens_per_s") == "perf/rollout_tokens_per_s"
    assert loggers.metric_name("mu[<0.01]/clip_frac") == "clip_buckets/lt0.01/clip_frac"
    assert loggers.metric_name("mu[>0.9]/share") == "clip_buckets/gt0.9/share"
    assert loggers.metric_name("rewards/brevity") == "rewards/brevity"
    assert loggers.metric_name("a new metric[x]") == "train/a_new_metric_x_"
    record = {"step": 3, "reward": 0.5, "grad_norm": None, "skipped_updates": 0, "eval": {"accuracy": 0.25}}
    assert loggers.step_scalars(record) == {"train/reward": 0.5, "optim/skipped_updates": 0.0}
    result = {
        "accuracy": 0.5,
        "se": None,
        "pass@k": 0.75,
        "problems": 10,
        "k": 4,
        "sets": {
            "a": {"accuracy": 0.25, "se": 0.1, "pass@k": 0.5, "problems": 4, "k": 4},
            "b": {"accuracy": 0.75, "se": 0.1, "pass@k": 1.0, "problems": 6, "k": 4},
        },
    }
    assert loggers.eval_scalars(result) == {
        "eval/mean_at_k": 0.5,
        "eval/pass_at_k": 0.75,
        "eval/a/mean_at_k": 0.25,
        "eval/a/mean_at_k_se": 0.1,
        "eval/a/pass_at_k": 0.5,
        "eval/b/mean_at_k": 0.75,
        "eval/b/mean_at_k_se": 0.1,
        "eval/b/pass_at_k": 1.0,
    }
    assert [row[2] for row in loggers.eval_rows(result, 5, "after", ["a", "b"])] == ["a", "b", "average"]


def test_unknown_or_missing_trackers_fail_before_anything_runs(monkeypatch):
    with pytest.raises(
        ValueError,
        match=r"--log tensorboard,mlflow: unknown tracker 'mlflow'; known: tensorboard, "
        r"wandb, trackio",
    ):
        loggers.check("tensorboard,mlflow")
    monkeypatch.setattr(loggers.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(
        ValueError,
        match=r"--log wandb: the wandb package is not installed; pip install -r "
        r"requirements-loggers.txt",
    ):
        loggers.check("wandb")


def wandb_records(path: Path) -> list:
    """The records of a W&B run file (run-ID.wandb): W&B's log format (a LevelDB-style log of 32 KiB blocks, each
    record with a CRC-32, a length and a type: full, or first / middle / last of a split one) holding its own
    protobuf Records."""
    from wandb.proto import wandb_internal_pb2

    data, block, header = path.read_bytes(), 32768, 7
    assert data[:4] == b":W&B", path
    records, pending, offset = [], b"", header
    while offset + header <= len(data):
        room = block - offset % block
        checksum, length, kind = struct.unpack("<IHB", data[offset : offset + header])
        if room < header or (kind == 0 and length == 0):  # the end of a block is padding
            offset += room
            continue
        chunk = data[offset + header : offset + header + length]
        assert zlib.crc32(bytes([kind]) + chunk) == checksum, f"{path}: damaged record at byte {offset}"
        offset += header + length
        pending += chunk
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def wandb_history(run_dir: Path) -> tuple[list[str], dict[int, dict], dict]:
    """(the run id of each offline run file, history by step, config) of a run's W&B folder."""
    ids, history, settings = [], {}, {}
    for path in sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                ids.append(record.run.run_id)
                settings |= {item.key: json.loads(item.value_json) for item in record.run.config.update}
            elif kind == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item
                }
                history.setdefault(items["_step"], {}).update(items)
    return ids, history, settings


def test_a_toml_run_logs_everywhere_trains_on_two_rewards_resumes_and_is_evaluated_from_its_directory(
    tiny_model_dir, tmp_path, capsys
):
    settings = tmp_path / "run.toml"
    settings.write_text(f"""
model = "{tiny_model_dir}"
out_dir = "{tmp_path}"
run_name = "logged"
prompts_per_step = 2
group_size = 2
max_new_tokens = 4
lr = 1e-2
lora_rank = 4
eval_problems = 3
eval_k = 2
eval_every = 1
checkpoint_every = 1
steps = 2
reward_fn = ["reward:math_reward", "{HERE}/examples/rewards.py:brevity"]
reward_weights = [1, 0.5]
log = "tensorboard,wandb,trackio"
log_project = "test-logged"
""")
    run_dir = tmp_path / "logged"
    cfg, given, _ = config.parse_args(["--config", str(settings)])
    train.train(cfg)
    cfg, given, _ = config.parse_args(["--resume", str(run_dir), "--steps", "3"])  # one more step, the same runs
    train.train(config.resumed_config(cfg, given))

    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    lines = [line for line in lines if "event" not in line]  # a resume's event line is not a step
    assert [line["step"] for line in lines] == [1, 2, 3]
    for line in lines:  # the random model answers nothing right: the reward is the length penalty alone
        assert line["rewards/math_reward"] == line["accuracy"] == 0.0 and line["rewards/brevity"] < 0
        assert line["reward"] == pytest.approx(line["rewards/math_reward"] + 0.5 * line["rewards/brevity"])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert 'reward_fn = ["reward:math_reward"' in (run_dir / "config.toml").read_text()

    # TensorBoard, read back with its own reader
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    for name in (
        "train/reward",
        "train/accuracy",
        "rewards/brevity",
        "train/entropy",
        "clip/low_frac",
        "kl/sampling_policy",
        "optim/grad_norm",
        "perf/step_seconds",
        "perf/rollout_tokens_per_s",
        "perf/train_tokens_per_s",
        "clip_buckets/gt0.9/share",
        "eval/mean_at_k",
        "eval/pass_at_k",
    ):
        assert name in scalars, name
    assert [(e.step, e.value) for e in events.Scalars("train/reward")] == [
        (line["step"], pytest.approx(line["reward"], rel=1e-6)) for line in lines
    ]
    assert [e.step for e in events.Scalars("eval/mean_at_k")] == [0, 1, 2, 3]  # before, step 1, after, after
    assert events.Scalars("eval/mean_at_k")[-1].value == summary["after"]["accuracy"]
    texts = {
        tag: [e.tensor_proto.string_val[0].decode() for e in events.Tensors(tag)] for tag in events.Tags()["tensors"]
    }
    assert "lora_rank = 4" in texts["config/text_summary"][0]
    assert texts["eval/results/text_summary"][-1].count("| arithmetic_test |") == 4  # every evaluation so far

    # W&B, offline: its run files read back; the resume continued the same run
    ids, history, wandb_config = wandb_history(run_dir)
    assert len(ids) == 2 and ids[0] == ids[1] == (run_dir / "wandb-id").read_text()
    assert wandb_config["lr"] == 0.01 and wandb_config["reward_fn"] == [
        "reward:math_reward",
        f"{HERE}/examples/rewards.py:brevity",
    ]
    assert [step for step in sorted(history) if "train/reward" in history[step]] == [1, 2, 3]
    assert history[3]["train/reward"] == pytest.approx(lines[2]["reward"])
    assert history[3]["eval/mean_at_k"] == summary["after"]["accuracy"] and "perf/step_seconds" in history[3]
    assert history[3]["eval/results/_type"] == "table-file" and history[3]["eval/results/nrows"] == 4
    table_file = sorted((run_dir / "wandb").glob("offline-run-*"))[-1] / "files" / history[3]["eval/results/path"]
    table = json.loads(table_file.read_text())
    assert table["columns"] == loggers.TABLE_COLUMNS and [row[:2] for row in table["data"]] == [
        [0, "before"],
        [1, "step 1"],
        [2, "after"],
        [3, "after"],
    ]

    # trackio, local: read back from its database with its own storage API
    from trackio.sqlite_storage import SQLiteStorage

    assert Path(os.environ["TRACKIO_DIR"]) in SQLiteStorage.get_project_db_path("test-logged").parents
    logs = SQLiteStorage.get_logs("test-logged", "logged")
    rewards = {log["step"]: log["train/reward"] for log in logs if "train/reward" in log}
    assert rewards == {line["step"]: pytest.approx(line["reward"]) for line in lines}
    assert {log["step"] for log in logs if "eval/mean_at_k" in log} == {0, 1, 2, 3}
    assert SQLiteStorage.get_run_config("test-logged", "logged")["lora_rank"] == 4

    # eval.py --run takes the run's settings and its last adapter, and says which
    capsys.readouterr()
    out = tmp_path / "eval.json"
    evaluation.main(["--run", str(run_dir), "--out", str(out)])
    err = capsys.readouterr().err
    last = run_dir / (run_dir / "latest").read_text().strip() / "adapter"
    assert (
        f"--adapter {last} --bench arithmetic_test --limit 3 --k 2 --temperature 1.0 --top-p 1.0 "
        f"--max-new-tokens 4 --template equation --system 'You are a helpful assistant.' --seed 0"
    ) in err
    assert "from the run: model, template, system, thinking, temperature" in err
    saved = json.loads(out.read_text())
    assert saved["config"]["adapter"] == str(last) and saved["config"]["k"] == 2
    assert saved["benchmarks"]["arithmetic_test"]["summary"]["mean@k"]["mean"] == summary["after"]["accuracy"]
    with pytest.raises(SystemExit) as exit_info:  # an existing file is kept
        evaluation.main(["--run", str(run_dir), "--out", str(out), "--k", "1"])
    assert exit_info.value.code == 2 and "already exists; pass --force" in capsys.readouterr().err
    evaluation.main(["--run", str(run_dir), "--out", str(out), "--k", "1", "--force"])
    assert json.loads(out.read_text())["config"]["k"] == 1


def test_a_tracker_that_cannot_start_leaves_no_run_directory_in_the_way(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import wandb

    import train
    from conftest import tiny_args

    def no_login(**_):
        raise RuntimeError("api_key not configured (no-tty)")

    monkeypatch.setattr(wandb, "init", no_login)
    args = tiny_args(tiny_model_dir, tmp_path, "tracked", "--steps", "1")
    with pytest.raises(SystemExit) as exit_info:
        train.main([*args, "--log", "wandb"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "train.py: --log wandb: W&B could not start a run" in err, err
    assert not (tmp_path / "tracked").exists(), "the retry the message suggests must not be refused"
    monkeypatch.undo()
    train.main([*args, "--log", "tensorboard"])  # the retry
    assert (tmp_path / "tracked" / "summary.json").is_file()
