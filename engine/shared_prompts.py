"""The training pass of rows that share prompts, each distinct prompt run once (hidden_shared): the
training pass's twin of the sampler's pool, where a prompt's G samples share its blocks. train.py's
policy_states runs a GRPO group's rows through it and turns the states into log-probs with
Transformer.hidden_logprobs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from model import ModelConfig, Transformer, check_contiguous, leading_pads


def hidden_shared(
    model: Transformer,
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    owner: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
) -> torch.Tensor:
    """Final-normed states [R, 1 + C, hidden] of R rows that share U prompts, each prompt run once
    (SharedPrompts): for row r, the state of the last token of its prompt prompt_ids[owner[r]], then
    those of its completion completion_ids[r]. They are model.hidden() of the row run whole, at those tokens.

    prompt_ids, prompt_mask [U, P]: each prompt's tokens contiguous (left-padded, as the sampler's),
    at least one; owner [R] long in [0, U); completion_ids, completion_mask [R, C]: tokens, then pads.
    """
    (U, P), (R, C), device = prompt_ids.shape, completion_ids.shape, prompt_ids.device
    rotate = (torch.arange(P, device=device) + leading_pads(prompt_mask)[:, None]) % P  # real tokens first
    prompt_ids, prompt_mask = prompt_ids.gather(1, rotate), prompt_mask.gather(1, rotate)
    check_contiguous(prompt_mask)
    check_contiguous(completion_mask)
    lengths = prompt_mask.sum(1)  # [U]
    ids = torch.cat([prompt_ids.flatten(), completion_ids.flatten()])[None]  # [1, U * P + R * C]
    positions = torch.cat(
        [
            torch.arange(P, device=device).repeat(U),
            (lengths[owner, None] + torch.arange(C, device=device)).flatten(),
        ]
    )[None]
    x = model.run_blocks(ids, positions, SharedPrompts(prompt_mask, owner, completion_mask, model.config))
    last_prompt_token = x[0, : U * P].view(U, P, -1)[torch.arange(U, device=device), lengths - 1]  # [U, hidden]
    # normed after the selection: the norm is per token, and most prompt states are not needed
    return model.model.norm(torch.cat([last_prompt_token[owner, None], x[0, U * P :].view(R, C, -1)], 1))


class SharedPrompts:
    """Rows that share prompts, laid out for one pass in which each distinct prompt runs once: the attention
    hook (model.AttentionHook) of hidden_shared.

    U prompts of P slots, real tokens first (rotated so, as Transformer.hidden does), and R completions
    of C slots, real tokens then pads; owner [R] is each row's prompt. The tokens run through the blocks
    as one flat sequence, the prompts' U * P slots then the completions' R * C, so every projection,
    norm and MLP is one matrix product for both; only attention (`attend`) tells them apart:
    - a prompt attends causally to itself, as a row of the plain path does (fused causal kernels);
    - a completion's queries attend to its prompt's keys and values, gathered by owner (with autograd,
      so the gradient of a prompt's keys and values is the sum over its rows), and to its own earlier
      tokens, under an additive mask built once per pass.

    The fused kernels that take a mask do not all take grouped-query attention, so the query heads that
    share a kv head are joined another way, whichever costs less memory: short completions (C at most
    twice the head size) fold them into one query axis, as the decode step's gather attention does, which
    repeats the mask per folded head; longer ones copy each layer's keys and values per query head instead.
    """

    def __init__(self, prompt_mask: torch.Tensor, owner: torch.Tensor, completion_mask: torch.Tensor, cfg: ModelConfig):
        (U, P), (R, C) = prompt_mask.shape, completion_mask.shape
        self.owner, self.sizes, self.cfg = owner, (U, P, R, C), cfg
        self.fold = C <= 2 * cfg.head_dim
        self.prompt_lengths = prompt_mask.sum(1)[owner]  # [R]: each row's prompt tokens
        self.bias = None

    def _bias(self, dtype: torch.dtype) -> torch.Tensor:
        """The additive mask, made at the first layer in the dtype the blocks compute in (under FSDP2 the
        gathered weights', not the shards', known only inside the forward); every layer reads it."""
        if self.bias is None:
            U, P, R, C = self.sizes
            device = self.owner.device
            keys, queries = torch.arange(P + C, device=device), torch.arange(C, device=device)
            own_prompt = keys < self.prompt_lengths[:, None, None]  # [R, 1, P + C]: its prompt's real tokens
            own_past = (keys >= P) & (keys - P <= queries[:, None])  # [C, P + C]: its own tokens up to the query
            hidden = ~(own_prompt | own_past)  # [R, C, P + C]
            bias = torch.zeros(R, 1, C, P + C, dtype=dtype, device=device).masked_fill_(hidden[:, None], float("-inf"))
            if self.fold:  # [R, 1, (head, t), P + C]
                heads_per_kv = self.cfg.num_heads // self.cfg.num_kv_heads
                bias = bias.expand(-1, heads_per_kv, -1, -1).reshape(R, 1, heads_per_kv * C, P + C)
            self.bias = bias
        return self.bias

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output [1, tokens, heads, D] of the flat sequence, from q [1, heads, tokens, D] and
        k, v [1, kv_heads, tokens, D]; every layer's the same way (`layer` is the paged cache's argument)."""
        U, P, R, C = self.sizes
        heads, kv_heads, D = q.shape[1], k.shape[1], q.shape[3]
        split = U * P
        qp, kp, vp = (x[0, :, :split].unflatten(1, (U, P)).transpose(0, 1) for x in (q, k, v))  # [U, heads, P, D]
        qc, kc, vc = (x[0, :, split:].unflatten(1, (R, C)).transpose(0, 1) for x in (q, k, v))  # [R, heads, C, D]
        prompt_out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        keys, values = torch.cat([kp[self.owner], kc], 2), torch.cat([vp[self.owner], vc], 2)  # [R, kv, P + C, D]
        if self.fold:
            folded = qc.reshape(R, kv_heads, heads // kv_heads * C, D)
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=self._bias(q.dtype))
            out = out.unflatten(2, (heads // kv_heads, C)).permute(0, 3, 1, 2, 4)  # [R, C, kv_heads, ., D]
        else:
            keys, values = (x.repeat_interleave(heads // kv_heads, 1) for x in (keys, values))  # [R, heads, ., D]
            out = F.scaled_dot_product_attention(qc, keys, values, attn_mask=self._bias(q.dtype)).transpose(1, 2)
        return torch.cat([prompt_out.transpose(1, 2).reshape(split, heads, D), out.reshape(R * C, heads, D)])[None]
