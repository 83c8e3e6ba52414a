"""GRPO training: model, LoRA, rollout, reward and loss wired into one loop.

    python train.py                                  # the offline demo: SmolLM2-135M learns arithmetic
    python train.py --preset atr-grpo-qwen3-1.7b     # a paper setup (needs the model and data/prepare.py)
    python train.py --resume runs/NAME               # continue a run from its last checkpoint

Each step: sample prompts -> G completions per prompt (rollout.py) -> rewards (reward.py) ->
group-normalized advantages -> one or more optimizer steps over mini-batches, each accumulated
over micro-batches (loss.py) -> one JSON line in runs/NAME/metrics.jsonl -> periodic eval and
checkpoint. Only the LoRA adapters train; the frozen base doubles as the reference policy.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import shutil
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

import eval as evaluation
import lora
import loss
import reward
import rollout
import weights
from data import load_problems, render_prompt


def opt(default, help: str):
    return field(default=default, metadata={"help": help})


@dataclass
class Config:
    # model
    model: str | None = opt(None, "HF directory or hub id; empty = the offline SmolLM2-135M-Instruct")
    device: str = opt("auto", "cpu, cuda, cuda:N or auto (cuda when present)")
    dtype: str = opt("auto", "float32, bfloat16 or auto (bfloat16 on cuda, float32 on cpu)")
    gradient_checkpointing: str = opt("auto", "on, off or auto (on for cuda)")
    lora_rank: int = opt(16, "LoRA rank r")
    lora_alpha: float = opt(32.0, "LoRA alpha (scale alpha/r)")
    lora_dropout: float = opt(0.0, "dropout on the LoRA input")
    lora_targets: str = opt("q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
                            "comma-separated module names that get adapters")
    # data
    dataset: str = opt("arithmetic", "training set: a name from data/ or a jsonl path")
    eval_dataset: str = opt("arithmetic_test", "held-out set: a name from data/ or a jsonl path")
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
    # loss
    rule: str = opt("grpo", "clip rule from loss.py (grpo, dapo, atr, ...; see loss.py's table)")
    delta: float | None = opt(None, "trust-region size; empty = the rule's default")
    dual_clip: str | None = opt(None, "dual clip: c (tokens with A < 0 and ratio > c lose their gradient) "
                                      "or lo,hi (also A > 0 and ratio < lo); empty = off")
    aggregation: str = opt("token-mean", "token-mean, seq-mean-token-mean or seq-mean-token-sum-norm")
    adv_std: str = opt("group", "advantage scale: group, batch or none (Dr. GRPO)")
    kl_beta: float = opt(0.0, "weight of the KL penalty to the frozen base")
    kl_estimator: str = opt("k3", "k1, k2 or k3")
    format_weight: float = opt(0.0, "reward for an answer in the template's format, added to correctness")
    # optimization
    steps: int = opt(20, "training steps (rollout batches)")
    lr: float = opt(3e-4, "AdamW learning rate")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    grad_clip: float = opt(1.0, "max gradient norm")
    updates_per_rollout: int = opt(1, "optimizer steps (mini-batches) per rollout batch")
    grad_accum: int = opt(1, "micro-batches per optimizer step")
    recompute_old_logp: bool = opt(False, "recompute old log-probs with a full forward before updating "
                                          "(the rollout's are exact in float32; bf16 kernels may differ)")
    # evaluation
    eval_every: int = opt(0, "evaluate every N steps (0 = only before and after training)")
    eval_problems: int = opt(0, "held-out problems used (0 = all)")
    eval_k: int = opt(8, "samples per held-out problem")
    eval_temperature: float = opt(1.0, "sampling temperature at evaluation")
    # run
    run_name: str | None = opt(None, "folder under out_dir; empty = a timestamp")
    out_dir: str = opt("runs", "where runs are written")
    seed: int = opt(0, "seed for data order, sampling and adapters")
    checkpoint_every: int = opt(10, "checkpoint every N steps (and at the end and on Ctrl-C)")
    resume: str | None = opt(None, "run directory to continue from its last checkpoint")
    export: str | None = opt(None, "after training, write merged HF weights to this directory")
    preset: str | None = opt(None, "a named setup from PRESETS; explicit flags override it")


PRESETS = {
    "atr-grpo-qwen3-1.7b": dict(
        model="Qwen/Qwen3-1.7B", dataset="dapo", eval_dataset="aime24", template="answer",
        lora_rank=32, lora_alpha=64.0, lr=5e-6, prompts_per_step=8, group_size=8, grad_accum=4,
        rule="atr", delta=0.07, max_new_tokens=4096, steps=500, eval_every=50, eval_k=8,
        eval_problems=0, eval_temperature=0.6),
    "gppo-qwen3-8b": dict(
        model="Qwen/Qwen3-8B", dataset="dapo", eval_dataset="aime24", template="answer",
        lora_rank=32, lora_alpha=64.0, lr=1e-6, prompts_per_step=64, group_size=8,
        updates_per_rollout=8, rule="kl-atomic", delta=0.223, dual_clip="0.5,10", kl_beta=0.0,
        max_new_tokens=8192, steps=500, eval_every=50, eval_k=8, eval_problems=0, eval_temperature=0.6),
}

FORMATTED_TEMPLATES = ("boxed", "answer")  # templates whose prompt asks for an answer format of that name


# ----------------------------------------------------------------------------- command line


def parse_args(argv: list[str] | None = None) -> tuple[Config, set[str]]:
    """Every Config field is a flag; a preset fills defaults that explicit flags still override.

    Returns the config and the names of the fields given explicitly (they win over a resumed run's).
    """
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(Config):
        flag = "--" + f.name.replace("_", "-")
        if f.type == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=argparse.SUPPRESS,
                                help=f"{f.metadata['help']} (default: {f.default})")
        else:
            parser.add_argument(flag, type=_parse_type(f.type), default=argparse.SUPPRESS,
                                help=f"{f.metadata['help']} (default: {f.default})")
    given = vars(parser.parse_args(argv))  # only the flags on the command line
    preset = given.get("preset")
    if preset is not None and preset not in PRESETS:
        parser.error(f"--preset {preset!r} is unknown; known presets: {', '.join(PRESETS)}")
    return Config(**{**PRESETS.get(preset, {}), **given}), set(given)


def _parse_type(type_name: str):
    """int, float or str; for an optional field an empty string means None."""
    base = {"int": int, "float": float, "str": str}[type_name.split("|")[0].strip()]
    return (lambda text: None if text == "" else base(text)) if "None" in type_name else base


# ----------------------------------------------------------------------------- checkpoints


def save_checkpoint(run_dir: Path, model, optimizer, state: dict) -> Path:
    """Write checkpoint-STEP under a temporary name, rename it into place, then repoint `latest`.

    Each rename is atomic, so a crash at any moment leaves `latest` naming a complete checkpoint.
    """
    name = f"checkpoint-{state['step']:06d}"
    tmp, final = run_dir / f".{name}.tmp", run_dir / name
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    lora.save(model, tmp / "adapter")
    torch.save({"optimizer": optimizer.state_dict(), "state": state, "rng": _rng_state()}, tmp / "trainer.pt")
    shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    pointer = run_dir / ".latest.tmp"
    pointer.write_text(name)
    os.replace(pointer, run_dir / "latest")
    for old in run_dir.glob("checkpoint-*"):
        if old.name != name:
            shutil.rmtree(old, ignore_errors=True)
    return final


def load_checkpoint(run_dir: Path, model, optimizer) -> dict:
    latest = run_dir / "latest"
    if not latest.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: no checkpoint found (missing {latest})")
    ckpt_dir = run_dir / latest.read_text().strip()
    lora.load(model, ckpt_dir / "adapter")
    saved = torch.load(ckpt_dir / "trainer.pt", weights_only=False)
    optimizer.load_state_dict(saved["optimizer"])
    _set_rng_state(saved["rng"])
    return saved["state"]


def _rng_state() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def _set_rng_state(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines logged after the checkpoint we resume from; they will be produced again.

    A process killed mid-write can leave a partial last line; it is dropped too. A bad line
    anywhere else means the file is not ours to rewrite, so it is an error.
    """
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break
            raise ValueError(f"{path}:{number}: not a JSON line; fix or remove it before resuming") from None
        if record["step"] <= last_step:
            kept.append(line)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(line + "\n" for line in kept))
    os.replace(tmp, path)


