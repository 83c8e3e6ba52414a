"""The training loop end to end on a tiny random model: it trains, logs, checkpoints and resumes exactly."""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import lora
import train
import weights

TIMING_KEYS = {"step_seconds", "rollout_tokens_per_s", "reward_seconds", "train_tokens_per_s"}


@pytest.fixture(autouse=True)
def varied_rewards(monkeypatch):
    """A random model never solves a problem, so every advantage would be zero and nothing would train.
    Rewarding completions by the parity of their length gives the loop real, deterministic signal."""
    monkeypatch.setattr(train.reward, "reward", lambda texts, references, **_: [float(len(t) % 2) for t in texts])


def tiny_args(model_dir: Path, out_dir: Path, name: str, *extra: str) -> list[str]:
    return ["--model", str(model_dir), "--out-dir", str(out_dir), "--run-name", name,
            "--prompts-per-step", "2", "--group-size", "2", "--max-new-tokens", "4", "--lr", "1e-2",
            "--lora-rank", "4", "--eval-problems", "3", "--eval-k", "2", "--checkpoint-every", "2", *extra]


def run_training(argv: list[str]) -> dict:
    cfg, given = train.parse_args(argv)
    if cfg.resume:
        cfg = train._resumed_config(cfg, given)
    return train.train(cfg)


def launch(args: list[str], log: Path) -> subprocess.Popen:
    """train.py in its own process, so a test can signal it. Its stderr (progress bars, tracebacks) goes
    to a file: a pipe nobody reads would fill up and stall the run."""
    with log.open("w") as stderr:
        return subprocess.Popen([sys.executable, "train.py", *args], cwd=Path(train.__file__).parent,
                                stdout=subprocess.DEVNULL, stderr=stderr)


def metric_lines(run_dir: Path) -> list[dict]:
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines]


def test_two_steps_train_log_and_checkpoint(tiny_model_dir, tmp_path):
    state = run_training(tiny_args(tiny_model_dir, tmp_path, "smoke", "--steps", "2",
                                   "--export", str(tmp_path / "export")))
    run_dir = tmp_path / "smoke"
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    for key in ("reward", "accuracy", "entropy", "completion_length", "truncated", "clip_low_frac",
                "clip_high_frac", "approx_kl", "mu[>0.9]/share", "grad_norm"):
        assert key in lines[0], key
    assert lines[0]["entropy"] > 0
    checkpoint = run_dir / (run_dir / "latest").read_text()
    adapter = load_file(checkpoint / "adapter" / "adapter_model.safetensors")
    lora_b = [t for k, t in adapter.items() if "lora_B" in k]
    assert lora_b and any(t.abs().sum() > 0 for t in lora_b), "LoRA B starts at zero and must have moved"
    assert state["step"] == 2 and state["before"]["problems"] == 3 and "after" in state
    assert (run_dir / "best" / "adapter_config.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["after"]["k"] == 2
    # the merged export is a plain transformers checkpoint with the trained policy's logits
    policy = lora.load(weights.from_pretrained(str(tiny_model_dir)), checkpoint / "adapter")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = torch.randint(0, policy.config.vocab_size, (2, 9))
    with torch.no_grad():
        assert torch.allclose(exported(ids).logits, policy(ids), atol=1e-4)


def test_resume_reproduces_an_uninterrupted_run(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "straight", "--steps", "4"))
    run_training(tiny_args(tiny_model_dir, tmp_path, "split", "--steps", "2"))
    run_training(["--resume", str(tmp_path / "split"), "--steps", "4"])
    straight, split = metric_lines(tmp_path / "straight"), metric_lines(tmp_path / "split")
    assert [line["step"] for line in split] == [1, 2, 3, 4]
    assert split == straight


def test_sigkill_loses_only_steps_after_the_last_checkpoint(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, "killed", "--steps", "1000000", "--checkpoint-every", "1",
                     "--eval-problems", "1", "--eval-k", "1")
    proc = launch(args, tmp_path / "killed.log")
    run_dir = tmp_path / "killed"
    deadline = time.time() + 120
    try:
        while not (run_dir / "latest").exists() or _latest_step(run_dir) < 3:
            assert proc.poll() is None and time.time() < deadline, "training did not reach step 3"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    saved_step = _latest_step(run_dir)
    assert saved_step >= 3
    state = run_training(["--resume", str(run_dir), "--steps", str(saved_step + 1)])
    assert state["step"] == saved_step + 1
    assert [line["step"] for line in metric_lines(run_dir)] == list(range(1, saved_step + 2))


def test_ctrl_c_checkpoints_the_step_in_progress_and_resumes(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, "interrupted", "--steps", "1000000", "--checkpoint-every", "1000",
                     "--eval-problems", "1", "--eval-k", "1")
    proc = launch(args, tmp_path / "interrupted.log")
    metrics = tmp_path / "interrupted" / "metrics.jsonl"
    deadline = time.time() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 2:
        assert proc.poll() is None and time.time() < deadline, "training did not reach step 2"
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 0, (tmp_path / "interrupted.log").read_text()[-2000:]
    saved_step = _latest_step(tmp_path / "interrupted")  # no periodic checkpoint was due: Ctrl-C wrote it
    assert saved_step >= 2 and len(metric_lines(tmp_path / "interrupted")) == saved_step
    state = run_training(["--resume", str(tmp_path / "interrupted"), "--steps", str(saved_step + 1)])
    assert state["step"] == saved_step + 1


