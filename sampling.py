"""How the sampler draws a token: the per-row random streams and the temperature, top-k and top-p rules.

A token is drawn by inverse-CDF sampling from one uniform number per row, a hash of (seed, prompt index,
sample index, token position), so a row's sample never depends on which rows share its batch, when it
was admitted, or how often it was preempted. Its old_logp is log_softmax(logits / temperature) of the
drawn token under the *full* tempered distribution: top-k and top-p only restrict which tokens can be
drawn, and their truncation is not part of old_logp (the training forward pass cannot know it).
Temperature 0 is greedy decoding, and its old_logp are taken at temperature 1. rollout.generate hands
`draw`, bound to its rows' keys and settings, to the engine's decode loop.
"""

from __future__ import annotations

import torch

MASK32 = 0xFFFFFFFF

# ----------------------------------------------------------------------------- random streams


def _mul32(h, c: int):
    """h * c mod 2^32 for h in [0, 2^32) (int or int64 tensor), with no product over 2^48: no overflow."""
    return ((h & 0xFFFF) * c + ((((h >> 16) * c) & 0xFFFF) << 16)) & MASK32


def mix32(h):
    """MurmurHash3's finalizer: a bijection of 32-bit integers in which every input bit flips about
    half of the output bits. Works on Python ints and on int64 tensors of any device, in a graph too."""
    h = h ^ (h >> 16)
    h = _mul32(h, 0x85EBCA6B)
    h = h ^ (h >> 13)
    h = _mul32(h, 0xC2B2AE35)
    return h ^ (h >> 16)


def row_keys(seed: int, first_prompt: int, prompts: int, G: int, device) -> torch.Tensor:
    """[N + 1] int64 hash of (seed, prompt index in the step, sample index) for each row, prompt-major;
    the extra last key serves padding rows."""
    seed_key = mix32(mix32(seed & MASK32) ^ ((seed >> 32) & MASK32))
    prompt = torch.arange(first_prompt, first_prompt + prompts, device=device).repeat_interleave(G)
    sample = torch.arange(G, device=device).repeat(prompts)
    keys = mix32(mix32(seed_key ^ (prompt & MASK32)) ^ sample)
    return torch.cat([keys, keys.new_zeros(1)])


def uniform(keys: torch.Tensor, position) -> torch.Tensor:
    """One uniform in (0, 1] per key at its token position (an int or [R]), [R, 1] fp32: 24 hashed bits,
    exact in fp32."""
    h = mix32(keys ^ position)
    return (((h >> 8) + 1).float() * 2.0**-24)[:, None]


# ----------------------------------------------------------------------------- drawing a token


def draw(
    logits: torch.Tensor,
    *,
    keys: torch.Tensor,
    rows: torch.Tensor,
    position: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from logits [R, V] for the output rows `rows` [R] (indices into keys) at their
    token positions [R]; returns tokens [R] and their full-distribution logp [R]."""
    logits = logits.float()
    if temperature == 0:
        tokens = logits.argmax(-1)
        return tokens, torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    logp = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)  # [R, V]
    # the cumulative sum in place: one fresh [R, V] tensor fewer a draw (a fresh one can cost the CPU a page
    # fault per 4 KiB of it, docs/engine.md)
    cdf = restrict(logp, top_p, top_k).exp().cumsum_(-1)  # [R, V], unnormalized
    # u in (0, 1]: the first index whose cdf reaches u * total always has a nonzero probability.
    u = uniform(keys[rows], position)
    tokens = torch.searchsorted(cdf, u * cdf[:, -1:])[:, 0]
    return tokens, logp.gather(1, tokens[:, None])[:, 0]


def restrict(logp: torch.Tensor, top_p: float, top_k: int) -> torch.Tensor:
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