# ----------------------------------------------------------------------------- one step


def sample(model, tokenizer, problems: list[dict], cfg: Config, stops: list[int], step: int) -> rollout.Rollout:
    """G completions for each problem, with the sampling policy's log-probs."""
    prompts = [render_prompt(tokenizer, p["problem"], cfg.template, cfg.system_prompt) for p in problems]
    model.eval()  # no LoRA dropout while sampling: the old log-probs must be the sampling policy's
    return rollout.generate(model, prompts, samples_per_prompt=cfg.group_size, max_new_tokens=cfg.max_new_tokens,
                            temperature=cfg.temperature, top_p=cfg.top_p, top_k=cfg.top_k, stop_ids=stops,
                            seed=cfg.seed * 1_000_003 + step, tokenizer=tokenizer)


def score(out: rollout.Rollout, problems: list[dict], cfg: Config) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [N], correct [N]): correctness, plus the optional format term of the template's format."""
    references = [p["answer"] for p in problems for _ in range(cfg.group_size)]
    correct = torch.tensor(reward.reward(out.texts, references))
    if not cfg.format_weight:
        return correct, correct
    formatted = torch.tensor([float(reward.has_format(t, cfg.template)) for t in out.texts])
    return correct + cfg.format_weight * formatted, correct


def policy_update(model, optimizer, out, advantages: torch.Tensor, cfg: Config, loss_cfg: loss.LossConfig,
                  step: int) -> dict:
    """updates_per_rollout optimizer steps over mini-batches, each summed over grad_accum micro-batches."""
    frozen = _frozen_passes(model, out, cfg, loss_cfg)  # leaves the model in train mode
    params = [p for p in model.parameters() if p.requires_grad]
    old_logp, mask = out.old_logp, out.completion_mask
    P = out.prompt_len
    if cfg.recompute_old_logp:
        old_logp = frozen["old_logp"]
    order = torch.randperm(len(mask), generator=torch.Generator().manual_seed(cfg.seed + step))
    records, skipped, grad_norms = [], 0, []
    for minibatch in order.chunk(cfg.updates_per_rollout):
        num_tokens, num_seqs = int(mask[minibatch].sum()), len(minibatch)
        losses = []
        for rows in minibatch.chunk(cfg.grad_accum):
            ids, pad, lo, hi = _trim(out.input_ids[rows], out.pad_mask[rows])
            C = hi - P  # completion columns this micro-batch uses
            h = model.hidden(ids, pad)
            logp, entropy = model.hidden_logprobs(h, ids, start=P - lo, temperature=cfg.temperature,
                                                  with_entropy=True)  # [rows, hi - P]
            extra = {}
            if "ref_logp" in frozen:
                extra["ref_logp"] = frozen["ref_logp"][rows, :C]
            if "old_hidden" in frozen:  # the region test needs no gradient through the KL
                with torch.no_grad():  # the states at positions P-1 .. hi-2 predict the completion tokens
                    extra["vocab_kl"] = loss.full_vocab_kl(frozen["old_hidden"][rows, :C],
                                                           h[:, P - 1 - lo:hi - 1 - lo], model.lm_head.weight,
                                                           temperature=cfg.temperature)
            value, metrics = loss.policy_loss(logp, old_logp[rows, :C], advantages[rows], mask[rows, :C],
                                              loss_cfg, num_tokens=num_tokens, num_seqs=num_seqs, **extra)
            value.backward()
            losses.append(value.detach())
            m = mask[rows, :C]
            metrics["entropy"] = float((entropy.detach() * m).sum() / m.sum().clamp(min=1))
            records.append((metrics, int(m.sum())))
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        total = torch.stack(losses).sum()
        if torch.isfinite(total) and torch.isfinite(grad_norm):
            optimizer.step()
            grad_norms.append(float(grad_norm))
        else:
            skipped += 1
            warnings.warn(f"step {step}: non-finite loss ({float(total)}) or gradient norm ({float(grad_norm)}); "
                          "update skipped")
        optimizer.zero_grad(set_to_none=True)
    summary = _mean_of(records)
    # None, not NaN, when every update was skipped: the metrics file stays strict JSON
    summary.update(grad_norm=float(np.mean(grad_norms)) if grad_norms else None, skipped_updates=skipped)
    return summary


