"""Sampling G completions per prompt with a KV cache: the rollout half of a GRPO step.

Sampling takes most of a GRPO step's wall clock, so this file is built for speed while staying plain:
- each distinct prompt is prefilled once (one left-padded batch) and its cache shared by its G samples:
  the prompt's keys are stored once and attention reads them once for all G rows (KVCache.fork);
- every decode step feeds one token per row through Transformer.decode_step, whose shapes never change,
  so on CUDA it is captured once in a CUDA graph and replayed without Python or launch overhead;
- on CPU the same step runs eagerly, and rows that finished are dropped from the batch as they pile up
  (the rows kept then take their own copy of their prompt's keys);
- a token is drawn by inverse-CDF sampling (one uniform number per row) instead of torch.multinomial,
  which draws one random number per vocabulary entry and costs as much as a third of a CPU step.

old_logp is log_softmax(logits / temperature) of the sampled token under the *full* tempered
distribution: exactly what model.token_logprobs(..., temperature=temperature) recomputes during
training, so the importance ratio is 1 when the weights did not change. top-k and top-p only restrict
which tokens can be drawn; their truncation is not part of old_logp (the training forward pass cannot
know it). Temperature 0 is greedy decoding, and its old_logp are taken at temperature 1.
The sampler runs in the model's dtype: load the model in bf16 on a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch

import model as modeling

PAD_ID = 0  # fills left padding and finished rows; any id works because those slots are masked out


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
             tokenizer=None) -> Rollout:
    """Sample samples_per_prompt completions for each prompt (token-id lists of any lengths).

    Rows stop independently at any of stop_ids or after max_new_tokens. The same seed gives the same
    samples on the same device.
    """
    _check_args(model, prompts, samples_per_prompt, max_new_tokens, temperature, top_p, top_k)
    G = samples_per_prompt
    try:
        with torch.inference_mode():
            prompt_ids, prompt_mask, completion_ids, old_logp, completion_mask = _sample_rows(
                model, prompts, G, max_new_tokens, temperature, top_p, top_k, stop_ids, seed)
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"out of memory sampling {len(prompts)} prompts x {G} samples x {max_new_tokens} new tokens: "
            f"lower samples_per_prompt, max_new_tokens or the number of prompts per call") from err

    # Outside inference mode, so the results can enter the loss's autograd graph (clone() makes
    # ordinary tensors of inference tensors; ops on them, like cat, return ordinary tensors too).
    completion_ids, old_logp, completion_mask = completion_ids.clone(), old_logp.clone(), completion_mask.clone()
    lengths = completion_mask.sum(1)  # [N], >= 1: every row samples at least one token
    last_token = completion_ids.gather(1, (lengths - 1)[:, None])[:, 0]
    finished = torch.isin(last_token, torch.tensor(stop_ids, dtype=torch.long, device=last_token.device))
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
        prompt_len=prompt_ids.shape[1],
        texts=tokenizer.batch_decode(completions, skip_special_tokens=True) if tokenizer is not None else None,
    )


def _check_args(model, prompts, samples_per_prompt, max_new_tokens, temperature, top_p, top_k) -> None:
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


def _sample_rows(model, prompts, G, max_new_tokens, temperature, top_p, top_k, stop_ids, seed):
    """Prefill, then decode; returns the left-padded prompts [B, P] with their mask, and [N, C] results."""
    device = model.device
    P = max(len(p) for p in prompts)
    prompt_ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts], device=device)  # [B, P]
    prompt_mask = torch.tensor([[False] * (P - len(p)) + [True] * len(p) for p in prompts], device=device)

    # Prefill the B distinct prompts once; only the last position's logits are needed.
    cache = model.new_cache(len(prompts), P + G * max_new_tokens)
    last_hidden = model.hidden(prompt_ids, prompt_mask, cache)[:, -1]  # left padding: last slot is real
    logits = model.lm_head(last_hidden).repeat_interleave(G, dim=0)  # [N, V]
    cache = cache.fork(G)

    generator = torch.Generator(device).manual_seed(seed)
    sample = partial(_sample, temperature=temperature, top_p=top_p, top_k=top_k, generator=generator)
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    on_gpu = device.type == "cuda"
    step = _graphed_decode_step(model, cache) if on_gpu else _eager_decode_step(model)
    return prompt_ids, prompt_mask, *_decode(step, cache, logits, sample, stop, max_new_tokens, compact=not on_gpu)


def _decode(step: Callable, cache: modeling.KVCache, logits: torch.Tensor, sample: Callable, stop: torch.Tensor,
            max_new_tokens: int, compact: bool):
    """The token loop. Returns completion ids, old_logp and mask, each [N, C] with C <= max_new_tokens.

    `rows` maps the rows the cache still holds to their place in the output. With compact=True, once a
    quarter of the held rows have finished, they are dropped from the cache (one copy of it) so later
    steps do not compute them; otherwise (the CUDA graph needs fixed shapes) a finished row keeps being
    fed a masked pad token.
    """
    N, device = logits.shape[0], logits.device
    completion_ids = torch.full((N, max_new_tokens), PAD_ID, dtype=torch.long, device=device)
    old_logp = torch.zeros(N, max_new_tokens, device=device)
    completion_mask = torch.zeros(N, max_new_tokens, dtype=torch.bool, device=device)
    rows = torch.arange(N, device=device)
    done = torch.zeros(N, dtype=torch.bool, device=device)  # over the held rows
    for t in range(max_new_tokens):
        tokens, logp = sample(logits)
        alive = ~done
        tokens = tokens.masked_fill(done, PAD_ID)
        completion_ids[rows, t] = tokens
        old_logp[rows, t] = logp.masked_fill(done, 0.0)
        completion_mask[rows, t] = alive
        done = done | (alive & torch.isin(tokens, stop))
        n_done = int(done.sum())  # the one host sync per step
        if n_done == len(rows) or t + 1 == max_new_tokens:
            break
        if compact and n_done >= max(1, len(rows) // 4):
            keep = ~done
            rows, cache, tokens, done = rows[keep], cache.select(keep), tokens[keep], done[keep]
        tokens = tokens.masked_fill(done, PAD_ID)
        logits = step(tokens, ~done, cache)
        cache.advance(~done)
    C = t + 1
    return completion_ids[:, :C], old_logp[:, :C], completion_mask[:, :C]


def _sample(logits: torch.Tensor, temperature: float, top_p: float, top_k: int, generator: torch.Generator):
    """One token per row from logits [R, V]; returns tokens [R] and their full-distribution logp [R]."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)  # [R, V]
    cdf = _restrict(logp, top_p, top_k).exp().cumsum(-1)  # [R, V], unnormalized
    # u in (0, 1]: the first index whose cdf reaches u * total always has a nonzero probability.
    u = 1.0 - torch.rand(logits.shape[0], 1, generator=generator, device=logits.device)
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


