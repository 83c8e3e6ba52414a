"""The training loop end to end on a tiny random model: it trains, logs, checkpoints and resumes exactly."""

import dataclasses
import json
import re
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import config
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
    cfg, given, _ = config.parse_args(argv)
    if cfg.resume:
        cfg = config.resumed_config(cfg, given)
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


def test_a_runs_config_toml_starts_the_same_run_again(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "first", "--steps", "1", "--rule", "kl-atomic",
                           "--updates-per-rollout", "2", "--system-prompt", "", "--reward-fn", "reward:math_reward", "--reward-fn",
                           f"{Path(train.__file__).parent}/examples/rewards.py:brevity", "--reward-weights", "1,0.5"))
    first = json.loads((tmp_path / "first" / "config.json").read_text())
    run_training(["--config", str(tmp_path / "first" / "config.toml"), "--run-name", "again"])
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again == {**first, "run_name": "again"}
    assert metric_lines(tmp_path / "again") == metric_lines(tmp_path / "first")


def test_a_reward_function_of_your_own_trains_next_to_the_built_in_one(tiny_model_dir, tmp_path):
    examples = Path(train.__file__).parent / "examples" / "rewards.py"
    run_training(tiny_args(tiny_model_dir, tmp_path, "two", "--steps", "2", "--max-new-tokens", "6",
                           "--reward-fn", "reward:math_reward", "--reward-fn", f"{examples}:brevity",
                           "--reward-weights", "1,0.5"))
    for line in metric_lines(tmp_path / "two"):
        # accuracy is the checker's verdict (here the fixture's parity), whatever else the reward holds
        assert line["accuracy"] == line["rewards/math_reward"]
        assert line["reward"] == pytest.approx(line["rewards/math_reward"] + 0.5 * line["rewards/brevity"])
        assert -1 <= line["rewards/brevity"] <= 0


def test_a_failing_reward_function_stops_the_step_in_one_line(tiny_model_dir, tmp_path, capsys):
    module = tmp_path / "broken.py"
    module.write_text("def on_step_one(completions, **columns):\n    return [1 / 0 for _ in completions]\n")
    with pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(tiny_model_dir, tmp_path, "broken", "--steps", "2",
                             "--reward-fn", f"{module}:on_step_one"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and lines[-1] == (
        f"train.py: reward function {module}:on_step_one raised on row 0 of step 1 (prompt 0, completion 0: "
        f"{train.batch_of(train.load_problems('arithmetic'), 0, 2, 0)[0]['problem']!r}): ZeroDivisionError: "
        "division by zero; the last checkpoint is kept (python train.py --resume RUN continues it)"), lines
    assert (tmp_path / "broken" / "latest").is_file()


def test_a_finished_run_exports_again_without_training_or_evaluating(tiny_model_dir, tmp_path, monkeypatch):
    run_training(tiny_args(tiny_model_dir, tmp_path, "done", "--steps", "2"))
    run_dir = tmp_path / "done"
    before = {name: (run_dir / name).read_bytes() for name in ("metrics.jsonl", "summary.json", "config.toml")}
    monkeypatch.setattr(train, "evaluate_held_out", lambda *a, **k: pytest.fail("an export-only run evaluated"))
    monkeypatch.setattr(train, "train_step", lambda *a, **k: pytest.fail("an export-only run trained"))
    state = run_training(["--resume", str(run_dir), "--steps", "0", "--export", str(tmp_path / "export")])
    assert state["step"] == 2 and {name: (run_dir / name).read_bytes() for name in before} == before
    policy = lora.load(weights.from_pretrained(str(tiny_model_dir)), run_dir / "checkpoint-000002" / "adapter")
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    ids = torch.randint(0, policy.config.vocab_size, (1, 7))
    torch.testing.assert_close(exported(ids).logits, policy(ids), rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match=r"--steps 0 trains and evaluates nothing; add --export DIR"):
        run_training(["--resume", str(run_dir), "--steps", "0"])


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
    log = (tmp_path / "interrupted.log").read_text()
    assert proc.returncode == 0, log[-2000:]
    # a redirected log gets plain lines: no progress bar's carriage returns or cursor moves
    assert "\r" not in log and "\x1b" not in log and re.search(r"^step 2/1000000: reward \S+, accuracy \S+, \S+ s$",
                                                                log, re.M), log[-2000:]
    saved_step = _latest_step(tmp_path / "interrupted")  # no periodic checkpoint was due: Ctrl-C wrote it
    assert saved_step >= 2 and len(metric_lines(tmp_path / "interrupted")) == saved_step
    state = run_training(["--resume", str(tmp_path / "interrupted"), "--steps", str(saved_step + 1)])
    assert state["step"] == saved_step + 1


def test_ctrl_c_during_an_evaluation_exits_cleanly_and_the_run_resumes(tiny_model_dir, tmp_path):
    args = tiny_args(tiny_model_dir, tmp_path, "eval-stop", "--steps", "1", "--eval-problems", "0", "--eval-k", "8",
                     "--max-new-tokens", "64")
    log = tmp_path / "eval-stop.log"
    proc = launch(args, log)
    deadline = time.time() + 120
    while "eval before" not in log.read_text():
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-2000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in log.read_text(), log.read_text()[-2000:]
    assert "--resume" in log.read_text().splitlines()[-1]
    state = run_training(["--resume", str(tmp_path / "eval-stop"), "--eval-problems", "2"])
    assert state["step"] == 1 and state["before"]["problems"] == 2


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
                           "--kl-beta", "0.1", "--recompute-old-logp", "on", "--updates-per-rollout", "2",
                           "--grad-accum", "2", "--prompts-per-step", "4"))
    first, second = metric_lines(tmp_path / "options")
    for line in (first, second):
        assert line["skipped_updates"] == 0 and line["ref_kl"] >= 0 and line["approx_kl"] >= 0
    assert second["ref_kl"] > 0, "after an update the policy differs from the frozen base"
    assert first["approx_kl"] > 0, "the second mini-batch of a step sees a policy that has moved"


