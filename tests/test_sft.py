"""The supervised stage on a tiny random model: the loss is the replies' alone, batches follow length, the run
checkpoints and resumes exactly, and its adapter is one train.py starts from."""

import json
import signal
import time
from pathlib import Path

import pytest
import torch

import config
import lora
import sft
import train
from conftest import launch
from data import render_prompt, render_solution
from infra import weights

TIMING_KEYS = {"step_seconds", "tokens_per_s"}


def tiny_args(model_dir: Path, out_dir: Path, name: str, *extra: str) -> list[str]:
    return [
        "--model",
        str(model_dir),
        "--out-dir",
        str(out_dir),
        "--run-name",
        name,
        "--template",
        "answer",
        "--lora-rank",
        "4",
        "--lr",
        "1e-2",
        "--batch-tokens",
        "2048",
        "--eval-problems",
        "2",
        "--eval-k",
        "2",
        "--max-new-tokens",
        "4",
        "--checkpoint-every",
        "2",
        *extra,
    ]


def run_sft(argv: list[str]) -> dict:
    cfg, given = config.parse_sft_args(argv)
    if cfg.resume:
        cfg = config.resumed_config(cfg, given)
    return sft.run(cfg)


def metric_lines(run_dir: Path) -> list[dict]:
    """The steps' lines, without their timings (a resume's event lines are not steps)."""
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in line.items() if k not in TIMING_KEYS} for line in lines if "event" not in line]


def grpo_config(model_dir, adapter):
    """The GRPO settings that start from an SFT run's adapter (answer template, rank 4)."""
    argv = ["--model", str(model_dir), "--lora-rank", "4", "--template", "answer", "--init-adapter", str(adapter)]
    return config.parse_args(argv)[0]


def test_the_loss_is_the_mean_negative_log_likelihood_of_the_reply_tokens(tiny_model_dir):
    model, tokenizer = weights.from_pretrained(tiny_model_dir), weights.load_tokenizer(str(tiny_model_dir))
    problems = [
        {"problem": "What is 7 + 5?", "answer": "12", "solution": "7 + 5 = 12"},
        {"problem": "What is 2 × 3?", "answer": "6", "solution": "2 × 3 = 6"},
    ]
    cfg, _ = config.parse_sft_args(["--template", "answer", "--system-prompt", "Be brief."])
    examples, too_long = sft.tokenize(problems, tokenizer, cfg)
    assert too_long == 0 and examples[0][1][-1] == tokenizer.eos_token_id
    assert examples[0][0] == render_prompt(tokenizer, "What is 7 + 5?", "answer", "Be brief.")
    assert (
        tokenizer.decode(examples[0][1][:-1])
        == render_solution("7 + 5 = 12", "12", "answer")
        == "7 + 5 = 12\nAnswer: 12"
    )
    batch = sft.collate(examples, model.device)
    loss = sft.reply_loss(model, batch, int(batch[3].sum()))
    # each example on its own, without padding: the log-probs of its reply tokens after its prompt
    expected, count = 0.0, 0
    for prompt, reply in examples:
        logp, _ = model.token_logprobs(torch.tensor([prompt + reply]))
        expected -= logp[0, len(prompt) :].sum().item()
        count += len(reply)
    assert loss.item() == pytest.approx(expected / count, rel=1e-5)


def test_batches_hold_examples_of_similar_length_within_the_token_budget():
    lengths = [(5, 3), (40, 10), (6, 2), (38, 12), (5, 4), (20, 20)]
    examples = [([1] * p, [2] * r) for p, r in lengths]
    batches = sft.length_batches(examples, batch_tokens=100)
    assert sorted(i for batch in batches for i in batch) == list(range(6))
    for batch in batches:
        widest = max(len(examples[i][0]) for i in batch) + max(len(examples[i][1]) for i in batch)
        assert len(batch) * widest <= 100
    assert batches[0] == [0, 2, 4]  # the three short ones together, shortest first
    assert sft.epoch_order(5, 0, seed=1) == sft.epoch_order(5, 0, seed=1) != sft.epoch_order(5, 1, seed=1)


def test_format_compliance_counts_the_format_after_the_thought():
    texts = ["7 + 5 = 12\nAnswer: 12", "<think>\nAnswer: 12", "twelve", "<think>x</think>\nAnswer: 12"]
    assert sft.format_rate(texts, "answer") == 0.5
    assert sft.format_rate(["12", "I am not sure about this one"], "equation") == 0.5


