"""The demo's whole GRPO step (`make train`) against TRL's GRPOTrainer on the same job, side by side.

Both sides train SmolLM2-135M-Instruct (the converted offline checkpoint) with LoRA r 16, alpha 32 on
the seven projections, on the same prompts in the same order (the demo's first steps: 8 prompts x 8
samples, 16 new tokens, temperature 1), rewarded by reward.py, one AdamW step of lr 3e-4 per rollout,
token-mean loss (TRL's "dapo", its default), no KL term, no gradient checkpointing, fp32, one thread.
train.py's side is train.train_step with the demo's config; TRL's is GRPOTrainer.train with a
callback that holds each step until it is that side's turn, so the two processes take turns, one step
each, and load from other programs hits both alike. The first pair warms up; of the --pairs after it,
the median step counts. Sampling is generation and reward (train.sample + train.score; TRL's
_generate_and_score_completions), the update the rest of the step. Peak memory: each process's peak
resident set size (VmHWM), weights and runtime included.

TRL is an optional requirement (requirements-bench.txt, installed by `make bench-trl`); without it
this prints why it skips and exits 0. Nothing is downloaded: set HF_HUB_OFFLINE=1 to make sure.

    make bench-trl                                  # install trl, then run this
    OMP_NUM_THREADS=1 .venv/bin/python bench/grpo_step.py [--pairs 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import multiprocessing
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import config  # noqa: E402
import reward  # noqa: E402
import train  # noqa: E402
from data import load_problems, render_prompt  # noqa: E402
from data.templates import EXAMPLES, user_message  # noqa: E402
from engine import sizes  # noqa: E402
from infra import weights  # noqa: E402

SIDES = ("train.py", "TRL GRPOTrainer")
DEMO = config.make_config({})  # the demo's settings: train.py with no flags


def demo_config(prompts: int) -> config.Config:
    """The demo's settings with `prompts` prompts per step (8, the demo's own, unless a check asks fewer)."""
    return config.make_config({"prompts_per_step": prompts})


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise ValueError("/proc/self/status has no VmHWM line")


def demo_problems(cfg: config.Config, steps: int) -> list[dict]:
    """The problems of the first `steps` steps, in the order train.py trains on them."""
    return train.batch_of(load_problems(cfg.dataset), 0, cfg.prompts_per_step * steps, cfg.seed)


class Laps:
    """Seconds spent inside wrapped functions since the last reset."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        return timed


def ours_worker(conn, steps: int, prompts: int) -> None:
    """train.py's demo, one train_step per "step" message; answers (step seconds, sampling seconds)."""
    torch.set_num_threads(1)
    cfg = demo_config(prompts)
    model, tokenizer, optimizer, _ = train.build(cfg)
    problems, sampling = demo_problems(cfg, steps), Laps()
    cfg = sizes.resolve_automatic(cfg, model, tokenizer, problems)
    pool = sizes.sampler_pool(cfg, model, tokenizer, problems, {})  # one KV pool for the run, as train.py's
    train.sample, train.score = sampling.wrap(train.sample), sampling.wrap(train.score)
    conn.send("ready")
    for step in range(1, steps + 1):
        conn.recv()
        sampling.seconds, start = 0.0, time.perf_counter()
        batch = problems[(step - 1) * cfg.prompts_per_step : step * cfg.prompts_per_step]
        train.train_step(model, optimizer, tokenizer, batch, cfg, step, pool=pool)
        conn.send((time.perf_counter() - start, sampling.seconds))
    conn.recv()
    conn.send(peak_rss_bytes())


def chat_messages(problem: str) -> list[dict]:
    """The demo's prompt as chat messages, as data/templates.render_prompt builds it."""
    messages = [{"role": "system", "content": DEMO.system_prompt}]
    for question, answer in EXAMPLES.get(DEMO.template, []):
        messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
    return messages + [{"role": "user", "content": user_message(problem, DEMO.template)}]


def trl_reward(prompts, completions, answer, **_) -> list[float]:
    return reward.reward([completion[0]["content"] for completion in completions], answer)