def sampled_step(tiny_model_dir, tmp_path, monkeypatch, *flags):
    """A config, a fresh model and one rollout with its advantages; a quarter of the vocabulary ends a row,
    so rows differ in length and the trimming of padding is exercised."""
    cfg, _, _ = config.parse_args(tiny_args(tiny_model_dir, tmp_path, "step", "--prompts-per-step", "4",
                                           "--max-new-tokens", "6", *flags))
    model, tokenizer, _, _ = train.build(cfg)
    cfg = train.resolve_automatic(cfg, model, tokenizer, [])
    monkeypatch.setattr(train, "stop_ids", lambda config, tok: list(range(0, len(tok), 4)))
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    out = train.sample(model, tokenizer, problems, cfg, step=1)
    rewards, _, _ = train.score(out, problems, cfg)
    assert out.completion_mask.sum(1).unique().numel() > 1
    return cfg, out, train.loss.advantages(rewards, cfg.group_size, cfg.loss)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_micro_batches_give_the_update_of_one_batch(tiny_model_dir, tmp_path, monkeypatch, aggregation):
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch, "--aggregation", aggregation)
    updated = []
    for accum in (1, 4):  # plain SGD: Adam would blow rounding noise in near-zero gradients up to +-lr
        model, _, _, _ = train.build(cfg)
        optimizer = torch.optim.SGD(lora.parameters(model), lr=1.0)
        train.policy_update(model, optimizer, out, advantages, dataclasses.replace(cfg, grad_accum=accum), step=1)
        updated.append({k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad})
    for name, value in updated[0].items():
        torch.testing.assert_close(updated[1][name], value, rtol=1e-5, atol=1e-7)


def test_non_finite_loss_skips_the_update(tiny_model_dir, tmp_path, monkeypatch):
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch)
    model, _, optimizer, _ = train.build(cfg)
    before = {k: v.clone() for k, v in model.named_parameters() if v.requires_grad}
    with pytest.warns(UserWarning, match="update skipped"):
        metrics = train.policy_update(model, optimizer, out, torch.full_like(advantages, float("nan")), cfg, step=1)
    assert metrics["skipped_updates"] == 1 and metrics["grad_norm"] is None
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, before[name]), name


def test_a_step_and_an_evaluation_create_every_tensor_on_the_model_device(tiny_model_dir, tmp_path, monkeypatch):
    """With the default device set to meta, any tensor made without naming the model's device lands on meta
    and meeting the model's CPU tensors raises, as a CPU tensor meeting CUDA ones does on a GPU."""
    cfg, _, _ = config.parse_args(tiny_args(tiny_model_dir, tmp_path, "device", "--updates-per-rollout", "2",
                                           "--kl-beta", "0.1", "--rule", "kl_full", "--recompute-old-logp", "on"))
    model, tokenizer, optimizer, _ = train.build(cfg)
    cfg = train.resolve_automatic(cfg, model, tokenizer, [])
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    eval_sets = train.load_eval_sets(cfg)
    torch.set_default_device("meta")
    try:
        record, _ = train.train_step(model, optimizer, tokenizer, problems, cfg, step=1)
        result = train.evaluate_held_out(model, tokenizer, eval_sets, cfg, "eval")
    finally:
        torch.set_default_device(None)
    assert record["skipped_updates"] == 0 and 0 <= result["accuracy"] <= 1


