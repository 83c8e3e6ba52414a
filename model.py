"""A hand-written decoder-only transformer for the Llama, Qwen2 and Qwen3 families.

One set of blocks covers all three: they differ only in whether q/k/v carry a bias
(Qwen2), whether q and k are RMS-normalized per head before RoPE (Qwen3), and in config
details (explicit head_dim, tied embeddings). Module names mirror Hugging Face's, so a
checkpoint's state dict loads by plain assignment and LoRA adapters keep PEFT's key names.

Three ways in:
- `model(input_ids, pad_mask)` returns logits [B, T, V], the plain path.
- `model.token_logprobs(input_ids, pad_mask)` returns the log-probability of every token
  given its prefix, computing the vocabulary projection in chunks so [B, T, V] fp32 logits
  never exist for the whole batch (`hidden_logprobs` does the same from hidden states).
- `model.run_blocks(input_ids, positions, attention)` runs the blocks at given RoPE positions with
  attention handed to a hook: how the engine runs its paged KV cache (engine/kv_cache.py) and its
  training pass with each shared prompt run once (engine/shared_prompts.py).

Padding: rows may be left-padded (prompts) and right-padded (completions). Positions count
real tokens only, so a padded row gives the same result as the same row alone.

Weights come in and go out through infra/weights.py (`weights.from_pretrained`, `weights.save_pretrained`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

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
            raise ValueError(
                f"config.json: model_type {model_type!r} is not supported; "
                f"supported types: {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
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
        # Normalize in fp32 (float64 stays float64) and cast back before the weight, as the reference
        # implementations do, so bf16 runs round the same way.
        x32 = x.to(at_least_fp32(x.dtype))
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The same norm as F.rms_norm, the sampler's decode step's: one fused kernel on CUDA from torch 2.8,
        its decomposition elsewhere. It scales by the weight before casting back, so in bf16 it rounds once
        where forward rounds twice; in fp32 and float64 it computes forward's products."""
        return F.rms_norm(x, self.weight.shape, self.weight, self.eps)


