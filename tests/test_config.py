"""The settings: the presets hold the papers' stated values, every setting is a flag, flags reach the config."""

import contextlib
import io
import math
import os
import re
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path
from unittest import mock

import pytest

import config
import loss
import train

ROOT = Path(config.__file__).parent
PRESET_TABLE = ROOT / "docs" / "presets.md"
PLACE = re.compile(
    r"\b(?:abstract|sections?|tables?|theorems?|equations?|eq\.|appendix|figures?)\b", re.I
)  # where a paper states it


def preset_table() -> list[dict]:
    """The rows of docs/presets.md's preset table: presets, setting, value (a TOML value), status, source."""
    rows, started = [], False
    for number, line in enumerate(PRESET_TABLE.read_text().splitlines(), start=1):
        if line.startswith("| presets | setting |"):
            started = True
            continue
        if not started or not line.startswith("| ") or line.startswith("| ---"):
            continue
        presets, setting, value, status, source = (cell.strip() for cell in line.strip()[1:-1].split(" | "))
        rows.append(
            {
                "line": number,
                "presets": [name.strip() for name in presets.split(",")],
                "setting": setting,
                "value": tomllib.loads(f"value = {value.strip('`')}")["value"],
                "status": status,
                "source": source,
            }
        )
    return rows


def preset_files() -> dict[str, dict]:
    """Every preset file as TOML reads it: name -> its settings."""
    paths = sorted((ROOT / "configs").glob("*.toml")) + sorted((ROOT / "configs" / "sft").glob("*.toml"))
    return {path.stem: tomllib.loads(path.read_text()) for path in paths}


def test_every_preset_file_holds_what_the_preset_table_says():
    files, table = preset_files(), preset_table()
    assert set(config.PRESETS) | set(config.SFT_PRESETS) == set(files)
    written: dict[str, dict] = {name: {} for name in files}
    for row in table:
        for name in row["presets"]:
            assert name in files, f"docs/presets.md:{row['line']}: no preset {name}"
            assert row["setting"] not in written[name], f"docs/presets.md:{row['line']}: {name} {row['setting']} twice"
            written[name][row["setting"]] = row["value"]
    for name, settings in files.items():
        assert settings == written[name], name


def test_a_stated_value_names_where_its_paper_states_it():
    table = preset_table()
    assert {row["status"] for row in table} == {"stated", "chosen"}
    for row in table:
        where = f"docs/presets.md:{row['line']}"
        if row["status"] == "stated":
            assert row["source"].startswith(("ATR-GRPO", "GPPO", "DAPO")), f"{where}: a stated value names its paper"
            assert PLACE.search(row["source"]), f"{where}: a stated value names its section, table or equation"
        else:
            assert len(row["source"]) > 10, f"{where}: a chosen value gives its reason"


def test_readings_the_papers_do_not_state_are_chosen():
    """GPPO's learning rate and code reward are not in its text, and [0.5, 10] as outer limits is a reading."""
    status = {(name, row["setting"]): row["status"] for row in preset_table() for name in row["presets"]}
    assert status["gppo-qwen3-8b-full", "lr"] == status["gppo-qwen3-8b-code", "code_reward"] == "chosen"
    assert {status[name, "ratio_limits"] for name in ("gppo-qwen3-8b", "gppo-qwen3-8b-full")} == {"chosen"}
    assert status["atr-grpo-qwen3-1.7b", "eval_dataset"] == "stated"  # the 83-problem AMC set


def test_presets_run_with_their_files_values():
    """What a preset file holds is what a run with --preset gets (the files are config.PRESETS' source)."""
    for name, settings in preset_files().items():
        if name in config.PRESETS:
            flat = config.flat_config(config.parse_args(["--preset", name])[0])
            for setting, value in settings.items():
                got = flat[setting]
                expected = tuple(value) if isinstance(value, list) and isinstance(got, tuple) else value
                if setting == "rule" and isinstance(got, tuple):
                    expected = tuple(value.split("-"))
                assert got == expected, (name, setting)