def test_old_logp_are_recomputed_automatically_outside_float32(tiny_model_dir, tmp_path, monkeypatch):
    cfg, out, _ = sampled_step(tiny_model_dir, tmp_path, monkeypatch)
    model, _, _, _ = train.build(cfg)
    assert train.frozen_inputs(model, out, cfg)["old_logp"] is out.old_logp  # float32: the sampler's are exact
    bf16 = dataclasses.replace(cfg, dtype="bfloat16")  # the compute dtype decides: a full run's weights are fp32
    recomputed = train.frozen_inputs(model.to(torch.bfloat16), out, bf16)["old_logp"]
    assert recomputed is not out.old_logp and recomputed.shape == out.old_logp.shape
    mask = out.completion_mask  # the loss reads these tokens only
    torch.testing.assert_close(recomputed[mask], out.old_logp[mask], atol=0.2, rtol=0)  # bf16 rounding, no more
    off = train.frozen_inputs(model, out, dataclasses.replace(cfg, recompute_old_logp="off"))
    assert off["old_logp"] is out.old_logp


def test_the_first_minibatch_logs_the_numerical_floor_of_the_ratio(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "floor", "--steps", "1", "--updates-per-rollout", "2"))
    line = metric_lines(tmp_path / "floor")[0]
    assert line["start_ratio_min"] == pytest.approx(1, abs=1e-5)
    assert line["start_ratio_max"] == pytest.approx(1, abs=1e-5)
    assert line["ratio_max"] > line["start_ratio_max"] or line["ratio_min"] < line["start_ratio_min"]


def test_the_inert_trust_region_is_announced_when_a_chosen_rule_cannot_act():
    with pytest.warns(UserWarning, match="every clip rule gives the same update"):
        train.warn_if_inert(config.parse_args(["--rule", "atr"])[0])
    with pytest.warns(UserWarning, match="every clip rule gives the same update"):
        train.warn_if_inert(config.parse_args(["--delta", "0.3"])[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train.warn_if_inert(config.parse_args([])[0])  # the default command says nothing about its own defaults
        train.warn_if_inert(config.parse_args(["--rule", "atr", "--updates-per-rollout", "2"])[0])


def test_token_records_are_written_every_step(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "tokens", "--steps", "2", "--log-tokens", "5",
                           "--updates-per-rollout", "2"))
    records = train.loss.read_token_records(tmp_path / "tokens")
    assert sorted(set(records["step"].tolist())) == [1, 2] and len(records["step"]) <= 10
    assert ((records["mu"] > 0) & (records["mu"] <= 1)).all() and (records["w"] > 0).all()


def test_merged_micro_batches_give_the_whole_batch_metrics():
    g = torch.Generator().manual_seed(3)
    old_logp = torch.empty(6, 8).uniform_(-6, -0.05, generator=g)
    logp = old_logp + 0.4 * torch.randn(6, 8, generator=g)
    adv = torch.tensor([1.0, -1.0, 0.0, 0.5, 0.0, -2.0])
    mask = torch.arange(8)[None, :] < torch.tensor([8, 3, 5, 8, 2, 6])[:, None]
    cfg = train.loss.LossConfig(rule="atr")

    def metrics(rows):
        m = train.loss.policy_loss(logp[rows], old_logp[rows], adv[rows], mask[rows], cfg)[1]
        return m | {"tokens": int(mask[rows].sum())}

    whole, merged = metrics(slice(0, 6)), train.merge_metrics([metrics(slice(0, 2)), metrics(slice(2, 6))])
    for key in merged:
        if not key.endswith(("_min", "_max")):
            assert merged[key] == pytest.approx(whole[key], abs=1e-6), key
    assert whole["active_clip_frac"] > 0 and whole["active_share"] < 1


def test_the_clip_rate_counts_acting_tokens_after_the_first_update(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "rate", "--steps", "2", "--log-tokens", "1000",
                           "--updates-per-rollout", "2", "--lr", "0.2"))
    records = train.loss.read_token_records(tmp_path / "rate")
    lines = metric_lines(tmp_path / "rate")
    for step, line in enumerate(lines, 1):
        mine = {name: column[records["step"] == step] for name, column in records.items()}
        assert sorted(set(mine["update"].tolist())) == [0, 1]
        acting = (mine["advantage"] != 0) & (mine["update"] == 1)
        stopped = mine["region_low"] | mine["region_high"] | mine["limit"]
        assert line["clip_rate_tokens"] == acting.sum()
        assert line["clip_rate"] == (pytest.approx(stopped[acting].mean()) if acting.any() else None)
        assert sum(line[f"mu[{b}]/clip_rate_tokens"] for b in train.loss.MU_LABELS) == acting.sum()
        assert not stopped[mine["update"] == 0].any()  # the first update starts at w = 1: nothing clips
    assert any(line["clip_rate"] for line in lines), "nothing clipped: the test says nothing"


