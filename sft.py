"""The supervised stage before GRPO: LoRA fine-tuning on worked solutions, as ATR-GRPO runs it first.

    python sft.py --template answer                    # the offline demo: SmolLM2 learns the "answer" format
    python sft.py --preset atr-sft-qwen3-1.7b          # ATR-GRPO's stage on OpenMathReasoning (data/prepare.py)
    python train.py --init-adapter runs/NAME/adapter   # then GRPO from the adapter, with the same prompt flags
    python sft.py --resume runs/NAME                   # continue a run from its last checkpoint

Each example is a problem posed exactly as train.py poses it (data.render_prompt: the template, the
system prompt, the thinking switch) followed by its worked solution, ending in the answer format that
template asks for (data.render_solution), then the end-of-turn token. The loss is the mean
cross-entropy over those reply tokens; prompt tokens carry none. The model, LoRA, weights and the
run directory are train.py's (model.py, lora.py, infra/weights.py, infra/rundir.py): checkpoints are atomic,
metrics.jsonl has a line per optimizer step, config.toml records the settings as `--config` reads them,
Ctrl-C checkpoints and writes the adapter so far (exit status 130), --resume continues exactly and
records what it changes.

Batches are cut by length: examples are sorted by tokens and a micro-batch takes as many as fit in
--batch-tokens padded tokens (rows x the longest), so short examples are not padded to long ones.
The order of the batches is shuffled afresh each epoch, from the seed and the epoch alone. Prompts
are left-padded and replies right-padded, the layout of a GRPO rollout, so the reply log-probs come
from the same model.hidden_logprobs call that training uses.

Before and after, the held-out problems are sampled and two numbers reported: accuracy (Mean@k) and
format compliance, the share of samples that state their answer where the reward looks for it (an
"Answer:" line for the answer template, a \\boxed{} for boxed, any gradable answer otherwise).
"""

from __future__ import annotations

import math
import os
import shutil
import sys
import time
import warnings
from pathlib import Path

import torch
from tqdm import tqdm

import config
import eval as evaluation
import lora
import reward
from config import SFTConfig
from data import load_problems, opens_thought, render_prompt, render_solution, thinking_note
from infra import errors, rundir, stopping, training, weights

# ----------------------------------------------------------------------------- examples and batches

Example = tuple[list[int], list[int]]  # (prompt ids, reply ids)
Batch = tuple[torch.Tensor, torch.Tensor, int, torch.Tensor]  # ids [B, P + C], pad mask, P, reply mask [B, C]


def tokenize(problems: list[dict], tokenizer, cfg: SFTConfig) -> tuple[list[Example], int]:
    """(prompt ids, reply ids) per problem, the reply ending with the end-of-turn token; and how many were
    left out for being longer than max_length. A problem without a "solution" is a ValueError naming it."""
    end_of_turn = tokenizer.eos_token_id
    if end_of_turn is None:
        raise ValueError("the tokenizer names no EOS token: the reply's end cannot be trained")
    examples, too_long = [], 0
    for index, problem in enumerate(problems):
        if not isinstance(problem.get("solution"), str) or not problem["solution"].strip():
            raise ValueError(
                f'--dataset {cfg.dataset}: problem {index} has no "solution" to train on (prepare a '
                "set with solutions: python data/prepare.py openmath, gsm8k_sft or math_sft)"
            )
        prompt = render_prompt(tokenizer, problem["problem"], cfg.template, cfg.system_prompt, cfg.thinking == "on")
        text = render_solution(problem["solution"], problem["answer"], cfg.template, cfg.thinking == "on")
        reply = tokenizer.encode(text, add_special_tokens=False) + [end_of_turn]
        if len(prompt) + len(reply) > cfg.max_length:
            too_long += 1
            continue
        examples.append((prompt, reply))
    return examples, too_long


def length_batches(examples: list[Example], batch_tokens: int) -> list[list[int]]:
    """Indices of examples in micro-batches of similar length, each at most batch_tokens padded tokens
    (rows x (longest prompt + longest reply)), in the order of their length."""
    order = sorted(range(len(examples)), key=lambda i: (len(examples[i][0]) + len(examples[i][1]), i))
    batches, current, prompt_width, reply_width = [], [], 0, 0
    for i in order:
        prompt, reply = examples[i]
        wider = (max(prompt_width, len(prompt)), max(reply_width, len(reply)))
        if current and (len(current) + 1) * sum(wider) > batch_tokens:
            batches.append(current)
            current, wider = [], (len(prompt), len(reply))
        current.append(i)
        prompt_width, reply_width = wider
    return batches + [current] if current else batches


