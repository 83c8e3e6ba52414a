"""Sampling G completions per prompt with a KV cache: the rollout half of a GRPO step.

Sampling takes most of a GRPO step's wall clock, so this file is built for speed while staying plain:
- each distinct prompt is prefilled once (one left-padded batch) and its cache shared by its G samples:
  the prompt's keys are stored once and attention reads them once for all G rows (KVCache.fork);
- a token is drawn by inverse-CDF sampling from one uniform number per row instead of
  torch.multinomial, which draws one random number per vocabulary entry and costs as much as a third
  of a CPU step. The uniform is a hash of (seed, prompt index, sample index, token position), so a
  row's sample never depends on which other rows share its batch: splitting the prompts into calls
  (max_rows, or one call per process with first_prompt), or dropping finished rows, changes nothing;
- rows that finished leave the batch as they pile up (the rows kept take their own copy of their
  prompt's keys), so the long tail of GRPO's completion lengths does not pay for the short rows.

Two decode loops share all of the above and give the same samples:
- eager (the CPU default): each step attends over exactly the filled cache slots, and a quarter of
  the rows finishing triggers a compaction to the rows still running;
- fixed shapes (always on CUDA; `fixed_shapes=True` runs it on any device, which is how the CPU
  tests check it): the step's shapes come from a few buckets, so a CUDA graph captured once per
  (rows bucket, span bucket) replays every step of that shape without Python or launch overhead.
  Attention reads the smallest power-of-two span of cache slots that covers what is filled (at most
  about twice what it needs), and when the running rows fit in half the batch they are compacted into
  the power-of-two row count that holds them, padded with dead rows.

old_logp is log_softmax(logits / temperature) of the sampled token under the *full* tempered
distribution: exactly what model.token_logprobs(..., temperature=temperature) recomputes during
training, so the importance ratio is 1 when the weights did not change. top-k and top-p only restrict
which tokens can be drawn; their truncation is not part of old_logp (the training forward pass cannot
know it). Temperature 0 is greedy decoding, and its old_logp are taken at temperature 1.
The sampler runs in the model's dtype: load the model in bf16 on a GPU.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.nn.functional as F

import model as modeling

PAD_ID = 0  # fills left padding and finished rows; any id works because those slots are masked out
CUDA_GRAPHS = ("auto", "on", "off")


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


def generate(model: modeling.Transformer, prompts: list[list[int]], *, samples_per_prompt: int, max_new_tokens: int,
             temperature: float, top_p: float = 1.0, top_k: int = 0, stop_ids: list[int], seed: int,
             tokenizer=None, max_rows: int | None = None, first_prompt: int = 0, fixed_shapes: bool = False,
             cuda_graphs: str = "auto") -> Rollout:
    """Sample samples_per_prompt completions for each prompt (token-id lists of any lengths).

    Rows stop independently at any of stop_ids or after max_new_tokens. A row's sample depends only
    on the weights, the seed, its prompt's index in the step (first_prompt + its index in prompts),
    its sample index and the device: max_rows (sample at most that many rows = prompts x G per call,
    whole prompts only, to bound the KV cache) gives the result of one call, padding layout included.
    fixed_shapes runs the decode loop that CUDA uses on any device; cuda_graphs says whether CUDA
    replays it from graphs ("on"), does not ("off"), or tries and falls back to eager with a warning
    ("auto").
    """
    _check_args(model, prompts, samples_per_prompt, max_new_tokens, temperature, top_p, top_k, max_rows,
                first_prompt, cuda_graphs)
    G, P = samples_per_prompt, max(len(p) for p in prompts)
    per_call = len(prompts) if max_rows is None else max_rows // G
    draw = partial(_sample, temperature=temperature, top_p=top_p, top_k=top_k)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=model.device)
    parts = []  # per call: prompt ids [B, P], prompt mask [B, P], completion ids, old_logp, completion mask [B*G, C]
    try:
        with torch.inference_mode():
            for lo in range(0, len(prompts), per_call):
                chunk = prompts[lo:lo + per_call]
                keys = _row_keys(seed, first_prompt + lo, len(chunk), G, model.device)
                parts.append(_sample_rows(model, chunk, P, G, max_new_tokens, partial(draw, keys=keys), stop,
                                          _decode_step(model, fixed_shapes, cuda_graphs)))
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"out of memory sampling {min(per_call, len(prompts))} prompts x {G} samples x {max_new_tokens} new "
            f"tokens in one call: lower max_rows, samples_per_prompt or max_new_tokens") from err

    # Outside inference mode, so the results can enter the loss's autograd graph (ops on inference
    # tensors, like cat and pad, return ordinary tensors). Shorter calls are right-padded to the longest.
    C = max(part[2].shape[1] for part in parts)
    prompt_ids, prompt_mask = (torch.cat([part[i] for part in parts]) for i in (0, 1))
    completion_ids, old_logp, completion_mask = (
        torch.cat([F.pad(part[i], (0, C - part[i].shape[1]), value=fill) for part in parts])
        for i, fill in ((2, PAD_ID), (3, 0.0), (4, False)))
    lengths = completion_mask.sum(1)  # [N], >= 1: every row samples at least one token
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
        texts=tokenizer.batch_decode(completions, skip_special_tokens=True) if tokenizer is not None else None,
    )


def _check_args(model, prompts, samples_per_prompt, max_new_tokens, temperature, top_p, top_k, max_rows,
                first_prompt, cuda_graphs) -> None:
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
        raise ValueError(f"max_new_tokens={max_new_tokens} plus the longest prompt ({longest}) exceeds the "
                         f"model's context ({context})")
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
    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {cuda_graphs!r}")
    if cuda_graphs == "on" and model.device.type != "cuda":
        raise ValueError(f"cuda_graphs='on' needs the model on a CUDA device; it is on {model.device}")


def _sample_rows(model, prompts, P, G, max_new_tokens, draw, stop, step):
    """Prefill, then decode; returns the prompts left-padded to P [B, P] with their mask, and [N, C] results."""
    device = model.device
    prompt_ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts], device=device)  # [B, P]
    prompt_mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts], device=device)

    cache, logits = prefill(model, prompt_ids, prompt_mask, G, max_new_tokens)
    return prompt_ids, prompt_mask, *_decode(step, cache, logits, draw, stop, max_new_tokens)


def prefill(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, G: int, max_new_tokens: int):
    """The B distinct prompts [B, P] prefilled once into a cache with room for G x max_new_tokens more
    tokens each, forked into G rows per prompt; returns (cache, the first logits [B * G, V])."""
    cache = model.new_cache(len(prompt_ids), prompt_ids.shape[1] + G * max_new_tokens)
    last_hidden = model.hidden(prompt_ids, prompt_mask, cache)[:, -1]  # left padding: last slot is real
    return cache.fork(G), model.lm_head(last_hidden).repeat_interleave(G, dim=0)


def _decode(step, cache: modeling.KVCache, logits: torch.Tensor, draw: Callable, stop: torch.Tensor,
            max_new_tokens: int):
    """The token loop. Returns completion ids, old_logp and mask, each [N, C] with C <= max_new_tokens.

    `rows` maps the rows the cache holds to their place in the output; a padding row (fixed shapes)
    maps to the extra output row N, which is dropped at the end. The step decides when finished rows
    are compacted away (step.rows_to_keep).
    """
    N, device = logits.shape[0], logits.device
    completion_ids = torch.full((N + 1, max_new_tokens), PAD_ID, dtype=torch.long, device=device)
    old_logp = torch.zeros(N + 1, max_new_tokens, device=device)
    completion_mask = torch.zeros(N + 1, max_new_tokens, dtype=torch.bool, device=device)
    rows = torch.arange(N, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)  # over the held rows
    for t in range(max_new_tokens):
        tokens, logp = draw(logits, rows=rows, position=t)
        alive = ~done
        tokens = tokens.masked_fill(done, PAD_ID)
        completion_ids[rows, t] = tokens
        old_logp[rows, t] = logp.masked_fill(done, 0.0)
        completion_mask[rows, t] = alive
        done = done | (alive & torch.isin(tokens, stop))
        n_done = int(done.sum())  # the one host sync per step
        if n_done == len(rows) or t + 1 == max_new_tokens:
            break
        keep = step.rows_to_keep(done, n_done)
        if keep is not None:
            rows = torch.where(keep.padding, N, rows[keep.rows])
            cache, tokens, done = cache.select(keep.rows), tokens[keep.rows], done[keep.rows] | keep.padding
        alive = ~done
        logits = step(tokens.masked_fill(done, PAD_ID), alive, cache)
        cache.advance(alive)
    C = t + 1
    return completion_ids[:N, :C], old_logp[:N, :C], completion_mask[:N, :C]


# ----------------------------------------------------------------------------- random streams

MASK32 = 0xFFFFFFFF


def _mul32(h, c: int):
    """h * c mod 2^32 for h in [0, 2^32) (int or int64 tensor), with no product over 2^48: no overflow."""
    return ((h & 0xFFFF) * c + ((((h >> 16) * c) & 0xFFFF) << 16)) & MASK32


def _mix32(h):
    """MurmurHash3's finalizer: a bijection of 32-bit integers in which every input bit flips about
    half of the output bits. Works on Python ints and on int64 tensors of any device, in a graph too."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def _row_keys(seed: int, first_prompt: int, prompts: int, G: int, device) -> torch.Tensor:
    """[N + 1] int64 hash of (seed, prompt index in the step, sample index) for each row, prompt-major;
    the extra last key serves padding rows."""
    seed_key = _mix32(_mix32(seed & MASK32) ^ ((seed >> 32) & MASK32))
    prompt = torch.arange(first_prompt, first_prompt + prompts, device=device).repeat_interleave(G)
    sample = torch.arange(G, device=device).repeat(prompts)
    keys = _mix32(_mix32(seed_key ^ (prompt & MASK32)) ^ sample)
    return torch.cat([keys, keys.new_zeros(1)])


