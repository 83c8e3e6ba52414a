"""A hand-written decoder-only transformer for the Llama, Qwen2 and Qwen3 families.

One set of blocks covers all three: they differ only in whether q/k/v carry a bias
(Qwen2), whether q and k are RMS-normalized per head before RoPE (Qwen3), and in config
details (explicit head_dim, tied embeddings). Module names mirror Hugging Face's, so a
checkpoint's state dict loads by plain assignment and LoRA adapters keep PEFT's key names.

Four ways in:
- `model(input_ids, pad_mask)` returns logits [B, T, V], the plain path.
- `model.token_logprobs(input_ids, pad_mask)` returns the log-probability of every token
  given its prefix, computing the vocabulary projection in chunks so [B, T, V] fp32 logits
  never exist for the whole batch (`hidden_logprobs` does the same from hidden states).
- `model.prefill(...)` and `model.decode_step(...)` sample over a KVPool, the paged KV cache whose
  blocks rows hold only for the tokens they have; rollout.py drives them.
- `model.hidden_shared(prompt_ids, prompt_mask, owner, completion_ids, completion_mask)` runs rows that
  share prompts with each prompt computed once (SharedPrompts): the training pass of a GRPO group,
  which train.py turns into log-probs with `hidden_logprobs`.

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


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin with rotate_half(x) = [-x2, x1]: the minus sign lives in signed_sin."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), signed_sin)


class KVPool:
    """The sampler's keys and values: every layer's in blocks of block_size token slots, k and v each
    [layers, blocks, block_size, kv_heads, head_dim], shared by all rows through their block tables.

    A row's t-th token sits at slot t of its sequence: block table[t // block_size], offset t % block_size,
    and its RoPE position is t too (rows hold no padding). A row holds blocks only for the tokens it has,
    and the G samples of a prompt share the blocks its prompt fills completely. Block 0 is never handed
    out: table entries past a row's blocks point at it, so a write past them or a read of them touches
    finite, unused slots (the pool starts zeroed) and never another row's.

    Attention reads a row's blocks in one of two ways (`attention`), both exact:
    - "flash" (CUDA, bf16/fp16, when torch has the paged FlashAttention kernel): torch.nn.attention.varlen
      reads the blocks in place through the block table, and only each row's own slots. It needs blocks
      of 256 slots.
    - "gather" (any device and dtype): the rows' first `span` slots are copied into one [rows, kv_heads,
      span, head_dim] tensor per layer (index_select over whole blocks), and F.scaled_dot_product_attention
      attends over them with the unfilled slots masked. Measured on 2 CPU cores (SmolLM2 shape, 32 rows x
      160 slots x 30 layers): the copies cost 9 ms a step next to 12 ms of attention, against 26 ms with
      advanced indexing; FlexAttention, the other in-place option, runs its math fallback on the CPU (the
      scores of every row against the whole pool) and needs torch.compile to be fast on a GPU.
    """

    def __init__(
        self, cfg: ModelConfig, blocks: int, block_size: int, dtype: torch.dtype, device, attention: str = "gather"
    ):
        if blocks < 2:
            raise ValueError(f"KVPool: blocks={blocks}; block 0 is reserved, so at least 2 are needed")
        if attention not in ("gather", "flash"):
            raise ValueError(f"KVPool: attention must be 'gather' or 'flash', got {attention!r}")
        shape = (cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.attention = block_size, attention

    @property
    def blocks(self) -> int:
        return self.k.shape[1]

    @staticmethod
    def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of keys and values over all layers."""
        return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize

    def copy_blocks(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Copy blocks source [n] into blocks target [n] in every layer (a prompt's partly filled last
        block, given to each of its samples)."""
        for pool in (self.k, self.v):
            pool.index_copy_(1, target, pool.index_select(1, source))


def flash_paged_attention_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether this torch has the paged FlashAttention kernel (varlen_attn with a block table) for this
    device and dtype. The meta device stands for CUDA here: the memory plan runs the CUDA path on it."""
    if device.type not in ("cuda", "meta") or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return False
    import inspect

    return "block_table" in inspect.signature(varlen_attn).parameters


@dataclass
class PagedRows:
    """Rows' view of a KVPool for one pass: table [rows, max_blocks] int32 block ids (0 past a row's
    blocks) and length [rows] long, the slots each row has filled (its next token's slot and position)."""

    pool: KVPool
    table: torch.Tensor
    length: torch.Tensor

    def slots(self, positions: torch.Tensor) -> torch.Tensor:
        """Flat slot ids (block * block_size + offset) of the given slots [rows, T] of each row's sequence."""
        bs = self.pool.block_size
        return self.table.long().gather(1, positions // bs) * bs + positions % bs

    def write(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store keys and values [n, kv_heads, head_dim] at flat slots [n]."""
        for pool, new in ((self.pool.k, k), (self.pool.v, v)):
            pool[layer].view(-1, *new.shape[1:]).index_copy_(0, slots, new)


class PrefillWrite:
    """What Attention does with a cache during a prefill (Transformer.prefill): store the batch's keys
    and values at slots 0..T-1 of each row's blocks, then attend causally within the batch."""

    def __init__(self, rows: PagedRows, T: int):
        self.rows = rows
        self.slots = rows.slots(torch.arange(T, device=rows.length.device).expand(len(rows.length), T)).reshape(-1)

    def attend(self, layer: int, q, k, v) -> torch.Tensor:
        """q [B, heads, T, D], k and v [B, kv_heads, T, D] -> attention output [B, T, heads, D]."""
        self.rows.write(layer, self.slots, k.transpose(1, 2).flatten(0, 1), v.transpose(1, 2).flatten(0, 1))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


class DecodeAttention:
    """One decode step's attention over the pool: each row's new key and value go to slot `length`, and
    its query attends over slots 0..length. Everything a layer needs is computed once per step, from
    device tensors only, so a CUDA graph captured for a (rows, span) shape serves every step of it."""

    def __init__(self, rows: PagedRows, span: int):
        pool, R = rows.pool, len(rows.length)
        bs = pool.block_size
        if span % bs or not 0 < span <= rows.table.shape[1] * bs:
            raise ValueError(
                f"span={span}: must be a positive multiple of the block size {bs} within the table "
                f"({rows.table.shape[1]} blocks)"
            )
        self.rows, self.span = rows, span
        self.write_slots = rows.slots(rows.length[:, None])[:, 0]  # [R]
        if pool.attention == "flash":
            seen = (rows.length + 1).int()  # [R] slots each query reads
            self.seen, self.cu_q = seen, torch.arange(R + 1, dtype=torch.int32, device=seen.device)
            self.cu_k = F.pad(seen.cumsum(0, dtype=torch.int32), (1, 0))
        else:
            self.gather = rows.table[:, : span // bs].reshape(-1).long()  # [R * blocks]
            positions = torch.arange(span, device=rows.length.device)
            self.mask = (positions <= rows.length[:, None])[:, None, None]  # [R, 1, 1, span]

    def __call__(self, layer: int, q, k, v) -> torch.Tensor:
        """q [R, heads, D], k and v [R, kv_heads, D] -> attention output [R, heads * D]."""
        rows, pool = self.rows, self.rows.pool
        rows.write(layer, self.write_slots, k, v)
        R, H, D = q.shape
        kv_heads = k.shape[1]
        if pool.attention == "flash":
            from torch.nn.attention.varlen import varlen_attn

            out = varlen_attn(
                q,
                pool.k[layer],
                pool.v[layer],
                self.cu_q,
                self.cu_k,
                1,
                self.span,
                seqused_k=self.seen,
                block_table=rows.table,
                enable_gqa=True,
            )
            return out.reshape(R, H * D)
        keys, values = (
            pool_[layer]
            .view(pool.blocks, -1)
            .index_select(0, self.gather)
            .view(R, self.span, kv_heads, D)
            .transpose(1, 2)
            for pool_ in (pool.k, pool.v)
        )
        # the query heads sharing a kv head are one query axis of length H / kv_heads: no copy per head
        out = F.scaled_dot_product_attention(q.view(R, kv_heads, H // kv_heads, D), keys, values, attn_mask=self.mask)
        return out.reshape(R, H * D)


# Row counts at which decode_linear puts the weight on the left of a CPU product, each with the largest
# in_features where that is faster: bench/rollout.py --products, at one and two threads, fp32 with MKL.
WEIGHT_LEFT_ROWS = {1: 1536, 2: float("inf"), 3: float("inf"), 4: 1536}
WEIGHT_LEFT_MEASURED = torch.backends.mkl.is_available()  # other CPU BLAS libraries were not measured


def decode_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for a decode step's activations x [rows, in] -> [rows, out].

    A long-tailed rollout spends most of its decode steps on a handful of rows. There, on the CPU (fp32,
    torch's MKL), x @ weight.T is slower than weight @ x.T with the same operands, and one row's
    matrix-vector product slower than a two-row product: at two and three rows by up to 5x for every
    shape measured (0.98x at worst), at one (padded to two) and four rows only up to 1536 input features
    (beyond, at one thread, 0.6x), and at five or more rows not at all (`bench/rollout.py --products`,
    and its table in the README). So there the rows of WEIGHT_LEFT_ROWS run with the weight on the left.
    The result differs from F.linear's by rounding only, as F.linear's own results differ between row
    counts; on other devices and dtypes, and without MKL, this is F.linear."""
    rows, in_features = x.shape
    measured = WEIGHT_LEFT_MEASURED and x.device.type == "cpu" and x.dtype == torch.float32
    if not measured or in_features > WEIGHT_LEFT_ROWS.get(rows, 0):
        return F.linear(x, weight, bias)
    columns = (F.pad(x, (0, 0, 0, 1)) if rows == 1 else x).t()  # [in, >= 2]
    out = torch.mm(weight, columns) if bias is None else torch.addmm(bias[:, None], weight, columns)
    return out[:, :rows].t().contiguous()


PROJECTION_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


class DecodeWeights:
    """The projections of decode_step, prepared once per rollout instead of once per token.

    A projection's base weight and bias are the parameters themselves. A projection may carry a low-rank
    term: a module with a `low_rank()` method (lora.LoRALinear) returns (A [r, in], scaled B [out, r])
    in fp32, or None when it adds nothing now. Those are cast to the model's dtype once, into buffers that
    keep their address (CUDA graphs read them) and that `refresh` overwrites in place. The projections of
    a group that reads one input (q, k, v; gate, up) share one product with their A's side by side, and
    each adds its part with one addmm against its B padded with zeros to the group's rank: per adapted
    projection one operator more than the base step, instead of a cast, a scaling and two products.
    """

    def __init__(self, model: Transformer):
        self.signature = self.signature_of(model)
        self.groups = []  # per layer and group: (modules, A [in, r_total] or None, B's [r_total, out] or None)
        for block in model.model.layers:
            for names in PROJECTION_GROUPS:
                modules = [_projection(block, name) for name in names]
                terms = [_low_rank(m) for m in modules]
                ranks = [0 if t is None else t[0].shape[0] for t in terms]
                if not sum(ranks):
                    self.groups.append((modules, None, [None] * len(modules)))
                    continue
                device, dtype = model.device, model.dtype
                A = torch.zeros(modules[0].weight.shape[1], sum(ranks), dtype=dtype, device=device)
                Bs = [
                    None if not r else torch.zeros(sum(ranks), m.weight.shape[0], dtype=dtype, device=device)
                    for m, r in zip(modules, ranks)
                ]
                self.groups.append((modules, A, Bs))
        self.refresh(model)

    @staticmethod
    def signature_of(model: Transformer) -> tuple:
        """Which projections carry a low-rank term and of what rank: buffers built for one signature
        serve any adapter values of it."""
        return tuple(
            None if (t := _low_rank(_projection(block, name))) is None else t[0].shape
            for block in model.model.layers
            for names in PROJECTION_GROUPS
            for name in names
        )

    @torch.no_grad()
    def refresh(self, model: Transformer) -> None:
        """Copy the current adapter values into the buffers (cast and scaled once)."""
        if self.signature_of(model) != self.signature:
            raise ValueError("DecodeWeights.refresh: the model's adapters changed shape; build new DecodeWeights")
        for modules, A, Bs in self.groups:
            lo = 0
            for module, B in zip(modules, Bs):
                term = _low_rank(module)
                if term is None:
                    continue
                a, scaled_b = term
                A[:, lo : lo + len(a)].copy_(a.t())
                B[lo : lo + len(a)].copy_(scaled_b.t())
                lo += len(a)

    def project(self, index: int, x: torch.Tensor) -> list[torch.Tensor]:
        """The outputs of group `index` (layer * 4 + group) for its input x [rows, in]."""
        modules, A, Bs = self.groups[index]
        outs = [decode_linear(x, m.weight, m.bias) for m in modules]
        if A is None:
            return outs
        xa = torch.mm(x, A)  # [rows, r_total]
        return [out if B is None else torch.addmm(out, xa, B) for out, B in zip(outs, Bs)]


def _projection(block: Block, name: str) -> nn.Module:
    return getattr(block.self_attn if name in ("q_proj", "k_proj", "v_proj", "o_proj") else block.mlp, name)


def _low_rank(module: nn.Module):
    low_rank = getattr(module, "low_rank", None)
    return None if low_rank is None else low_rank()


class SharedPrompts:
    """Rows that share prompts, laid out for one pass in which each distinct prompt runs once: the
    training pass's twin of the sampler's pool, where a prompt's G samples share its blocks.
    Transformer.hidden_shared builds it.

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
    twice the head size) fold them into one query axis, as DecodeAttention does, which repeats the mask
    per folded head; longer ones copy each layer's keys and values per query head instead.
    """

    def __init__(
        self,
        prompt_mask: torch.Tensor,
        owner: torch.Tensor,
        completion_mask: torch.Tensor,
        cfg: ModelConfig,
        dtype: torch.dtype,
    ):
        (U, P), (R, C), device = prompt_mask.shape, completion_mask.shape, owner.device
        self.owner, self.sizes = owner, (U, P, R, C)
        self.fold = C <= 2 * cfg.head_dim
        keys, queries = torch.arange(P + C, device=device), torch.arange(C, device=device)
        own_prompt = keys < prompt_mask.sum(1)[owner][:, None, None]  # [R, 1, P + C]: its prompt's real tokens
        own_past = (keys >= P) & (keys - P <= queries[:, None])  # [C, P + C]: its own tokens up to the query
        hidden = ~(own_prompt | own_past)  # [R, C, P + C]
        bias = torch.zeros(R, 1, C, P + C, dtype=dtype, device=device).masked_fill_(hidden[:, None], float("-inf"))
        if self.fold:  # [R, 1, (head, t), P + C]
            heads_per_kv = cfg.num_heads // cfg.num_kv_heads
            bias = bias.expand(-1, heads_per_kv, -1, -1).reshape(R, 1, heads_per_kv * C, P + C)
        self.bias = bias

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention output [1, tokens, heads, D] of the flat sequence, from q [1, heads, tokens, D] and
        k, v [1, kv_heads, tokens, D]; every layer's the same way (`layer` is PrefillWrite's argument)."""
        U, P, R, C = self.sizes
        heads, kv_heads, D = q.shape[1], k.shape[1], q.shape[3]
        split = U * P
        qp, kp, vp = (x[0, :, :split].unflatten(1, (U, P)).transpose(0, 1) for x in (q, k, v))  # [U, heads, P, D]
        qc, kc, vc = (x[0, :, split:].unflatten(1, (R, C)).transpose(0, 1) for x in (q, k, v))  # [R, heads, C, D]
        prompt_out = F.scaled_dot_product_attention(qp, kp, vp, is_causal=True, enable_gqa=True)
        keys, values = torch.cat([kp[self.owner], kc], 2), torch.cat([vp[self.owner], vc], 2)  # [R, kv, P + C, D]
        if self.fold:
            folded = qc.reshape(R, kv_heads, heads // kv_heads * C, D)
            out = F.scaled_dot_product_attention(folded, keys, values, attn_mask=self.bias)
            out = out.unflatten(2, (heads // kv_heads, C)).permute(0, 3, 1, 2, 4)  # [R, C, kv_heads, ., D]
        else:
            keys, values = (x.repeat_interleave(heads // kv_heads, 1) for x in (keys, values))  # [R, heads, ., D]
            out = F.scaled_dot_product_attention(qc, keys, values, attn_mask=self.bias).transpose(1, 2)
        return torch.cat([prompt_out.transpose(1, 2).reshape(split, heads, D), out.reshape(R * C, heads, D)])[None]


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

    def forward(self, x, cos, sin, layer: int = 0, cache: PrefillWrite | SharedPrompts | None = None):
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
            out = cache.attend(layer, q, k, v)
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

    def forward(self, x, cos, sin, layer=0, cache=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, layer, cache)
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

    def hidden_shared(
        self,
        prompt_ids: torch.Tensor,
        prompt_mask: torch.Tensor,
        owner: torch.Tensor,
        completion_ids: torch.Tensor,
        completion_mask: torch.Tensor,
    ) -> torch.Tensor:
        """Final-normed states [R, 1 + C, hidden] of R rows that share U prompts, each prompt run once
        (SharedPrompts): for row r, the state of the last token of its prompt prompt_ids[owner[r]], then
        those of its completion completion_ids[r]. They are hidden() of the row run whole, at those tokens.

        prompt_ids, prompt_mask [U, P]: each prompt's tokens contiguous (left-padded, as the sampler's),
        at least one; owner [R] long in [0, U); completion_ids, completion_mask [R, C]: tokens, then pads.
        """
        (U, P), (R, C), device = prompt_ids.shape, completion_ids.shape, prompt_ids.device
        rotate = (torch.arange(P, device=device) + _leading_pads(prompt_mask)[:, None]) % P  # real tokens first
        prompt_ids, prompt_mask = prompt_ids.gather(1, rotate), prompt_mask.gather(1, rotate)
        _check_contiguous(prompt_mask)
        _check_contiguous(completion_mask)
        lengths = prompt_mask.sum(1)  # [U]
        ids = torch.cat([prompt_ids.flatten(), completion_ids.flatten()])[None]  # [1, U * P + R * C]
        positions = torch.cat(
            [
                torch.arange(P, device=device).repeat(U),
                (lengths[owner, None] + torch.arange(C, device=device)).flatten(),
            ]
        )[None]
        x = self.model.embed_tokens(ids)
        # the mask in the dtype the blocks compute in (under FSDP2, the gathered weights', not the shards')
        shared = SharedPrompts(prompt_mask, owner, completion_mask, self.config, x.dtype)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, block in enumerate(self.model.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled():
                x = checkpoint(block, x, cos, sin, i, shared, use_reentrant=False)
            else:
                x = block(x, cos, sin, i, shared)
        last_prompt_token = x[0, : U * P].view(U, P, -1)[torch.arange(U, device=device), lengths - 1]  # [U, hidden]
        # normed after the selection: the norm is per token, and most prompt states are not needed
        return self.model.norm(torch.cat([last_prompt_token[owner, None], x[0, U * P :].view(R, C, -1)], 1))

    def _run_blocks(self, input_ids, positions, cache: PrefillWrite | None = None):
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.config.head_dim, self.config.rope_theta, x.dtype)
        for i, block in enumerate(self.model.layers):
            if self.gradient_checkpointing and self.training and torch.is_grad_enabled() and cache is None:
                x = checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin, i, cache)
        return self.model.norm(x)

    def prefill(self, input_ids: torch.Tensor, pad_mask: torch.Tensor, rows: PagedRows) -> torch.Tensor:
        """The final-normed hidden state [B, hidden] of each row's last prompt token, for prompts left-padded
        to [B, T]; their keys and values are stored at slots 0.. of each row's blocks (rows.table).

        As in hidden, each row is rotated so its real tokens come first, which is also the pool's layout:
        slot = position. The padding lands in the slots after the prompt (or in block 0), which the row's
        next tokens overwrite before any query reads them.
        """
        shift, T = _leading_pads(pad_mask), input_ids.shape[1]
        arange = torch.arange(T, device=input_ids.device)
        rotated = input_ids.gather(1, (arange + shift[:, None]) % T)
        h = self._run_blocks(rotated, arange.expand_as(input_ids), PrefillWrite(rows, T))
        return h[torch.arange(len(h), device=h.device), T - 1 - shift]

    def decode_step(
        self, tokens: torch.Tensor, rows: PagedRows, span: int, weights: DecodeWeights | None = None
    ) -> torch.Tensor:
        """Logits [rows, V] for one token per row (tokens [rows] long): each is stored at slot rows.length of
        its row (its position) and attends over slots 0..length; rows.length is not advanced.

        Attention reads each row's first `span` slots (a multiple of the block size covering every row's
        length + 1; the rest are masked or skipped), and nothing here reads a Python number that changes
        between steps, so one CUDA graph per (rows, span) serves every step of that shape. The activations
        are [rows, features] throughout and the projections come from `weights` (DecodeWeights, built here
        when not given): one operator per projection, plus one per adapted one. The sampler runs in eval
        mode, so LoRA dropout does not apply here.
        """
        cfg, R = self.config, len(tokens)
        weights = weights if weights is not None else DecodeWeights(self)
        attend = DecodeAttention(rows, span)
        x = self.model.embed_tokens(tokens)  # [R, hidden]
        cos, sin = (t.view(R, 1, -1) for t in rope_cos_sin(rows.length[:, None], cfg.head_dim, cfg.rope_theta, x.dtype))
        for i, block in enumerate(self.model.layers):
            q, k, v = weights.project(4 * i, block.input_layernorm(x))
            q = q.view(R, cfg.num_heads, cfg.head_dim)
            k, v = k.view(R, cfg.num_kv_heads, cfg.head_dim), v.view(R, cfg.num_kv_heads, cfg.head_dim)
            if cfg.qk_norm:
                q, k = block.self_attn.q_norm(q), block.self_attn.k_norm(k)
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            (out,) = weights.project(4 * i + 1, attend(i, q, k, v))
            x = x + out
            gate, up = weights.project(4 * i + 2, block.post_attention_layernorm(x))
            (down,) = weights.project(4 * i + 3, F.silu(gate) * up)
            x = x + down
        return decode_linear(self.model.norm(x), self.lm_head.weight)

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


def _leading_pads(pad_mask: torch.Tensor) -> torch.Tensor:
    """Number of pad slots before each row's first real token, [B]."""
    return (pad_mask.long().cumsum(1) == 0).sum(1)


def _check_contiguous(rotated_mask: torch.Tensor) -> None:
    """After rotation every row must be real tokens then pads; anything else is unsupported."""
    count = rotated_mask.sum(1, keepdim=True)
    prefix = torch.arange(rotated_mask.shape[1], device=rotated_mask.device)[None] < count
    if not torch.equal(prefix, rotated_mask):
        raise ValueError("pad_mask: each row must be left pads, then real tokens, then right pads")
