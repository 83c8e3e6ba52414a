"""The run's settings: the Config dataclass (train.py) and SFTConfig (sft.py), the papers' presets, the
checks every value passes before anything loads, and the command line that turns flags into a config.

Every Config field and every loss.LossConfig field is a flag (`--lora-rank`, `--rule`, ...): a new knob
is one field here or in loss.py, and its help text is the field's. A preset fills defaults that explicit
flags override. The file is separate from train.py so that the step and the loop read without the flag
plumbing, and so that every entry point (train.py, research/study.py, the tests) builds a Config the same way.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import json
import math
import re
import tomllib
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

import lora
import loss
import reward
from data import TEMPLATES, problem_location, render_prompt
from grading import scoring
from infra import distributed, loggers


def opt(default, help: str, choices: tuple[str, ...] | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class Config:
    # model
    model: str | None = opt(None, "HF directory or hub id; empty = the offline SmolLM2-135M-Instruct")
    device: str = opt("auto", "cpu, cuda, cuda:N or auto (cuda when present)")
    dtype: str = opt("auto", "bfloat16 on cuda and float32 on cpu when auto", ("auto", "float32", "bfloat16"))
    gradient_checkpointing: str = opt(
        "auto", "recompute activations in the backward (auto: on for cuda)", ("auto", "on", "off")
    )
    lora_rank: int = opt(
        16, "LoRA rank r; 0 trains every weight (full-parameter, sharded over the processes with FSDP2)"
    )
    lora_alpha: float = opt(32.0, "LoRA alpha (scale alpha/r)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA input")
    lora_targets: str = opt(
        "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "comma-separated module names that get adapters"
    )
    init_adapter: str | None = opt(
        None,
        "start from this LoRA adapter (PEFT format, e.g. sft.py's RUN/adapter) "
        "instead of fresh ones; its r, alpha and targets must be --lora-rank, "
        "--lora-alpha and --lora-targets",
    )
    # data
    dataset: str = opt("arithmetic", "training set: a name from data/ or a jsonl path")
    eval_dataset: str = opt("arithmetic_test", "held-out sets, comma-separated: names from data/ or jsonl paths")
    template: str = opt("equation", "prompt template of data/templates.py: equation, plain, boxed, answer or code")
    system_prompt: str | None = opt(
        "You are a helpful assistant.", "system message; empty = the chat template's own default"
    )
    thinking: str = opt(
        "off",
        "thinking mode: passed as enable_thinking to chat templates that take it (Qwen3); "
        "the reward grades only what follows the last </think>",
        ("on", "off"),
    )
    # sampling
    prompts_per_step: int = opt(8, "distinct prompts sampled per step")
    group_size: int = opt(8, "completions per prompt (G)")
    max_new_tokens: int = opt(16, "completion length cap")
    temperature: float = opt(1.0, "sampling temperature (also used for the training log-probs)")
    top_p: float = opt(1.0, "nucleus sampling mass")
    top_k: int = opt(0, "top-k sampling; 0 = off")
    rollout_batch: int = opt(
        0,
        "prompts in flight in the sampler (their rows bound its batch); 0 = from the memory "
        "plan on a GPU, all of a step's on the CPU",
    )
    kv_blocks: int = opt(
        0,
        "blocks of the sampler's KV cache pool, kept for the whole run; 0 = from the memory plan "
        "on a GPU, enough for every row at full length on the CPU",
    )
    cuda_graphs: str = opt(
        "auto", "replay the decode step from CUDA graphs (auto: on, eager if capture fails)", ("auto", "on", "off")
    )
    dynamic_sampling: int = opt(
        0,
        "DAPO's dynamic sampling (Yu et al. 2025, arXiv:2503.14476; verl's filter_groups): up to N sampler calls "
        "a step, each on --prompts-per-step new prompts, until the step holds --prompts-per-step groups whose "
        "rewards differ (under torchrun, the groups one process keeps); 0 = off, one call",
    )
    overlong: str = opt(
        "off",
        "truncated completions: mask (out of the loss, TRL's mask_truncated_completions) or penalty:L, DAPO's "
        "soft overlong punishment (arXiv:2503.14476, eq. 13) adding ((Lmax - L) - |y|) / L to the reward over "
        "the last L tokens before Lmax = --max-new-tokens; off",
    )
    # reward
    format_weight: float = opt(0.0, "reward in [0, 1) for an answer in the template's format, added to correctness")
    reward_fn: tuple[str, ...] = opt(
        ("reward:math_reward",),
        "a reward function module:function with TRL's "
        "signature; repeat the flag for several, whose weighted rewards add up",
    )
    reward_weights: tuple[float, ...] | None = opt(
        None, "weights of the --reward-fn functions, comma-separated, in their order; empty = 1 each"
    )
    reward_timeout: float = opt(
        2.0,
        "seconds a reward function of your own may take per completion; a completion "
        "past it scores 0 from that function, as a slow answer does in the checker",
    )
    code_reward: str = opt(
        "binary",
        "the built-in reward on code problems: 1 when every test passes (binary), or the share of tests passed",
        ("binary", "fraction"),
    )
    code_timeout: float = opt(2.0, "code problems: seconds a program may run per test (sandbox.py)")
    # optimization
    steps: int = opt(20, "training steps (rollout batches)")
    lr: float = opt(3e-4, "AdamW learning rate (the peak, with a schedule)")
    lr_schedule: str = opt(
        "constant",
        "learning rate over the training steps after the warmup: constant, cosine or linear decay towards 0",
        ("constant", "cosine", "linear"),
    )
    warmup_steps: int = opt(0, "training steps of linear warmup to --lr (the rate is set once per step, as verl does)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm")
    updates_per_rollout: int = opt(1, "optimizer steps (mini-batches) per pass over a rollout batch")
    epochs: int = opt(
        1,
        "passes over each rollout batch, each reshuffled into --updates-per-rollout mini-batches "
        "(TRL's num_iterations, verl's ppo_epochs)",
    )
    shuffle: str = opt(
        "rows",
        "mini-batches of the rollout's rows shuffled one by one, or of whole prompt groups "
        "(G rows each): then every micro-batch runs each of its prompts once",
        ("rows", "groups"),
    )
    grad_accum: int = opt(
        0,
        "micro-batches per optimizer step (per process, on average, under torchrun); 0 = from "
        "the memory plan on a GPU, 1 on the CPU. With --micro-batch-tokens it sizes only the passes "
        "without gradient (old and reference log-probs)",
    )
    micro_batch_tokens: int = opt(
        0,
        "training micro-batches of rows packed by length: each process's share of a mini-batch, longest rows "
        "first, in micro-batches of at most N tokens counted as the pass pads them (rows x the longest prompt "
        "+ completion; a longer row runs alone); the update is the same, but for clip_cov, kl_cov and "
        "--top-entropy-quantile, which select among a micro-batch's tokens. 0 = from the memory plan where it "
        "chooses --grad-accum (0, on a GPU): the tokens of its micro-batch at full length; else by rows",
    )
    recompute_old_logp: str = opt(
        "auto",
        "recompute old log-probs with the training pass before updating "
        "(auto: unless float32, where the sampler's are exact)",
        ("auto", "on", "off"),
    )
    loss: loss.LossConfig = field(default_factory=loss.LossConfig)  # its fields are flags too: --rule, --delta, ...
    # evaluation
    eval_every: int = opt(0, "evaluate every N steps (0 = only before and after training)")
    eval_problems: int = opt(0, "held-out problems used per set (0 = all)")
    eval_k: int = opt(8, "samples per held-out problem")
    eval_temperature: float = opt(1.0, "sampling temperature at evaluation")
    eval_batch: int = opt(
        0, "held-out prompts per sampler call (all in flight); 0 = from the memory plan on a GPU, 16 on the CPU"
    )
    # run
    run_name: str | None = opt(None, "folder under out_dir; empty = a timestamp")
    out_dir: str = opt("runs", "where runs are written")
    seed: int = opt(0, "seed for data order, sampling and adapters")
    checkpoint_every: int = opt(10, "checkpoint every N steps (and at the end and on Ctrl-C)")
    log_tokens: int = opt(
        0,
        "per step, record this many sampled completion tokens (mu, w, advantage, clip flags) "
        "in RUN/tokens/ for `python calibrate.py RUN`; 0 = off",
    )
    gpu_memory: float | None = opt(
        None, "GPU memory budget in GB for --plan and the automatic batch sizes; empty = the GPU's (80 without one)"
    )
    resume: str | None = opt(None, "run directory to continue from its last checkpoint")
    export: str | None = opt(
        None,
        "after training, write merged HF weights to this new or empty directory; "
        "with --resume RUN --steps 0, export that run's last checkpoint and nothing else",
    )
    preset: str | None = opt(None, "a named setup, a file configs/NAME.toml; --config and explicit flags override it")
    # trackers
    log: str = opt("", "experiment trackers besides metrics.jsonl, comma-separated: tensorboard, wandb, trackio")
    log_project: str = opt("grpo", "the W&B and trackio project the run is logged under")
    # distributed
    world_size: int = opt(
        0,
        "processes the run is meant for: --plan plans each rank's memory for this many; 0 = "
        "torchrun's (1 without it). A run trains on the processes torchrun starts",
    )
    dist_timeout: float = opt(
        1800.0,
        "under torchrun, seconds a process waits for the others (say, while rank 0 "
        "writes a checkpoint) before it fails: a process died or hangs",
    )
    # not a flag: where each setting came from (resolve), for the run's record and for errors naming a file's key
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)


def shared(name: str):
    """Config's field `name` (its default and help), for a settings class that means the same by it."""
    f = Config.__dataclass_fields__[name]
    return field(default=f.default, metadata=f.metadata)


