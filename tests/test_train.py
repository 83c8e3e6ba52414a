"""The training loop end to end on a tiny random model: it trains and logs, its updates are exact, and bad
settings fail before the model loads. A run's life on disk (interrupts, checkpoints, resumes): test_rundir.py."""

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import load_file

import config
import lora
import train
from conftest import RecordingSGD, assert_equal_to, metric_lines, run_training, tiny_args
from engine import sizes
from infra import rundir, weights

REAL_REWARD = train.reward.reward  # before varied_rewards replaces it
pytestmark = pytest.mark.usefixtures("varied_rewards")


def test_two_steps_train_log_and_checkpoint(tiny_model_dir, tmp_path, capsys):
    state = run_training(
        tiny_args(tiny_model_dir, tmp_path, "smoke", "--steps", "2", "--export", str(tmp_path / "export"))
    )
    run_dir = tmp_path / "smoke"
    assert capsys.readouterr().err.count(f"run directory: {run_dir}\n") == 2  # at the start and at the end
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2]
    for key in (
        "reward",
        "accuracy",
        "entropy",
        "completion_length",
        "truncated",
        "clip_low_frac",
        "clip_high_frac",
        "approx_kl",
        "mu[>0.9]/share",
        "grad_norm",
    ):
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
    run_training(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            "first",
            "--steps",
            "1",
            "--rule",
            "kl-atomic",
            "--updates-per-rollout",
            "2",
            "--system-prompt",
            "",
            "--reward-fn",
            "reward:math_reward",
            "--reward-fn",
            f"{Path(train.__file__).parent}/examples/rewards.py:brevity",
            "--reward-weights",
            "1,0.5",
        )
    )
    first = json.loads((tmp_path / "first" / "config.json").read_text())
    run_training(["--config", str(tmp_path / "first" / "config.toml"), "--run-name", "again"])
    again = json.loads((tmp_path / "again" / "config.json").read_text())
    assert again == {**first, "run_name": "again"}
    assert metric_lines(tmp_path / "again") == metric_lines(tmp_path / "first")


def test_a_reward_function_of_your_own_trains_next_to_the_built_in_one(tiny_model_dir, tmp_path):
    examples = Path(train.__file__).parent / "examples" / "rewards.py"
    run_training(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            "two",
            "--steps",
            "2",
            "--max-new-tokens",
            "6",
            "--reward-fn",
            "reward:math_reward",
            "--reward-fn",
            f"{examples}:brevity",
            "--reward-weights",
            "1,0.5",
        )
    )
    for line in metric_lines(tmp_path / "two"):
        # accuracy is the checker's verdict (here the fixture's parity), whatever else the reward holds
        assert line["accuracy"] == line["rewards/math_reward"]
        assert line["reward"] == pytest.approx(line["rewards/math_reward"] + 0.5 * line["rewards/brevity"])
        assert -1 <= line["rewards/brevity"] <= 0


def trained_on(dataset: str, eval_dataset: str, seed: int = 0) -> list[dict]:
    """The problems a run trains on: its training set without its validation split."""
    return rundir.validation_split(train.load_problems(dataset), {"held out": train.load_problems(eval_dataset)}, seed)[
        0
    ]


def test_a_failing_reward_function_stops_the_step_in_one_line(tiny_model_dir, tmp_path, capsys):
    module = tmp_path / "broken.py"
    module.write_text(  # the trial call before training passes an empty completion: this fails on the step's
        "def on_step_one(completions, **columns):\n    return [1 / 0 if text else 0.0 for text in completions]\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        train.main(
            tiny_args(tiny_model_dir, tmp_path, "broken", "--steps", "2", "--reward-fn", f"{module}:on_step_one")
        )
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1 and lines[-1] == (
        f"train.py: reward function {module}:on_step_one raised on row 0 of step 1 (prompt 0, completion 0: "
        f"{train.batch_of(trained_on('arithmetic', 'arithmetic_test'), 0, 2, 0)[0]['problem']!r}): ZeroDivisionError: "
        "division by zero; the last checkpoint is kept: fix the function, then continue with python train.py "
        f"--resume {tmp_path / 'broken'} (which imports it again)"
    ), lines
    assert (tmp_path / "broken" / "latest").is_file()


def test_reference_kl_full_kl_rule_minibatches_and_recomputed_old_logp(tiny_model_dir, tmp_path):
    run_training(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            "options",
            "--steps",
            "2",
            "--rule",
            "kl_full",
            "--kl-beta",
            "0.1",
            "--recompute-old-logp",
            "on",
            "--updates-per-rollout",
            "2",
            "--grad-accum",
            "2",
            "--prompts-per-step",
            "4",
        )
    )
    first, second = metric_lines(tmp_path / "options")
    for line in (first, second):
        assert line["skipped_updates"] == 0 and line["ref_kl"] >= 0 and line["approx_kl"] >= 0
    assert second["ref_kl"] > 0, "after an update the policy differs from the frozen base"
    assert first["approx_kl"] > 0, "the second mini-batch of a step sees a policy that has moved"


def sampled_step(tiny_model_dir, tmp_path, monkeypatch, *flags):
    """A config, a fresh model and one rollout with its advantages; a quarter of the vocabulary ends a row,
    so rows differ in length and the trimming of padding is exercised."""
    cfg, _, _ = config.parse_args(
        tiny_args(tiny_model_dir, tmp_path, "step", "--prompts-per-step", "4", "--max-new-tokens", "6", *flags)
    )
    model, tokenizer, _, _ = train.build(cfg)
    cfg = sizes.resolve_automatic(cfg, model, tokenizer, [])
    monkeypatch.setattr(train, "stop_ids", lambda config, tok: list(range(0, len(tok), 4)))
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step, cfg.seed)
    out = train.sample(model, tokenizer, problems, cfg, step=1)
    rewards, *_ = train.score(out, problems, cfg)
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
        metrics, _ = train.policy_update(model, optimizer, out, torch.full_like(advantages, float("nan")), cfg, step=1)
    assert metrics["skipped_updates"] == 1 and metrics["grad_norm"] is None
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, before[name]), name


