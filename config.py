"""The run's settings: the Config dataclass, the papers' presets, the checks every value passes before
anything loads, and the command line that turns flags into a Config.

Every Config field and every loss.LossConfig field is a flag (`--lora-rank`, `--rule`, ...): a new knob
is one field here or in loss.py, and its help text is the field's. A preset fills defaults that explicit
flags override. The file is separate from train.py so that the step and the loop read without the flag
plumbing, and so that every entry point (train.py, study.py, the tests) builds a Config the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import torch

import distributed
import loggers
import loss
import reward
import scoring


def opt(default, help: str, choices: tuple[str, ...] | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    # model
    model: str | None = opt(None, "HF directory or hub id; empty = the offline SmolLM2-135M-Instruct")
    device: str = opt("auto", "cpu, cuda, cuda:N or auto (cuda when present)")
    dtype: str = opt("auto", "bfloat16 on cuda and float32 on cpu when auto", ("auto", "float32", "bfloat16"))
    gradient_checkpointing: str = opt("auto", "recompute activations in the backward (auto: on for cuda)",
                                      ("auto", "on", "off"))
    lora_rank: int = opt(16, "LoRA rank r; 0 trains every weight (full-parameter, sharded over the processes "
                             "with FSDP2)")
    lora_alpha: float = opt(32.0, "LoRA alpha (scale alpha/r)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA input")
    lora_targets: str = opt("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                            "comma-separated module names that get adapters")
    # data
    dataset: str = opt("arithmetic", "training set: a name from data/ or a jsonl path")
    eval_dataset: str = opt("arithmetic_test", "held-out sets, comma-separated: names from data/ or jsonl paths")
    template: str = opt("equation", "prompt template of data/templates.py: equation, plain, boxed or answer")
    system_prompt: str | None = opt("You are a helpful assistant.",
                                    "system message; empty = the chat template's own default")
    # rollout
    prompts_per_step: int = opt(8, "distinct prompts sampled per step")
    group_size: int = opt(8, "completions per prompt (G)")
    max_new_tokens: int = opt(16, "completion length cap")
    temperature: float = opt(1.0, "sampling temperature (also used for the training log-probs)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    top_k: int = opt(0, "top-k sampling; 0 = off")
    rollout_batch: int = opt(0, "prompts per sampler call; 0 = from the memory plan on a GPU, all on the CPU")
    cuda_graphs: str = opt("auto", "replay the decode step from CUDA graphs (auto: on, eager if capture fails)",
                           ("auto", "on", "off"))
    format_weight: float = opt(0.0, "reward in [0, 1) for an answer in the template's format, added to correctness")
    # reward
    reward_fn: tuple[str, ...] = opt(("reward:math_reward",), "a reward function module:function with TRL's "
                                     "signature; repeat the flag for several, whose weighted rewards add up")
    reward_weights: tuple[float, ...] | None = opt(None, "weights of the --reward-fn functions, comma-separated, in "
                                                         "their order; empty = 1 each")
    reward_timeout: float = opt(2.0, "seconds a reward function of your own may take per completion; a completion "
                                     "past it scores 0 from that function, as a slow answer does in the checker")
    # optimization
    steps: int = opt(20, "training steps (rollout batches)")
    lr: float = opt(3e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm")
    updates_per_rollout: int = opt(1, "optimizer steps (mini-batches) per rollout batch")
    grad_accum: int = opt(0, "micro-batches per optimizer step (per process, on average, under torchrun); 0 = from "
                             "the memory plan on a GPU, 1 on the CPU")
    recompute_old_logp: str = opt("auto", "recompute old log-probs with the training pass before updating "
                                          "(auto: unless float32, where the sampler's are exact)",
                                  ("auto", "on", "off"))
    loss: loss.LossConfig = field(default_factory=loss.LossConfig)  # its fields are flags too: --rule, --delta, ...
    # evaluation
    eval_every: int = opt(0, "evaluate every N steps (0 = only before and after training)")
    eval_problems: int = opt(0, "held-out problems used per set (0 = all)")
    eval_k: int = opt(8, "samples per held-out problem")
    eval_temperature: float = opt(1.0, "sampling temperature at evaluation")
    eval_batch: int = opt(0, "held-out prompts per sampler call; 0 = from the memory plan on a GPU, 16 on the CPU")
    # run
    run_name: str | None = opt(None, "folder under out_dir; empty = a timestamp")
    out_dir: str = opt("runs", "where runs are written")
    seed: int = opt(0, "seed for data order, sampling and adapters")
    checkpoint_every: int = opt(10, "checkpoint every N steps (and at the end and on Ctrl-C)")
    log_tokens: int = opt(0, "per step, record this many sampled completion tokens (mu, w, advantage, clip flags) "
                             "in RUN/tokens/ for `python loss.py calibrate RUN`; 0 = off")
    gpu_memory: float | None = opt(None, "GPU memory budget in GB for --plan and the automatic batch sizes; "
                                         "empty = the GPU's (80 without one)")
    world_size: int = opt(0, "processes the run is meant for: --plan plans each rank's memory for this many; 0 = "
                             "torchrun's (1 without it). A run trains on the processes torchrun starts")
    resume: str | None = opt(None, "run directory to continue from its last checkpoint")
    dist_timeout: float = opt(1800.0, "under torchrun, seconds a process waits for the others (say, while rank 0 "
                                      "writes a checkpoint) before it fails: a process died or hangs")
    export: str | None = opt(None, "after training, write merged HF weights to this new or empty directory; "
                                   "with --resume RUN --steps 0, export that run's last checkpoint and nothing else")
    log: str = opt("", "experiment trackers besides metrics.jsonl, comma-separated: tensorboard, wandb, trackio")
    log_project: str = opt("grpo", "the W&B and trackio project the run is logged under")
    preset: str | None = opt(None, "a named setup, a file configs/NAME.toml; --config and explicit flags override it")


# The papers' runs are files, configs/NAME.toml, one per preset (a fork adds a recipe by copying one). Every value
# a paper states carries its source in a comment there; the values it leaves open are our choices, listed with
# their reasons in the README ("Presets"). PRESETS is read from them below, after the reader.
CONFIGS = Path(__file__).resolve().parent / "configs"


# ----------------------------------------------------------------------------- checks


def resolve_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    """The device and dtype the settings name: auto is cuda when present, and bf16 there, fp32 on the CPU."""
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    if cfg.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, cfg.dtype)


def validate(cfg: Config, need_device: bool = True) -> None:
    """Every setting that would fail after the model loads fails here, naming the flag and what it accepts."""
    rows = cfg.prompts_per_step * cfg.group_size
    device, processes = cfg.device, distributed.world_size()
    # the processes running (torchrun's) and those the run is planned for (--world-size) must both split a step
    split = next((n for n in (processes, cfg.world_size) if n and cfg.prompts_per_step % n), processes)
    for ok, message in (
        (device in ("auto", "cpu", "meta") or device.startswith("cuda"),
         f"--device {device!r}: expected cpu, cuda, cuda:N or auto"),
        (not need_device or not device.startswith("cuda") or torch.cuda.is_available(),
         f"--device {device}: no CUDA GPU is visible to torch on this machine; use --device cpu"),
        (cfg.prompts_per_step % split == 0,
         f"--prompts-per-step {cfg.prompts_per_step} does not split over {split} processes: each samples whole "
         "prompts (a prompt's G completions share one process, where its advantages are computed); use a multiple "
         f"of {split}"),
        (processes == 1 or not device.startswith("cuda:"),
         f"--device {device}: under torchrun each process takes the GPU of its LOCAL_RANK; use --device auto or cuda"),
        (cfg.group_size >= 2, f"--group-size {cfg.group_size}: GRPO compares at least 2 samples per prompt"),
        (cfg.prompts_per_step >= 1, f"--prompts-per-step {cfg.prompts_per_step}: must be >= 1"),
        (cfg.max_new_tokens >= 1, f"--max-new-tokens {cfg.max_new_tokens}: must be >= 1"),
        (cfg.temperature > 0 and math.isfinite(cfg.temperature),
         f"--temperature {cfg.temperature}: training needs sampling (> 0); greedy samples of a prompt are "
         "identical and carry no signal"),
        (0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]"),
        (cfg.top_k >= 0, f"--top-k {cfg.top_k}: must be >= 0 (0 = off)"),
        (cfg.lora_rank >= 0 and cfg.lora_alpha > 0, f"--lora-rank {cfg.lora_rank} must be >= 0 (0 trains every "
                                                    f"weight) and --lora-alpha {cfg.lora_alpha} > 0"),
        (cfg.world_size >= 0, f"--world-size {cfg.world_size}: must be >= 0 (0 = torchrun's)"),
        (0 <= cfg.lora_dropout < 1, f"--lora-dropout {cfg.lora_dropout}: must be in [0, 1)"),
        (cfg.lr > 0 and math.isfinite(cfg.lr), f"--lr {cfg.lr}: must be a positive number"),
        (cfg.weight_decay >= 0 and cfg.grad_clip > 0, f"--weight-decay {cfg.weight_decay} must be >= 0 and "
                                                      f"--grad-clip {cfg.grad_clip} > 0"),
        (1 <= cfg.updates_per_rollout <= rows, f"--updates-per-rollout {cfg.updates_per_rollout}: must be between 1 "
                                               f"and the {rows} rows of a step (--prompts-per-step x --group-size)"),
        (0 <= cfg.grad_accum <= max(1, rows // cfg.updates_per_rollout),
         f"--grad-accum {cfg.grad_accum}: must be between 0 (automatic) and the {rows // cfg.updates_per_rollout} "
         "rows of a mini-batch"),
        (cfg.rollout_batch >= 0 and cfg.eval_batch >= 0,
         "--rollout-batch and --eval-batch must be >= 0 (0 = automatic)"),
        (cfg.checkpoint_every >= 1, f"--checkpoint-every {cfg.checkpoint_every}: must be >= 1"),
        (cfg.steps >= 0 and cfg.eval_every >= 0 and cfg.eval_problems >= 0 and cfg.eval_k >= 1,
         "--steps, --eval-every and --eval-problems must be >= 0 and --eval-k >= 1"),
        (cfg.eval_temperature >= 0, f"--eval-temperature {cfg.eval_temperature}: must be >= 0 (0 = greedy)"),
        (cfg.log_tokens >= 0, f"--log-tokens {cfg.log_tokens}: must be >= 0"),
        (cfg.dist_timeout > 0, f"--dist-timeout {cfg.dist_timeout}: must be > 0 seconds"),
        (cfg.gpu_memory is None or cfg.gpu_memory > 0, f"--gpu-memory {cfg.gpu_memory}: must be > 0 GB"),
        (0 <= cfg.format_weight < 1, f"--format-weight {cfg.format_weight}: must be in [0, 1), below a correct "
                                     "answer's reward"),
        (not cfg.format_weight or cfg.template in reward.ANSWER_FORMATS,
         f"--format-weight needs a template that asks for a format ({', '.join(reward.ANSWER_FORMATS)}), "
         f"not {cfg.template!r}"),
        (len(cfg.reward_fn) >= 1, "--reward-fn: give at least one reward function (module:function)"),
        (cfg.reward_weights is None or len(cfg.reward_weights) == len(cfg.reward_fn),
         f"--reward-weights {_text(cfg.reward_weights)}: {len(cfg.reward_weights or ())} weights for "
         f"{len(cfg.reward_fn)} --reward-fn functions ({', '.join(cfg.reward_fn)}); give one weight per function"),
        (cfg.reward_weights is None or all(math.isfinite(w) for w in cfg.reward_weights),
         f"--reward-weights {_text(cfg.reward_weights)}: weights must be finite numbers"),
        (cfg.reward_timeout > 0, f"--reward-timeout {cfg.reward_timeout}: must be > 0 seconds"),
    ):
        if not ok:
            raise ValueError(message)
    for spec in cfg.reward_fn:
        scoring.check_spec(spec)
    loggers.check(cfg.log)


def _text(values) -> str:
    return "" if values is None else ",".join(f"{v:g}" for v in values)


# ----------------------------------------------------------------------------- the command line


LOSS_FIELDS = {f.name: f for f in dataclasses.fields(loss.LossConfig)}
TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name != "loss"}
assert not LOSS_FIELDS.keys() & TRAIN_FIELDS.keys(), "a flag name would mean two settings"


def parse_args(argv: list[str] | None = None, description: str | None = None) -> tuple[Config, set[str], bool]:
    """Every Config and LossConfig field is a flag. The settings come, each overriding the one before, from the
    defaults, the preset, the --config file and the flags given.

    Returns the config, the names of the fields given explicitly (by flag or file: they win over a resumed
    run's) and whether --plan was asked. --print-config prints the resolved settings as TOML and exits.
    """
    parser = OneLineErrors(prog="train.py", description=description,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--plan", action="store_true", help="print the GPU memory of each phase and exit "
                                                            "(0: fits, 1: does not); loads no weights")
    parser.add_argument("--config", metavar="FILE.toml", help="settings from a TOML file (keys are the flags' "
                        "names, such as lora_rank; a run's config.toml works as is); flags given override it")
    parser.add_argument("--print-config", action="store_true", help="print the resolved settings as TOML, the "
                        "file --config reads, and exit")
    for f in [*TRAIN_FIELDS.values(), *LOSS_FIELDS.values()]:
        help_text = f"{f.metadata.get('help', '')} (default: {_default_text(f)})"
        flag = "--" + f.name.replace("_", "-")
        if _type_text(f) == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
        elif _type_text(f) == "tuple[str, ...]":  # repeatable: --reward-fn a:f --reward-fn b:g
            parser.add_argument(flag, action="append", default=argparse.SUPPRESS, help=help_text)
        else:
            parser.add_argument(flag, type=_parser_of(f), choices=f.metadata.get("choices"),
                                default=argparse.SUPPRESS, help=help_text)
    given = vars(parser.parse_args(argv))  # only the flags on the command line
    show_plan, print_config, config_file = given.pop("plan"), given.pop("print_config"), given.pop("config", None)
    from_file = read_toml(config_file, "--config") if config_file else {}
    preset = given.get("preset", from_file.get("preset"))
    if preset is not None and preset not in PRESETS:
        parser.error(f"--preset {preset!r} is unknown; known presets: {', '.join(PRESETS)} (files in {CONFIGS})")
    cfg = make_config({**PRESETS.get(preset, {}), **from_file, **given})
    given = set(from_file) | set(given)
    if print_config:
        print(to_toml(resumed_config(cfg, given) if cfg.resume else cfg), end="")
        parser.exit(0)
    return cfg, given, show_plan


class OneLineErrors(argparse.ArgumentParser):
    """A flag that cannot be parsed is one line of error, not the usage of seventy flags."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message}\n")