@dataclass
class SFTConfig:
    """The supervised stage's settings (sft.py): the model, LoRA and prompt fields are train.py's own, so an
    adapter trained here is one that `train.py --init-adapter` continues with the same prompts."""

    # model
    model: str | None = shared("model")
    device: str = shared("device")
    dtype: str = shared("dtype")
    gradient_checkpointing: str = shared("gradient_checkpointing")
    lora_rank: int = opt(16, "LoRA rank r")
    lora_alpha: float = shared("lora_alpha")
    lora_dropout: float = shared("lora_dropout")
    lora_targets: str = shared("lora_targets")
    # data: problems with a worked "solution" (data/prepare.py writes them; arithmetic has them)
    dataset: str = opt("arithmetic", "problems with worked solutions: a name from data/ or a jsonl path")
    eval_dataset: str = opt(
        "arithmetic_test", "held-out problems sampled before and after, comma-separated; empty = none"
    )
    template: str = shared("template")
    system_prompt: str | None = shared("system_prompt")
    thinking: str = shared("thinking")
    max_length: int = opt(2048, "examples longer than this (prompt + reply tokens) are left out, and counted")
    batch_tokens: int = opt(
        4096, "padded tokens per micro-batch (rows x the longest row); examples of similar length share a batch"
    )
    # optimization
    epochs: int = opt(1, "passes over the dataset")
    max_steps: int = opt(0, "stop after this many optimizer steps; 0 = the epochs decide")
    lr: float = opt(2e-4, "AdamW learning rate (the peak)")
    lr_schedule: str = opt(
        "cosine",
        "learning rate after the warmup: constant, cosine or linear decay towards 0",
        ("constant", "cosine", "linear"),
    )
    warmup_steps: int = opt(0, "optimizer steps of linear warmup")
    weight_decay: float = shared("weight_decay")
    grad_clip: float = shared("grad_clip")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    # evaluation: format compliance and accuracy on the held-out problems
    eval_problems: int = opt(64, "held-out problems used per set (0 = all)")
    eval_k: int = opt(2, "samples per held-out problem")
    eval_temperature: float = shared("eval_temperature")
    eval_batch: int = opt(16, "held-out prompts per sampler call")
    max_new_tokens: int = opt(32, "completion length cap at evaluation")
    # run
    run_name: str | None = shared("run_name")
    out_dir: str = shared("out_dir")
    seed: int = shared("seed")
    checkpoint_every: int = opt(50, "checkpoint every N optimizer steps (and at the end and on Ctrl-C)")
    resume: str | None = shared("resume")
    export: str | None = opt(None, "after training, write merged HF weights to this new or empty directory")
    preset: str | None = opt(
        None, "a named setup, a file configs/sft/NAME.toml; --config and explicit flags override it"
    )
    origins: dict[str, str] = field(default_factory=dict, compare=False, repr=False)  # not a flag, as Config's


# The papers' runs are files, configs/NAME.toml, one per preset (a fork adds a recipe by copying one), and
# configs/sft/NAME.toml for sft.py's. Every value a paper states carries its source in a comment there; every
# other value is written out too, so that a change of a default never changes a paper's run, and its reason is
# in the README ("Presets"). PRESETS and SFT_PRESETS are read from them below, after the reader.
CONFIGS = Path(__file__).resolve().parent / "configs"


# ----------------------------------------------------------------------------- checks


def overlong_cache(overlong: str, max_new_tokens: int) -> int | None:
    """L of --overlong penalty:L when it is one (1 <= L <= max_new_tokens), else None."""
    kind, _, length = overlong.partition(":")
    if kind != "penalty" or not length.isdigit() or not 1 <= int(length) <= max_new_tokens:
        return None
    return int(length)


def resolve_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    """The device and dtype the settings name: auto is cuda when present, and bf16 there, fp32 on the CPU."""
    device = torch.device(
        "cuda" if cfg.device == "auto" and torch.cuda.is_available() else "cpu" if cfg.device == "auto" else cfg.device
    )
    if cfg.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    return device, getattr(torch, cfg.dtype)