def test_a_run_trains_checkpoints_resumes_exactly_and_hands_train_py_its_adapter(tiny_model_dir, tmp_path):
    # a constant rate: the schedule follows --max-steps, which the interrupted run below changes on resuming
    state = run_sft(tiny_args(tiny_model_dir, tmp_path, "full", "--max-steps", "3", "--lr-schedule", "constant"))
    run_dir = tmp_path / "full"
    lines = metric_lines(run_dir)
    assert [line["step"] for line in lines] == [1, 2, 3] and all(line["loss"] > 0 for line in lines)
    assert state["before"]["problems"] == 2 and 0 <= state["after"]["format"] <= 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["left_out"] == 0
    # interrupted after step 2 (its checkpoint), then resumed: the same metrics, the same adapter
    run_sft(tiny_args(tiny_model_dir, tmp_path, "cut", "--max-steps", "2", "--lr-schedule", "constant"))
    (tmp_path / "cut" / "adapter").rename(tmp_path / "cut-adapter-at-2")
    run_sft(["--resume", str(tmp_path / "cut"), "--max-steps", "3"])
    assert metric_lines(tmp_path / "cut") == lines
    events = [json.loads(line) for line in (tmp_path / "cut" / "metrics.jsonl").read_text().splitlines()]
    assert [e for e in events if "event" in e] == [{"step": 2, "event": "resume", "changed": {"max_steps": [2, 3]}}]
    resumed = lora.load(weights.from_pretrained(str(tiny_model_dir)), tmp_path / "cut" / "adapter")
    whole = lora.load(weights.from_pretrained(str(tiny_model_dir)), run_dir / "adapter")
    for a, b in zip(lora.parameters(resumed), lora.parameters(whole)):
        assert torch.equal(a, b)
    # GRPO starts from it: same shape, same weights
    grpo = grpo_config(tiny_model_dir, run_dir / "adapter")
    config.check_init_adapter(grpo)
    # the adapter learned the answer template's prompts: another template is refused before the model loads
    other, _, _ = config.parse_args(
        ["--model", str(tiny_model_dir), "--lora-rank", "4", "--init-adapter", str(run_dir / "adapter")]
    )
    with pytest.raises(ValueError, match=r"posed the prompts with --template 'answer' \(this run: 'equation'\)"):
        config.check_init_adapter(other)
    started, _, _, _ = train.build(grpo, grpo.init_adapter)
    for a, b in zip(lora.parameters(started), lora.parameters(whole)):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dataset", "arithmetic", "--max-length", "1"], "--max-length"),
        (["--batch-tokens", "10"], "--batch-tokens"),
        (["--grad-accum", "0"], "--grad-accum"),
        (["--lr", "0"], "--lr"),
        (["--preset", "nope"], "--preset"),
        (["--epochs", "0"], "--epochs"),
    ],
)
def test_each_bad_flag_fails_in_one_line_before_the_model_loads(tmp_path, capsys, flags, message):
    with pytest.raises(SystemExit) as exit_info:
        sft.main(["--model", str(tmp_path / "no-model"), "--out-dir", str(tmp_path), *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and message in lines[0], lines
    assert not any(tmp_path.iterdir()), "a failed start leaves nothing behind"


def test_a_set_without_solutions_is_named_in_one_line(tiny_model_dir, tmp_path, capsys):
    data = tmp_path / "bare.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 + 1?", "answer": "2"}) + "\n")
    with pytest.raises(SystemExit):
        sft.main(tiny_args(tiny_model_dir, tmp_path, "bare", "--dataset", str(data)))
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and 'problem 0 has no "solution"' in lines[0], lines


def test_the_presets_hold_the_grpo_stages_adapter_shape_and_prompt():
    for size in ("1.7b", "8b"):
        stage, _ = config.parse_sft_args(["--preset", f"atr-sft-qwen3-{size}"])
        grpo, _, _ = config.parse_args(["--preset", f"atr-grpo-qwen3-{size}"])
        assert stage.dataset == "openmath" and stage.model == grpo.model  # stated: OpenMathReasoning, then GRPO
        for name in ("lora_rank", "lora_alpha", "lora_targets", "template", "thinking", "system_prompt"):
            assert getattr(stage, name) == getattr(grpo, name), name
        assert stage.max_length >= grpo.max_new_tokens
    missing = [
        name
        for name in config.SFT_FIELDS
        if name not in config.SFT_PRESETS["atr-sft-qwen3-1.7b"]
        and name
        not in (
            "device",
            "dtype",
            "gradient_checkpointing",
            "eval_batch",
            "run_name",
            "out_dir",
            "seed",
            "resume",
            "export",
            "preset",
            "model",
        )
    ]
    assert not missing, f"the SFT preset leaves {missing} to the defaults"


def test_ctrl_c_exits_130_with_a_checkpoint_and_the_adapter_so_far(tiny_model_dir, tmp_path):
    """As train.py: one Ctrl-C stops after the step in progress, checkpoints it and exits 130; sft.py also writes
    the adapter so far, which train.py --init-adapter loads, and names the run it stopped, not a placeholder."""
    run_dir = tmp_path / "stopped"
    args = tiny_args(tiny_model_dir, tmp_path, "stopped", "--max-steps", "100000", "--checkpoint-every", "100000")
    log = tmp_path / "sft.log"
    process = launch(args, log, script="sft.py")
    deadline = time.monotonic() + 300
    while not ((run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").read_text().strip()):
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.2)
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=300) == 130, log.read_text()
    step = int((run_dir / "latest").read_text().rpartition("-")[2])
    assert log.read_text().splitlines()[-1] == (
        f"stopped at step {step}; the adapter so far is {run_dir / 'adapter'}; continue with: "
        f"python sft.py --resume {run_dir}"
    )
    assert (run_dir / "config.toml").is_file() and "batch_tokens = 2048  # given" in (
        run_dir / "config.toml"
    ).read_text()
    grpo = grpo_config(tiny_model_dir, run_dir / "adapter")
    config.check_init_adapter(grpo)
    started, _, _, _ = train.build(grpo, grpo.init_adapter)
    saved = lora.load(weights.from_pretrained(str(tiny_model_dir)), run_dir / latest_name(run_dir) / "adapter")
    for a, b in zip(lora.parameters(started), lora.parameters(saved)):
        assert torch.equal(a, b), "the adapter so far is the checkpoint's"


def latest_name(run_dir: Path) -> str:
    return (run_dir / "latest").read_text().strip()


def test_a_finished_run_resumed_without_more_training_is_refused(tiny_model_dir, tmp_path, capsys):
    run_sft(tiny_args(tiny_model_dir, tmp_path, "done", "--max-steps", "1"))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        sft.main(["--resume", str(tmp_path / "done")])
    assert exit_info.value.code == 2 and capsys.readouterr().err == (
        f"sft.py: --resume {tmp_path / 'done'}: the run is finished; give more --epochs or --max-steps to train it "
        "further\n"
    )