def test_a_step_and_an_evaluation_create_every_tensor_on_the_model_device(tiny_model_dir, tmp_path, monkeypatch):
    """With the default device set to meta, any tensor made without naming the model's device lands on meta
    and meeting the model's CPU tensors raises, as a CPU tensor meeting CUDA ones does on a GPU."""
    cfg, _, _ = config.parse_args(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            "device",
            "--updates-per-rollout",
            "2",
            "--kl-beta",
            "0.1",
            "--rule",
            "kl_full",
            "--recompute-old-logp",
            "on",
            "--shuffle",
            "groups",
        )
    )  # every pass shares its prompt
    model, tokenizer, optimizer, _ = train.build(cfg)
    cfg = sizes.resolve_automatic(cfg, model, tokenizer, [])
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, 2 * cfg.prompts_per_step, cfg.seed)
    eval_sets = train.evaluation.load_eval_sets(cfg)
    dynamic = dataclasses.replace(cfg, dynamic_sampling=2)  # its groups kept and dealt out
    torch.set_default_device("meta")
    try:
        record, _ = train.train_step(model, optimizer, tokenizer, problems[: cfg.prompts_per_step], cfg, step=1)
        sampled, _ = train.train_step(model, optimizer, tokenizer, problems, dynamic, step=2)
        result = train.evaluation.held_out(model, tokenizer, eval_sets, cfg, "eval")
    finally:
        torch.set_default_device(None)
    assert record["skipped_updates"] == 0 and sampled["dynamic/calls"] in (1, 2) and 0 <= result["accuracy"] <= 1


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
    with pytest.warns(UserWarning, match="one optimizer step per rollout.*every clip rule gives the same update"):
        config.warn_if_inert(config.parse_args(["--rule", "atr"])[0])
    with pytest.warns(UserWarning, match="every clip rule gives the same update"):
        config.warn_if_inert(config.parse_args(["--delta", "0.3"])[0])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config.warn_if_inert(config.parse_args([])[0])  # the default command says nothing about its own defaults
        config.warn_if_inert(config.parse_args(["--rule", "atr", "--updates-per-rollout", "2"])[0])
        config.warn_if_inert(config.parse_args(["--rule", "atr", "--epochs", "2"])[0])


def test_token_records_are_written_every_step(tiny_model_dir, tmp_path):
    run_training(
        tiny_args(tiny_model_dir, tmp_path, "tokens", "--steps", "2", "--log-tokens", "5", "--updates-per-rollout", "2")
    )
    records = train.calibrate.read_token_records(tmp_path / "tokens")
    assert sorted(set(records["step"].tolist())) == [1, 2] and len(records["step"]) <= 10
    assert ((records["mu"] > 0) & (records["mu"] <= 1)).all() and (records["w"] > 0).all()