def _model_checks(cfg, need_device: bool) -> list[tuple[bool, str]]:
    """The checks of the settings train.py and sft.py share: device, LoRA dropout, optimizer, epochs."""
    device = cfg.device
    return [
        (
            device in ("auto", "cpu", "meta") or device.startswith("cuda"),
            f"--device {device!r}: expected cpu, cuda, cuda:N or auto",
        ),
        (
            not need_device or not device.startswith("cuda") or torch.cuda.is_available(),
            f"--device {device}: no CUDA GPU is visible to torch on this machine; use --device cpu",
        ),
        (0 <= cfg.lora_dropout < 1, f"--lora-dropout {cfg.lora_dropout}: must be in [0, 1)"),
        (cfg.lr > 0 and math.isfinite(cfg.lr), f"--lr {cfg.lr}: must be a positive number"),
        (cfg.weight_decay >= 0, f"--weight-decay {cfg.weight_decay}: must be >= 0"),
        (cfg.grad_clip > 0, f"--grad-clip {cfg.grad_clip}: must be > 0 (the largest gradient norm an update keeps)"),
        (cfg.epochs >= 1, f"--epochs {cfg.epochs}: must be >= 1"),
    ]


def validate(cfg: Config, need_device: bool = True) -> None:
    """Every setting that would fail after the model loads fails here, naming the one flag at fault and what
    it accepts. (What needs the model's shape, its context and LoRA rank, is checked by check_model.)"""
    for ok, message in _checks(cfg, need_device):
        if not ok:
            raise ValueError(message)
    for spec in cfg.reward_fn:
        scoring.check_spec(spec)
    loggers.check(cfg.log)


def validate_sft(cfg: SFTConfig, need_device: bool = True) -> None:
    """sft.py's settings, checked before anything loads, each failure naming its flag."""
    for ok, message in (
        *_model_checks(cfg, need_device),
        (
            cfg.lora_rank >= 1 and cfg.lora_alpha > 0,
            f"--lora-rank {cfg.lora_rank} must be >= 1 and --lora-alpha {cfg.lora_alpha} > 0",
        ),
        (distributed.world_size() == 1, "sft.py runs in one process; start it without torchrun"),
        (cfg.max_length >= 2, f"--max-length {cfg.max_length}: must be >= 2 (a prompt and a reply token)"),
        (
            cfg.batch_tokens >= cfg.max_length,
            f"--batch-tokens {cfg.batch_tokens}: must hold one example of --max-length {cfg.max_length}",
        ),
        (cfg.max_steps >= 0 and cfg.warmup_steps >= 0, "--max-steps and --warmup-steps must be >= 0"),
        (cfg.grad_accum >= 1, f"--grad-accum {cfg.grad_accum}: must be >= 1"),
        (
            cfg.eval_problems >= 0 and cfg.eval_k >= 1 and cfg.eval_batch >= 1 and cfg.max_new_tokens >= 1,
            "--eval-problems must be >= 0, and --eval-k, --eval-batch and --max-new-tokens >= 1",
        ),
        (cfg.eval_temperature >= 0, f"--eval-temperature {cfg.eval_temperature}: must be >= 0 (0 = greedy)"),
        (cfg.checkpoint_every >= 1, f"--checkpoint-every {cfg.checkpoint_every}: must be >= 1"),
        (
            not cfg.eval_dataset or all(name.strip() for name in cfg.eval_dataset.split(",")),
            f"--eval-dataset {cfg.eval_dataset!r}: an empty name between commas; give names separated by commas "
            '(or "" for none)',
        ),
        (
            cfg.template in TEMPLATES or "{problem}" in cfg.template,
            f"--template {cfg.template!r}: expected one of {', '.join(TEMPLATES)}, or a string containing '{{problem}}'",
        ),
    ):
        if not ok:
            raise ValueError(message)