def epoch_order(batches: int, epoch: int, seed: int) -> list[int]:
    """The order of the micro-batches in an epoch: a function of (seed, epoch), so a resume needs the step alone."""
    return torch.randperm(batches, generator=torch.Generator().manual_seed(seed * 7919 + epoch)).tolist()


def collate(examples: list[Example], device) -> Batch:
    """Input ids and pad mask [B, P + C] (prompts left-padded to P, replies right-padded to C), P, and the
    reply mask [B, C]: a rollout's layout, so hidden_logprobs(..., start=P) scores exactly the replies."""
    P, C = max(len(p) for p, _ in examples), max(len(r) for _, r in examples)
    ids = torch.zeros(len(examples), P + C, dtype=torch.long)
    pad = torch.zeros(len(examples), P + C, dtype=torch.bool)
    for row, (prompt, reply) in enumerate(examples):
        ids[row, P - len(prompt) : P + len(reply)] = torch.tensor(prompt + reply)
        pad[row, P - len(prompt) : P + len(reply)] = True
    return ids.to(device), pad.to(device), P, pad[:, P:].to(device)


def reply_loss(model, batch: Batch, step_tokens: int) -> torch.Tensor:
    """This micro-batch's share of the step's loss: its reply tokens' negative log-likelihood over the
    step's reply tokens, so accumulated micro-batches add up to the step's token mean."""
    ids, pad, P, mask = batch
    logp, _ = model.hidden_logprobs(model.hidden(ids, pad), ids, start=P)  # [B, C]
    return -(logp * mask).sum() / step_tokens


# ----------------------------------------------------------------------------- held-out measure


def measure(model, tokenizer, eval_sets: dict[str, list[dict]], cfg: SFTConfig, desc: str) -> dict:
    """Accuracy (Mean@k) and format compliance on the held-out sets, over all their samples."""
    open_thought = opens_thought(tokenizer, cfg.thinking == "on")
    results = {}
    for name, problems in eval_sets.items():
        run = evaluation.evaluate(
            model,
            tokenizer,
            problems,
            k=cfg.eval_k,
            temperature=cfg.eval_temperature,
            max_new_tokens=cfg.max_new_tokens,
            template=cfg.template,
            system=cfg.system_prompt,
            thinking=cfg.thinking == "on",
            batch_size=cfg.eval_batch,
            seed=cfg.seed,
            desc=f"{desc} {name}" if len(eval_sets) > 1 else desc,
        )
        texts = [text for problem in run.problems for text in problem.completions]
        results[name] = {
            "accuracy": run.summary["mean@k"].mean,
            "se": run.summary["mean@k"].se,
            "format": format_rate(texts, cfg.template, open_thought),
            "problems": len(problems),
            "k": cfg.eval_k,
        }
    if len(results) == 1:
        return next(iter(results.values()))
    parts = list(results.values())
    return {
        "accuracy": sum(p["accuracy"] for p in parts) / len(parts),
        "format": sum(p["format"] for p in parts) / len(parts),
        "sets": results,
    }


def format_rate(texts: list[str], template: str, open_thought: bool = False) -> float:
    """The share of completions that state an answer where the reward looks for it: after the thought, in
    the template's format ("Answer:" line, \\boxed{}), or for other templates any answer it can extract."""

    def stated(text: str) -> bool:
        answer = reward.split_thinking(text, open_thought).answer
        if answer is None:
            return False
        if template in reward.ANSWER_FORMATS:
            return reward.has_format(answer, template)
        return reward.extract_answer(answer) is not None

    return sum(map(stated, texts)) / max(1, len(texts))


# ----------------------------------------------------------------------------- the run