def _uniform(keys: torch.Tensor, position) -> torch.Tensor:
    """One uniform in (0, 1] per key for this token position, [R, 1] fp32: 24 hashed bits, exact in fp32."""
    h = _mix32(keys ^ position)
    return (((h >> 8) + 1).float() * 2.0 ** -24)[:, None]


# ----------------------------------------------------------------------------- drawing a token


def _sample(logits: torch.Tensor, *, keys: torch.Tensor, rows: torch.Tensor, position: int, temperature: float,
            top_p: float, top_k: int):
    """One token per row from logits [R, V] for the output rows `rows` [R] at a token position;
    returns tokens [R] and their full-distribution logp [R]."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)  # [R, V]
    cdf = _restrict(logp, top_p, top_k).exp().cumsum(-1)  # [R, V], unnormalized
    # u in (0, 1]: the first index whose cdf reaches u * total always has a nonzero probability.
    u = _uniform(keys[rows], position)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:])[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def _restrict(logp: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
    """logp [R, V] with every token outside the top-k, then top-p (nucleus) set at -inf.

    As in common samplers, top-p keeps the smallest set of most likely candidates whose probability,
    renormalized over the top-k candidates, reaches top_p.
    """
    if top_k == 0 and top_p == 1.0:
        return logp
    if top_k > 0:
        candidates, index = logp.topk(min(top_k, logp.shape[-1]), dim=-1)  # sorted, descending
    else:
        candidates, index = logp.sort(dim=-1, descending=True)
    if top_p < 1.0:
        probs = candidates.softmax(-1)
        candidates = candidates.masked_fill(probs.cumsum(-1) - probs >= top_p, float("-inf"))
    return torch.full_like(logp, float("-inf")).scatter(1, index, candidates)


# ----------------------------------------------------------------------------- decode steps


@dataclass
class Keep:
    rows: torch.Tensor  # [R] long: the held rows to copy into the compacted cache, in order
    padding: torch.Tensor  # [R] bool: copies that only fill the row bucket (dead from now on)


def _decode_step(model: modeling.Transformer, fixed_shapes: bool, cuda_graphs: str):
    on_cuda = model.device.type == "cuda"
    if not (fixed_shapes or on_cuda):
        return EagerStep(model)
    return FixedShapeStep(model, graphs=on_cuda and cuda_graphs != "off", required=cuda_graphs == "on")


class EagerStep:
    """model.decode_step over exactly the filled slots; once a quarter of the held rows have finished,
    they are dropped (the copy costs about one step, and is repaid within a few)."""

    def __init__(self, model: modeling.Transformer):
        self.model = model

    def __call__(self, tokens, alive, cache):
        return self.model.decode_step(tokens, alive, cache)

    @staticmethod
    def rows_to_keep(done: torch.Tensor, n_done: int) -> Keep | None:
        if n_done < max(1, len(done) // 4):
            return None
        running = (~done).nonzero()[:, 0]
        return Keep(running, torch.zeros_like(running, dtype=torch.bool))


def bucket(n: int) -> int:
    """The smallest power of two >= n: the row counts and attention spans of fixed-shape steps."""
    return 1 << (n - 1).bit_length()


class FixedShapeStep:
    """model.decode_step with shapes from buckets: rows are a power of two (after the first compaction)
    and attention reads the first bucket(filled slots) cache slots. With graphs, each (cache, span) is
    captured on first use into a CUDA graph and replayed for every later step of that shape; a cache
    replaced by compaction takes its graphs with it. All graphs share one memory pool (they never run
    at once).
    """

    def __init__(self, model: modeling.Transformer, graphs: bool, required: bool):
        self.model, self.graphs, self.required = model, graphs, required
        self.cache, self.captured = None, {}  # span -> (tokens, alive, logits, graph) for self.cache
        self.pool = None

    def __call__(self, tokens, alive, cache):
        span = min(cache.max_len, bucket(cache.length + cache.group))  # covers the slot this step writes
        if not self.graphs:
            return self.model.decode_step(tokens, alive, cache, span=span)
        if cache is not self.cache:
            self.cache, self.captured = cache, {}
        if span not in self.captured:
            try:
                self.captured[span] = self._capture(tokens, alive, cache, span)
            except Exception as err:  # noqa: BLE001 - "auto" falls back on any capture failure but memory
                if self.required or isinstance(err, torch.OutOfMemoryError):
                    raise
                warnings.warn(f"CUDA graph capture failed, decoding without graphs: {err!r}", stacklevel=2)
                self.graphs, self.cache, self.captured = False, None, {}
                return self.model.decode_step(tokens, alive, cache, span=span)
        static_tokens, static_alive, logits, graph = self.captured[span]
        static_tokens.copy_(tokens)
        static_alive.copy_(alive)
        graph.replay()
        return logits  # overwritten by the next replay; the sampler reads it first

    def _capture(self, tokens, alive, cache, span):
        """Capture decode_step on copies of this step's inputs. Warm-up runs and the capture compute this
        very step (decode_step writes the current slot and does not advance), so running it again is harmless."""
        device = tokens.device
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        static_tokens, static_alive = tokens.clone(), alive.clone()
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up outside the graph: kernel choice and workspace allocation
            for _ in range(2):
                self.model.decode_step(static_tokens, static_alive, cache, span=span)
        torch.cuda.current_stream(device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits = self.model.decode_step(static_tokens, static_alive, cache, span=span)
        return static_tokens, static_alive, logits, graph

    @staticmethod
    def rows_to_keep(done: torch.Tensor, n_done: int) -> Keep | None:
        """Compact once the running rows fit in a row bucket of at most half the held rows."""
        running_count = len(done) - n_done
        rows = bucket(running_count)
        if 2 * rows > len(done):
            return None
        running = (~done).nonzero()[:, 0]
        padding = torch.arange(rows, device=done.device) >= running_count
        return Keep(torch.cat([running, running[:1].expand(rows - running_count)]), padding)


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
    import weights
    from data import TEMPLATES, render_prompt, stop_ids

    class Parser(argparse.ArgumentParser):
        def error(self, message: str):  # one line, not the usage block
            self.exit(2, f"rollout.py: {message}\n")

    parser = Parser(prog="rollout.py", description=main.__doc__, allow_abbrev=False,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", nargs="*", help="the problem; read from stdin when not given")
    parser.add_argument("--model", default=None, help="model directory or hub id (default: the offline SmolLM2)")
    parser.add_argument("--adapter", default=None, help="a LoRA adapter directory, e.g. runs/NAME/best")
    parser.add_argument("--template", default="equation", help=f"one of {', '.join(TEMPLATES)} (default: equation)")
    parser.add_argument("--system", default="You are a helpful assistant.", help="system message, as train.py's")
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
            parser.error(f"--template {args.template!r}: expected one of {', '.join(TEMPLATES)} "
                         "or a string with {problem}")
        if args.adapter is not None and not Path(args.adapter).is_dir():
            parser.error(f"--adapter {args.adapter}: no such directory")
        model = weights.from_pretrained(args.model)
        tokenizer = weights.load_tokenizer(args.model)
        if args.adapter is not None:
            lora.load(model, args.adapter)
        prompt = render_prompt(tokenizer, problem, args.template, args.system)
        out = generate(model, [prompt], samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens,
                       temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                       stop_ids=stop_ids(model.config, tokenizer), seed=args.seed, tokenizer=tokenizer)
    except (ValueError, OSError) as error:
        parser.error(str(error))
    except KeyboardInterrupt:
        print("\nrollout.py: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    grades = None if args.answer is None else reward.reward(
        out.texts, [args.answer] * len(out.texts), problems=[problem] * len(out.texts), template=args.template)
    for i, text in enumerate(out.texts):
        verdict = "" if grades is None else f" [{'correct' if grades[i] == 1.0 else 'wrong'}: " \
                                            f"{reward.answer_of(text, args.template)!r}]"
        print(f"--- sample {i + 1}{' (truncated)' if out.truncated[i] else ''}{verdict}\n{text or '(empty)'}")
    if grades is not None:
        print(f"--- {int(sum(grades))} of {len(grades)} correct")


if __name__ == "__main__":
    main()
