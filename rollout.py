"""Sampling G completions per prompt: the rollout half of a GRPO step.

`generate` samples every prompt's rows and returns them as a Rollout, the layout training reads:
- each row stops independently, at its first stop token (kept, and `finished`) or after max_new_tokens
  (`truncated`); its completion_mask covers the tokens it drew, stop token included;
- a token is drawn by sampling.draw: inverse-CDF sampling from one uniform number per row, a hash of
  (seed, prompt index, sample index, token position), so a row's sample depends only on the weights,
  those indices and the device, never on which rows share its batch. Temperature scales the logits;
  top-k, then top-p, restrict the tokens that can be drawn; temperature 0 is greedy decoding;
- old_logp is log_softmax(logits / temperature) of the sampled token under the *full* tempered
  distribution: exactly what model.token_logprobs(..., temperature=temperature) recomputes during
  training, so the importance ratio is 1 when the weights did not change. The top-k and top-p
  truncation is not part of it (the training forward pass cannot know it); at temperature 0 old_logp
  are taken at temperature 1.
The engine carries the rows: the paged KV pool kept across calls and steps (engine/pool.py, passed as
`pool`), the scheduler that admits and preempts prompt groups (engine/scheduler.py), the decode loop and
its CUDA graphs (engine/sampler.py, engine/graphs.py). It runs in the model's dtype (load the model in
bf16 on a GPU) and in eval mode (no dropout). docs/engine.md describes it.

    python rollout.py --model DIR "What is 7 + 6?" --answer 13     # sample a prompt, and grade it
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch

import sampling
from engine import graphs, sampler
from engine.pool import Pool
from engine.scheduler import SamplerStats
from model import Transformer


@dataclass
class Rollout:
    completions: list[list[int]]  # N = prompts * G rows, prompt-major; stop token included
    old_logp: torch.Tensor  # [N, C] fp32 log-prob of each sampled token, 0 past the end
    completion_ids: torch.Tensor  # [N, C] long, PAD_ID past the end
    completion_mask: torch.Tensor  # [N, C] bool, True on sampled tokens (stop token included)
    finished: torch.Tensor  # [N] bool: ended with a stop token
    truncated: torch.Tensor  # [N] bool: hit max_new_tokens first
    input_ids: torch.Tensor  # [N, P + C] left-padded prompt, then completion
    pad_mask: torch.Tensor  # [N, P + C] bool, True on real tokens
    prompt_len: int  # P
    texts: list[str] | None  # decoded completions (special tokens skipped) when a tokenizer was given
    stats: SamplerStats = field(default_factory=SamplerStats)


def generate(
    model: Transformer,
    prompts: list[list[int]],
    *,
    samples_per_prompt: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float = 1.0,
    top_k: int = 0,
    stop_ids: list[int],
    seed: int,
    tokenizer=None,
    max_rows: int | None = None,
    first_prompt: int = 0,
    fixed_shapes: bool = False,
    cuda_graphs: str = "auto",
    pool: Pool | None = None,
) -> Rollout:
    """Sample samples_per_prompt completions for each prompt (token-id lists of any lengths).

    Rows stop independently at any of stop_ids or after max_new_tokens. A row's sample depends only
    on the weights, the seed, its prompt's index in the step (first_prompt + its index in prompts),
    its sample index and the device. pool (a Pool, kept by the caller across calls) holds the KV cache;
    without one, a pool that holds every row at full length is made for the call. max_rows bounds the
    rows in flight (whole prompts are admitted: at least samples_per_prompt). fixed_shapes runs the
    decode loop that CUDA uses on any device; cuda_graphs says whether it is replayed from graphs
    ("on"), not ("off"), or tried, falling back to eager with a warning ("auto").
    """
    _check_args(
        model,
        prompts,
        samples_per_prompt,
        max_new_tokens,
        temperature,
        top_p,
        top_k,
        max_rows,
        first_prompt,
        cuda_graphs,
        pool,
    )
    G, P, N = samples_per_prompt, max(len(p) for p in prompts), len(prompts) * samples_per_prompt
    device = model.device
    draw = partial(
        sampling.draw,
        keys=sampling.row_keys(seed, first_prompt, len(prompts), G, device),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    completion_ids, old_logp, completion_mask, stats = sampler.sample(
        model,
        prompts,
        G,
        max_new_tokens,
        draw,
        stop,
        max_rows=max_rows or N,
        fixed=fixed_shapes or device.type == "cuda",
        cuda_graphs=cuda_graphs,
        pool=pool,
    )

    # Outside inference mode, so the results can enter the loss's autograd graph (ops on inference
    # tensors, like cat and pad, return ordinary tensors).
    prompt_ids = torch.tensor([[sampler.PAD_ID] * (P - len(p)) + p for p in prompts], device=device)  # [B, P]
    prompt_mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts], device=device)
    lengths = completion_mask.sum(1)  # [N], >= 1: every row samples at least one token
    C = int(lengths.max())
    completion_ids, old_logp, completion_mask = (t[:, :C].clone() for t in (completion_ids, old_logp, completion_mask))
    last_token = completion_ids.gather(1, (lengths - 1)[:, None])[:, 0]
    finished = torch.isin(last_token, stop)
    completions = [row[:n] for row, n in zip(completion_ids.tolist(), lengths.tolist())]
    return Rollout(
        completions=completions,
        old_logp=old_logp,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        finished=finished,
        truncated=~finished,
        input_ids=torch.cat([prompt_ids.repeat_interleave(G, dim=0), completion_ids], dim=1),
        pad_mask=torch.cat([prompt_mask.repeat_interleave(G, dim=0), completion_mask], dim=1),
        prompt_len=P,
        texts=decoded(tokenizer, completions),
        stats=stats,
    )


def decoded(tokenizer, completions: list[list[int]]) -> list[str] | None:
    """The completions as text, special tokens skipped (None without a tokenizer)."""
    return tokenizer.batch_decode(completions, skip_special_tokens=True) if tokenizer is not None else None


ROW_TENSORS = ("old_logp", "completion_ids", "completion_mask", "finished", "truncated", "input_ids", "pad_mask")


def joined(parts: list[tuple[Rollout, torch.Tensor]], widths: tuple[int, int] | None = None) -> Rollout:
    """Some rows of several rollouts as one: (rollout, row indices) pairs, the rows in that order. Prompts are
    left-padded and completions right-padded to the widest part (or to widths, (P, C), when wider), so every
    row's tokens, masks and log-probs are its own rollout's; the stats of the rollouts add up. Dynamic sampling
    keeps the groups of several sampler calls this way."""
    P = max(widths[0] if widths else 0, *(out.prompt_len for out, _ in parts))
    C = max(widths[1] if widths else 0, *(out.completion_mask.shape[1] for out, _ in parts))

    def padded(out: Rollout, rows: torch.Tensor, name: str, value) -> torch.Tensor:
        tensor = getattr(out, name)[rows]  # [n, C_part] or [n, P_part + C_part]
        if name in ("input_ids", "pad_mask"):
            left, right = P - out.prompt_len, C - out.completion_mask.shape[1]
        else:
            left, right = 0, C - tensor.shape[1]
        return torch.nn.functional.pad(tensor, (left, right), value=value)

    def cat(name: str, value) -> torch.Tensor:
        return torch.cat([padded(out, rows, name, value) for out, rows in parts])

    picked = [(out, rows.tolist()) for out, rows in parts]
    return Rollout(
        completions=[out.completions[i] for out, rows in picked for i in rows],
        old_logp=cat("old_logp", 0.0),
        completion_ids=cat("completion_ids", sampler.PAD_ID),
        completion_mask=cat("completion_mask", False),
        finished=torch.cat([out.finished[rows] for out, rows in parts]),
        truncated=torch.cat([out.truncated[rows] for out, rows in parts]),
        input_ids=cat("input_ids", sampler.PAD_ID),
        pad_mask=cat("pad_mask", False),
        prompt_len=P,
        texts=None if parts[0][0].texts is None else [out.texts[i] for out, rows in picked for i in rows],
        stats=sum({id(out): out.stats for out, _ in parts}.values(), SamplerStats()),  # each rollout's once
    )


def rows_moved(out: Rollout, move: Callable[[torch.Tensor], torch.Tensor], tokenizer=None) -> Rollout:
    """The rollout whose row tensors (ROW_TENSORS) are move(tensor) of out's, each [N, ...] to [M, ...]: rows
    picked, reordered or sent between processes. Its completions are read back from the ids and mask, its texts
    decoded again with tokenizer (generate's texts), and its stats are empty: no sampler call made these rows."""
    tensors = {name: move(getattr(out, name)) for name in ROW_TENSORS}
    lengths = tensors["completion_mask"].sum(1).tolist()  # a row's tokens are a prefix of its columns
    completions = [row[:n] for row, n in zip(tensors["completion_ids"].tolist(), lengths)]
    return Rollout(completions=completions, **tensors, prompt_len=out.prompt_len, texts=decoded(tokenizer, completions))


def _check_args(
    model,
    prompts,
    samples_per_prompt,
    max_new_tokens,
    temperature,
    top_p,
    top_k,
    max_rows,
    first_prompt,
    cuda_graphs,
    pool,
) -> None:
    if not prompts:
        raise ValueError("prompts: empty list, nothing to sample")
    context, vocab = model.config.max_position_embeddings, model.config.vocab_size
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompts[{i}] is empty")
        if len(prompt) > context:
            raise ValueError(f"prompts[{i}] has {len(prompt)} tokens, longer than the model's context ({context})")
        if min(prompt) < 0 or max(prompt) >= vocab:
            raise ValueError(f"prompts[{i}] holds a token id outside [0, {vocab})")
    if samples_per_prompt < 1:
        raise ValueError(f"samples_per_prompt must be >= 1, got {samples_per_prompt}")
    if max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be > 0, got {max_new_tokens}")
    longest = max(len(p) for p in prompts)
    if longest + max_new_tokens > context:
        raise ValueError(
            f"max_new_tokens={max_new_tokens} plus the longest prompt ({longest}) exceeds the "
            f"model's context ({context})"
        )
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {top_k}")
    if max_rows is not None and max_rows < samples_per_prompt:
        raise ValueError(f"max_rows={max_rows} holds no whole prompt of samples_per_prompt={samples_per_prompt} rows")
    if first_prompt < 0:
        raise ValueError(f"first_prompt must be >= 0, got {first_prompt}")
    if cuda_graphs not in sampler.CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(sampler.CUDA_GRAPHS)}, got {cuda_graphs!r}")
    if cuda_graphs == "on" and model.device.type != "cuda" and (pool is None or pool.graph_class is graphs.CudaGraph):
        raise ValueError(
            f"cuda_graphs='on' needs the model on a CUDA device (or a pool with a graph stand-in); "
            f"it is on {model.device}"
        )
    if pool is not None and pool.model is not model:
        raise ValueError(
            "pool: it was built for another model (its graphs and buffers read that model's weights); "
            "Pool.bind serves a new one"
        )