def run(cfg: SFTConfig) -> dict:
    """Train (or resume) the supervised stage; returns the final state, with the before / after measures.
    The adapter lands in RUN/adapter, the folder `train.py --init-adapter` takes. The run directory has one
    writer (rundir.RunLock, as train.py's), and a start that fails before its first checkpoint leaves no
    folder behind."""
    config.validate_sft(cfg)
    problems = load_problems(cfg.dataset)
    names = [name.strip() for name in cfg.eval_dataset.split(",") if name.strip()]
    eval_sets = {name: load_problems(name)[: cfg.eval_problems or None] for name in names}
    run_dir = rundir.run_path(cfg)
    with rundir.RunLock(run_dir, resume=bool(cfg.resume)) as lock:
        try:
            model, tokenizer, optimizer, _ = training.build(cfg)
            examples, too_long = tokenize(problems, tokenizer, cfg)
            if not examples:
                raise ValueError(f"--max-length {cfg.max_length}: every one of the {len(problems)} examples is longer")
            if too_long:
                warnings.warn(
                    f"{too_long} of {len(problems)} examples are longer than --max-length "
                    f"{cfg.max_length} tokens and are left out"
                )
            if note := thinking_note(tokenizer, cfg.thinking == "on"):
                warnings.warn(note)
            state = open_run(cfg, run_dir, model, optimizer)
        except BaseException:
            lock.discard()  # a new run that never stepped: a retry finds no folder in its way
            raise
        try:
            return train_loop(cfg, run_dir, model, tokenizer, optimizer, state, examples, too_long, eval_sets)
        except KeyboardInterrupt:  # a second Ctrl-C, or one during an evaluation: the last checkpoint stands
            adapter_of_checkpoint(run_dir)
            raise stopping.Interrupted(run_dir) from None


def train_loop(
    cfg: SFTConfig,
    run_dir: Path,
    model,
    tokenizer,
    optimizer,
    state: dict,
    examples: list[Example],
    too_long: int,
    eval_sets: dict[str, list[dict]],
) -> dict:
    """The steps of a started run, between the measures before and after; then the adapter and summary."""
    batches = length_batches(examples, cfg.batch_tokens)
    steps_per_epoch = math.ceil(len(batches) / cfg.grad_accum)
    total_steps = min(cfg.max_steps or math.inf, cfg.epochs * steps_per_epoch)
    metrics_file = run_dir / "metrics.jsonl"
    with stopping.StopRequest() as stop:
        if state["before"] is None:
            with stop.immediate():
                state["before"] = measure(model, tokenizer, eval_sets, cfg, "eval before") if eval_sets else {}
        bar = tqdm(
            range(state["step"], total_steps),
            desc="sft",
            unit="step",
            initial=state["step"],
            total=total_steps,
            disable=not sys.stderr.isatty(),
        )  # no bar's escapes in a redirected log
        for _ in bar:
            step = state["step"] + 1
            record = sft_step(model, optimizer, examples, batches, cfg, step, steps_per_epoch, total_steps)
            state["step"] = step
            rundir.append_metrics(metrics_file, record)
            bar.set_postfix(loss=f"{record['loss']:.3f}")
            if bar.disable:  # a log file gets one plain line per step instead of the bar
                print(
                    f"step {step}/{total_steps}: loss {record['loss']:.4f}, lr {record['lr']:.3g}, "
                    f"{record['step_seconds']:.1f} s",
                    file=sys.stderr,
                )
            if step % cfg.checkpoint_every == 0 or stop.requested:
                rundir.save_checkpoint(run_dir, model, optimizer, state)
            if stop.requested:  # the adapter so far, for `train.py --init-adapter`, and a checkpoint to resume
                save_adapter(model, run_dir / "adapter", cfg.model)
                bar.close()
                raise stopping.Stopped(run_dir, step)
        with stop.immediate():
            state["after"] = measure(model, tokenizer, eval_sets, cfg, "eval after") if eval_sets else {}
    rundir.save_checkpoint(run_dir, model, optimizer, state)
    save_adapter(model, run_dir / "adapter", cfg.model)
    rundir.write_json(
        run_dir / "summary.json",
        {
            "before": state["before"],
            "after": state["after"],
            "examples": len(examples),
            "left_out": too_long,
            "steps": state["step"],
        },
    )
    if cfg.export:
        with rundir.writing(Path(cfg.export)):
            weights.save_pretrained(model, cfg.export, tokenizer=tokenizer)
        print(f"exported merged weights to {cfg.export}", file=sys.stderr)
    print(f"run directory: {run_dir}", file=sys.stderr)
    return state