# What every preset writes out, stated or chosen: a change of a default must not change a paper's run.
WRITTEN_OUT = (
    "model",
    "dataset",
    "template",
    "thinking",
    "system_prompt",
    "prompts_per_step",
    "group_size",
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "steps",
    "lr",
    "lr_schedule",
    "warmup_steps",
    "weight_decay",
    "grad_clip",
    "updates_per_rollout",
    "epochs",
    "lora_rank",
    "lora_alpha",
    "lora_dropout",
    "lora_targets",
    "rule",
    "aggregation",
    "adv_std",
    "leave_one_out",
    "kl_beta",
    "entropy_coef",
    "eval_dataset",
    "eval_k",
    "eval_temperature",
    "eval_every",
)


@pytest.mark.parametrize("preset", list(config.PRESETS))
def test_every_preset_writes_out_every_choice(preset):
    missing = [name for name in WRITTEN_OUT if name not in config.PRESETS[preset]]
    assert not missing, f"{preset} leaves {missing} to the defaults"


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
    usage = parsed(train.main, "--help").stdout  # train.py's own main(), with its description
    for name in [*config.TRAIN_FIELDS, *config.LOSS_FIELDS]:
        assert "--" + name.replace("_", "-") in usage, name


FLAG_VALUES = {  # a value for every loss setting, other than its default, and what LossConfig makes of it
    "rule": ("dapo", "dapo"),
    "delta": ("0.3", 0.3),
    "delta_high": ("0.4", 0.4),
    "dual_clip": ("3", 3.0),
    "ratio_limits": ("0.5,10", (0.5, 10.0)),
    "aggregation": ("seq-mean-token-mean", "seq-mean-token-mean"),
    "norm_len": ("7", 7),
    "kl_beta": ("0.1", 0.1),
    "kl_estimator": ("k2", "k2"),
    "tv_half": (True, True),
    "kl_two_sided": (False, False),
    "sapo_tau_pos": ("2", 2.0),
    "sapo_tau_neg": ("3", 3.0),
    "cov_ratio": ("0.01", 0.01),
    "clip_cov_bounds": ("2,4", (2.0, 4.0)),
    "kl_cov_coef": ("2", 2.0),
    "adv_std": ("batch", "batch"),
    "leave_one_out": (True, True),
    "entropy_coef": ("0.01", 0.01),
    "rollout_correction": ("tis-seq", "tis-seq"),
    "rollout_correction_cap": ("3", 3.0),
    "top_entropy_quantile": ("0.2", 0.2),
}


# the flags under which a setting acts (given alone, the others would be refused as doing nothing)
ACTIVE_WITH = {
    "tv_half": ["--rule", "tv-mc"],
    "kl_two_sided": ["--rule", "kl-mc"],
    "sapo_tau_pos": ["--rule", "sapo"],
    "sapo_tau_neg": ["--rule", "sapo"],
    "cov_ratio": ["--rule", "kl_cov"],
    "clip_cov_bounds": ["--rule", "clip_cov"],
    "kl_cov_coef": ["--rule", "kl_cov"],
    "rollout_correction_cap": ["--rollout-correction", "mis-token"],
    "norm_len": ["--aggregation", "seq-mean-token-sum-norm"],
    "kl_estimator": ["--kl-beta", "0.1"],
}


def test_every_loss_setting_reaches_the_loss_config():
    assert FLAG_VALUES.keys() == config.LOSS_FIELDS.keys(), "a new LossConfig field needs a row here"
    for name, (text, value) in FLAG_VALUES.items():
        flag = "--" + name.replace("_", "-")
        argv = [flag] if text is True else ["--no-" + flag[2:]] if text is False else [flag, text]
        cfg, _, _ = config.parse_args(ACTIVE_WITH.get(name, []) + argv)
        assert getattr(cfg.loss, name) == value, name