def _frozen_passes(model, out, cfg: Config, loss_cfg: loss.LossConfig) -> dict:
    """Forward passes without gradient that some settings need before the policy moves.

    They run in eval mode (no LoRA dropout: the sampling policy is deterministic) and in micro-batches
    of the training size. old_hidden keeps the states that predict completion tokens, [N, C, hidden].
    """
    P = out.prompt_len
    wanted = {
        "old_logp": cfg.recompute_old_logp,
        "ref_logp": loss_cfg.kl_beta > 0,
        "old_hidden": loss_cfg.rule == "kl_full",  # the exact KL needs the sampling policy's distribution
    }
    parts = {name: [] for name, on in wanted.items() if on}
    model.eval()
    with torch.no_grad():
        for rows in torch.arange(len(out.input_ids)).chunk(cfg.updates_per_rollout * cfg.grad_accum):
            ids, pad = out.input_ids[rows], out.pad_mask[rows]
            if wanted["old_logp"]:
                parts["old_logp"].append(model.token_logprobs(ids, pad, temperature=cfg.temperature)[0][:, P:])
            if wanted["ref_logp"]:
                with lora.disabled(model):  # the frozen base is the reference policy
                    parts["ref_logp"].append(model.token_logprobs(ids, pad, temperature=cfg.temperature)[0][:, P:])
            if wanted["old_hidden"]:
                parts["old_hidden"].append(model.hidden(ids, pad)[:, P - 1:-1])
    model.train()
    return {name: torch.cat(chunks) for name, chunks in parts.items()}