@pytest.mark.parametrize("prompts, updates", [(16, 4), (5, 2), (3, 3)])
def test_group_minibatches_hold_whole_prompts_and_every_row_once(prompts, updates):
    cfg = config.make_config(
        {"prompts_per_step": prompts, "group_size": 4, "updates_per_rollout": updates, "shuffle": "groups"}
    )
    minibatches = train.shuffled_minibatches(prompts * 4, cfg, step=3)
    assert len(minibatches) == updates
    assert sorted(torch.cat(minibatches).tolist()) == list(range(prompts * 4))
    for rows in minibatches:
        groups = rows.view(-1, 4)
        assert (groups == groups[:, :1] + torch.arange(4)).all() and (groups[:, 0] % 4 == 0).all()
    assert {len(rows) // 4 for rows in minibatches} <= {prompts // updates, -(-prompts // updates)}
    by_rows = train.shuffled_minibatches(prompts * 4, dataclasses.replace(cfg, shuffle="rows"), step=3)
    assert sorted(torch.cat(by_rows).tolist()) == list(range(prompts * 4))


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

    whole, merged = metrics(slice(0, 6)), train.loss.merge_metrics([metrics(slice(0, 2)), metrics(slice(2, 6))])
    for key in merged:
        if not key.endswith(("_min", "_max")):
            assert merged[key] == pytest.approx(whole[key], abs=1e-6), key
    assert whole["active_clip_frac"] > 0 and whole["active_share"] < 1


def test_the_clip_rate_counts_acting_tokens_after_the_first_update(tiny_model_dir, tmp_path):
    run_training(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            "rate",
            "--steps",
            "2",
            "--log-tokens",
            "1000",
            "--updates-per-rollout",
            "2",
            "--lr",
            "0.2",
        )
    )
    records = train.calibrate.read_token_records(tmp_path / "rate")
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


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--adv-std", "foo"], "--adv-std"),
        (["--top-k", "-3"], "--top-k"),
        (["--kl-beta", "-1"], "kl.beta"),
        (["--lr", "-1"], "--lr"),
        (["--lr", "nan"], "--lr"),
        (["--lr", "0"], "--lr"),
        (["--max-new-tokens", "0"], "--max-new-tokens"),
        (["--gradient-checkpointing", "maybe"], "--gradient-checkpointing"),
        (["--updates-per-rollout", "100"], "--updates-per-rollout"),
        (["--group-size", "1"], "--group-size"),
        (["--checkpoint-every", "0"], "--checkpoint-every"),
        (["--temperature", "0"], "--temperature"),
        (["--format-weight", "0.1"], "--format-weight"),
        (["--format-weight", "1", "--template", "boxed"], "--format-weight"),
        (["--rule", "nope"], "rule"),
        (["--dual-clip", "0.5,x"], "--dual-clip"),
        (["--ratio-limits", "2,1"], "ratio.limits"),
        (["--aggregation", "token-mean", "--rule", "gspo"], "--aggregation"),
        (["--shuffle", "prompts"], "--shuffle"),
        (["--shuffle", "groups", "--updates-per-rollout", "9"], "--updates-per-rollout 9: with --shuffle groups"),
        (["--kv-blocks", "1"], "--kv-blocks"),
        (["--kv-blocks", "-2"], "--kv-blocks"),
        (
            ["--micro-batch-tokens", "-5"],
            r"^train.py: --micro-batch-tokens -5: must be >= 0 \(0 = from the memory plan",
        ),
        (["--updates-per-rollout", "0"], "^train.py: --updates-per-rollout 0: must be between 1 and the 64 rows"),
        (["--template", "foo"], "^train.py: --template 'foo': expected one of answer, boxed, plain, equation"),
        (["--seed", "-1"], r"^train.py: --seed -1: must be in \[0, 2\^32\)$"),
        (["--steps", "-1"], "^train.py: --steps -1: must be >= 0$"),  # the one flag at fault, no other
        (["--grad-clip", "0"], "^train.py: --grad-clip 0.0: must be > 0"),
        (["--run-name", "../escape"], "^train.py: --run-name '../escape': must be one folder name, inside --out-dir"),
        (["--kl-cov-coef", "nan"], "^train.py: --kl-cov-coef nan: must be a finite number$"),
        (["--step", "2"], "^train.py: unrecognized arguments: --step 2$"),  # not taken for --steps
        (["--rule", "interval", "--delta", "0.1"], "^train.py: --delta 0.1: --rule interval has no trust-region size"),
        (["--norm-len", "8"], "^train.py: --norm-len 8: only --aggregation seq-mean-token-sum-norm divides by it"),
        (["--lora-targets", "q_proj,attn"], "^train.py: --lora-targets q_proj,attn: expected distinct names among"),
        (["--reward-weights", "1,2"], "--reward-weights 1,2: 2 weights for 1 --reward-fn"),
        (["--reward-fn", "no_colon"], "--reward-fn 'no_colon': expected module:function"),
        (["--reward-fn", "no_such_module_xyz:f"], "--reward-fn no_such_module_xyz:f: cannot import"),
        (["--reward-timeout", "0"], "--reward-timeout"),
        (["--log", "mlflow"], "--log mlflow: unknown tracker"),
    ],
)
def test_each_bad_flag_fails_in_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    """The model path does not exist: an error about the flag proves the check came first."""
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and re.search(message, lines[0]), lines
    assert not any(tmp_path.iterdir()), "a failed start leaves nothing behind"


@pytest.fixture
def no_weights(monkeypatch):
    """Loading weights fails the test: these checks must come before it."""
    monkeypatch.setattr(train.weights, "from_pretrained", lambda *_, **__: pytest.fail("the weights loaded"))


def test_a_missing_model_is_named_by_its_flag(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path)])
    assert (
        capsys.readouterr().err == f"train.py: --model {tmp_path / 'no-model'}: neither a local directory nor a "
        "hub id (owner/name)\n"
    )


def test_what_needs_the_models_shape_is_checked_before_its_weights_load(tiny_model_dir, tmp_path, capsys, no_weights):
    """The tiny model has a context of 256 tokens and k_proj of 32 x 16."""
    long_problem = "What is " + " + ".join(["1"] * 200) + "?"
    train_file = tmp_path / "long.jsonl"
    train_file.write_text(
        "".join(
            json.dumps({"problem": p, "answer": "2"}) + "\n" for p in ("What is 1 + 1?", "What is 2 + 0?", long_problem)
        )
    )
    out = tmp_path / "runs"
    cases = [
        (["--max-new-tokens", "256"], "--max-new-tokens 256: the model's context is 256 tokens, prompt included"),
        (["--lora-rank", "17"], "--lora-rank 17: above the 16 dimensions of k_proj in this model"),
        (["--dataset", str(train_file)], f"{train_file}:3: the prompt has "),
        (["--eval-dataset", f"arithmetic_test,{train_file}"], f"{train_file}:3: the prompt has "),
        (["--export", "/proc/no-export"], "--export /proc/no-export: cannot write in /proc"),
    ]
    for flags, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            train.main(tiny_args(tiny_model_dir, out, "shape", *flags))
        err = capsys.readouterr().err.strip()
        assert exit_info.value.code == 2 and err.startswith(f"train.py: {message}") and "\n" not in err, err
    assert not out.exists(), "a failed start leaves nothing behind"


def test_an_unwritable_out_dir_fails_before_the_weights_load(tiny_model_dir, tmp_path, capsys, no_weights):
    if os.geteuid() == 0:
        out = Path("/proc/no-runs")  # root may write anywhere else
    else:
        out = tmp_path / "read-only"
        out.mkdir(mode=0o555)
    with pytest.raises(SystemExit) as exit_info:
        train.main(tiny_args(tiny_model_dir, out, "ro"))
    err = capsys.readouterr().err.strip()
    assert exit_info.value.code == 2 and err.startswith(f"train.py: cannot write {out}") and "\n" not in err, err
    assert not (tmp_path / "read-only" / "ro").exists()


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
        "train.py: --device cuda: no CUDA GPU is visible to torch on this machine; use --device cpu"
    )