def make_config(values: dict) -> Config:
    """A Config from flat settings (flag names with underscores), the loss's fields going to LossConfig.

    Dr. GRPO's constant length defaults to the generation cap: the same for every micro-batch, however
    much padding each trims, so accumulated micro-batches add up to one batch's gradient.
    """
    loss_values = {name: value for name, value in values.items() if name in LOSS_FIELDS}
    # lists (from JSON, TOML or a repeated flag) are tuples, as the fields are
    train_values = {name: tuple(value) if isinstance(value, list) else value for name, value in values.items()
                    if name not in LOSS_FIELDS}
    unknown = train_values.keys() - TRAIN_FIELDS.keys()
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    cfg = Config(**train_values)
    validate(cfg, need_device=False)  # before LossConfig, whose norm_len follows max_new_tokens
    loss_values.setdefault("norm_len", cfg.max_new_tokens)
    return dataclasses.replace(cfg, loss=loss.LossConfig(**loss_values))


def flat_config(cfg: Config) -> dict:
    """The settings as one flat dict, as the command line names them (the inverse of make_config)."""
    values = {name: getattr(cfg, name) for name in TRAIN_FIELDS}
    return {**values, **dataclasses.asdict(cfg.loss)}


def _type_text(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__ if isinstance(f.type, type) else str(f.type)


def _default_text(f: dataclasses.Field) -> str:
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return "empty" if default is None else str(default)


def _parser_of(f: dataclasses.Field):
    """A flag's text -> value: int, float or str; "lo,hi" for pairs; an empty string is None."""
    text = _type_text(f).replace(" ", "")
    optional = "None" in text.split("|")
    if "tuple[float" in text:
        def parse(value: str):
            try:
                numbers = tuple(float(v) for v in value.split(","))
            except ValueError:
                raise argparse.ArgumentTypeError(f"expected numbers separated by a comma, got {value!r}") from None
            return numbers[0] if len(numbers) == 1 and text.startswith("float") else numbers
    else:
        parse = {"int": int, "float": float}.get(text.split("|")[0], str)
    return (lambda value: None if value == "" else parse(value)) if optional else parse


def resumed_config(cfg: Config, given: set[str]) -> Config:
    """The saved run's config, with the flags given on this command line on top (e.g. more --steps)."""
    run_dir = Path(cfg.resume)
    saved_file = run_dir / "config.json"
    if not saved_file.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: not a run directory (no config.json)")
    saved = json.loads(saved_file.read_text())
    current = flat_config(cfg)
    # the run's own config.toml given with --config names the run as it is: only a change is refused
    refused = {name for name in given & {"preset", "run_name", "out_dir"} if current[name] != saved.get(name)}
    if refused:
        flags = ", ".join("--" + name.replace("_", "-") for name in sorted(refused))
        raise ValueError(f"--resume {run_dir} continues that run with its own settings; {flags} cannot change them")
    if "steps" in given and cfg.steps == 0 and not cfg.export:
        raise ValueError(f"--resume {run_dir} --steps 0 trains and evaluates nothing; add --export DIR to export "
                         "the run's last checkpoint")
    if "lora_rank" in given and cfg.lora_rank != saved.get("lora_rank", cfg.lora_rank):
        raise ValueError(f"--resume {run_dir}: the run trains with --lora-rank {saved['lora_rank']} and its "
                         f"checkpoints hold those weights; --lora-rank {cfg.lora_rank} cannot change it")
    merged = {**saved, **{name: current[name] for name in given}}
    merged.update(run_name=run_dir.name, out_dir=str(run_dir.parent), resume=str(run_dir))
    return make_config(merged)


# ----------------------------------------------------------------------------- settings files

FIELDS = {**TRAIN_FIELDS, **LOSS_FIELDS}
NOT_WRITTEN = ("resume",)  # what to do, not how: a written config.toml starts a run, it does not continue one


def read_toml(path: str | Path, source: str = "--config") -> dict:
    """The settings of a TOML file, by field name: `lora_rank = 32` (a flag's spelling, lora-rank, works too).

    The file is flat, one key per setting; `""` is an empty setting (None), as on the command line. A key
    that names no setting, a table, or a value of the wrong type is a ValueError naming the file and the key.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{source} {path}: no such file")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{source} {path}: not valid TOML ({error})") from None
    values = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if isinstance(value, dict):
            raise ValueError(f"{path}: [{key}]: a table is not a setting; settings files are flat (key = value)")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; the keys are the flags' names (train.py --help)"
            raise ValueError(f"{path}: {key!r} is not a setting{hint}")
        values[name] = _toml_value(FIELDS[name], value, f"{path}: {key}")
    return values


def _toml_value(f: dataclasses.Field, value, where: str):
    """A TOML value as the field holds it, or a ValueError saying what the field takes."""
    kinds = _type_text(f).replace(" ", "").split("|")
    if value == "" and "None" in kinds:
        return None
    if isinstance(value, list) and any(kind.startswith("tuple") for kind in kinds):
        return tuple(value)  # the items are checked where the setting is (LossConfig, validate)
    if isinstance(value, str) and "tuple[str,...]" in kinds:
        return (value,)  # one reward function
    if isinstance(value, bool):
        if "bool" in kinds:
            return value
    elif isinstance(value, int) and "int" in kinds:
        return value
    elif isinstance(value, (int, float)) and "float" in kinds:
        return float(value)
    elif isinstance(value, str) and "str" in kinds:
        return value
    raise ValueError(f"{where} = {_toml_text(value)}: expected {_expected(kinds)}")


def _expected(kinds: list[str]) -> str:
    words = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false",
             "None": '"" (empty)'}
    return " or ".join(words.get(kind, "a list" if kind.startswith("tuple") else kind) for kind in kinds)


def to_toml(cfg: Config) -> str:
    """The settings as the TOML file read_toml reads back into the same Config (resume left out)."""
    lines = ["# train.py settings: `python train.py --config THIS_FILE` runs them (flags given with it override).",
             '# Keys are the flags\' names; "" is an empty setting, as on the command line.', ""]
    values = flat_config(cfg)
    for name in FIELDS:
        if name == next(iter(LOSS_FIELDS)):
            lines += ["", "# the loss (loss.LossConfig)"]
        if name not in NOT_WRITTEN:
            value = "-".join(values[name]) if name == "rule" and isinstance(values[name], tuple) else values[name]
            lines.append(f"{name} = {_toml_text(value)}")
    return "\n".join(lines) + "\n"


def _toml_text(value) -> str:
    """One value in TOML: strings as JSON writes them (a subset of TOML's basic strings), None as ""."""
    if value is None:
        return '""'
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else ("nan" if math.isnan(value) else f"{'-' * (value < 0)}inf")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_toml_text(item) for item in value) + "]"
    return json.dumps(str(value), ensure_ascii=False).replace("\x7f", "\\u007f")


def load_presets(folder: Path = CONFIGS) -> dict[str, dict]:
    """Every configs/NAME.toml as preset NAME."""
    return {path.stem: read_toml(path, "preset") for path in sorted(folder.glob("*.toml"))}


PRESETS = load_presets()