def _trim(input_ids: torch.Tensor, pad_mask: torch.Tensor):
    """Drop the columns that are padding in every row: (ids, pad_mask, lo, hi) with the kept window [lo, hi)."""
    used = pad_mask.any(0).nonzero()
    lo, hi = int(used[0]), int(used[-1]) + 1
    return input_ids[:, lo:hi], pad_mask[:, lo:hi], lo, hi


def _mean_of(records: list[tuple[dict, int]]) -> dict:
    """One step's metrics from its micro-batches': extremes for ratio_min/max, else token-weighted means."""
    metrics, tokens = [r for r, _ in records], [n for _, n in records]
    reduced = {key: float(np.average([m[key] for m in metrics], weights=tokens)) for key in metrics[0]}
    reduced.update(ratio_min=min(m["ratio_min"] for m in metrics), ratio_max=max(m["ratio_max"] for m in metrics))
    return reduced


# ----------------------------------------------------------------------------- the run


def batch_of(problems: list[dict], position: int, size: int, seed: int) -> list[dict]:
    """Problems position .. position+size of an endless stream: a fresh seeded shuffle each epoch.

    The order is a function of (seed, epoch) alone, so a resumed run needs only the position.
    """
    orders, batch = {}, []
    for index in range(position, position + size):
        epoch, offset = divmod(index, len(problems))
        if epoch not in orders:
            orders[epoch] = torch.randperm(len(problems), generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        batch.append(problems[int(orders[epoch][offset])])
    return batch


def loss_config(cfg: Config) -> loss.LossConfig:
    # Dr. GRPO's constant length is the generation cap: the same for every micro-batch, however
    # much padding each one trims, so accumulated micro-batches add up to one batch's gradient.
    return loss.LossConfig(rule=cfg.rule, delta=cfg.delta, dual_clip=_dual_clip(cfg.dual_clip),
                           aggregation=cfg.aggregation, norm_len=cfg.max_new_tokens, kl_beta=cfg.kl_beta,
                           kl_estimator=cfg.kl_estimator)


def _dual_clip(text: str | None) -> float | tuple[float, float] | None:
    """--dual-clip "3" -> 3.0, "0.5,10" -> (0.5, 10.0); loss.LossConfig checks the values."""
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise ValueError(f"--dual-clip {text!r}: expected a number c or two numbers lo,hi") from None
    return values[0] if len(values) == 1 else values


def evaluate_held_out(model, tokenizer, problems, cfg: Config, desc: str) -> dict:
    result = evaluation.evaluate(model, tokenizer, problems, k=cfg.eval_k, temperature=cfg.eval_temperature,
                                 top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens, template=cfg.template,
                                 system=cfg.system_prompt, batch_size=16, seed=cfg.seed, desc=desc)
    mean = result.summary["mean@k"]
    return {"accuracy": mean.mean, "se": mean.se, "pass@k": result.summary["pass@k"].mean,
            "problems": len(problems), "k": cfg.eval_k}


def resolve_device(cfg: Config) -> tuple[torch.device, torch.dtype]:
    device = torch.device("cuda" if cfg.device == "auto" and torch.cuda.is_available() else
                          "cpu" if cfg.device == "auto" else cfg.device)
    if cfg.dtype == "auto":
        return device, torch.bfloat16 if device.type == "cuda" else torch.float32
    dtypes = {"float32": torch.float32, "bfloat16": torch.bfloat16}
    if cfg.dtype not in dtypes:
        raise ValueError(f"--dtype {cfg.dtype!r}: expected one of {', '.join(dtypes)} or auto")
    return device, dtypes[cfg.dtype]


def build(cfg: Config):
    """Model with fresh LoRA adapters, tokenizer and optimizer."""
    device, dtype = resolve_device(cfg)
    model = weights.from_pretrained(cfg.model, dtype=dtype, device=device)
    tokenizer = weights.load_tokenizer(cfg.model)
    model.requires_grad_(False)
    torch.manual_seed(cfg.seed)  # adapter initialization
    lora.inject(model, cfg.lora_rank, cfg.lora_alpha, targets=tuple(cfg.lora_targets.split(",")),
                dropout=cfg.lora_dropout)
    model.gradient_checkpointing = cfg.gradient_checkpointing == "on" or (
        cfg.gradient_checkpointing == "auto" and device.type == "cuda")
    optimizer = torch.optim.AdamW(lora.parameters(model), lr=cfg.lr, weight_decay=cfg.weight_decay)
    return model, tokenizer, optimizer


class StopRequest:
    """While active, the first Ctrl-C (or SIGTERM) asks the loop to stop after the current step and
    checkpoint; a second one interrupts at once, and the last checkpoint stays as it was."""

    def __enter__(self):
        self.requested = False
        self.previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}
        return self

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum, frame):
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (press Ctrl-C again to abort without saving)", file=sys.stderr)