def check_init_adapter(cfg) -> None:
    """--init-adapter is an adapter of the run's LoRA shape: checked on its config file, before the model loads."""
    if not cfg.init_adapter:
        return
    saved = lora.read_config(cfg.init_adapter)
    ours = {"r": cfg.lora_rank, "lora_alpha": cfg.lora_alpha, "target_modules": sorted(cfg.lora_targets.split(","))}
    flags = {"r": "--lora-rank", "lora_alpha": "--lora-alpha", "target_modules": "--lora-targets"}
    differ = [
        f"{flags[key]} {ours[key]} (the adapter has {saved.get(key)})"
        for key in ours
        if (sorted(saved.get(key) or []) if key == "target_modules" else saved.get(key)) != ours[key]
    ]
    if differ:
        raise ValueError(f"--init-adapter {cfg.init_adapter}: its shape differs from this run's: {'; '.join(differ)}")
    # an adapter of a run (RUN/adapter, RUN/best, RUN/checkpoint-N/adapter) learned the prompts of that run's settings
    adapter = Path(cfg.init_adapter).resolve()
    run_settings = next(
        (p / "config.json" for p in (adapter.parent, adapter.parent.parent) if (p / "config.json").is_file()), None
    )
    if run_settings is None:
        return
    try:
        trained = json.loads(run_settings.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return  # not a run's settings file: nothing to compare with
    prompts = [
        f"{_flag(name)} {trained[name]!r} (this run: {getattr(cfg, name)!r})"
        for name in ("template", "system_prompt", "thinking")
        if isinstance(trained, dict) and name in trained and trained[name] != getattr(cfg, name)
    ]
    if prompts:
        raise ValueError(
            f"--init-adapter {cfg.init_adapter}: its run ({run_settings}) posed the prompts with {'; '.join(prompts)}; "
            "give the same prompt flags, so the adapter continues with the prompts it learned"
        )


def _text(values) -> str:
    return "" if values is None else ",".join(f"{v:g}" for v in values)


def _checks(cfg: Config, need_device: bool):
    """(ok, message) pairs in order; a generator, so that a message is built only once the checks before it
    hold (the rows of a mini-batch divide by --updates-per-rollout, checked first)."""
    device, processes = cfg.device, distributed.world_size()
    # the processes running (torchrun's) and those the run is planned for (--world-size) must both split a step
    split = next((n for n in (processes, cfg.world_size) if n and cfg.prompts_per_step % n), processes)
    for name in TRAIN_FIELDS:  # nan and infinities are no setting's value
        value = getattr(cfg, name)
        if isinstance(value, float):
            yield math.isfinite(value), f"{_flag(name)} {value}: must be a finite number"
    yield from _model_checks(cfg, need_device)
    yield (
        cfg.prompts_per_step % split == 0,
        f"--prompts-per-step {cfg.prompts_per_step} does not split over {split} processes: each samples whole "
        "prompts (a prompt's G completions share one process, where its advantages are computed); use a multiple "
        f"of {split}",
    )
    yield (
        processes == 1 or not device.startswith("cuda:"),
        f"--device {device}: under torchrun each process takes the GPU of its LOCAL_RANK; use --device auto or cuda",
    )
    yield cfg.group_size >= 2, f"--group-size {cfg.group_size}: GRPO compares at least 2 samples per prompt"
    yield cfg.prompts_per_step >= 1, f"--prompts-per-step {cfg.prompts_per_step}: must be >= 1"
    yield cfg.max_new_tokens >= 1, f"--max-new-tokens {cfg.max_new_tokens}: must be >= 1"
    yield cfg.dynamic_sampling >= 0, f"--dynamic-sampling {cfg.dynamic_sampling}: must be >= 0 (0 = off)"
    yield (
        overlong_cache(cfg.overlong, cfg.max_new_tokens) is not None or cfg.overlong in ("off", "mask"),
        f"--overlong {cfg.overlong}: expected off, mask or penalty:L with 1 <= L <= --max-new-tokens "
        f"({cfg.max_new_tokens})",
    )
    yield (
        cfg.loss.rollout_correction == "off" or cfg.recompute_old_logp != "off",
        f"--rollout-correction {cfg.loss.rollout_correction}: weighs by the training pass's old log-probs over "
        "the sampler's, so it needs --recompute-old-logp on or auto",
    )
    yield (
        cfg.temperature > 0,
        f"--temperature {cfg.temperature}: training needs sampling (> 0); greedy samples of "
        "a prompt are identical and carry no signal",
    )
    yield 0 < cfg.top_p <= 1, f"--top-p {cfg.top_p}: must be in (0, 1]"
    yield cfg.top_k >= 0, f"--top-k {cfg.top_k}: must be >= 0 (0 = off)"
    yield cfg.lora_rank >= 0, f"--lora-rank {cfg.lora_rank}: must be >= 0 (0 trains every weight)"
    yield cfg.lora_alpha > 0, f"--lora-alpha {cfg.lora_alpha}: must be > 0"
    yield cfg.world_size >= 0, f"--world-size {cfg.world_size}: must be >= 0 (0 = torchrun's)"
    targets = [t.strip() for t in cfg.lora_targets.split(",")]
    yield (
        all(t in LORA_TARGETS for t in targets) and len(set(targets)) == len(targets),
        f"--lora-targets {cfg.lora_targets}: expected distinct names among {', '.join(LORA_TARGETS)}, "
        "separated by commas",
    )
    rows = cfg.prompts_per_step * cfg.group_size
    yield (
        1 <= cfg.updates_per_rollout <= rows,
        f"--updates-per-rollout {cfg.updates_per_rollout}: must be between "
        f"1 and the {rows} rows of a step (--prompts-per-step x --group-size)",
    )
    yield (
        cfg.shuffle == "rows" or cfg.updates_per_rollout <= cfg.prompts_per_step,
        f"--updates-per-rollout {cfg.updates_per_rollout}: with --shuffle groups each mini-batch holds whole "
        f"prompt groups, so at most the {cfg.prompts_per_step} prompts of a step (--prompts-per-step)",
    )
    yield (
        0 <= cfg.grad_accum <= max(1, rows // cfg.updates_per_rollout),
        f"--grad-accum {cfg.grad_accum}: must be between 0 (automatic) and the {rows // cfg.updates_per_rollout} "
        "rows of a mini-batch",
    )
    yield (
        cfg.micro_batch_tokens >= 0,
        f"--micro-batch-tokens {cfg.micro_batch_tokens}: must be >= 0 (0 = from the memory plan, or by rows)",
    )
    yield cfg.rollout_batch >= 0, f"--rollout-batch {cfg.rollout_batch}: must be >= 0 (0 = automatic)"
    yield cfg.eval_batch >= 0, f"--eval-batch {cfg.eval_batch}: must be >= 0 (0 = automatic)"
    yield cfg.kv_blocks >= 0, f"--kv-blocks {cfg.kv_blocks}: must be >= 0 (0 = automatic)"
    yield cfg.kv_blocks != 1, "--kv-blocks 1: block 0 is reserved, so a pool needs at least 2"
    yield (
        0 <= cfg.warmup_steps <= max(cfg.steps, 0),
        f"--warmup-steps {cfg.warmup_steps}: must be between 0 and --steps {cfg.steps}",
    )
    yield (
        not cfg.init_adapter or cfg.lora_rank >= 1,
        "--init-adapter starts from LoRA adapters; with --lora-rank 0 every weight trains and there are none",
    )
    yield (
        not cfg.init_adapter or not cfg.loss.kl_beta,
        "--init-adapter with --kl-beta: the KL reference is the frozen base model (adapters off), not the "
        "adapter's policy; a penalty towards the base is not what a run from an SFT adapter wants",
    )
    yield cfg.checkpoint_every >= 1, f"--checkpoint-every {cfg.checkpoint_every}: must be >= 1"
    yield cfg.steps >= 0, f"--steps {cfg.steps}: must be >= 0"
    yield cfg.eval_every >= 0, f"--eval-every {cfg.eval_every}: must be >= 0 (0 = only before and after training)"
    yield cfg.eval_problems >= 0, f"--eval-problems {cfg.eval_problems}: must be >= 0 (0 = all)"
    yield cfg.eval_k >= 1, f"--eval-k {cfg.eval_k}: must be >= 1"
    yield cfg.eval_temperature >= 0, f"--eval-temperature {cfg.eval_temperature}: must be >= 0 (0 = greedy)"
    yield cfg.log_tokens >= 0, f"--log-tokens {cfg.log_tokens}: must be >= 0"
    yield cfg.dist_timeout > 0, f"--dist-timeout {cfg.dist_timeout}: must be > 0 seconds"
    yield cfg.gpu_memory is None or cfg.gpu_memory > 0, f"--gpu-memory {cfg.gpu_memory}: must be > 0 GB"
    yield 0 <= cfg.seed < 2**32, f"--seed {cfg.seed}: must be in [0, 2^32)"
    yield (
        cfg.template in TEMPLATES or "{problem}" in cfg.template,
        f"--template {cfg.template!r}: expected one of {', '.join(TEMPLATES)}, or a string containing '{{problem}}'",
    )
    yield (
        0 <= cfg.format_weight < 1,
        f"--format-weight {cfg.format_weight}: must be in [0, 1), below a correct answer's reward",
    )
    yield (
        not cfg.format_weight or cfg.template in reward.ANSWER_FORMATS,
        f"--format-weight needs a template that asks for a format ({', '.join(reward.ANSWER_FORMATS)}), "
        f"not {cfg.template!r}",
    )
    yield (
        all(name.strip() for name in cfg.eval_dataset.split(",")),
        f"--eval-dataset {cfg.eval_dataset!r}: an empty name between commas; give names separated by commas",
    )
    yield (
        not cfg.log or all(name.strip() for name in cfg.log.split(",")),
        f"--log {cfg.log!r}: an empty name between commas; give tracker names separated by commas",
    )
    yield cfg.code_timeout > 0, f"--code-timeout {cfg.code_timeout}: must be a positive number of seconds"
    yield len(cfg.reward_fn) >= 1, "--reward-fn: give at least one reward function (module:function)"
    yield (
        cfg.reward_weights is None or len(cfg.reward_weights) == len(cfg.reward_fn),
        f"--reward-weights {_text(cfg.reward_weights)}: {len(cfg.reward_weights or ())} weights for "
        f"{len(cfg.reward_fn)} --reward-fn functions ({', '.join(cfg.reward_fn)}); give one weight per function",
    )
    yield (
        cfg.reward_weights is None or all(math.isfinite(w) for w in cfg.reward_weights),
        f"--reward-weights {_text(cfg.reward_weights)}: weights must be finite numbers",
    )
    yield cfg.reward_timeout > 0, f"--reward-timeout {cfg.reward_timeout}: must be > 0 seconds"
    name = cfg.run_name
    yield (
        name is None or (name not in ("", ".", "..") and Path(name).name == name and "\\" not in name),
        f"--run-name {name!r}: must be one folder name, inside --out-dir (no '/', '.' or '..')",
    )


LORA_TARGETS = (*lora.DEFAULT_TARGETS, "lm_head")  # the linear layers of a decoder that can take an adapter


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_model(cfg: Config, model_cfg) -> None:
    """The settings against the model's shape, read from its config.json before any weight loads: the
    completion fits the context, and the LoRA rank is below every targeted layer's smaller dimension."""
    context = model_cfg.max_position_embeddings
    if cfg.max_new_tokens >= context:
        raise ValueError(
            f"--max-new-tokens {cfg.max_new_tokens}: the model's context is {context} tokens, prompt "
            "included; use fewer"
        )
    dims = {
        "q_proj": model_cfg.num_heads * model_cfg.head_dim,
        "k_proj": model_cfg.num_kv_heads * model_cfg.head_dim,
        "v_proj": model_cfg.num_kv_heads * model_cfg.head_dim,
        "o_proj": model_cfg.num_heads * model_cfg.head_dim,
        "gate_proj": model_cfg.intermediate_size,
        "up_proj": model_cfg.intermediate_size,
        "down_proj": model_cfg.intermediate_size,
        "lm_head": model_cfg.vocab_size,
    }
    for target in cfg.lora_targets.split(",") if cfg.lora_rank else ():  # rank 0: no adapters, every weight trains
        smallest = min(model_cfg.hidden_size, dims[target.strip()])
        if cfg.lora_rank > smallest:
            raise ValueError(
                f"--lora-rank {cfg.lora_rank}: above the {smallest} dimensions of {target.strip()} in "
                f"this model, where no update has a higher rank; use at most {smallest}"
            )


BUILT_IN_REWARDS = {"reward:math_reward": "math", "sandbox:code_reward": "code"}  # a built-in -> what it grades


def check_reward_functions(cfg: Config, problems: list[dict], eval_sets: dict[str, list[dict]] | None = None) -> None:
    """Each kind of problem graded, in training and in the held-out sets: with built-in reward functions only,
    a kind none of them grades (code problems under the default reward:math_reward) would earn nothing, or
    measure a run on a task it never trained for, so it fails here. A function of your own may grade any row,
    and is trusted to."""
    if not set(cfg.reward_fn) <= BUILT_IN_REWARDS.keys():
        return
    graded = {BUILT_IN_REWARDS[spec] for spec in cfg.reward_fn}
    sets = [
        ("--dataset", cfg.dataset, problems),
        *(("--eval-dataset", name, p) for name, p in (eval_sets or {}).items()),
    ]
    for flag, name, rows in sets:
        kinds = {"code" if p.get("task") == "code" else "math" for p in rows}
        for kind in sorted(kinds - graded):
            spec = next(spec for spec, grades in BUILT_IN_REWARDS.items() if grades == kind)
            raise ValueError(
                f"{flag} {name} holds {kind} problems, which no --reward-fn grades ({', '.join(cfg.reward_fn)}): "
                + (
                    f"add --reward-fn {spec}"
                    if flag == "--dataset"
                    else f"evaluate on a set of {', '.join(graded)} problems, or train with --reward-fn {spec}"
                )
            )


def check_prompts(cfg: Config, problems: list[dict], tokenizer, context: int, dataset: str) -> None:
    """Every prompt of a dataset leaves room for --max-new-tokens in the context; the first that does not is
    named by file and line. A prompt has at most one token per byte (byte-level BPE), plus the template's
    own tokens, so only prompts long enough to overflow are tokenized."""
    room = context - cfg.max_new_tokens
    frame = len(render_prompt(tokenizer, "", cfg.template, cfg.system_prompt)) + 8
    for index, problem in enumerate(problems):
        if len(problem["problem"].encode()) + frame <= room:
            continue
        tokens = len(render_prompt(tokenizer, problem["problem"], cfg.template, cfg.system_prompt))
        if tokens > room:
            raise ValueError(
                f"{problem_location(dataset, index)}: the prompt has {tokens} tokens, and with "
                f"--max-new-tokens {cfg.max_new_tokens} it does not fit the model's context of "
                f"{context}; shorten or drop it, or lower --max-new-tokens"
            )


def warn_if_inert(cfg: Config) -> None:
    """Say once, at the start, when the settings make a chosen trust region do nothing (the default run,
    which chooses none, says nothing)."""
    default = loss.LossConfig()  # a run that sets the rule or a setting the rule's entry reads asks for a region
    chosen = cfg.loss.rule != default.rule or any(
        getattr(cfg.loss, name) != getattr(default, name) for name in loss.get_rule(cfg.loss.rule).settings
    )
    if cfg.updates_per_rollout * cfg.epochs == 1 and chosen:
        warnings.warn(
            "one optimizer step per rollout (--updates-per-rollout 1, --epochs 1): every update starts "
            "from the weights that sampled its rollout, so the ratio w is 1 up to rounding and every "
            "clip rule gives the same update; use several updates or epochs per rollout to compare "
            "rules",
            stacklevel=2,
        )
    if cfg.loss.rule == "interval" and cfg.loss.ratio_limits is None and cfg.loss.dual_clip is None:
        warnings.warn(
            "--rule interval clips only at --ratio-limits or --dual-clip, and neither is set: no token "
            "loses its gradient (the importance-weighted policy gradient, unclipped)",
            stacklevel=2,
        )


def check_given(cfg: Config, given: set[str]) -> None:
    """A flag given on the command line that does nothing with the others can only be a mistake: an error.
    (A settings file holds every setting, those that do nothing under its rule included: not checked.)"""
    for name, why in loss.inert_settings(cfg.loss).items():
        if name in given:
            value = getattr(cfg.loss, name)
            shown = (
                ""
                if isinstance(value, bool)
                else " " + (",".join(f"{v:g}" for v in value) if isinstance(value, tuple) else f"{value}")
            )
            raise ValueError(f"{_flag(name)}{shown}: {why}; leave it out")


# ----------------------------------------------------------------------------- the command line


LOSS_FIELDS = {f.name: f for f in dataclasses.fields(loss.LossConfig)}
NOT_FLAGS = ("loss", "origins")  # the loss's fields are flags of their own; origins says where the others came from
TRAIN_FIELDS = {f.name: f for f in dataclasses.fields(Config) if f.name not in NOT_FLAGS}
SFT_FIELDS = {f.name: f for f in dataclasses.fields(SFTConfig) if f.name not in NOT_FLAGS}
FIELDS = {**TRAIN_FIELDS, **LOSS_FIELDS}
assert not LOSS_FIELDS.keys() & TRAIN_FIELDS.keys(), "a flag name would mean two settings"

# --help's groups, each from its first field to the next group's, in the dataclasses' order (the loss's last)
TRAIN_GROUPS = {
    "model": "model",
    "data": "dataset",
    "sampling": "prompts_per_step",
    "reward": "format_weight",
    "optimisation": "steps",
    "loss": "rule",
    "evaluation": "eval_every",
    "run": "run_name",
    "trackers": "log",
    "distributed": "world_size",
}
SFT_GROUPS = {
    "model": "model",
    "data": "dataset",
    "optimisation": "epochs",
    "evaluation": "eval_problems",
    "run": "run_name",
}

# Where a value came from (Config.origins): the command line, "preset NAME", or a settings file's path. A value no
# source gives is the default, or derived from the others; a derived one is written as a comment (to_toml).
FLAG = "given"
DERIVED = "derived"
# A derived value follows the settings it derives from: one that a preset, a file or the resumed run gave is set
# aside when a later source changes one of those, so that `--rule grpo` over ATR's preset clips with grpo's size,
# not ATR's. A rule's own defaults are the LossConfig fields that loss.Rule declares.
RULE_OWNED = tuple(f.name for f in dataclasses.fields(loss.Rule) if f.name in LOSS_FIELDS)
FOLLOWS = {**{name: ("rule",) for name in RULE_OWNED}, "delta_high": ("rule", "delta"), "norm_len": ("max_new_tokens",)}
# 0: chosen by the memory plan (engine/sizes.py)
PLANNED = ("rollout_batch", "kv_blocks", "grad_accum", "micro_batch_tokens", "eval_batch")


def parse_args(argv: list[str] | None = None, description: str | None = None) -> tuple[Config, set[str], bool]:
    """Every Config and LossConfig field is a flag. The settings come, each overriding the one before, from the
    defaults, the preset, the --config file and the flags given; what none of them gives is derived (resolve).

    Returns the config, the names of the fields given explicitly (by flag or file: they win over a resumed
    run's) and whether --plan was asked. --print-config prints the settings as TOML, each line saying where
    its value came from, and exits; --help-rules lists the rules.
    """
    parser = _parser("train.py", description, FIELDS, TRAIN_GROUPS)
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the GPU memory of each phase and exit (0: fits, 1: does not); loads no weights",
    )
    parser.add_argument("--help-rules", action=RulesHelp, help="list the clip rules, one line each, and exit")
    cfg, given, extra = _parse(parser, argv, PRESETS, CONFIGS, make_config)
    if cfg.resume is None:  # a resume checks them against the run's own settings (resumed_config)
        check_given(cfg, typed(cfg))  # the flags typed, not a settings file's every value
    if extra["print_config"]:
        print(to_toml(resumed_config(cfg, given) if cfg.resume else cfg), end="")
        parser.exit(0)
    return cfg, given, extra["plan"]


def parse_sft_args(argv: list[str] | None = None, description: str | None = None) -> tuple[SFTConfig, set[str]]:
    """sft.py's flags, one per SFTConfig field, read as train.py reads its own: a preset (configs/sft/NAME.toml),
    a --config file and the flags, each overriding the one before; --print-config. Returns the config and the
    names of the fields given explicitly."""
    parser = _parser("sft.py", description, SFT_FIELDS, SFT_GROUPS)
    cfg, given, extra = _parse(parser, argv, SFT_PRESETS, CONFIGS / "sft", make_sft_config)
    if extra["print_config"]:
        print(to_toml(resumed_config(cfg, given) if cfg.resume else cfg), end="")
        parser.exit(0)
    return cfg, given


def _parser(prog: str, description: str | None, fields: dict, groups: dict[str, str]) -> argparse.ArgumentParser:
    """The command line of a trainer: one flag per field in its group, --config and --print-config."""
    parser = OneLineErrors(
        prog=prog,
        usage=f"{prog} [-h] [--config FILE.toml] [--print-config] [--FLAG VALUE ...]",
        description=description,
        allow_abbrev=False,  # --step is not --steps
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--config",
        metavar="FILE.toml",
        help="settings from a TOML file (keys are the flags' names, such as lora_rank; a run's config.toml works "
        "as is); flags given override it",
    )
    parser.add_argument(
        "--print-config",
        action="store_true",
        help="print the settings as TOML, the file --config reads, each value marked as given, from the preset or "
        "file, default or derived, and exit",
    )
    sections = {first: parser.add_argument_group(title) for title, first in groups.items()}  # shown in this order
    group = parser
    for name, f in fields.items():
        group = sections.get(name, group)
        add_flag(group, f)
    return parser


def _parse(parser, argv, presets: dict, folder: Path, make) -> tuple[Config | SFTConfig, set[str], dict]:
    """The config of a command line, the names it gives (by file or flag), and its other arguments."""
    args = vars(parser.parse_args(argv))  # a field's flag is present only when given
    extra = {name: args.pop(name) for name in list(args) if name not in FIELDS and name not in SFT_FIELDS}
    file = extra.pop("config")
    from_file = read_toml(file, "--config", SFT_FIELDS if make is make_sft_config else FIELDS) if file else {}
    preset = args.get("preset", from_file.get("preset"))
    if preset is not None and preset not in presets:
        parser.error(f"--preset {preset!r} is unknown; known presets: {', '.join(presets)} (files in {folder})")
    cfg = resolve([(f"preset {preset}", presets.get(preset, {})), (file, from_file), (FLAG, args)], make)
    return cfg, {name for name, origin in cfg.origins.items() if origin in (file, FLAG)}, extra


def resolve(layers: list[tuple[str | None, dict]], make) -> Config | SFTConfig:
    """The config of layers of settings, each (where from, {name: value}) overriding the ones before it (a
    preset, a file, the flags); make builds it (make_config, make_sft_config), deriving what none gives.

    A value that follows others (FOLLOWS) and was given under other values of them is set aside, to be
    derived again; its origin says so. An invalid value is a ValueError naming where it came from: its flag,
    or the file (or preset) and key."""
    merged, origins, given_with = {}, {}, {}
    for source, values in layers:
        merged.update(values)
        origins.update(dict.fromkeys(values, source))
        for name in values.keys() & FOLLOWS.keys():
            given_with[name] = {parent: _same(merged.get(parent, FIELDS[parent].default)) for parent in FOLLOWS[name]}
    for name in FOLLOWS:  # in order: delta before delta_high, which follows it
        moved = [
            (parent, then)
            for parent, then in given_with.get(name, {}).items()
            if _same(merged.get(parent, FIELDS[parent].default)) != then
        ]
        if moved:
            parent, then = moved[0]
            origins[name] = f"{DERIVED}: {origins[name]} set {_toml_text(merged.pop(name))} for {_flag(parent)} {then}"
    try:
        cfg = make(merged)
    except ValueError as error:
        raise blamed(error, origins) from None
    return dataclasses.replace(cfg, origins=origins)


def _same(value) -> str:
    """A value as text, the same for every spelling of it (a GPPO cell as "kl-atomic" or a pair)."""
    return (
        "-".join(value) if isinstance(value, (tuple, list)) and all(isinstance(v, str) for v in value) else str(value)
    )


def blamed(error: ValueError, origins: dict[str, str]) -> ValueError:
    """An error about a flag ("--steps -1: ...") whose value came from a file or preset, naming that file and key
    instead ("mine.toml: steps -1: ..."): the user typed no such flag."""
    match = re.match(r"--([a-z0-9-]+)", str(error))
    source = match and origins.get(match[1].replace("-", "_"))
    if not source or source == FLAG or source.startswith(DERIVED):
        return error
    return ValueError(f"{source}: {match[1].replace('-', '_')}{str(error)[match.end() :]}")


def typed(cfg: Config | SFTConfig) -> set[str]:
    """The settings given as flags on the command line."""
    return {name for name, origin in cfg.origins.items() if origin == FLAG}


def is_derived(cfg: Config | SFTConfig, name: str) -> bool:
    """Whether a setting's value was derived from the others (no source gave it, and it is not the default)."""
    origin = cfg.origins.get(name)
    if (
        isinstance(cfg, SFTConfig)
        or name not in (*FOLLOWS, *PLANNED)
        or (origin is not None and not origin.startswith(DERIVED))
    ):
        return False
    return json.dumps(flat_config(cfg)[name]) != json.dumps(FIELDS[name].default)


def derivation(cfg: Config, name: str) -> str:
    """Why a derived setting has its value, for --print-config and the run's config.toml."""
    rule, shown = loss.get_rule(cfg.loss.rule), _same(cfg.loss.rule)
    if name in PLANNED:
        why = "chosen by the memory plan for this machine (engine/sizes.py); 0 asks for it again"
    elif name == "norm_len":
        why = f"from --max-new-tokens {cfg.max_new_tokens}"
    elif name == "delta":
        why = f"rule {shown}'s default"
    elif name == "delta_high":
        why = f"from --delta {cfg.loss.delta:g}" + (
            f" x rule {shown}'s ratio {rule.delta_high / rule.delta:g}" if rule.delta_high else ""
        )
    else:
        why = f"rule {shown}'s own" if getattr(rule, name) else f"the default of a rule without its own {name}"
    origin = cfg.origins.get(name, "")
    return f"{DERIVED}: {why}" + (f"; {origin.partition(': ')[2]}" if origin.startswith(DERIVED) else "")


class RulesHelp(argparse.Action):
    """--help-rules: every rule of loss.py's registry in one line: its interval at mu = 0.5, its default sizes
    and aggregation, the settings it reads."""

    def __init__(self, option_strings, dest, help=None):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        lines = [f"rules (--rule NAME; {len(loss.RULES)} in loss.py's registry):"]
        for name, rule in loss.RULES.items():
            cfg = loss.LossConfig(rule=name)
            region = "soft, no interval"
            if rule.bounds is not None:
                lo, hi = (float(bound) for bound in loss.ratio_bounds(name, None, 0.5))
                region = f"w in [{lo:.4g}, {hi:.4g}] at mu 0.5"
            sizes = f"delta {cfg.delta:.4g}" if cfg.delta is not None else "no size"
            if "delta_high" in rule.settings:
                sizes += f", delta_high {cfg.delta_high:.4g}"
            lines.append(f"  {name:<17} {region}; {sizes}; {cfg.aggregation}; reads {', '.join(rule.settings)}")
        print("\n".join(lines))  # on stdout, as --help
        parser.exit(0)


def add_flag(parser, f: dataclasses.Field) -> None:
    """The flag of a dataclass field, its help the field's; an unset flag stays out of the parsed namespace."""
    help_text = f"{f.metadata.get('help', '')} (default: {_default_text(f)})"
    flag = _flag(f.name)
    if _type_text(f) == "bool":
        parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS, help=help_text)
    elif _type_text(f) == "tuple[str, ...]":  # repeatable: --reward-fn a:f --reward-fn b:g
        parser.add_argument(flag, action="append", default=argparse.SUPPRESS, help=help_text)
    else:
        parser.add_argument(
            flag, type=_parser_of(f), choices=f.metadata.get("choices"), default=argparse.SUPPRESS, help=help_text
        )


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
    train_values = {
        name: tuple(value) if isinstance(value, list) else value
        for name, value in values.items()
        if name not in LOSS_FIELDS
    }
    unknown = train_values.keys() - TRAIN_FIELDS.keys()
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    cfg = Config(**train_values)
    validate(cfg, need_device=False)  # before LossConfig, whose norm_len follows max_new_tokens
    loss_values.setdefault("norm_len", cfg.max_new_tokens)
    return dataclasses.replace(cfg, loss=loss.LossConfig(**loss_values))