def test_a_plan_that_does_not_fit_says_which_phase_and_exits_1(capsys):
    with pytest.raises(SystemExit) as exit:
        train.main(["--plan", "--gpu-memory", "1.5"])
    out = capsys.readouterr().out
    last = out.strip().splitlines()[-1]
    assert exit.value.code == 1 and last.startswith("plan: peak") and "of 1.5 GB (does not fit: " in last, out
    assert "--micro-batch-tokens" in last or "--lora-rank" in last  # the default packs its micro-batches


def test_one_kv_pool_serves_every_rollout_and_evaluation(tiny_model_dir, tmp_path, monkeypatch):
    """The run allocates the sampler's pool once, before its first evaluation, and every sampler call of
    its steps and evaluations uses it."""
    pools, used = [], []
    make, generate = train.rollout.Pool.__init__, train.rollout.generate
    monkeypatch.setattr(train.rollout.Pool, "__init__", lambda pool, *a, **k: pools.append(pool) or make(pool, *a, **k))
    monkeypatch.setattr(train.rollout, "generate", lambda *a, **k: used.append(k["pool"]) or generate(*a, **k))
    run_training(tiny_args(tiny_model_dir, tmp_path, "pool", "--steps", "2"))
    assert len(pools) == 1 and len(used) >= 4 and all(pool is pools[0] for pool in used)


def test_train_py_asks_for_expandable_segments_before_cuda_starts():
    """Imported without an allocator setting, train.py sets one (before torch can start CUDA); a user's stays
    (the module run again in the same process, with the user's setting)."""
    code = (
        "import importlib, os, train; print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF')); "
        "os.environ['PYTORCH_CUDA_ALLOC_CONF'] = 'max_split_size_mb:64'; importlib.reload(train); "
        "print(os.environ.get('PYTORCH_CUDA_ALLOC_CONF'))"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")}
    run = subprocess.run(
        [sys.executable, "-c", code], cwd=Path(__file__).parent.parent, env=env, capture_output=True, text=True
    )
    assert run.stdout.split() == ["expandable_segments:True", "max_split_size_mb:64"], run.stderr


# ----------------------------------------------------------------------------- epochs, schedules, the start


def test_epochs_pass_over_every_row_again_in_a_fresh_order(tiny_model_dir, tmp_path, monkeypatch):
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch, "--updates-per-rollout", "2")
    seen, real = [], train.policy_inputs

    def recording(model, out, frozen, rows, cfg):
        seen.append(rows.tolist())
        return real(model, out, frozen, rows, cfg)

    monkeypatch.setattr(train, "policy_inputs", recording)
    model, _, optimizer, _ = train.build(cfg)
    steps = []
    monkeypatch.setattr(train, "optimizer_step", lambda *args: steps.append(1) or 1.0)
    one, _ = train.policy_update(model, optimizer, out, advantages, cfg, step=1)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(cfg.seed + 1)).tolist()
    assert sum(seen, []) == order and len(steps) == 2, "one epoch is the order a run without --epochs had"
    assert not any(key.startswith("epoch[") for key in one)
    seen.clear(), steps.clear()
    three, _ = train.policy_update(model, optimizer, out, advantages, dataclasses.replace(cfg, epochs=3), step=1)
    passes = [sum(seen[i : i + 2], []) for i in (0, 2, 4)]
    assert len(steps) == 6 and passes[0] == order and all(sorted(p) == list(range(8)) for p in passes)
    assert passes[1] != passes[0] and passes[2] != passes[1]
    for epoch in (1, 2, 3):
        for key in train.CLIP_KEYS:
            assert 0 <= three[f"epoch[{epoch}]/{key}"] <= 1


def test_learning_rate_schedules():
    def lr(schedule, step, warmup=2, total=10):
        return train.learning_rate(1.0, schedule, warmup, total, step)

    assert [lr("constant", s) for s in (1, 2, 3, 10)] == [0.5, 1.0, 1.0, 1.0]
    assert lr("constant", 1, warmup=0) == 1.0
    assert [lr("linear", s) for s in (3, 4, 10)] == pytest.approx([1.0, 7 / 8, 1 / 8])
    assert [lr("cosine", s) for s in (3, 7, 10)] == pytest.approx(
        [1.0, 0.5 * (1 + math.cos(math.pi * 4 / 8)), 0.5 * (1 + math.cos(math.pi * 7 / 8))]
    )
    assert all(lr(schedule, s) > 0 for schedule in ("linear", "cosine") for s in range(1, 11))


def test_warmup_sets_each_steps_rate_and_logs_it(tiny_model_dir, tmp_path):
    run_training(
        tiny_args(tiny_model_dir, tmp_path, "warm", "--steps", "3", "--warmup-steps", "2", "--lr-schedule", "linear")
    )
    assert [line["lr"] for line in metric_lines(tmp_path / "warm")] == pytest.approx([5e-3, 1e-2, 1e-2])


def test_an_entropy_bonus_changes_the_update(tiny_model_dir, tmp_path, monkeypatch):
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch)
    updated = []
    for coef in (0.0, 0.5):
        model, _, _, _ = train.build(cfg)
        optimizer = torch.optim.SGD(lora.parameters(model), lr=1.0)
        bonus = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, entropy_coef=coef))
        train.policy_update(model, optimizer, out, advantages, bonus, step=1)
        updated.append(torch.cat([p.detach().flatten() for p in lora.parameters(model)]))
    assert not torch.allclose(updated[0], updated[1])
    assert sizes.workload(bonus).entropy_grad and not sizes.workload(cfg).entropy_grad