@pytest.mark.parametrize(
    "flags, message",
    [
        (
            ["--rule", "interval", "--delta", "0.1"],
            r"--delta 0.1: --rule interval has no trust-region size \(read by grpo",
        ),
        (["--rule", "atr", "--delta-high", "0.1"], r"--delta-high 0.1: --rule atr does not read it \(read by .*dcpo"),
        (["--sapo-tau-pos", "2"], r"--sapo-tau-pos 2.0: --rule grpo does not read it \(read by sapo\)"),
        (["--tv-half"], r"--tv-half: --rule grpo does not read it \(read by tv-mc, tv-atomic, tv-binary\)"),
        (["--rule", "kl-atomic", "--tv-half"], r"--tv-half: --rule kl-atomic does not read it"),
        (["--rule", "tv-mc", "--no-kl-two-sided"], r"--kl-two-sided: --rule tv-mc does not read it \(read by kl-mc"),
        (["--norm-len", "5"], "--norm-len 5: only --aggregation seq-mean-token-sum-norm divides by it, not token-mean"),
        (["--kl-estimator", "k2"], "--kl-estimator k2: the KL penalty is off"),
        (
            ["--rule", "clip_cov", "--kl-cov-coef", "2"],
            r"--kl-cov-coef 2.0: --rule clip_cov does not read it \(read by kl_cov\)",
        ),
    ],
)
def test_a_flag_that_does_nothing_with_the_others_is_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        config.parse_args(flags)


def test_every_setting_a_rules_entry_declares_is_accepted_with_it():
    for rule, entry in loss.RULES.items():
        for name in entry.settings:
            text, value = FLAG_VALUES[name]
            flag = "--" + name.replace("_", "-")
            argv = [flag] if text is True else ["--no-" + flag[2:]] if text is False else [flag, text]
            cfg, given, _ = config.parse_args(["--rule", rule, *argv])
            assert getattr(cfg.loss, name) == value and name in given, (rule, name)