def flat_config(cfg: Config | SFTConfig) -> dict:
    """The settings as one flat dict, as the command line names them (the inverse of make_config)."""
    if isinstance(cfg, SFTConfig):
        return {name: getattr(cfg, name) for name in SFT_FIELDS}
    values = {name: getattr(cfg, name) for name in TRAIN_FIELDS}
    return {**values, **dataclasses.asdict(cfg.loss)}


def make_sft_config(values: dict) -> SFTConfig:
    """An SFTConfig from flat settings, checked as validate_sft checks it (without the device)."""
    unknown = values.keys() - SFT_FIELDS.keys()
    if unknown:
        raise ValueError(f"unknown settings: {', '.join(sorted(unknown))}")
    cfg = SFTConfig(**values)
    validate_sft(cfg, need_device=False)
    return cfg


def _type_text(f: dataclasses.Field) -> str:
    return f.type if isinstance(f.type, str) else f.type.__name__ if isinstance(f.type, type) else str(f.type)


def _default_text(f: dataclasses.Field) -> str:
    """A field's default as a user types it: a list comma-separated, a switch as its flag, nothing as empty."""
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if default is None or default == "":
        return "empty"
    if isinstance(default, bool):
        return _flag(f.name) if default else "--no-" + _flag(f.name)[2:]
    if isinstance(default, (tuple, list)):
        return ",".join(f"{v:g}" if isinstance(v, float) else str(v) for v in default)
    if isinstance(default, str) and " " in default:
        return json.dumps(default)  # quoted, as a shell takes it
    return f"{default:g}" if isinstance(default, float) else str(default)


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