def test_a_run_starts_from_an_init_adapter_of_its_shape(tiny_model_dir, tmp_path):
    cfg, _, _ = config.parse_args(tiny_args(tiny_model_dir, tmp_path, "init"))
    model, _, _, _ = train.build(cfg)
    with torch.no_grad():
        for p in lora.parameters(model):
            p.add_(0.01)
    lora.save(model, tmp_path / "sft-adapter")
    started, _, _, _ = train.build(cfg, str(tmp_path / "sft-adapter"))
    for ours, theirs in zip(lora.parameters(started), lora.parameters(model)):
        assert torch.equal(ours, theirs)
    config.check_init_adapter(dataclasses.replace(cfg, init_adapter=str(tmp_path / "sft-adapter")))
    with pytest.raises(ValueError, match="--lora-rank 8 \\(the adapter has 4\\)"):
        config.check_init_adapter(dataclasses.replace(cfg, init_adapter=str(tmp_path / "sft-adapter"), lora_rank=8))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--init-adapter", "no-such-dir"], "adapter_config.json: not found"),
        (["--init-adapter", "x", "--kl-beta", "0.1"], "--init-adapter with --kl-beta"),
        (["--epochs", "0"], "--epochs"),
        (["--warmup-steps", "30"], "--warmup-steps"),
        (["--entropy-coef", "-1"], "--entropy-coef"),
        (["--lr-schedule", "step"], "--lr-schedule"),
        (["--thinking", "maybe"], "--thinking"),
    ],
)
def test_the_new_flags_fail_in_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_thought_lengths_count_unclosed_thoughts_and_split_the_rest():
    from types import SimpleNamespace

    from conftest import QWEN3_CHAT_TEMPLATE, make_tokenizer

    tokenizer = make_tokenizer(chat_template=QWEN3_CHAT_TEMPLATE, think_tokens=True)
    texts = ["<think>\n7 + 5 is 12", "<think>\nx</think>\n12", "12"]
    lengths = [len(tokenizer.encode(t, add_special_tokens=False)) + stop for t, stop in zip(texts, (0, 1, 1))]
    mask = torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]
    out = SimpleNamespace(
        texts=texts, completion_mask=mask, finished=torch.tensor([False, True, True]), old_logp=torch.zeros(mask.shape)
    )
    stats = train.thought_lengths(out, tokenizer, open_thought=False).tolist()
    answer = len(tokenizer.encode("\n12", add_special_tokens=False)) + 1
    assert stats == [[1.0, lengths[0], 0.0], [0.0, lengths[1] - answer, answer], [0.0, 0.0, lengths[2]]]


def test_score_grades_a_step_that_mixes_math_and_code(monkeypatch):
    """Each problem routes by its task: math by its answer, code by running the program; code metrics count why."""
    import types

    from grading import sandbox

    monkeypatch.setattr(train.reward, "reward", REAL_REWARD)
    code = {
        "task": "code",
        "problem": "Double n.",
        "tests": [{"input": "2\n", "output": "4"}, {"input": "5\n", "output": "10"}],
    }
    problems = [{"problem": "What is 2 + 2?", "answer": "4"}, code, code]
    texts = [
        "#### 4",
        "#### 5",  # math: right, wrong
        "```python\nprint(2 * int(input()))\n```",
        "```python\nprint(4)\n```",  # code: right, 1 of 2 tests
        "```python\nwhile True: pass\n```",
        "no program",
    ]
    out = types.SimpleNamespace(texts=texts, completions=[[0]] * 6, old_logp=torch.zeros(6, 1))
    cfg = dataclasses.replace(
        train.Config(), group_size=2, code_timeout=0.5, reward_fn=("reward:math_reward", "sandbox:code_reward")
    )
    try:
        rewards, correct, _, code_rows = train.score(out, problems, cfg)
    except sandbox.SandboxUnavailable as error:
        pytest.skip(str(error))
    assert rewards.tolist() == [1, 0, 1, 0, 0, 0] and correct.tolist() == rewards.tolist()
    metrics = train.sandbox.step_metrics(code_rows)
    assert metrics["code_tests_passed"] == pytest.approx((1 + 0.5 + 0 + 0) / 4)
    assert (metrics["code_wrong_answer"], metrics["code_timeout"], metrics["code_no_code_block"]) == (0.25, 0.25, 0.25)
    assert train.sandbox.step_metrics(code_rows[:2]) == {}  # a math-only step logs no code metrics
    fraction = dataclasses.replace(cfg, code_reward="fraction")
    assert train.score(out, problems, fraction)[0].tolist() == [1, 0, 1, 0.5, 0, 0]


def test_a_code_run_trains_and_logs_its_code_metrics(tiny_model_dir, tmp_path, monkeypatch):
    from grading import sandbox

    monkeypatch.setattr(train.reward, "reward", REAL_REWARD)
    try:
        sandbox.grade(["print(1)"], [{"tests": [{"input": "", "output": "1"}]}], workers=1)
    except sandbox.SandboxUnavailable as error:
        pytest.skip(str(error))
    run_training(
        tiny_args(
            tiny_model_dir,
            tmp_path,
            "code",
            "--steps",
            "1",
            "--dataset",
            "code",
            "--eval-dataset",
            "code_test",
            "--template",
            "{problem}",  # the code template outgrows its context
            "--reward-fn",
            "sandbox:code_reward",
        )
    )
    (line,) = metric_lines(tmp_path / "code")
    assert line["code_no_code_block"] == 1.0 and line["code_tests_passed"] == 0.0  # a random model writes no code


def test_code_problems_without_a_code_reward_fail_before_the_model_loads(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path), "--dataset", "code"])
    assert exit_info.value.code == 2 and capsys.readouterr().err.strip() == (
        "train.py: --dataset code holds code problems, which no --reward-fn grades (reward:math_reward): "
        "add --reward-fn sandbox:code_reward"
    )
    cfg, _, _ = train.config.parse_args(["--dataset", "code", "--reward-fn", "my_rewards:anything"])
    train.config.check_reward_functions(cfg, train.load_problems("code"))  # a function of your own may grade it


