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

Weights come in and go out through weights.py (`weights.from_pretrained`, `weights.save_pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

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
    slot shared + t * group + g, so the slots filled so far are always one prefix of the cache, and
    attention over the first `span` slots covers every row (decode_step). A cache from new_cache has
    groups of one row: a plain per-row cache. fork(G) turns a filled cache of B prompts into B groups
    of G rows without copying anything, and attention then reads each group's slots once for all G
    rows' queries, in one kernel call per layer; select copies rows out into groups of one again.
    mark_new_slots is the one place that turns this layout into a step's slots and mask.

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
            for layer in range(layers):  # a layer at a time: the gathers' temporaries stay one layer big
                new[layer, :, :, :P] = old[layer, owners, :, :P]
                own = old[layer, :, :, P:self.length].unflatten(2, (T, G))  # [groups, kv, T, G, D]
                new[layer, :, :, P:P + T] = own[owners, :, :, members]  # [R, kv, T, D]
        out.valid = self.valid.new_zeros(R, P + T + room)
        out.valid[:, :P] = self.valid[rows, :P]
        own_valid = self.valid[rows, P:self.length].unflatten(1, (T, G))  # [R, T, G]
        out.valid[:, P:P + T] = own_valid[torch.arange(R, device=rows.device), :, members]
        out.next_pos = self.next_pos[rows]
        out.length = P + T
        out.slot = torch.full_like(self.slot, out.length)
        out.group, out.shared = 1, 0
        out.member = torch.zeros_like(out.next_pos)
        return out

    def mark_new_slots(self, present: torch.Tensor, span: int) -> torch.Tensor:
        """Mark in `valid` the slots of each row's next T tokens (present [rows, T]: real tokens) and
        return which of the first `span` slots each new query sees, [rows, T, span]: its row's valid
        slots up to its own. Reads the slot from the device tensor, so decode_step stays graph-safe.

        A pad or finished row's query sees only its own slot: its output is never used, but it must not be NaN.
        """
        T, device = present.shape[1], present.device
        own = self.slot + torch.arange(T, device=device) * self.group + self.member[:, None]  # [rows, T]
        self.valid.scatter_(1, own, present)
        slots = torch.arange(span, device=device)
        return ((slots <= own[..., None]) & self.valid[:, None, :span]) | (slots == own[..., None])

    def advance(self, alive: torch.Tensor, steps: int = 1) -> None:
        """Move past `steps` Transformer.decode_step calls; rows where alive [rows] is False keep their
        position. (Several at once is how the memory planner skips to the last step.)"""
        self.next_pos += alive * steps
        self.slot += self.group * steps
        self.length += self.group * steps


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
        mask = cache.mark_new_slots(pad_mask, end)
        h = self._run_blocks(input_ids, positions.clamp(min=0), cache, mask, slice(start, end))
        cache.length = end
        cache.slot.fill_(end)
        cache.next_pos += pad_mask.sum(1)
        return h

    def decode_step(self, tokens: torch.Tensor, alive: torch.Tensor, cache: KVCache,
                    span: int | None = None) -> torch.Tensor:
        """Logits [rows, V] for one token per row (tokens [rows] long, alive [rows] bool), written at each
        row's next slot of the KVCache layout: the one-token twin of model(tokens[:, None], alive[:, None], cache).

        With span=None it attends over exactly the filled slots and writes through a slice, the cheapest
        eager step. With a span (at least cache.length + cache.group, the slots filled once this step is
        written) it attends over the cache's first `span` slots, unwritten ones masked, and reads no
        Python number that changes between steps, so one CUDA-graph capture per (cache, span) serves
        every step that span covers. It does not move the cache forward; call cache.advance(alive)
        after it, which also makes a repeated call harmless.
        """
        G = cache.group
        if span is None:
            span, slots = cache.length + G, slice(cache.length, cache.length + G)
        elif not cache.length + G <= span <= cache.max_len:
            raise ValueError(f"span={span} must cover the {cache.length + G} slots filled after this step and fit "
                             f"the cache ({cache.max_len})")
        else:
            slots = cache.slot + torch.arange(G, device=tokens.device)
        mask = cache.mark_new_slots(alive[:, None], span)
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

        The entropy is a metric, never differentiated: it is computed without autograd, so no chunk's
        [chunk, V] blocks outlive the chunk (with a graph, each would stay alive until the backward).
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
        logits = self.lm_head(h)
        # at least fp32 (a float64 model, as the exactness tests run, keeps its precision)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
        logp_all = torch.log_softmax(logits, dim=-1)
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        if not with_entropy:
            return logp, logp.new_zeros(0)
        with torch.no_grad():
            entropy = -(logp_all.exp() * logp_all).sum(-1)
        return logp, entropy


def _leading_pads(pad_mask: torch.Tensor) -> torch.Tensor:
    """Number of pad slots before each row's first real token, [B]."""
    return (pad_mask.long().cumsum(1) == 0).sum(1)


def _check_contiguous(rotated_mask: torch.Tensor) -> None:
    """After rotation every row must be real tokens then pads; anything else is unsupported."""
    count = rotated_mask.sum(1, keepdim=True)
    prefix = torch.arange(rotated_mask.shape[1], device=rotated_mask.device)[None] < count
    if not torch.equal(prefix, rotated_mask):
        raise ValueError("pad_mask: each row must be left pads, then real tokens, then right pads")