def validate(cfg: Config) -> None:
    """Settings that would fail only after the model loads fail here, naming the flag."""
    for ok, message in (
        (cfg.group_size >= 2, f"--group-size {cfg.group_size}: GRPO compares at least 2 samples per prompt"),
        (cfg.prompts_per_step >= 1, f"--prompts-per-step {cfg.prompts_per_step}: must be >= 1"),
        (cfg.updates_per_rollout >= 1, f"--updates-per-rollout {cfg.updates_per_rollout}: must be >= 1"),
        (cfg.grad_accum >= 1, f"--grad-accum {cfg.grad_accum}: must be >= 1"),
        (cfg.checkpoint_every >= 1, f"--checkpoint-every {cfg.checkpoint_every}: must be >= 1"),
        (cfg.temperature > 0, f"--temperature {cfg.temperature}: training needs sampling (> 0); greedy "
                              "samples of a prompt are identical and carry no signal"),
        (cfg.steps >= 0 and cfg.eval_every >= 0 and cfg.eval_problems >= 0 and cfg.eval_k >= 1,
         "--steps, --eval-every and --eval-problems must be >= 0 and --eval-k >= 1"),
        (not cfg.format_weight or cfg.template in FORMATTED_TEMPLATES,
         f"--format-weight needs a template that asks for a format ({', '.join(FORMATTED_TEMPLATES)}), "
         f"not {cfg.template!r}"),
    ):
        if not ok:
            raise ValueError(message)


def train(cfg: Config) -> dict:
    """Run (or resume) training; returns the final state with the before/after evaluations."""
    validate(cfg)
    loss_cfg = loss_config(cfg)  # first, so a bad rule or option fails before the model loads
    train_set = load_problems(cfg.dataset)
    eval_set = load_problems(cfg.eval_dataset)
    eval_set = eval_set[:cfg.eval_problems] if cfg.eval_problems else eval_set
    run_dir = Path(cfg.out_dir) / (cfg.run_name or time.strftime("%Y%m%d-%H%M%S"))
    if not cfg.resume and (run_dir / "latest").exists():
        raise FileExistsError(f"{run_dir} already holds a run: continue it with --resume {run_dir}, "
                              "or pick another --run-name")
    run_dir.mkdir(parents=True, exist_ok=True)
    random.seed(cfg.seed)
    np.random.seed(cfg.seed)
    model, tokenizer, optimizer = build(cfg)
    stops = evaluation.stop_ids(model, tokenizer)
    metrics_file = run_dir / "metrics.jsonl"
    if cfg.resume:
        state = load_checkpoint(run_dir, model, optimizer)
        truncate_metrics(metrics_file, state["step"])
        print(f"resumed {run_dir} at step {state['step']}")
    else:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2))
        metrics_file.unlink(missing_ok=True)
        state = {"step": 0, "data_position": 0, "before": None, "best": None}
    if state["before"] is None:
        state["before"] = evaluate_held_out(model, tokenizer, eval_set, cfg, "eval before")
    with StopRequest() as stop:
        bar = tqdm(range(state["step"], cfg.steps), desc="train", unit="step", initial=state["step"],
                   total=cfg.steps)
        for _ in bar:
            record = train_step(model, optimizer, tokenizer, train_set, cfg, loss_cfg, stops, state)
            if cfg.eval_every and state["step"] % cfg.eval_every == 0 and state["step"] < cfg.steps:
                record["eval"] = evaluate_held_out(model, tokenizer, eval_set, cfg, f"eval step {state['step']}")
                _keep_best(run_dir, model, state, record["eval"])
            with metrics_file.open("a") as f:
                f.write(json.dumps(record) + "\n")
            bar.set_postfix(reward=f"{record['reward']:.2f}", acc=f"{record['accuracy']:.2f}")
            if state["step"] % cfg.checkpoint_every == 0 or stop.requested:
                save_checkpoint(run_dir, model, optimizer, state)
            if stop.requested:
                print(f"stopped at step {state['step']}; continue with --resume {run_dir}")
                return state
    state["after"] = evaluate_held_out(model, tokenizer, eval_set, cfg, "eval after")
    _keep_best(run_dir, model, state, state["after"])
    save_checkpoint(run_dir, model, optimizer, state)
    if cfg.export:
        weights.save_pretrained(model, cfg.export, tokenizer=tokenizer)
    (run_dir / "summary.json").write_text(json.dumps({k: state[k] for k in ("before", "after", "best")}, indent=2))
    return state