def test_plan_with_resume_plans_the_run(tiny_model_dir, tmp_path, capsys):
    run_training(tiny_args(tiny_model_dir, tmp_path, "planned", "--steps", "1", "--lora-rank", "3"))
    with pytest.raises(SystemExit):
        train.main(["--plan", "--resume", str(tmp_path / "planned")])
    out = capsys.readouterr().out
    assert "r3 on 7 targets" in out and "up to 2 prompts x 2 samples in flight" in out, out
    assert "4 new tokens" in out, out


def whole_rows(monkeypatch) -> None:
    """Every row runs whole, each with its own copy of its prompt: the reference of the shared layout."""
    policy_states = train.policy_states
    monkeypatch.setattr(train, "policy_states", lambda model, out, rows, group_size: policy_states(model, out, rows, 1))


def recorded_update(cfg, out, advantages, monkeypatch) -> dict:
    """policy_update of a fresh float64 model: its metrics, micro-batch losses, gradients, shared passes and
    trained weights after the update."""
    model, _, _, _ = train.build(cfg)
    model.to(torch.float64)
    optimizer, losses, shared_passes = RecordingSGD(lora.parameters(model)), [], []
    policy_loss, hidden_shared = train.loss.policy_loss, train.hidden_shared

    def recorded_loss(*args, **kwargs):
        value, metrics = policy_loss(*args, **kwargs)
        losses.append(value.detach())
        return value, metrics

    def counted(model, *args):  # (rows, prompts of different lengths) of each shared pass
        shared_passes.append((len(args[2]), args[1].sum(1).unique().numel()))
        return hidden_shared(model, *args)

    monkeypatch.setattr(train.loss, "policy_loss", recorded_loss)
    monkeypatch.setattr(train, "hidden_shared", counted)
    metrics, _ = train.policy_update(model, optimizer, out, advantages, cfg, step=1)
    trained = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
    return {
        "metrics": metrics,
        "losses": torch.stack(losses),
        "grads": optimizer.grads,
        "shared": shared_passes,
        "weights": trained,
    }


@pytest.mark.parametrize("shuffle", ["rows", "groups"])
@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean"])
def test_shared_prompts_give_the_update_of_whole_rows(tiny_model_dir, tmp_path, monkeypatch, aggregation, shuffle):
    """In float64, each prompt run once per micro-batch gives the losses, gradients and metrics of every row run
    whole: 2 updates of 2 micro-batches, padded rows, prompts of different lengths, recomputed old log-probs
    and a reference policy (frozen passes shared too)."""
    cfg, out, advantages = sampled_step(
        tiny_model_dir,
        tmp_path,
        monkeypatch,
        "--group-size",
        "4",
        "--updates-per-rollout",
        "2",
        "--grad-accum",
        "2",
        "--kl-beta",
        "0.1",
        "--recompute-old-logp",
        "on",
        "--aggregation",
        aggregation,
        "--shuffle",
        shuffle,
    )
    assert out.pad_mask[:, : out.prompt_len].sum(1).unique().numel() > 1, "prompts of different lengths"
    shared = recorded_update(cfg, out, advantages, monkeypatch)
    whole_rows(monkeypatch)
    whole = recorded_update(cfg, out, advantages, monkeypatch)
    assert shared["shared"] and not whole["shared"]
    if shuffle == "groups":  # 4 rows a pass, one prompt's: old and reference log-probs, then 4 micro-batches
        assert shared["shared"] == [(4, 1)] * 12
    else:
        assert max(lengths for _, lengths in shared["shared"]) > 1
    assert_equal_to(shared["losses"], whole["losses"])
    assert len(shared["grads"]) == len(whole["grads"]) == 2
    for got, expected in zip(shared["grads"], whole["grads"]):
        assert_equal_to(got, expected)
    assert shared["metrics"].keys() == whole["metrics"].keys()
    for key, expected in whole["metrics"].items():
        assert shared["metrics"][key] == pytest.approx(expected, rel=1e-12, abs=1e-15), key


def test_a_float32_run_with_shared_prompts_logs_the_metrics_of_whole_rows(tiny_model_dir, tmp_path, monkeypatch):
    args = ("--steps", "2", "--group-size", "4", "--updates-per-rollout", "2", "--shuffle", "groups")
    run_training(tiny_args(tiny_model_dir, tmp_path, "shared", *args))
    whole_rows(monkeypatch)
    run_training(tiny_args(tiny_model_dir, tmp_path, "whole", *args))
    shared, whole = metric_lines(tmp_path / "shared"), metric_lines(tmp_path / "whole")
    assert [line.keys() for line in shared] == [line.keys() for line in whole]
    for got, expected in zip(shared, whole):
        for key, value in expected.items():
            assert got[key] == pytest.approx(value, rel=1e-4, abs=1e-6), (got["step"], key)
    summaries = [json.loads((tmp_path / run / "summary.json").read_text()) for run in ("shared", "whole")]
    assert summaries[0] == summaries[1]


# ----------------------------------------------------------------------------- dynamic sampling, overlong, mismatch


def dynamic_setup(tiny_model_dir, tmp_path, monkeypatch, *flags):
    cfg, _, _ = config.parse_args(
        tiny_args(tiny_model_dir, tmp_path, "dyn", "--prompts-per-step", "4", "--max-new-tokens", "6", *flags)
    )
    model, tokenizer, _, _ = train.build(cfg)
    cfg = sizes.resolve_automatic(cfg, model, tokenizer, [])
    monkeypatch.setattr(train, "stop_ids", lambda config, tok: list(range(0, len(tok), 4)))
    problems = train.batch_of(train.load_problems(cfg.dataset), 0, cfg.prompts_per_step * 3, cfg.seed)
    return cfg, model, tokenizer, problems