def _latest_step(run_dir: Path) -> int:
    return int((run_dir / "latest").read_text().split("-")[1])


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


def test_reference_kl_full_kl_rule_minibatches_and_recomputed_old_logp(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "options", "--steps", "2", "--rule", "kl_full",
                           "--kl-beta", "0.1", "--recompute-old-logp", "--updates-per-rollout", "2",
                           "--grad-accum", "2", "--prompts-per-step", "4"))
    first, second = metric_lines(tmp_path / "options")
    for line in (first, second):
        assert line["skipped_updates"] == 0 and line["ref_kl"] >= 0 and line["approx_kl"] >= 0
    assert second["ref_kl"] > 0, "after an update the policy differs from the frozen base"
    assert first["approx_kl"] > 0, "the second mini-batch of a step sees a policy that has moved"


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_update_of_one_batch(tiny_model_dir, tmp_path, aggregation):
    cfg, _ = train.parse_args(tiny_args(tiny_model_dir, tmp_path, "accum", "--prompts-per-step", "4",
                                        "--max-new-tokens", "6", "--aggregation", aggregation))
    loss_cfg = train.loss_config(cfg)
    model, tokenizer, _ = train.build(cfg)
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    stops = list(range(0, len(tokenizer), 4))  # a quarter of the vocabulary ends a row: lengths differ
    out = train.sample(model, tokenizer, problems, cfg, stops, step=1)
    rewards, _ = train.score(out, problems, cfg)
    assert out.completion_mask.sum(1).unique().numel() > 1, "rows of different lengths exercise the trimming"
    advantages = train.loss.group_advantages(rewards, cfg.group_size).float()
    updated = []
    for accum in (1, 4):
        model, _, optimizer = train.build(cfg)
        cfg.grad_accum = accum
        train.policy_update(model, optimizer, out, advantages, cfg, loss_cfg, step=1)
        updated.append({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad})
    for name, value in updated[0].items():
        torch.testing.assert_close(updated[1][name], value, rtol=1e-5, atol=1e-7)


def test_non_finite_loss_skips_the_update(tiny_model_dir, tmp_path):
    cfg, _ = train.parse_args(tiny_args(tiny_model_dir, tmp_path, "nan"))
    model, tokenizer, optimizer = train.build(cfg)
    stops = [tokenizer.eos_token_id]
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    out = train.sample(model, tokenizer, problems, cfg, stops, step=1)
    rewards, _ = train.score(out, problems, cfg)
    before = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad}
    advantages = torch.full((len(rewards),), float("nan"))
    with pytest.warns(UserWarning, match="update skipped"):
        metrics = train.policy_update(model, optimizer, out, advantages, cfg, train.loss.LossConfig(), step=1)
    assert metrics["skipped_updates"] == 1
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, before[name]), name


def test_every_config_field_is_a_flag_and_presets_yield_to_flags():
    cfg, given = train.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--lr", "1e-5", "--model", ""])
    assert cfg.rule == "atr" and cfg.delta == 0.07 and cfg.grad_accum == 4 and cfg.lora_rank == 32
    assert cfg.lr == 1e-5 and cfg.model is None and given == {"preset", "lr", "model"}
    assert train.parse_args(["--recompute-old-logp"])[0].recompute_old_logp is True
    gppo, _ = train.parse_args(["--preset", "gppo-qwen3-8b"])
    assert gppo.rule == "kl-atomic" and gppo.updates_per_rollout == 8 and gppo.kl_beta == 0.0
    assert train._dual_clip(gppo.dual_clip) == (0.5, 10.0) and train._dual_clip("3") == 3.0
    with pytest.raises(SystemExit):
        train.parse_args(["--preset", "nope"])


def test_bad_inputs_fail_before_training(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"problem": "", "answer": "3"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "bad", "--dataset", str(bad)))
    with pytest.raises(ValueError, match="rule"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "bad", "--rule", "nope"))
    with pytest.raises(ValueError, match="dual.clip"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "bad", "--dual-clip", "0.5,x"))
    with pytest.raises(FileNotFoundError, match="--resume"):
        run_training(["--resume", str(tmp_path / "missing")])
    for flags, flag in ((["--group-size", "1"], "--group-size"), (["--checkpoint-every", "0"], "--checkpoint-every"),
                        (["--temperature", "0"], "--temperature"), (["--format-weight", "0.1"], "--format-weight")):
        with pytest.raises(ValueError, match=flag):
            run_training(tiny_args(tiny_model_dir, tmp_path, "bad", *flags))


def test_a_run_is_never_silently_restarted_or_overwritten(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "once", "--steps", "1"))
    with pytest.raises(FileExistsError, match="--resume"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "once", "--steps", "2"))
    (tmp_path / "early").mkdir()  # a run that died before its first checkpoint has nothing to resume
    (tmp_path / "early" / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_training(["--resume", str(tmp_path / "early")])