def test_settings_that_leave_the_trust_region_inert_warn_once():
    cfg, _, _ = config.parse_args(["--rule", "interval", "--updates-per-rollout", "2"])
    with pytest.warns(UserWarning, match="no token loses its gradient") as caught:
        config.warn_if_inert(cfg)
    assert len(caught) == 1
    for flags in (["--rule", "interval", "--ratio-limits", "0.5,10"], ["--rule", "interval", "--dual-clip", "3"]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            config.warn_if_inert(config.parse_args([*flags, "--updates-per-rollout", "2"])[0])


def test_flags_are_never_abbreviations():
    with pytest.raises(SystemExit):
        config.parse_args(["--step", "2"])  # not --steps 2


# ----------------------------------------------------------------------------- settings files


def test_every_preset_is_a_file_whose_stated_comments_follow_the_table():
    """A preset is configs/NAME.toml; a value its file comments "# stated" is stated in docs/presets.md, and
    the other way round, so the files' comments say what the table says."""
    files = sorted(config.CONFIGS.glob("*.toml"))
    assert sorted(config.PRESETS) == sorted(path.stem for path in files) and files
    stated = {(name, row["setting"]) for row in preset_table() if row["status"] == "stated" for name in row["presets"]}
    for path in files:
        marked = {
            (path.stem, line.split("=")[0].strip())
            for line in path.read_text().splitlines()
            if "# stated" in line and not line.startswith("#")
        }
        assert marked, f"{path.name} states no value"
        assert marked == {key for key in stated if key[0] == path.stem}, path.name
        config.validate(config.make_config(config.PRESETS[path.stem]), need_device=False)


def test_a_config_file_holds_any_flags_and_explicit_flags_override_it(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text(
        'preset = "atr-grpo-qwen3-1.7b"  # the rest of the recipe\n'
        'lr = 1e-5\nlora-rank = 8\nsystem_prompt = ""\nrule = "kl-atomic"\nratio_limits = [0.5, 10]\n'
        'reward_fn = ["reward:math_reward", "examples/rewards.py:length_penalty"]\n'
        "reward_weights = [1, 0.5]\nlora_alpha = 16\n"
    )
    cfg, given, _ = config.parse_args(["--config", str(path), "--lr", "2e-5"])
    assert cfg.lr == 2e-5 and cfg.lora_rank == 8 and cfg.lora_alpha == 16.0 and cfg.system_prompt is None
    assert cfg.loss.rule == ("kl", "atomic") and cfg.loss.ratio_limits == (0.5, 10.0)
    assert cfg.reward_fn == ("reward:math_reward", "examples/rewards.py:length_penalty")
    assert cfg.reward_weights == (1.0, 0.5)
    assert cfg.model == "Qwen/Qwen3-1.7B" and cfg.eval_k == 8, "what the file leaves out comes from its preset"
    assert {"lr", "lora_rank", "rule", "preset"} <= given


@pytest.mark.parametrize(
    "argv",
    [
        [],
        *[["--preset", name] for name in config.PRESETS],
        [
            "--system-prompt",
            'say "hi"\n\tthen «stop» \\ done',
            "--reward-fn",
            "a.b:c",
            "--reward-fn",
            "d.py:e",
            "--dual-clip",
            "0.5,10",
            "--norm-len",
            "7",
            "--gpu-memory",
            "40",
            "--no-kl-two-sided",
            "--rule",
            "kl-mc",  # where they act
            "--aggregation",
            "seq-mean-token-sum-norm",
        ],
    ],
)
def test_the_written_toml_reads_back_as_the_same_config(tmp_path, argv):
    cfg, _, _ = config.parse_args(argv)
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(cfg))
    again, _, _ = config.parse_args(["--config", str(path)])
    assert config.flat_config(again) == {**config.flat_config(cfg), "resume": None}


def test_print_config_shows_the_resolved_settings_as_toml(tmp_path):
    out = train_py("--preset", "gppo-qwen3-8b", "--lr", "2e-6", "--print-config")
    assert out.returncode == 0 and out.stderr == "", out.stderr
    values = tomllib.loads(out.stdout)
    assert values["lr"] == 2e-6 and values["rule"] == "kl-atomic" and values["ratio_limits"] == [0.5, 10.0]
    assert values["model"] == "Qwen/Qwen3-8B-Base" and "resume" not in values


@pytest.mark.parametrize(
    "text, message",
    [
        ("lora_rnak = 4\n", r"'lora_rnak' is not a setting; did you mean 'lora_rank'\?"),
        ("lora_rank = 4.5\n", r"lora_rank = 4.5: expected an integer"),
        ('lr = "fast"\n', r"lr = \"fast\": expected a number"),
        ("tv_half = 1\n", r"tv_half = 1: expected true or false"),
        ("model = 3\n", r"model = 3: expected a string or \"\" \(empty\)"),
        ("steps = [1, 2]\n", r"steps = \[1, 2\]: expected an integer"),
        ('[loss]\nrule = "atr"\n', r"\[loss\]: a table is not a setting"),
        ("lr = \n", r"not valid TOML \(.*line 1"),
        ("ratio_limits = [2, 1]\n", r"ratio.limits"),
        ('preset = "nope"\n', r"--preset 'nope' is unknown"),
    ],
)
def test_a_bad_config_file_fails_in_one_line_naming_the_file_and_key(tmp_path, capsys, text, message):
    import train

    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(path), "--out-dir", str(tmp_path / "runs")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and re.search(message, lines[0]), lines
    with pytest.raises(SystemExit):
        train.main(["--config", str(tmp_path / "missing.toml")])
    assert "missing.toml: no such file" in capsys.readouterr().err


# ----------------------------------------------------------------------------- given versus derived


def parsed(parse, *argv: str) -> subprocess.CompletedProcess:
    """What a command line that ends in parsing (--help, --print-config, a refused flag) prints and exits with:
    config's parser in this process, on a wide terminal so the help's lines are unwrapped."""
    out, err = io.StringIO(), io.StringIO()
    with (
        mock.patch.dict(os.environ, {"COLUMNS": "400"}),
        contextlib.redirect_stdout(out),
        contextlib.redirect_stderr(err),
        pytest.raises(SystemExit) as exit_info,
    ):
        parse(list(argv))
    return subprocess.CompletedProcess(argv, exit_info.value.code or 0, out.getvalue(), err.getvalue())


def train_py(*argv: str) -> subprocess.CompletedProcess:
    return parsed(config.parse_args, *argv)


def test_a_rule_given_over_a_preset_takes_its_own_sizes_and_print_config_says_why():
    out = train_py("--preset", "atr-grpo-qwen3-1.7b", "--rule", "grpo", "--print-config")
    assert out.returncode == 0, out.stderr
    lines = {line.lstrip("# ").split(" = ")[0]: line for line in out.stdout.splitlines() if " = " in line}
    assert lines["rule"] == 'rule = "grpo"  # given'
    assert lines["delta"].startswith("# delta = 0.2  (derived: rule grpo's default; ")
    assert "preset atr-grpo-qwen3-1.7b set 0.07 for --rule atr" in lines["delta"]
    assert lines["lr"] == "lr = 5e-06  # preset atr-grpo-qwen3-1.7b" and lines["top_k"].endswith(
        "# preset atr-grpo-qwen3-1.7b"
    )
    assert lines["kl_cov_coef"] == "kl_cov_coef = 1.0  # default"
    cfg, given, _ = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--rule", "grpo"])
    assert loss.ratio_bounds("grpo", cfg.loss.delta, 0.5) == (0.8, 1.2) and cfg.loss.delta_high == 0.2
    assert "delta" not in given, "the preset's delta was ATR's, not given for grpo"
    # a sequence-level rule over the preset is not refused for the preset's token-mean
    gspo, _, _ = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--rule", "gspo"])
    assert gspo.loss.aggregation == "seq-mean-token-mean" and gspo.loss.delta == 3e-4
    # given together, a rule and its size are kept
    both, _, _ = config.parse_args(["--preset", "atr-grpo-qwen3-1.7b", "--rule", "dapo", "--delta", "0.1"])
    assert (both.loss.delta, both.loss.delta_high) == (0.1, pytest.approx(0.14))


def written_run_config(tmp_path: Path, *argv: str, **planned) -> Path:
    """The config.toml a run of these flags writes: its settings once the plan has chosen the sizes left at 0."""
    cfg, _, _ = config.parse_args(list(argv))
    path = tmp_path / "config.toml"
    path.write_text(config.to_toml(__import__("dataclasses").replace(cfg, **planned)))
    return path


def test_a_runs_config_file_derives_again_what_it_did_not_give(tmp_path):
    path = written_run_config(
        tmp_path, "--prompts-per-step", "8", rollout_batch=8, kv_blocks=300, grad_accum=2, eval_batch=16
    )
    text = path.read_text()
    assert "# delta_high = 0.2  (derived: from --delta 0.2)" in text and "# rollout_batch = 8  (derived: " in text
    assert "prompts_per_step = 8  # given" in text
    same, _, _ = config.parse_args(["--config", str(path)])
    assert same.loss.delta_high == 0.2 and same.rollout_batch == 0, "derived again, to the same values"
    wider, _, _ = config.parse_args(["--config", str(path), "--delta", "0.3"])
    assert wider.loss.delta_high == 0.3, "follows the new delta, as without --config"
    smaller, _, _ = config.parse_args(
        ["--config", str(path), "--prompts-per-step", "4", "--group-size", "4", "--max-new-tokens", "32"]
    )
    assert (smaller.rollout_batch, smaller.kv_blocks, smaller.grad_accum, smaller.loss.norm_len) == (0, 0, 0, 32)
    gspo, _, _ = config.parse_args(["--config", str(path), "--rule", "gspo"])  # not refused for token-mean
    assert gspo.loss.aggregation == "seq-mean-token-mean"


def test_a_settings_file_written_before_derived_values_were_marked_still_follows_a_new_rule(tmp_path):
    path = tmp_path / "old.toml"
    path.write_text('rule = "grpo"\ndelta = 0.2\ndelta_high = 0.2\naggregation = "token-mean"\nnorm_len = 16\n')
    dapo, _, _ = config.parse_args(["--config", str(path), "--rule", "dapo"])
    assert (dapo.loss.delta, dapo.loss.delta_high) == (0.2, 0.28)
    longer, _, _ = config.parse_args(["--config", str(path), "--max-new-tokens", "64"])
    assert longer.loss.norm_len == 64
    gspo, _, _ = config.parse_args(["--config", str(path), "--rule", "gspo"])
    assert gspo.loss.aggregation == "seq-mean-token-mean"


@pytest.mark.parametrize(
    "text, message",
    [
        ("steps = -1\n", "bad.toml: steps -1: must be >= 0"),
        ("delta = -0.5\n", "bad.toml: delta -0.5: must be >= 0"),
        (
            'rule = "gspo"\naggregation = "token-mean"\n',
            "bad.toml: aggregation token-mean: rule gspo is sequence-level",
        ),
    ],
)
def test_an_invalid_value_in_a_settings_file_names_the_file_and_key_not_a_flag(tmp_path, capsys, text, message):
    import train

    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exit_info:
        train.main(["--config", str(path), "--out-dir", str(tmp_path / "runs")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err == f"train.py: {tmp_path}/{message}" + err.split(message, 1)[1], err
    assert err.count("\n") == 1
    with pytest.raises(SystemExit):  # the same value typed as a flag is blamed on the flag
        train.main(["--steps", "-1", "--out-dir", str(tmp_path / "runs")])
    assert capsys.readouterr().err.startswith("train.py: --steps -1: must be >= 0")


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--eval-dataset", "arithmetic_test,"], "--eval-dataset 'arithmetic_test,': an empty name between commas"),
        (["--eval-dataset", ",arithmetic_test"], "--eval-dataset ',arithmetic_test': an empty name between commas"),
        (["--log", "tensorboard,"], "--log 'tensorboard,': an empty name between commas"),
    ],
)
def test_an_empty_item_of_a_list_is_refused(argv, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        config.parse_args(argv)
    if argv[0] == "--eval-dataset":
        with pytest.raises(ValueError, match=re.escape(message)):
            config.parse_sft_args(argv)


def test_help_is_grouped_with_defaults_as_typed_and_lists_the_rules():
    out = train_py("--help")
    assert out.returncode == 0
    headings = [line[:-1] for line in out.stdout.splitlines() if re.fullmatch(r"[a-z]+:", line)]
    assert headings == [
        "options",
        "model",
        "data",
        "sampling",
        "reward",
        "optimisation",
        "loss",
        "evaluation",
        "run",
        "trackers",
        "distributed",
    ]
    flat = " ".join(out.stdout.split())
    assert "(default: )" not in flat and "('" not in flat and "(1.0, 5.0)" not in flat
    assert "(default: reward:math_reward)" in flat and "(default: 1,5)" in flat and "(default: 0.0003)" in flat
    assert "(default: --kl-two-sided)" in flat and "(default: --no-leave-one-out)" in flat
    rules = train_py("--help-rules")
    assert rules.returncode == 0 and rules.stderr == ""
    lines = rules.stdout.splitlines()[1:]
    assert [line.split()[0] for line in lines] == list(loss.RULES) and "dapo" in loss.RULES
    assert (
        next(line for line in lines if line.split()[0] == "dapo")
        .split(None, 1)[1]
        .startswith("w in [0.8, 1.28] at mu 0.5; delta 0.2, delta_high 0.28; token-mean")
    )


def test_sft_reads_its_command_line_as_train_py_does(tmp_path):
    sft = lambda *argv: parsed(config.parse_sft_args, *argv)  # noqa: E731
    prefix = subprocess.run(  # sft.py as typed; the rest through its parser in this process
        [sys.executable, "sft.py", "--epoch", "2", "--print-config"],
        cwd=Path(config.__file__).parent,
        capture_output=True,
        text=True,
    )
    assert prefix.returncode == 2 and "unrecognized arguments: --epoch" in prefix.stderr
    printed = sft("--preset", "atr-sft-qwen3-1.7b", "--epochs", "2", "--print-config")
    assert printed.returncode == 0, printed.stderr
    assert "epochs = 2  # given" in printed.stdout and "# preset atr-sft-qwen3-1.7b" in printed.stdout
    path = tmp_path / "sft.toml"
    path.write_text(printed.stdout)
    cfg, given = config.parse_sft_args(["--config", str(path), "--lr", "1e-5"])
    assert cfg.epochs == 2 and cfg.lr == 1e-5 and {"epochs", "lr"} <= given
    assert cfg.model == config.SFT_PRESETS["atr-sft-qwen3-1.7b"]["model"]
    groups = [line[:-1] for line in sft("--help").stdout.splitlines() if re.fullmatch(r"[a-z]+:", line)]
    assert groups == ["options", "model", "data", "optimisation", "evaluation", "run"]