def at_least_fp32(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16 and fp32, float64 for float64: the precision of norms and log-probs. A float64 model
    is the exact reference of the tests, so nothing in it rounds to fp32."""
    return torch.promote_types(dtype, torch.float32)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos and signed sin, each [B, 1, T, head_dim], for integer positions [B, T].

    Dimension i pairs with i + head_dim/2 (the Hugging Face layout). The sin of the first half carries
    the rotation's minus sign, so apply_rope needs one roll instead of slicing, negating and concatenating.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [B, T, head_dim/2]
    cos, sin = angles.cos(), angles.sin()
    return torch.cat([cos, cos], dim=-1)[:, None].to(dtype), torch.cat([-sin, sin], dim=-1)[:, None].to(dtype)


def rope_rotation(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> torch.Tensor:
    """RoPE at integer positions [N] as one 2x2 rotation per frequency, [N, 2, 2, head_dim/2]: out_i = sum_j
    rotation[i, j] * x_j with x_0, x_1 the halves of a head, the values of rope_cos_sin. Applied as one product
    and one sum over j (engine/kv_cache.py), it rounds as apply_rope's x * cos + rotate_half(x) * sin does."""
    cos, signed_sin = (t.view(len(positions), 2, -1) for t in rope_cos_sin(positions[:, None], head_dim, theta, dtype))
    # [[cos, -sin], [sin, cos]]: signed_sin holds -sin in its first half and sin in its second
    return torch.stack([cos[:, 0], signed_sin[:, 0], signed_sin[:, 1], cos[:, 1]], 1).view(len(positions), 2, 2, -1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: the minus sign lives in signed_sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class AttentionHook(Protocol):
    """What takes the place of causal self-attention in a pass (Transformer.run_blocks): the engine's paged
    cache (it stores the keys and values it is given) and its shared-prompt layout."""

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, T, D], k and v [B, kv_heads, T, D] after RoPE -> attention output [B, T, heads, D]."""


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

    def forward(self, x, cos, sin, layer: int = 0, attention: AttentionHook | None = None):
        B, T, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(B, T, cfg.num_heads, cfg.head_dim)
        k = self.k_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        v = self.v_proj(x).view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, T, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if attention is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)
        else:
            out = attention.attend(layer, q, k, v)
        return self.o_proj(out.reshape(B, T, -1))


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

    def forward(self, x, cos, sin, layer=0, attention=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, attention)
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

    def hidden(self, input_ids: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-normed hidden states [B, T, hidden] for input_ids [B, T]."""
        T = input_ids.shape[1]
        positions = torch.arange(T, device=input_ids.device).expand_as(input_ids)
        if pad_mask is None:
            return self.model.norm(self.run_blocks(input_ids, positions))
        # Rotate each row so its real tokens start at slot 0: plain causal attention is then exact
        # for them (pads sit after every real token), which keeps the fast fused attention kernels.
        shift = leading_pads(pad_mask)
        gather = (torch.arange(T, device=input_ids.device) + shift[:, None]) % T  # [B, T]
        check_contiguous(pad_mask.gather(1, gather))
        h = self.model.norm(self.run_blocks(input_ids.gather(1, gather), positions))
        scatter = (torch.arange(T, device=input_ids.device) - shift[:, None]) % T
        return h.gather(1, scatter[..., None].expand_as(h))

    def run_blocks(
        self, input_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionHook | None = None
    ) -> torch.Tensor:
        """The last block's states [B, T, hidden], before the final norm, for input_ids [B, T] at RoPE positions
        [B, T]. Without `attention` each row attends causally to itself; with it, attention.attend does instead,
        in every layer. Under FSDP this is the registered forward method (infra/fsdp.py): callers apply the
        final norm and the vocabulary projection to what it returns, while the root stays gathered."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, block in enumerate(self.model.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, i, attention, use_reentrant=False)
            else:
                x = block(x, cos, sin, i, attention)
        return x

    def forward(self, input_ids: torch.Tensor, pad_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, vocab] in the model's dtype."""
        return self.lm_head(self.hidden(input_ids, pad_mask))

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        pad_mask: torch.Tensor | None = None,
        *,
        temperature: float = 1.0,
        with_entropy: bool = False,
        chunk_tokens: int = 1024,
    ):
        """log p(input_ids[:, t] | input_ids[:, :t]) as [B, T] fp32, with logp[:, 0] = 0.

        Returns (logp, entropy) with entropy [B, T] or None. See hidden_logprobs for the memory cost.
        """
        h = self.hidden(input_ids, pad_mask)
        logp, entropy = self.hidden_logprobs(
            h, input_ids, start=1, temperature=temperature, with_entropy=with_entropy, chunk_tokens=chunk_tokens
        )
        zero = logp.new_zeros(input_ids.shape[0], 1)
        return torch.cat([zero, logp], 1), None if entropy is None else torch.cat([zero, entropy], 1)

    def hidden_logprobs(
        self,
        h: torch.Tensor,
        input_ids: torch.Tensor,
        *,
        start: int = 1,
        temperature: float = 1.0,
        with_entropy: bool = False,
        entropy_grad: bool = False,
        chunk_tokens: int = 1024,
    ):
        """log-probs [B, T - start] fp32 (float64 for a float64 model) of input_ids[:, start:] from
        hidden states h [B, T, hidden].

        Only positions from `start` on pay for the vocabulary projection (training passes the prompt
        length: prompt tokens need no log-prob). It runs chunk_tokens positions at a time and, under
        autograd, each chunk is recomputed in the backward pass, so peak memory holds one
        [chunk, V] fp32 block rather than [B, T, V]. Returns (logp, entropy or None).

        The entropy is a metric, computed without autograd, so no chunk's [chunk, V] blocks outlive the
        chunk (with a graph, each would stay alive until the backward). entropy_grad=True (an entropy
        bonus) differentiates it; inside the chunk's checkpoint, so memory still holds one block.
        """
        h = h[:, start - 1 : -1]  # the states that predict tokens start..T-1
        B, T, H = h.shape
        flat_h, flat_targets = h.reshape(-1, H), input_ids[:, start:].reshape(-1)
        logps, entropies = [], []
        for lo in range(0, flat_h.shape[0], chunk_tokens):
            args = (
                flat_h[lo : lo + chunk_tokens],
                flat_targets[lo : lo + chunk_tokens],
                temperature,
                with_entropy,
                entropy_grad,
            )
            if torch.is_grad_enabled() and flat_h.requires_grad:
                logp, entropy = checkpoint(self._chunk_logprobs, *args, use_reentrant=False)
            else:
                logp, entropy = self._chunk_logprobs(*args)
            logps.append(logp)
            entropies.append(entropy)
        logp = torch.cat(logps).view(B, T)
        return logp, torch.cat(entropies).view(B, T) if with_entropy else None

    def _chunk_logprobs(self, h, targets, temperature: float, with_entropy: bool, entropy_grad: bool = False):
        # Each [chunk, V] block is as large as the activations of a short micro-batch: none is made twice.
        logits = self.lm_head(h).to(at_least_fp32(h.dtype))
        logp_all = torch.log_softmax(logits if temperature == 1 else logits / temperature, dim=-1)
        del logits
        logp = logp_all.gather(-1, targets[:, None]).squeeze(-1)
        if not with_entropy:
            return logp, logp.new_zeros(0)
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            probs = logp_all.exp()  # in place below only without a graph: exp's backward reads its output
            entropy = -(probs * logp_all if torch.is_grad_enabled() else probs.mul_(logp_all)).sum(-1)
        return logp, entropy


def leading_pads(pad_mask: torch.Tensor) -> torch.Tensor:
    """Number of pad slots before each row's first real token, [B]."""
    return (pad_mask.long().cumsum(1) == 0).sum(1)


def check_contiguous(rotated_mask: torch.Tensor) -> None:
    """After rotation every row must be real tokens then pads; anything else is unsupported."""
    count = rotated_mask.sum(1, keepdim=True)
    prefix = torch.arange(rotated_mask.shape[1], device=rotated_mask.device)[None] < count
    if not torch.equal(prefix, rotated_mask):
        raise ValueError("pad_mask: each row must be left pads, then real tokens, then right pads")