# What a resumed run keeps: the flags that name the run, and those its adapters were built with (the
# checkpoint loads into no other shape or base).
NAMES_THE_RUN = ("preset", "run_name", "out_dir")
FIXED_ON_RESUME = ("model", "lora_rank", "lora_alpha", "lora_targets")


def resumed_config(cfg: Config | SFTConfig, given: set[str]) -> Config | SFTConfig:
    """The resumed run's settings, resolved again: its preset, what its config.toml records as given, then the
    settings given on this command line (e.g. more --steps); sft.py's runs too. What none of them gives is
    derived again, so `--rule dapo` clips with dapo's delta_high.

    Flags that would name another run, or that the run's adapters cannot follow, are refused when they
    differ from the run's own, as is a resume of a finished run that asks for no more steps. What the resumed
    run changes, derived values included, is recorded in the run by rundir.open_run."""
    run_dir = Path(cfg.resume)
    sft = isinstance(cfg, SFTConfig)
    fields, presets, make = (SFT_FIELDS, SFT_PRESETS, make_sft_config) if sft else (FIELDS, PRESETS, make_config)
    saved = saved_config(run_dir, fields.keys())
    current = json.loads(json.dumps(flat_config(cfg)))  # tuples as JSON lists, as the saved values are
    # the run's own config.toml given with --config names the run as it is: only a change is refused
    refused = [name for name in NAMES_THE_RUN if name in given and current[name] != saved.get(name)] + [
        name for name in FIXED_ON_RESUME if name in given and current[name] != saved.get(name, current[name])
    ]
    if refused:
        flags = ", ".join(_flag(name) for name in refused)
        raise ValueError(f"--resume {run_dir} continues that run with its own settings; {flags} cannot change them")
    if not sft and "steps" in given and cfg.steps == 0 and not cfg.export:
        raise ValueError(
            f"--resume {run_dir} --steps 0 trains and evaluates nothing; add --export DIR to export "
            "the run's last checkpoint"
        )
    record = run_dir / "config.toml"  # what the run was given, its derived values as comments
    base = read_toml(record, "--resume", fields) if record.is_file() else saved
    flat = flat_config(cfg)
    from_file = {name: flat[name] for name in given if cfg.origins.get(name) != FLAG}  # a --config file's
    layers = [
        (f"preset {base.get('preset')}", presets.get(base.get("preset"), {})),
        (str(record), {name: value for name, value in base.items() if name not in NOT_WRITTEN}),
        (next((cfg.origins[name] for name in from_file), None), from_file),
        (FLAG, {name: flat[name] for name in given if cfg.origins.get(name) == FLAG}),
        (f"--resume {run_dir}", {"run_name": run_dir.name, "out_dir": str(run_dir.parent), "resume": str(run_dir)}),
    ]
    try:
        resumed = resolve(layers, make)
    except ValueError as error:
        raise ValueError(f"--resume {run_dir}: {error}") from None
    if not sft:  # the new flags among those that do nothing with the run's rule
        check_given(resumed, {name for name in typed(cfg) if current[name] != saved.get(name, current[name])})
    return resumed