def train_step(model, optimizer, tokenizer, train_set, cfg: Config, loss_cfg, stops, state: dict) -> dict:
    """One GRPO step; advances state (step, data position) and returns the step's metrics line."""
    step = state["step"] + 1
    start = time.perf_counter()
    problems = batch_of(train_set, state["data_position"], cfg.prompts_per_step, cfg.seed)
    out = sample(model, tokenizer, problems, cfg, stops, step)
    sampled = time.perf_counter()
    rewards, correct = score(out, problems, cfg)
    scored = time.perf_counter()
    advantages = loss.group_advantages(rewards, cfg.group_size, std=cfg.adv_std).float()
    trained = time.perf_counter()
    update = policy_update(model, optimizer, out, advantages, cfg, loss_cfg, step)
    done = time.perf_counter()
    state.update(step=step, data_position=state["data_position"] + cfg.prompts_per_step)
    lengths = out.completion_mask.sum(1).float()
    trained_tokens = int(out.pad_mask.sum())
    return {"step": step, "reward": float(rewards.mean()), "accuracy": float(correct.mean()),
            "completion_length": float(lengths.mean()), "truncated": float(out.truncated.float().mean()),
            **update, "step_seconds": done - start,
            "rollout_tokens_per_s": float(lengths.sum()) / (sampled - start),
            "reward_seconds": scored - sampled,
            "train_tokens_per_s": trained_tokens / (done - trained)}  # each row trains once per step


def _keep_best(run_dir: Path, model, state: dict, result: dict) -> None:
    """Keep the adapter with the best held-out accuracy in run_dir/best (the papers report best and last)."""
    if state["best"] is not None and result["accuracy"] <= state["best"]["accuracy"]:
        return
    state["best"] = {**result, "step": state["step"]}
    tmp = run_dir / ".best.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    lora.save(model, tmp)
    shutil.rmtree(run_dir / "best", ignore_errors=True)
    os.replace(tmp, run_dir / "best")


def main(argv: list[str] | None = None) -> None:
    cfg, given = parse_args(argv)
    if cfg.resume:
        cfg = _resumed_config(cfg, given)
    state = train(cfg)
    if "after" in state:
        before, after = state["before"], state["after"]
        best = state["best"]
        print(f"best held-out accuracy {100 * best['accuracy']:.1f}% at step {best['step']}")
        print(f"held-out accuracy: before {100 * before['accuracy']:.1f}% -> after {100 * after['accuracy']:.1f}% "
              f"(n={after['problems']}, k={after['k']}, se {100 * after['se']:.1f})")


def _resumed_config(cfg: Config, given: set[str]) -> Config:
    """The saved run's config, with the flags given on this command line on top (e.g. more --steps)."""
    run_dir = Path(cfg.resume)
    saved_file = run_dir / "config.json"
    if not saved_file.is_file():
        raise FileNotFoundError(f"--resume {run_dir}: not a run directory (no config.json)")
    saved = json.loads(saved_file.read_text())
    merged = {**saved, **{name: getattr(cfg, name) for name in given}}
    merged.update(run_name=run_dir.name, out_dir=str(run_dir.parent), resume=str(run_dir))
    return Config(**merged)


if __name__ == "__main__":
    main()