def test_dynamic_sampling_keeps_the_groups_whose_rewards_differ_from_each_calls_own_streams(
    tiny_model_dir, tmp_path, monkeypatch
):
    cfg, model, tokenizer, problems = dynamic_setup(tiny_model_dir, tmp_path, monkeypatch, "--dynamic-sampling", "3")
    G, n = cfg.group_size, cfg.prompts_per_step
    out, scores, counts = train.dynamic_sample(model, tokenizer, problems, cfg, 1, False, train.Stopwatch())
    calls = [
        train.sample(model, tokenizer, problems[k * n : (k + 1) * n], cfg, 1, first_prompt=k * n)
        for k in range(counts["dynamic/calls"])
    ]
    groups = [(k, g) for k, call in enumerate(calls) for g in range(n)]
    rewards = torch.cat([train.score(call, problems[k * n : (k + 1) * n], cfg).reward for k, call in enumerate(calls)])
    differ = [bool(r.max() != r.min()) for r in rewards.view(-1, G)]
    expected = ([gk for gk, d in zip(groups, differ) if d] + [gk for gk, d in zip(groups, differ) if not d])[:n]
    assert counts == {
        "dynamic/groups_sampled": n * len(calls),
        "dynamic/groups_kept": min(n, sum(differ)),
        "dynamic/calls": len(calls),
    }
    assert sum(differ[:-n]) < n <= sum(differ) or len(calls) == 3  # it stops at the first call that fills the step
    assert len(out.completions) == n * G and torch.equal(scores.reward.view(-1, G), rewards.view(-1, G)[
        [k * n + g for k, g in expected]
    ])  # fmt: skip
    for i, (k, g) in enumerate(expected):  # each kept row is its call's row, token for token
        for j in range(G):
            row, source = i * G + j, g * G + j
            assert out.completions[row] == calls[k].completions[source]
            length = len(out.completions[row])
            assert torch.equal(out.old_logp[row, :length], calls[k].old_logp[source, :length])
            assert out.input_ids[row][out.pad_mask[row]].tolist() == calls[k].input_ids[source][
                calls[k].pad_mask[source]
            ].tolist()  # fmt: skip
    again = train.dynamic_sample(model, tokenizer, problems, cfg, 1, False, train.Stopwatch())
    assert again[0].completions == out.completions and again[2] == counts  # a run repeats


def test_dynamic_sampling_on_a_step_whose_groups_all_differ_is_the_plain_step(tiny_model_dir, tmp_path, monkeypatch):
    cfg, model, tokenizer, problems = dynamic_setup(tiny_model_dir, tmp_path, monkeypatch, "--dynamic-sampling", "3")
    monkeypatch.setattr(
        train.reward, "reward", lambda texts, references, **_: [float(i % 2) for i in range(len(texts))]
    )
    out, scores, counts = train.dynamic_sample(model, tokenizer, problems, cfg, 1, False, train.Stopwatch())
    plain = train.sample(model, tokenizer, problems[: cfg.prompts_per_step], cfg, 1)
    assert counts["dynamic/calls"] == 1 and counts["dynamic/groups_kept"] == cfg.prompts_per_step
    for name in ("old_logp", "completion_ids", "completion_mask", "input_ids", "pad_mask", "truncated"):
        assert torch.equal(getattr(out, name), getattr(plain, name)), name
    assert torch.equal(scores.reward, train.score(plain, problems[: cfg.prompts_per_step], cfg).reward)


def test_a_dynamic_sampling_run_logs_its_groups_and_draws_the_prompts_it_used(tiny_model_dir, tmp_path, capsys):
    state = run_training(
        tiny_args(
            tiny_model_dir, tmp_path, "dapo", "--steps", "2", "--dynamic-sampling", "3", "--overlong", "penalty:2"
        )
    )
    lines = metric_lines(tmp_path / "dapo")
    for line in lines:
        assert line["dynamic/groups_sampled"] == 2 * line["dynamic/calls"] and line["dynamic/calls"] in (1, 2, 3)
        assert 0 <= line["dynamic/groups_kept"] <= 2 and -1 <= line["overlong_penalty"] <= 0
    assert state["data_position"] == 2 * sum(line["dynamic/calls"] for line in lines)
    assert "groups kept" in capsys.readouterr().err


def test_the_soft_overlong_penalty_is_daps_formula():
    from types import SimpleNamespace

    lengths = torch.tensor([3, 6, 7, 8, 10])
    out = SimpleNamespace(completion_mask=torch.arange(10)[None, :] < lengths[:, None])
    cfg = SimpleNamespace(overlong="penalty:4", max_new_tokens=10)  # Lmax 10, L 4: 0 up to 6 tokens
    assert train.overlong_penalty(out, cfg).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert train.overlong_penalty(out, SimpleNamespace(overlong="mask", max_new_tokens=10)) is None


def test_overlong_mask_takes_truncated_rows_out_of_the_loss(tiny_model_dir, tmp_path, monkeypatch):
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch, "--overlong", "mask")
    assert out.truncated.any() and not out.truncated.all()
    mask = train.loss_mask(out, cfg)
    assert not mask[out.truncated].any() and torch.equal(mask[~out.truncated], out.completion_mask[~out.truncated])
    plan = train.micro_batch_plan(out, cfg, 1, train.distributed.SOLO, False)
    assert plan[0][1]["num_tokens"] == mask.sum()
    # the update is the one of the untruncated rows alone, with the truncated rows' advantages anything
    updated = []
    for adv in (advantages, torch.where(out.truncated, 100.0, advantages)):
        model, _, _, _ = train.build(cfg)
        optimizer = torch.optim.SGD(lora.parameters(model), lr=1.0)
        train.policy_update(model, optimizer, out, adv, cfg, step=1)
        updated.append([v.detach().clone() for v in model.parameters() if v.requires_grad])
    assert all(torch.equal(a, b) for a, b in zip(*updated))