def check_finished(cfg: Config | SFTConfig) -> None:
    """A resume of a finished run must ask for more steps (train.py) or epochs or steps (sft.py): else it
    would only print the old summary again. (--plan and --print-config of a finished run are not refused.)"""
    run_dir = Path(cfg.resume)
    summary = run_dir / "summary.json"
    if not summary.is_file():
        return
    saved = saved_config(run_dir, (SFT_FIELDS if isinstance(cfg, SFTConfig) else FIELDS).keys())
    if isinstance(cfg, SFTConfig):
        if cfg.epochs == saved.get("epochs") and cfg.max_steps == saved.get("max_steps"):
            raise ValueError(
                f"--resume {run_dir}: the run is finished; give more --epochs or --max-steps to train it further"
            )
        return
    finished = json.loads(summary.read_text()).get("step", _latest_step(run_dir))
    if finished is not None and cfg.steps <= finished and not (cfg.steps == 0 and cfg.export):
        raise ValueError(
            f"--resume {run_dir}: the run finished its {finished} steps; give --steps N with N above {finished} "
            "to train it further (or --steps 0 --export DIR to export it)"
        )


def _latest_step(run_dir: Path) -> int | None:
    """The step of the checkpoint a run's `latest` names (checkpoint-000020: 20)."""
    latest = run_dir / "latest"
    name = latest.read_text().strip() if latest.is_file() else ""
    return int(name.rpartition("-")[2]) if name.rpartition("-")[2].isdigit() else None


