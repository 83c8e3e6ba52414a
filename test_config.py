"""The settings: the presets hold the papers' stated values, every setting is a flag, flags reach the config."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

import config


# Each row: (preset, setting, value, where the paper states it). Values the papers leave open are not here:
# they are our choices, listed in the README.
PAPER_VALUES = [
    ("atr-grpo-qwen3-1.7b", "model", "Qwen/Qwen3-1.7B", "ATR-GRPO, arXiv:2602.05494, experiments"),
    ("atr-grpo-qwen3-8b", "model", "Qwen/Qwen3-8B", "ATR-GRPO, experiments: the 8B twin"),
    ("atr-grpo-qwen3-1.7b", "lora_rank", 32, "ATR-GRPO, experimental setup"),
    ("atr-grpo-qwen3-1.7b", "lr", 5e-6, "ATR-GRPO, experimental setup"),
    ("atr-grpo-qwen3-1.7b", "group_size", 8, "ATR-GRPO, experimental setup"),
    ("atr-grpo-qwen3-1.7b", "rule", "atr", "ATR-GRPO: the KL3 constraint"),
    ("atr-grpo-qwen3-1.7b", "delta", 0.07, "ATR-GRPO, experimental setup"),
    ("atr-grpo-qwen3-1.7b", "eval_dataset", "amc23,aime24,aime25", "ATR-GRPO, results tables"),
    ("atr-grpo-qwen3-1.7b", "eval_k", 8, "ATR-GRPO: Mean@8 and Pass@8"),
    ("gppo-qwen3-8b", "model", "Qwen/Qwen3-8B-Base", "GPPO, experimental setup"),
    ("gppo-qwen3-8b", "prompts_per_step", 128, "GPPO: 1024 rollouts per step = 128 prompts x 8"),
    ("gppo-qwen3-8b", "group_size", 8, "GPPO, experimental setup"),
    ("gppo-qwen3-8b", "updates_per_rollout", 8, "GPPO: 8 mini-batch updates per rollout"),
    ("gppo-qwen3-8b", "steps", 400, "GPPO: 400 steps for math"),
    ("gppo-qwen3-8b", "rule", ("kl", "atomic"), "GPPO: the KL x Atomic cell"),
    ("gppo-qwen3-8b", "ratio_limits", (0.5, 10.0), "GPPO: global clip [0.5, 10]"),
    ("gppo-qwen3-8b", "kl_beta", 0.0, "GPPO: no KL penalty"),
]


@pytest.mark.parametrize("preset, name, value, source", PAPER_VALUES)
def test_presets_are_the_papers_runs(preset, name, value, source):
    cfg, _, _ = config.parse_args(["--preset", preset])
    assert config.flat_config(cfg)[name] == value, source


def test_atr_preset_steps_the_optimizer_on_32_completions():
    """ATR-GRPO's "batch 8, gradient accumulation 4" counts completions: 4 prompts x 8 per optimizer step."""
    cfg, _, _ = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b"])
    assert cfg.prompts_per_step * cfg.group_size / cfg.updates_per_rollout == 32 and cfg.updates_per_rollout > 1
    assert cfg.shuffle == "groups"  # whole prompts: 4 of them, with their 8 completions each


def test_the_gppo_delta_is_kl_at_0_8():
    cfg, _, _ = config.parse_args(["--preset", "gppo-qwen3-8b"])
    assert cfg.loss.delta == pytest.approx(-math.log(0.8))


def test_every_setting_is_a_flag_and_presets_yield_to_flags():
    cfg, given, _ = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--lr", "1e-5", "--model", ""])
    assert cfg.loss.rule == "atr" and cfg.loss.delta == 0.07 and cfg.lora_rank == 32
    assert cfg.lr == 1e-5 and cfg.model is None and given == {"preset", "lr", "model"}
    assert config.parse_args(["--plan"])[2] is True
    usage = subprocess.run([sys.executable, "train.py", "--help"], cwd=Path(config.__file__).parent,
                           capture_output=True, text=True).stdout
    for name in [*config.TRAIN_FIELDS, *config.LOSS_FIELDS]:
        assert "--" + name.replace("_", "-") in usage, name


FLAG_VALUES = {  # a value for every loss setting, other than its default, and what LossConfig makes of it
    "rule": ("dapo", "dapo"), "delta": ("0.3", 0.3), "delta_high": ("0.4", 0.4), "dual_clip": ("3", 3.0),
    "ratio_limits": ("0.5,10", (0.5, 10.0)), "aggregation": ("seq-mean-token-mean", "seq-mean-token-mean"),
    "norm_len": ("7", 7), "kl_beta": ("0.1", 0.1), "kl_estimator": ("k2", "k2"), "tv_half": (True, True),
    "kl_two_sided": (False, False), "sapo_tau_pos": ("2", 2.0), "sapo_tau_neg": ("3", 3.0),
    "cov_ratio": ("0.01", 0.01), "clip_cov_bounds": ("2,4", (2.0, 4.0)), "kl_cov_coef": ("2", 2.0),
    "adv_std": ("batch", "batch"), "leave_one_out": (True, True),
}


def test_every_loss_setting_reaches_the_loss_config():
    assert FLAG_VALUES.keys() == config.LOSS_FIELDS.keys(), "a new LossConfig field needs a row here"
    argv = []
    for name, (text, _) in FLAG_VALUES.items():
        flag = "--" + name.replace("_", "-")
        argv += [flag] if text is True else ["--no-" + flag[2:]] if text is False else [flag, text]
    cfg, _, _ = config.parse_args(argv)
    for name, (_, value) in FLAG_VALUES.items():
        assert getattr(cfg.loss, name) == value, name