def sft_step(
    model,
    optimizer,
    examples: list[Example],
    batches: list[list[int]],
    cfg: SFTConfig,
    step: int,
    steps_per_epoch: int,
    total_steps: int,
) -> dict:
    """One optimizer step over grad_accum micro-batches of the epoch's order; its metrics line."""
    start = time.perf_counter()
    epoch, position = divmod(step - 1, steps_per_epoch)
    order = epoch_order(len(batches), epoch, cfg.seed)
    chosen = [batches[i] for i in order[position * cfg.grad_accum : (position + 1) * cfg.grad_accum]]
    micro = [collate([examples[i] for i in rows], model.device) for rows in chosen]
    step_tokens = sum(int(batch[3].sum()) for batch in micro)
    lr = training.learning_rate(cfg.lr, cfg.lr_schedule, cfg.warmup_steps, total_steps, step)
    for group in optimizer.param_groups:
        group["lr"] = lr
    model.train()
    total = torch.zeros((), device=model.device)
    for batch in micro:
        with errors.oom_hint(
            f"an SFT micro-batch of {batch[0].numel()} padded tokens", f"lower --batch-tokens (now {cfg.batch_tokens})"
        ):
            value = reply_loss(model, batch, step_tokens)
            value.backward()
        total += value.detach()
    grad_norm = training.optimizer_step(model, optimizer, total, cfg, step)
    padded = sum(batch[0].numel() for batch in micro)
    real = sum(int(batch[1].sum()) for batch in micro)
    seconds = time.perf_counter() - start
    return {
        "step": step,
        "epoch": epoch + 1,
        "loss": float(total),
        "lr": lr,
        "grad_norm": grad_norm,
        "reply_tokens": step_tokens,
        "examples": sum(len(rows) for rows in chosen),
        "padding_frac": 1 - real / padded,
        "step_seconds": seconds,
        "tokens_per_s": real / seconds,
    }


def open_run(cfg: SFTConfig, run_dir: Path, model, optimizer) -> dict:
    """A resumed run's checkpoint, with what the resume changes recorded as train.py records it, or step 0 of a
    new run (its config.json and config.toml written, checkpointed at once, so it can resume)."""
    if cfg.resume:
        state = rundir.load_checkpoint(run_dir, model, optimizer)
        rundir.note_resume(cfg, run_dir, state["step"])
        return state
    state = {"step": 0, "before": None}
    rundir.write_settings(cfg, run_dir)
    rundir.save_checkpoint(run_dir, model, optimizer, state)
    return state


def save_adapter(model, path: Path, base: str | None) -> None:
    """The adapter in PEFT format, written under a temporary name and renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    with rundir.writing(path, tmp):
        lora.save(model, tmp, base_model_name_or_path=base)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


def adapter_of_checkpoint(run_dir: Path) -> None:
    """RUN/adapter from the run's last checkpoint, copied under a temporary name and renamed into place: an
    interrupt that could not wait for a step leaves the adapter of the last complete one."""
    latest = run_dir / "latest"
    if not latest.is_file():
        return
    tmp, path = run_dir / ".adapter.tmp", run_dir / "adapter"
    shutil.rmtree(tmp, ignore_errors=True)
    with rundir.writing(path, tmp):
        shutil.copytree(run_dir / latest.read_text().strip() / "adapter", tmp)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    """Settings, data and paths are checked before anything loads: a mistake prints one line, exit status 2.
    A Ctrl-C exits with 130, as train.py's: after the step in progress, its checkpoint and the adapter so far."""
    warnings.formatwarning = lambda message, category, *_, **__: f"warning: {message}\n"
    try:
        cfg, given = config.parse_sft_args(argv, description=__doc__)
        if cfg.resume:
            cfg = config.resumed_config(cfg, given)
            config.check_finished(cfg)
        state = run(cfg)
    except errors.USER_ERRORS as error:
        if errors.inside_training(error, ("sft_step", "measure")):
            raise
        print(f"sft.py: {error}", file=sys.stderr)
        sys.exit(2)
    except stopping.Stopped as stop:  # as train.py: exit 130 with a checkpoint of the step, and here the adapter
        print(
            f"stopped at step {stop.step}; the adapter so far is {stop.run_dir / 'adapter'}; continue with: "
            f"python sft.py --resume {stop.run_dir}",
            file=sys.stderr,
        )
        stopping.exit_interrupted()
    except KeyboardInterrupt as interrupt:
        if isinstance(interrupt, stopping.Interrupted):
            run_dir = interrupt.run_dir
            print(
                f"\ninterrupted; the last checkpoint is kept, its adapter in {run_dir / 'adapter'}: continue with "
                f"python sft.py --resume {run_dir}",
                file=sys.stderr,
            )
        else:
            print("\ninterrupted before the run started: nothing was written", file=sys.stderr)
        stopping.exit_interrupted()
    if "after" in state and state["after"]:
        before, after = state["before"], state["after"]
        print(f"held-out format: before {100 * before['format']:.1f}% -> after {100 * after['format']:.1f}%")
        print(f"held-out accuracy: before {100 * before['accuracy']:.1f}% -> after {100 * after['accuracy']:.1f}%")


if __name__ == "__main__":
    main()