def saved_config(run_dir: Path, known=None) -> dict:
    """A run's config.json, checked: valid JSON holding only known settings (the file is named if not);
    known: the settings of its command (train.py's by default, sft.py's for an SFT run)."""
    saved_file = run_dir / "config.json"
    if not saved_file.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: not a run directory (no config.json)")
    try:
        saved = json.loads(saved_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{saved_file}: not valid JSON ({error}); it holds the run's settings: restore it") from None
    if not isinstance(saved, dict):
        raise ValueError(f"{saved_file}: expected a JSON object of settings, got {type(saved).__name__}")
    unknown = sorted(saved.keys() - (known or FIELDS.keys()))
    if unknown:
        raise ValueError(f"{saved_file}: unknown settings {', '.join(unknown)}")
    return saved


def changed_settings(saved: dict, cfg: Config | SFTConfig) -> dict[str, list]:
    """{name: [saved value, new value]} for every setting of cfg that differs from the saved run's, derived
    ones included (a new rule's delta_high, the sizes the plan chose for another machine)."""
    current = json.loads(json.dumps(flat_config(cfg)))
    return {
        name: [saved.get(name), value]
        for name, value in current.items()
        if name != "resume" and saved.get(name) != value
    }


# ----------------------------------------------------------------------------- settings files

NOT_WRITTEN = ("resume",)  # what to do, not how: a written config.toml starts a run, it does not continue one


def read_toml(path: str | Path, source: str = "--config", fields: dict = FIELDS) -> dict:
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
        if name not in fields:
            close = difflib.get_close_matches(name, fields, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else "; the keys are the flags' names (train.py --help)"
            raise ValueError(f"{path}: {key!r} is not a setting{hint}")
        values[name] = _toml_value(fields[name], value, f"{path}: {key}")
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
    words = {"str": "a string", "int": "an integer", "float": "a number", "bool": "true or false", "None": '"" (empty)'}
    return " or ".join(words.get(kind, "a list" if kind.startswith("tuple") else kind) for kind in kinds)


def to_toml(cfg: Config | SFTConfig) -> str:
    """The settings as the TOML file read_toml reads back into the same config (resume left out). Each line
    says where its value came from (Config.origins): given, the preset or file, or the default; a derived
    value is a comment saying why, so that the file given with other flags derives it again from them."""
    sft = isinstance(cfg, SFTConfig)
    program = "sft.py" if sft else "train.py"
    lines = [
        f"# {program} settings: `python {program} --config THIS_FILE` runs them (flags given with it override).",
        '# Keys are the flags\' names; "" is an empty setting, as on the command line. A derived value is a comment:',
        "# given with other flags, this file derives it again from them.",
        "",
    ]
    values = flat_config(cfg)
    for name in SFT_FIELDS if sft else FIELDS:
        if name == next(iter(LOSS_FIELDS)):
            lines += ["", "# the loss (loss.LossConfig)"]
        if name in NOT_WRITTEN:
            continue
        value = "-".join(values[name]) if name == "rule" and isinstance(values[name], tuple) else values[name]
        line = f"{name} = {_toml_text(value)}"
        if not cfg.origins:  # a config built in code: every value as it is
            lines.append(line)
        elif is_derived(cfg, name):
            lines.append(f"# {line}  ({derivation(cfg, name)})")
        else:
            lines.append(f"{line}  # {cfg.origins.get(name, 'default')}")
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


def load_presets(folder: Path = CONFIGS, fields: dict = FIELDS) -> dict[str, dict]:
    """Every folder/NAME.toml as preset NAME."""
    return {path.stem: read_toml(path, "preset", fields) for path in sorted(folder.glob("*.toml"))}


PRESETS = load_presets()
SFT_PRESETS = load_presets(CONFIGS / "sft", SFT_FIELDS)