def test_a_mini_batch_of_truncated_rows_alone_is_a_skipped_update_without_a_nan(tiny_model_dir, tmp_path, monkeypatch):
    """Under --overlong mask a mini-batch whose every row is truncated has no token in its normaliser: the update
    is skipped as such (no non-finite loss warned of), and AdamW's moments do not move the adapters."""
    cfg, out, advantages = sampled_step(tiny_model_dir, tmp_path, monkeypatch, "--overlong", "mask")
    out.truncated = torch.ones_like(out.truncated)
    model, _, optimizer, _ = train.build(cfg)
    before = [p.detach().clone() for p in lora.parameters(model)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        summary, _ = train.policy_update(model, optimizer, out, advantages, cfg, step=1)
    assert summary["skipped_updates"] == 1 and summary["grad_norm"] is None
    assert all(torch.equal(a, p) for a, p in zip(before, lora.parameters(model)))


def test_the_mismatch_is_measured_every_step_and_near_zero_in_float32(tiny_model_dir, tmp_path):
    run_training(tiny_args(tiny_model_dir, tmp_path, "sampled", "--steps", "1"))
    run_training(tiny_args(tiny_model_dir, tmp_path, "all", "--steps", "1", "--recompute-old-logp", "on"))
    (sampled,), (every,) = metric_lines(tmp_path / "sampled"), metric_lines(tmp_path / "all")
    assert sampled["mismatch/rows"] == 2 and every["mismatch/rows"] == 4  # one group of 2; recomputed: all rows
    for line in (sampled, every):
        assert 0 <= line["mismatch/k3"] < 1e-6 and line["mismatch/abs_max"] < 1e-3 and line["mismatch/out_frac"] == 0


def test_the_mismatch_sample_is_the_first_group_and_matches_a_recomputation(tiny_model_dir, tmp_path, monkeypatch):
    cfg, out, _ = sampled_step(tiny_model_dir, tmp_path, monkeypatch, "--grad-accum", "2")
    model, _, _, _ = train.build(cfg)
    sampled = train.sampler_mismatch(model, out, {"old_logp": out.old_logp}, cfg)
    assert sampled["mismatch/rows"] == cfg.group_size < len(out.completions) // 2  # a group of the first micro-batch
    shifted = out.old_logp - 0.1 * out.completion_mask  # a trainer 0.1 nats above the sampler on every token
    full = train.sampler_mismatch(model, out, {"old_logp": shifted}, cfg)
    assert full["mismatch/rows"] == len(out.completions)
    assert full["mismatch/abs_mean"] == pytest.approx(0.1, rel=1e-5)
    assert full["mismatch/k3"] == pytest.approx(math.exp(-0.1) - 1 + 0.1, rel=1e-4)


def test_a_rollout_correction_trains_with_its_weights_logged(tiny_model_dir, tmp_path):
    run_training(
        tiny_args(
            tiny_model_dir, tmp_path, "tis", "--steps", "1", "--rollout-correction", "tis-token",
            "--top-entropy-quantile", "0.5",
        )
    )  # fmt: skip
    (line,) = metric_lines(tmp_path / "tis")
    assert line["mismatch/rows"] == 4  # the correction recomputes the old log-probs
    assert line["correction_weight_mean"] == pytest.approx(1.0, abs=1e-4) and line["correction_weight_max"] <= 2.0
    assert 0.4 <= line["entropy_selected_frac"] <= 1.0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--dynamic-sampling", "-1"], "--dynamic-sampling -1: must be >= 0"),
        (["--overlong", "penalty:0"], "--overlong penalty:0: expected off, mask or penalty:L"),
        (["--overlong", "trim"], "--overlong trim: expected off, mask or penalty:L"),
        (["--rollout-correction", "tis-token", "--recompute-old-logp", "off"], "--rollout-correction tis-token: "),
        (["--rollout-correction", "tis"], "--rollout-correction tis: expected one of off, tis-token"),
        (["--top-entropy-quantile", "1.5"], "--top-entropy-quantile 1.5: must be in (0, 1]"),
        (["--rollout-correction-cap", "3"], "--rollout-correction-cap 3"),  # inert without a correction
    ],
)
def test_the_field_options_fail_in_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], lines


def test_a_reward_function_with_the_wrong_signature_fails_before_the_model_loads(tmp_path, capsys, no_weights):
    module = tmp_path / "mine.py"
    module.write_text("def score(completions):\n    return [0.0 for _ in completions]\n")
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--out-dir", str(tmp_path), "--run-name", "sig", "--reward-fn", f"{module}:score"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1, err
    assert err.startswith(f"train.py: --reward-fn: reward function {module}:score raised on row 0 of a trial call")
    assert "unexpected keyword argument" in err and err.endswith("; fix the function, then start again\n")
    assert not (tmp_path / "sig").exists()


def test_a_held_out_set_no_reward_function_grades_is_refused_before_the_model_loads(tmp_path, capsys, no_weights):
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--out-dir", str(tmp_path), "--eval-dataset", "code_test"])
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        "train.py: --eval-dataset code_test holds code problems, which no --reward-fn grades (reward:math_reward): "
        "evaluate on a set of math problems, or train with --reward-fn sandbox:code_reward\n"
    )