def trl_worker(conn, steps: int, prompts: int) -> None:
    """GRPOTrainer on the demo's job; its callback waits for a "step" message before each step."""
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(1)
    checkpoint, tokenizer = weights.resolve_checkpoint(None), weights.load_tokenizer(None)
    cfg = demo_config(prompts)
    problems = demo_problems(cfg, steps)
    rows = [{"prompt": chat_messages(p["problem"]), "answer": p["answer"]} for p in problems]
    for row, p in zip(rows, problems):  # the prompts train.py samples from, token for token
        ids = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, tokenize=True)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids  # a BatchEncoding in recent transformers
        if list(ids) != render_prompt(tokenizer, p["problem"], DEMO.template, DEMO.system_prompt):
            raise RuntimeError("the chat messages do not render to train.py's prompt")
    sampling = Laps()

    class Turns(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            conn.recv()
            sampling.seconds, self.start = 0.0, time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            conn.send((time.perf_counter() - self.start, sampling.seconds))

    rows_per_step = cfg.prompts_per_step * cfg.group_size
    with tempfile.TemporaryDirectory() as out_dir:
        args = GRPOConfig(
            output_dir=out_dir,
            per_device_train_batch_size=rows_per_step,
            gradient_accumulation_steps=1,
            num_generations=DEMO.group_size,
            max_completion_length=DEMO.max_new_tokens,
            temperature=DEMO.temperature,
            top_p=DEMO.top_p,
            top_k=DEMO.top_k,
            learning_rate=DEMO.lr,
            lr_scheduler_type="constant",
            weight_decay=DEMO.weight_decay,
            max_grad_norm=DEMO.grad_clip,
            beta=0.0,
            epsilon=0.2,
            loss_type="dapo",
            scale_rewards="group",
            num_iterations=1,
            max_steps=steps,
            shuffle_dataset=False,
            seed=DEMO.seed,
            gradient_checkpointing=False,
            use_cpu=True,
            bf16=False,
            save_strategy="no",
            report_to="none",
            logging_steps=steps,
            disable_tqdm=True,
            dataloader_num_workers=0,
        )
        peft_config = LoraConfig(
            r=DEMO.lora_rank,
            lora_alpha=DEMO.lora_alpha,
            lora_dropout=DEMO.lora_dropout,
            target_modules=DEMO.lora_targets.split(","),
            task_type="CAUSAL_LM",
        )
        model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=trl_reward,
            args=args,
            train_dataset=Dataset.from_list(rows),
            processing_class=tokenizer,
            peft_config=peft_config,
            callbacks=[Turns()],
        )
        trainer._generate_and_score_completions = sampling.wrap(trainer._generate_and_score_completions)
        conn.send("ready")
        trainer.train()
    conn.recv()
    conn.send(peak_rss_bytes())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=3, help="timed steps per side after the warm-up pair")
    parser.add_argument(
        "--prompts",
        type=int,
        default=DEMO.prompts_per_step,
        help="prompts per step (the demo's 8; fewer for a quick check that both sides run)",
    )
    args = parser.parse_args()
    if importlib.util.find_spec("trl") is None:
        print("bench/grpo_step.py skipped: trl is not installed (`make bench-trl` installs requirements-bench.txt)")
        return
    import peft
    import transformers
    import trl

    steps = args.pairs + 1
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
        f"peft {peft.__version__}; one thread per side; {args.prompts} prompts x {DEMO.group_size} "
        f"samples x {DEMO.max_new_tokens} new tokens, LoRA r{DEMO.lora_rank}; {args.pairs} pairs after a warm-up"
    )
    context = multiprocessing.get_context("spawn")
    pipes, processes = {}, []
    for side, worker in zip(SIDES, (ours_worker, trl_worker)):
        ours, theirs = context.Pipe()
        processes.append(context.Process(target=worker, args=(theirs, steps, args.prompts)))
        processes[-1].start()
        pipes[side] = ours
    for pipe in pipes.values():
        pipe.recv()  # "ready"
    times = {side: [] for side in SIDES}
    for pair in range(steps):
        for side, pipe in pipes.items():
            pipe.send("step")
            times[side].append(pipe.recv())
            step, sampling = times[side][-1]
            warm_up = " (warm-up)" if pair == 0 else ""
            print(f"pair {pair}{warm_up}: {side}: step {step:.1f} s, sampling {sampling:.1f} s", flush=True)
    peaks = {}
    for side, pipe in pipes.items():
        pipe.send("stop")
        peaks[side] = pipe.recv()
    for process in processes:
        process.join()
    rows = {}
    for side in SIDES:
        timed = times[side][1:]
        step, sampling = statistics.median(t for t, _ in timed), statistics.median(s for _, s in timed)
        update = statistics.median(t - s for t, s in timed)
        rows[side] = (step, sampling, update, peaks[side] / 1e9)
    print(f"\n{'side':<18} {'step s':>8} {'sampling s':>11} {'update s':>9} {'peak GB':>8}")
    for side, (step, sampling, update, peak) in rows.items():
        print(f"{side:<18} {step:>8.1f} {sampling:>11.1f} {update:>9.1f} {peak:>8.1f}")
    ours, theirs = rows[SIDES[0]], rows[SIDES[1]]
    print(
        f"{'TRL / train.py':<18} {theirs[0] / ours[0]:>7.2f}x {theirs[1] / ours[1]:>10.2f}x "
        f"{theirs[2] / ours[2]:>8.2f}x {ours[3] / theirs[3]:>7.2f}x (peak: train.py / TRL)"
    )


if __name__ == "__main__":
    main()