# ----------------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> None:
    """Talk to a model: sample completions for a prompt, as training poses it, and grade them if asked.

    python rollout.py --adapter runs/NAME/best --template equation "What is 7 + 6?" --answer 13
    echo "What is 7 + 6?" | python rollout.py --samples 4
    """
    import argparse
    import sys
    from pathlib import Path

    import lora
    import reward
    from data import TEMPLATES, opens_thought, render_prompt, stop_ids, thinking_note
    from infra import weights

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one line, not the usage block
            self.exit(2, f"rollout.py: {message}\n")

    parser = Parser(
        prog="rollout.py",
        description=main.__doc__,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("prompt", nargs="*", help="the problem; read from stdin when not given")
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the offline SmolLM2)")
    parser.add_argument("--adapter", default=None, help="a LoRA adapter directory, e.g. runs/NAME/best")
    parser.add_argument("--template", default="equation", help=f"one of {', '.join(TEMPLATES)} (default: equation)")
    parser.add_argument("--system", default="You are a helpful assistant.", help="system message, as train.py's")
    parser.add_argument(
        "--thinking",
        default="off",
        choices=["on", "off"],
        help="enable_thinking for chat "
        "templates that take it (Qwen3); grading reads only what follows the last </think>",
    )
    parser.add_argument("--samples", type=int, default=4, help="completions to draw (default: 4)")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="(default: 64)")
    parser.add_argument("--temperature", type=float, default=1.0, help="0 = greedy (default: 1.0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--answer", default=None, help="reference answer: grade each completion against it")
    args = parser.parse_args(argv)
    try:
        problem = " ".join(args.prompt) or sys.stdin.read().strip()
        if not problem:
            parser.error("no prompt: give it as an argument or on stdin")
        if args.template not in TEMPLATES and "{problem}" not in args.template:
            parser.error(
                f"--template {args.template!r}: expected one of {', '.join(TEMPLATES)} or a string with {{problem}}"
            )
        if args.adapter is not None and not Path(args.adapter).is_dir():
            parser.error(f"--adapter {args.adapter}: no such directory")
        model = weights.from_pretrained(args.model)
        tokenizer = weights.load_tokenizer(args.model)
        if args.adapter is not None:
            lora.load(model, args.adapter)
        thinking = args.thinking == "on"
        if note := thinking_note(tokenizer, thinking):
            print(f"rollout.py: {note}", file=sys.stderr)
        prompt = render_prompt(tokenizer, problem, args.template, args.system, thinking)
        open_thought = opens_thought(tokenizer, thinking)
        out = generate(
            model,
            [prompt],
            samples_per_prompt=args.samples,
            max_new_tokens=args.max_new_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            stop_ids=stop_ids(model.config, tokenizer),
            seed=args.seed,
            tokenizer=tokenizer,
        )
    except (ValueError, OSError) as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        print("\nrollout.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    grades = (
        None
        if args.answer is None
        else reward.reward(
            out.texts,
            [args.answer] * len(out.texts),
            problems=[problem] * len(out.texts),
            template=args.template,
            open_thought=open_thought,
        )
    )
    for i, text in enumerate(out.texts):
        final = reward.split_thinking(text, open_thought).answer
        extracted = "thought never closes" if final is None else repr(reward.answer_of(final, args.template))
        verdict = "" if grades is None else f" [{'correct' if grades[i] == 1.0 else 'wrong'}: {extracted}]"
        print(f"--- sample {i + 1}{' (truncated)' if out.truncated[i] else ''}{verdict}\n{text or '(empty)'}")
    if grades is not None:
        print(f"--- {int(sum(grades))} of {len(grades)} correct")


if __name__ == "__main__":
    main()