def test_a_resumed_run_refuses_settings_that_name_another_run(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "first", "--steps", "1"))
    for flags in (["--preset", "atr-grpo-qwen3-1.7b"], ["--run-name", "other"], ["--out-dir", "elsewhere"]):
        with pytest.raises(ValueError, match="cannot change"):
            run_training(["--resume", str(tmp_path / "first"), *flags])


@pytest.mark.parametrize("flags, message", [
    (["--adv-std", "foo"], "--adv-std"), (["--top-k", "-3"], "--top-k"), (["--kl-beta", "-1"], "kl.beta"),
    (["--lr", "-1"], "--lr"), (["--lr", "nan"], "--lr"), (["--lr", "0"], "--lr"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--gradient-checkpointing", "maybe"], "--gradient-checkpointing"),
    (["--updates-per-rollout", "100"], "--updates-per-rollout"), (["--group-size", "1"], "--group-size"),
    (["--checkpoint-every", "0"], "--checkpoint-every"), (["--temperature", "0"], "--temperature"),
    (["--format-weight", "0.1"], "--format-weight"),
    (["--format-weight", "1", "--template", "boxed"], "--format-weight"),
    (["--rule", "nope"], "rule"), (["--dual-clip", "0.5,x"], "--dual-clip"),
    (["--ratio-limits", "2,1"], "ratio.limits"), (["--aggregation", "token-mean", "--rule", "gspo"], "--aggregation"),
    (["--reward-weights", "1,2"], "--reward-weights 1,2: 2 weights for 1 --reward-fn"),
    (["--reward-fn", "no_colon"], "--reward-fn 'no_colon': expected module:function"),
    (["--reward-fn", "no_such_module_xyz:f"], "--reward-fn no_such_module_xyz:f: cannot import"),
    (["--reward-timeout", "0"], "--reward-timeout"), (["--log", "mlflow"], "--log mlflow: unknown tracker"),
])
def test_each_bad_flag_fails_in_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    """The model path does not exist: an error about the flag proves the check came first."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and re.search(message, lines[0]), lines
    assert not any(tmp_path.iterdir()), "a failed start leaves nothing behind"


def test_bad_data_and_runs_fail_before_training(tiny_model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"problem": "", "answer": "3"}\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "bad", "--dataset", str(bad)))
    with pytest.raises(FileNotFoundError, match="--resume"):
        run_training(["--resume", str(tmp_path / "missing")])
    assert not (tmp_path / "bad").exists(), "a failed start leaves no run directory"


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_says_so_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--device", "cuda", "--out-dir", str(tmp_path)])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == (
        "train.py: --device cuda: no CUDA GPU is visible to torch on this machine; use --device cpu")


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


def test_the_two_newest_checkpoints_are_kept_and_a_damaged_one_falls_back(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "two", "--steps", "4", "--checkpoint-every", "1"))
    run_dir = tmp_path / "two"
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-000003", "checkpoint-000004"]
    (run_dir / "checkpoint-000004" / "adapter" / "adapter_model.safetensors").write_bytes(b"damaged")
    with pytest.warns(UserWarning, match="checkpoint-000004"):
        state = run_training(["--resume", str(run_dir), "--steps", "5"])
    assert state["step"] == 5


def test_a_run_is_never_silently_restarted_or_overwritten(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "once", "--steps", "1"))
    with pytest.raises(FileExistsError, match="--resume"):
        run_training(tiny_args(tiny_model_dir, tmp_path, "once", "--steps", "2"))
    (tmp_path / "early").mkdir()  # a run that died before its first checkpoint has nothing to resume
    (tmp_path / "early" / "config.json").write_text(json.dumps({}))
    with pytest.raises(FileNotFoundError, match="no checkpoint"):
        run_training(["--resume", str(tmp_path / "early")])


def test_a_plan_that_does_not_fit_says_which_phase_and_exits_1():
    proc = subprocess.run([sys.executable, "train.py", "--plan", "--gpu-memory", "1.5"],
                          cwd=Path(train.__file__).parent, capture_output=True, text=True)
    last = proc.stdout.strip().splitlines()[-1]
    assert proc.returncode == 1 and last.startswith("plan: peak") and "of 1.5 GB (does not fit: " in last, proc.stdout
    assert "--grad-accum" in last or "--lora-rank" in last