def _eager_decode_step(model: modeling.Transformer) -> Callable:
    """model.decode_step attending over the filled cache slots only: shapes may change on the CPU."""
    return lambda tokens, alive, cache: model.decode_step(tokens, alive, cache, whole_cache=False)


def _graphed_decode_step(model: modeling.Transformer, cache: modeling.KVCache) -> Callable:
    """model.decode_step on `cache`, captured once in a CUDA graph; calling it copies the inputs in and replays.

    The capture runs on dummy tokens: decode_step only writes the current slot and does not advance
    the cache, and the first real replay overwrites that slot.
    """
    N, device = cache.valid.shape[0], cache.valid.device
    tokens = torch.full((N,), PAD_ID, dtype=torch.long, device=device)
    alive = torch.ones(N, dtype=torch.bool, device=device)
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up outside the graph: kernel choice and workspace allocation
        for _ in range(3):
            model.decode_step(tokens, alive, cache)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits = model.decode_step(tokens, alive, cache)

    def step(new_tokens: torch.Tensor, new_alive: torch.Tensor, _cache: modeling.KVCache) -> torch.Tensor:
        # _cache is the captured cache: rows are never dropped on this path, so it does not change.
        tokens.copy_(new_tokens)
        alive.copy_(new_alive)
        graph.replay()
        return logits  # overwritten by the next replay; the sampler reads it first

    return step
