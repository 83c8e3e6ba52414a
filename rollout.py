"""Sampling G completions per prompt from a paged KV cache: the rollout half of a GRPO step.

Sampling takes most of a GRPO step's wall clock, and on a GPU its speed is set by how many rows share
each pass over the weights, so this file is built around memory held only for the tokens written:
- the keys and values live in a pool of fixed-size blocks (model.KVPool), sized once and kept across
  calls and steps (Pool). A row holds blocks only for the tokens it has and asks for another when it
  fills one; the G rows of a prompt share the blocks their prompt fills;
- continuous batching: a call takes all of a step's prompts and keeps as many rows in flight as the pool
  holds (and max_rows allows). When rows finish, their blocks go back, and the next prompts are
  prefilled into the room within the step, instead of fixed calls that each wait for their longest row;
- when the pool runs out, the newest prompt group is preempted: its blocks are freed and its unfinished
  rows are sampled again later, from the start. A token is drawn by inverse-CDF sampling from one
  uniform number per row, a hash of (seed, prompt index, sample index, token position), so a row's
  sample never depends on which rows share its batch, when it was admitted, or how often it was
  preempted: pool size, max_rows, first_prompt splits and preemptions change no sample;
- each distinct prompt is prefilled once, its last logits shared by its G rows.

The scheduling (Scheduler) works on block counts on the host. Two decode loops share it and give the
same samples:
- eager (the CPU default): the host reads the finished flags after every step (free on a CPU), drops
  finished rows at once (no copy: a row is an entry of the block table) and attends over exactly the
  slots filled;
- fixed shapes (always on CUDA; `fixed_shapes=True` runs it on any device, which is how the CPU tests
  check it): the host reads the finished flags once every SYNC_EVERY steps, the only host sync of the
  loop, and allocates blocks ahead for that many tokens. Rows come in power-of-two buckets (padded with
  dead rows) and attention reads a power-of-two number of blocks covering the longest row, so a CUDA
  graph captured once per (rows, span) replays every step of that shape. Graphs are kept by the Pool,
  so later calls and steps reuse them; capturing does not synchronize or empty the allocator's cache
  (CUDAGraph.capture_begin on a side stream, not the torch.cuda.graph context manager, which does both).

old_logp is log_softmax(logits / temperature) of the sampled token under the *full* tempered
distribution: exactly what model.token_logprobs(..., temperature=temperature) recomputes during
training, so the importance ratio is 1 when the weights did not change. top-k and top-p only restrict
which tokens can be drawn; their truncation is not part of old_logp (the training forward pass cannot
know it). Temperature 0 is greedy decoding, and its old_logp are taken at temperature 1.
The sampler runs in the model's dtype (load the model in bf16 on a GPU) and in eval mode (no dropout).
"""

from __future__ import annotations

import warnings
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Callable

import torch

import model as modeling

PAD_ID = 0  # fills left padding and finished rows; any id works because those slots are masked out
CUDA_GRAPHS = ("auto", "on", "off")
SYNC_EVERY = 16  # fixed shapes: decode steps between two reads of the finished flags (the loop's one host sync)
PREFILL_TOKENS = 8192  # prompt tokens (padding included) per prefill pass: bounds its activations
GATHER_BLOCK, FLASH_BLOCK = 16, 256  # block sizes: FlashAttention's paged kernel needs multiples of 256
ADMIT_WATERMARK = 0.05  # share of the pool a new prompt group must leave free (Scheduler)


@dataclass
class SamplerStats:
    """What a generate call did, for benchmarks, tests and the memory plan's estimates."""

    decode_steps: int = 0  # passes over the weights with one token per row in flight
    prefills: int = 0  # prefill passes
    rows_max: int = 0  # most rows in flight at once
    row_steps: int = 0  # rows in flight summed over decode steps: rows_mean = row_steps / decode_steps
    preempted: int = 0  # prompt groups preempted (their unfinished rows sampled again from the start)
    captures: int = 0  # CUDA graphs captured during the call (0 once the pool has them all)

    @property
    def rows_mean(self) -> float:
        return self.row_steps / max(1, self.decode_steps)


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
    model: modeling.Transformer,
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
        _sample,
        keys=_row_keys(seed, first_prompt, len(prompts), G, device),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
    )
    stop = torch.tensor(stop_ids, dtype=torch.long, device=device)
    fixed = fixed_shapes or device.type == "cuda"
    model.eval()
    loop = None
    try:
        if pool is None:  # every row at full length: the call never preempts
            largest = sorted(map(len, prompts), reverse=True)[: -(-(max_rows or N) // G)]
            pool = Pool.for_groups(model, largest, G, max_new_tokens)
        pool.check_fits([len(p) for p in prompts], G, max_new_tokens)
        with torch.inference_mode():
            loop = _Loop(model, pool, prompts, G, max_new_tokens, draw, stop, max_rows or N, fixed, cuda_graphs)
            completion_ids, old_logp, completion_mask = loop.run()
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"out of memory sampling {len(prompts)} prompts x {G} samples x {max_new_tokens} new tokens "
            f"({loop.stats.rows_max if loop else 0} rows in flight): lower max_rows (--rollout-batch) or the "
            f"pool's blocks"
        ) from err

    # Outside inference mode, so the results can enter the loss's autograd graph (ops on inference
    # tensors, like cat and pad, return ordinary tensors).
    prompt_ids = torch.tensor([[PAD_ID] * (P - len(p)) + p for p in prompts], device=device)  # [B, P]
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
        texts=tokenizer.batch_decode(completions, skip_special_tokens=True) if tokenizer is not None else None,
        stats=loop.stats,
    )


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
    if cuda_graphs not in CUDA_GRAPHS:
        raise ValueError(f"cuda_graphs must be one of {', '.join(CUDA_GRAPHS)}, got {cuda_graphs!r}")
    if cuda_graphs == "on" and model.device.type != "cuda" and (pool is None or pool.graph_class is CudaGraph):
        raise ValueError(
            f"cuda_graphs='on' needs the model on a CUDA device (or a pool with a graph stand-in); "
            f"it is on {model.device}"
        )
    if pool is not None and pool.model is not model:
        raise ValueError(
            "pool: it was built for another model (its graphs and buffers read that model's weights); "
            "Pool.bind serves a new one"
        )


# ----------------------------------------------------------------------------- the pool


class Pool:
    """What the sampler keeps across calls and steps: the KV pool (allocated once, so a long run does
    not fragment the allocator by freeing and re-allocating its largest tensor), the decode weights
    (model.DecodeWeights, refreshed in place at each call) and the CUDA graphs captured over both.

    blocks counts the pool's blocks, block 0 included (reserved); max_len bounds a row's prompt plus
    completion (the block tables' width; default the model's context). attention is "flash" (CUDA,
    bf16/fp16, torch with the paged FlashAttention kernel), "gather" or "auto" (flash where it is
    available and agrees with gather on a small self-check at creation, else gather). graph_class
    replays the fixed-shape steps: CudaGraph on CUDA; EagerGraph stands in for it anywhere.

    A pool serves the model it was made with. A full-parameter run samples each step with weights gathered
    anew (fsdp.whole: a new Transformer whose tensors live only for the rollout), so it binds the pool to
    that model for the call and releases it after: the decode weights and graphs, which read the model's
    tensors, are dropped, and the blocks are kept.
    """

    def __init__(
        self,
        model: modeling.Transformer,
        blocks: int,
        *,
        max_len: int | None = None,
        block_size: int | None = None,
        attention: str = "auto",
        graph_class: type | None = None,
    ):
        if attention not in ("auto", "flash", "gather"):
            raise ValueError(f"attention must be auto, flash or gather, got {attention!r}")
        flash = modeling.flash_paged_attention_available(model.device, model.dtype)
        if attention == "flash" and not flash:
            raise ValueError(
                f"attention='flash' needs CUDA, bf16 or fp16 and torch's paged varlen_attn "
                f"(model on {model.device} in {model.dtype})"
            )
        kind = "flash" if flash and attention != "gather" else "gather"
        self.block_size = block_size or default_block_size(model, attention)
        if kind == "flash" and self.block_size % FLASH_BLOCK:
            raise ValueError(
                f"block_size={self.block_size}: the paged FlashAttention kernel needs a multiple of {FLASH_BLOCK}"
            )
        self.model, self.max_len = model, max_len or model.config.max_position_embeddings
        self.shape = (model.config, model.dtype, model.device)
        self.table_width = -(-self.max_len // self.block_size)
        self.kv = modeling.KVPool(model.config, blocks, self.block_size, model.dtype, model.device, kind)
        if kind == "flash" and attention == "auto" and model.device.type == "cuda" and not _flash_agrees(self.kv):
            self.kv.attention = "gather"
        self.graph_class = graph_class or CudaGraph
        self.graphs = _Graphs(self)
        self.weights: modeling.DecodeWeights | None = None

    @classmethod
    def for_groups(cls, model: modeling.Transformer, prompt_lens: list[int], G: int, new_tokens: int, **kwargs) -> Pool:
        """A pool that holds these prompts' groups of G rows at once, each row at its full length."""
        block_size = kwargs.pop("block_size", None) or default_block_size(model, kwargs.get("attention", "auto"))
        blocks = 1 + sum(group_blocks(p, G, new_tokens, block_size) for p in prompt_lens)
        return cls(model, blocks, max_len=max(prompt_lens) + new_tokens, block_size=block_size, **kwargs)

    @property
    def attention(self) -> str:
        return self.kv.attention

    def check_fits(self, prompt_lens: list[int], G: int, new_tokens: int) -> None:
        """Raise ValueError before any work if some prompt's group cannot run to its full length in this pool
        alone (preemption could then never finish it) or a row would outgrow the block tables."""
        longest = max(prompt_lens)
        if longest + new_tokens > self.max_len:
            raise ValueError(
                f"pool: a prompt of {longest} tokens plus max_new_tokens={new_tokens} exceeds the "
                f"pool's max_len={self.max_len}"
            )
        need = group_blocks(longest, G, new_tokens, self.block_size)
        if need > self.kv.blocks - 1:
            raise ValueError(
                f"pool: {self.kv.blocks - 1} blocks of {self.block_size} slots hold no group of "
                f"{G} samples of the longest prompt ({longest} tokens) at {new_tokens} new tokens, "
                f"which needs {need}; give the pool more blocks or lower max_new_tokens"
            )

    def bind(self, model: modeling.Transformer) -> None:
        """Serve `model` from now on: a model of the pool's config, dtype and device whose weights may be other
        tensors than the last one's (its decode weights and graphs are built again)."""
        if model is self.model:
            return
        if (model.config, model.dtype, model.device) != self.shape:
            raise ValueError(
                f"pool: made for a model of {self.shape[1]} on {self.shape[2]} with another config, "
                f"given one of {model.dtype} on {model.device}"
            )
        self.release()
        self.model = model

    def release(self) -> None:
        """Let go of the model: its decode weights, and the graphs that read its tensors with their memory (bind
        serves another). Whether graphs failed to capture is kept: the fallback warns once per pool."""
        failed = self.graphs.failed
        self.model, self.weights, self.graphs = None, None, _Graphs(self)
        self.graphs.failed = failed

    def decode_weights(self) -> modeling.DecodeWeights:
        """The decode weights with the adapters' current values; rebuilt (dropping the graphs that read the
        old buffers) when adapters were added, removed, merged or disabled since."""
        if self.weights is not None and self.weights.signature == modeling.DecodeWeights.signature_of(self.model):
            self.weights.refresh(self.model)
        else:
            self.weights = modeling.DecodeWeights(self.model)
            self.graphs.clear()
        return self.weights


def default_block_size(model: modeling.Transformer, attention: str = "auto") -> int:
    """The block size of a pool for this model: FLASH_BLOCK where the paged FlashAttention kernel serves it."""
    flash = attention != "gather" and modeling.flash_paged_attention_available(model.device, model.dtype)
    return FLASH_BLOCK if flash else GATHER_BLOCK


def group_blocks(prompt_len: int, G: int, new_tokens: int, block_size: int) -> int:
    """Blocks a prompt's G rows hold at full length: the blocks the prompt fills, shared, and each row's own
    (its copy of the prompt's last, partly filled block, then its tokens)."""
    shared = prompt_len // block_size
    return shared + G * (-(-(prompt_len + new_tokens - 1) // block_size) - shared)


@torch.no_grad()
def _flash_agrees(kv: modeling.KVPool) -> bool:
    """A self-check of the paged FlashAttention kernel on this machine: three rows of different lengths over
    random blocks, against the gather path. False (with a warning) if it fails or differs."""
    heads, kv_heads, D = 2 * kv.k.shape[3], kv.k.shape[3], kv.k.shape[4]
    rows = 3
    width = min(4, kv.blocks - 1)
    g = torch.Generator(device=kv.k.device).manual_seed(0)
    table = torch.randint(1, kv.blocks, (rows, width), generator=g, device=kv.k.device, dtype=torch.int32)
    length = torch.tensor([1, kv.block_size + 3, width * kv.block_size - 1], device=kv.k.device)
    length = length.clamp(max=width * kv.block_size - 1)
    saved = kv.k[0].clone(), kv.v[0].clone()
    try:
        kv.k[0].normal_(generator=g)
        kv.v[0].normal_(generator=g)
        q = torch.randn(rows, heads, D, generator=g, device=kv.k.device, dtype=kv.k.dtype)
        k = torch.randn(rows, kv_heads, D, generator=g, device=kv.k.device, dtype=kv.k.dtype)
        out = {}
        for kind in ("flash", "gather"):
            kv.attention = kind
            paged = modeling.PagedRows(kv, table, length)
            out[kind] = modeling.DecodeAttention(paged, width * kv.block_size)(0, q, k, k).float()
        error = (out["flash"] - out["gather"]).abs().max().item()
        agrees = error < 0.05
        if not agrees:
            warnings.warn(
                f"paged FlashAttention differs from the gather path by {error:.3g}; using gather", stacklevel=3
            )
    except Exception as err:  # noqa: BLE001 - any failure of the kernel means the gather path
        warnings.warn(f"paged FlashAttention failed its self-check ({err!r}); using gather", stacklevel=3)
        agrees = False
    finally:
        kv.k[0].copy_(saved[0])
        kv.v[0].copy_(saved[1])
        kv.attention = "flash"
    return agrees


# ----------------------------------------------------------------------------- scheduling


@dataclass(eq=False)
class Group:
    """A prompt and the samples of it still to draw; while admitted, its running rows and shared blocks."""

    prompt: int  # index in the call's prompts
    prompt_len: int
    members: list[int]  # sample indices not finished yet
    shared: list[int] = field(default_factory=list)  # blocks the prompt fills, shared by its rows
    rows: list[Row] = field(default_factory=list)
    restarts: int = 0


@dataclass(eq=False)
class Row:
    group: Group
    member: int  # sample index
    length: int  # slots filled (prompt and completion tokens written): the next token's slot and position
    position: int  # completion tokens drawn (the next draw's index)
    blocks: list[int]  # the group's shared blocks, then the row's own

    def out_row(self, G: int) -> int:
        return self.group.prompt * G + self.member


class Scheduler:
    """Which prompt groups hold rows in the pool, on the host, in block counts: no tensors, so the memory plan
    simulates a step with the same code (memory.simulate_rollout).

    At each sync point (every `chunk` decode steps) the caller reports the finished rows, then `sync`:
    - grows every running row's blocks to hold the next chunk's tokens; when the free blocks do not
      suffice, the newest group is preempted (its blocks freed, its unfinished rows queued again at the
      front) until they do: the oldest rows always progress, and a preempted group loses the least work;
    - admits waiting groups in prompt order while the rows in flight stay within max_rows and the free
      blocks cover the group's prompt and first chunk plus a reserve: the blocks every row, old and new,
      asks for at the next sync (so admitting does not preempt there), and ADMIT_WATERMARK of the pool;
      a group whose rows can all run to full length beside the running ones' needs no reserve (a pool
      sized for every row admits them all at once). No group is admitted at a sync that preempted one:
      the rows still running need the room.
    Simulated for the 8B preset (memory.simulate_rollout, 1,024 rows in a pool of 1,261 blocks, at most
    256 in flight), the watermark cut the groups preempted from 196 to 22 and the decode steps redone
    from 10% to 2% of the rows', for 2% more decode passes; a reserve for the rows' expected growth (as
    much again as each has written) preempted none but took 25% more passes.
    """

    def __init__(self, blocks: int, block_size: int, chunk: int, max_rows: int, new_tokens: int):
        self.blocks, self.free = blocks, list(range(blocks, 0, -1))  # block ids 1..blocks; block 0 is reserved
        self.block_size, self.chunk, self.max_rows, self.new_tokens = block_size, chunk, max_rows, new_tokens
        self.waiting: deque[Group] = deque()
        self.admitted: list[Group] = []  # in admission order
        self.preemptions = 0

    def add(self, group: Group) -> None:
        self.waiting.append(group)

    @property
    def running(self) -> list[Row]:
        """The rows in flight, in a stable order: admission order, then sample index."""
        return [row for group in self.admitted for row in group.rows]

    def _blocks(self, prompt_len: int, slots: int) -> int:
        """Blocks covering `slots` slots of a row of a prompt_len-token prompt (capped at its full length)."""
        return -(-min(slots, prompt_len + self.new_tokens - 1) // self.block_size)

    def _take(self, n: int) -> list[int]:
        taken, self.free = self.free[len(self.free) - n :], self.free[: len(self.free) - n]
        return taken[::-1]

    def finish(self, rows: list[Row]) -> None:
        """Rows that drew a stop token or reached max_new_tokens leave, and give back their own blocks; a
        group's shared blocks go back with its last row."""
        for row in rows:
            group = row.group
            group.rows.remove(row)
            group.members.remove(row.member)
            self.free += row.blocks[len(group.shared) :]
            if not group.rows:
                self.free += group.shared
                group.shared = []
                self.admitted.remove(group)

    def _preempt(self, group: Group) -> None:
        for row in group.rows:
            self.free += row.blocks[len(group.shared) :]
        self.free += group.shared
        group.shared, group.rows = [], []
        group.restarts += 1
        self.admitted.remove(group)
        self.waiting.appendleft(group)
        self.preemptions += 1

    def sync(self) -> tuple[list[Group], list[Group]]:
        """Grow the running rows for the next chunk, preempting as needed, then admit; returns (preempted,
        admitted). An admitted group's rows start at length = prompt, position 1 (the prefill draws one)."""
        preempted = []
        while True:
            needs = [
                (row, self._blocks(row.group.prompt_len, row.length + self.chunk) - len(row.blocks))
                for row in self.running
            ]
            if sum(n for _, n in needs) <= len(self.free):
                break
            if len(self.admitted) == 1:
                raise RuntimeError(
                    "pool: one prompt group outgrew the whole pool (Pool.check_fits should have refused the call)"
                )
            preempted.append(self.admitted[-1])
            self._preempt(self.admitted[-1])
        for row, n in needs:
            row.blocks += self._take(n)
        admitted = []
        while self.waiting and not preempted:
            group = self.waiting[0]
            p, m = group.prompt_len, len(group.members)
            shared = p // self.block_size
            own = self._blocks(p, p + self.chunk) - shared
            if len(self.running) + m > self.max_rows:
                break
            # a group whose rows can all run to full length beside the others' needs no reserve
            full = group_blocks(p, m, self.new_tokens, self.block_size) + self._to_full_length(self.running)
            reserve = self._next_growth(self.running) + m * self._growth(p, p) + int(ADMIT_WATERMARK * self.blocks)
            if full > len(self.free) and shared + m * own + reserve > len(self.free):
                break
            self.waiting.popleft()
            group.shared = self._take(shared)
            group.rows = [Row(group, member, p, 1, group.shared + self._take(own)) for member in group.members]
            self.admitted.append(group)
            admitted.append(group)
        return preempted, admitted

    def _growth(self, prompt_len: int, length: int) -> int:
        """Blocks a row of `length` slots asks for at the sync after next (none past its full length)."""
        return self._blocks(prompt_len, length + 2 * self.chunk) - self._blocks(prompt_len, length + self.chunk)

    def _next_growth(self, rows: list[Row]) -> int:
        return sum(self._growth(row.group.prompt_len, row.length) for row in rows)

    def _to_full_length(self, rows: list[Row]) -> int:
        """Blocks the rows still ask for until each reaches its full length."""
        return sum(
            self._blocks(row.group.prompt_len, row.group.prompt_len + self.new_tokens) - len(row.blocks) for row in rows
        )

    def chunk_steps(self) -> int:
        """Decode steps until the next sync: a chunk, or fewer when every running row reaches its cap sooner."""
        return min(self.chunk, max(self.new_tokens - row.position for row in self.running))

    def advance(self, steps: int) -> None:
        """The host's view of `steps` decode steps: every running row wrote and drew that many tokens (a row
        that finished meanwhile is reported, and dropped, at the next sync)."""
        for row in self.running:
            row.length += steps
            row.position += steps


# ----------------------------------------------------------------------------- the decode loop


def bucket(n: int) -> int:
    """The smallest power of two >= n: the row counts and attention spans (in blocks) of fixed-shape steps."""
    return 1 << (n - 1).bit_length()


@dataclass
class _Batch:
    """The rows in flight on the device, in the Scheduler's order, padded in fixed-shape mode to a row bucket
    with dead rows (block table of block 0, output row N, done). Each [R]: tokens (last drawn, fed next),
    done, length (slots filled), position (tokens drawn), out_row; table [R, table_width] int32."""

    tokens: torch.Tensor
    done: torch.Tensor
    length: torch.Tensor
    position: torch.Tensor
    out_row: torch.Tensor
    table: torch.Tensor

    def copy_(self, other: _Batch) -> _Batch:
        for name in self.__dataclass_fields__:
            getattr(self, name).copy_(getattr(other, name))
        return self


class _Loop:
    """One generate call: the Scheduler's decisions carried out on the device."""

    def __init__(self, model, pool: Pool, prompts, G, C, draw, stop, max_rows, fixed, cuda_graphs):
        self.model, self.pool, self.prompts, self.G, self.C = model, pool, prompts, G, C
        self.draw, self.stop, self.fixed = draw, stop, fixed
        self.N, device = len(prompts) * G, model.device
        # [N + 1, C]: row N takes the writes of dead and padding rows
        self.ids = torch.full((self.N + 1, C), PAD_ID, dtype=torch.long, device=device)
        self.logp = torch.zeros(self.N + 1, C, device=device)
        self.mask = torch.zeros(self.N + 1, C, dtype=torch.bool, device=device)
        self.sched = Scheduler(pool.kv.blocks - 1, pool.block_size, SYNC_EVERY if fixed else 1, max_rows, C)
        for i, prompt in enumerate(prompts):
            self.sched.add(Group(i, len(prompt), list(range(G))))
        graphs_possible = device.type == "cuda" or pool.graph_class is not CudaGraph
        self.graphs = fixed and cuda_graphs != "off" and graphs_possible and not pool.graphs.failed
        self.graphs_required = cuda_graphs == "on"
        self.weights = pool.decode_weights()
        self.stats = SamplerStats()

    def run(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Completion ids, old_logp and mask, each [N, C]."""
        sched, batch, rows = self.sched, None, []
        while True:
            if batch is not None:  # the loop's one host sync
                sched.finish([row for row, done in zip(rows, _to_host(batch.done[: len(rows)])) if done])
            preempted, admitted = sched.sync()
            self.stats.preempted += len(preempted)
            if not sched.running:
                break
            new_rows = [row for group in admitted for row in group.rows]
            new_tokens, new_done = self._prefill(admitted, new_rows)
            batch, rows = self._batch(batch, rows, new_rows, new_tokens, new_done), sched.running
            steps, longest = sched.chunk_steps(), max(row.length for row in rows)
            for step in range(steps):
                self._step(batch, self._span(longest + step + 1))
                self.stats.decode_steps += 1
                self.stats.row_steps += len(rows)
            self.stats.rows_max = max(self.stats.rows_max, len(rows))
            sched.advance(steps)
        return self.ids[: self.N], self.logp[: self.N], self.mask[: self.N]

    def _span(self, slots: int) -> int:
        """Slots attention reads to cover `slots`: whole blocks, a power-of-two count of them in fixed shapes."""
        blocks = -(-slots // self.pool.block_size)
        if self.fixed:
            blocks = min(bucket(blocks), self.pool.table_width)
        return blocks * self.pool.block_size

    def _prefill(self, groups: list[Group], new_rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill the admitted groups' prompts, give each row its copy of its prompt's last, partly filled
        block, and draw every new row's first token; returns their tokens and done flags [new rows]."""
        device, kv, bs = self.model.device, self.pool.kv, self.pool.block_size
        if not groups:
            return torch.zeros(0, dtype=torch.long, device=device), torch.zeros(0, dtype=torch.bool, device=device)
        restarted = [row.out_row(self.G) for row in new_rows if row.group.restarts]
        if restarted:  # a preempted row starts over: clear what it wrote
            index = _to_device(restarted, torch.long, device)
            self.ids.index_fill_(0, index, PAD_ID)
            self.logp.index_fill_(0, index, 0.0)
            self.mask.index_fill_(0, index, False)
        logits = []
        for part in prefill_batches(groups):
            T = max(g.prompt_len for g in part)
            prompts = [self.prompts[g.prompt] for g in part]
            ids = _to_device([[PAD_ID] * (T - len(p)) + p for p in prompts], torch.long, device)
            pad = _to_device([[False] * (T - len(p)) + [True] * len(p) for p in prompts], torch.bool, device)
            table = _to_device([_padded(g.rows[0].blocks, self.pool.table_width) for g in part], torch.int32, device)
            rows = modeling.PagedRows(kv, table, torch.zeros(len(part), dtype=torch.long, device=device))
            logits.append(self.model.lm_head(self.model.prefill(ids, pad, rows)))
            self.stats.prefills += 1
            tails = [
                (g.rows[0].blocks[len(g.shared)], row.blocks[len(g.shared)])
                for g in part
                if g.prompt_len % bs
                for row in g.rows[1:]
            ]
            if tails:
                source, target = (_to_device(list(side), torch.long, device) for side in zip(*tails))
                kv.copy_blocks(source, target)
        group_of_row = _to_device([i for i, g in enumerate(groups) for _ in g.rows], torch.long, device)
        out_row = _to_device([row.out_row(self.G) for row in new_rows], torch.long, device)
        position = torch.zeros_like(out_row)
        tokens, logp = self.draw(torch.cat(logits)[group_of_row], rows=out_row, position=position)
        done = torch.zeros_like(out_row, dtype=torch.bool)
        self._record(out_row, position, done, tokens, logp)
        return tokens, done | torch.isin(tokens, self.stop) | (self.C <= 1)

    def _batch(self, old: _Batch | None, old_rows: list[Row], new_rows: list[Row], new_tokens, new_done) -> _Batch:
        """The device rows for the Scheduler's running rows: tokens and done flags from the old batch and the
        new rows, the rest from the host's bookkeeping."""
        device, width = self.model.device, self.pool.table_width
        rows = self.sched.running
        place = {id(row): i for i, row in enumerate(old_rows + new_rows)}
        select = _to_device([place[id(row)] for row in rows], torch.long, device)
        tokens, done = new_tokens, new_done
        if old is not None:
            tokens, done = (
                torch.cat([old.tokens[: len(old_rows)], tokens]),
                torch.cat([old.done[: len(old_rows)], done]),
            )
        n = len(rows)
        padding = (bucket(n) if self.fixed else n) - n
        batch = _Batch(
            tokens=torch.cat([tokens[select], tokens.new_zeros(padding)]),
            done=torch.cat([done[select], done.new_ones(padding)]),
            length=_to_device([row.length for row in rows] + [0] * padding, torch.long, device),
            position=_to_device([row.position for row in rows] + [0] * padding, torch.long, device),
            out_row=_to_device([row.out_row(self.G) for row in rows] + [self.N] * padding, torch.long, device),
            table=_to_device(
                [_padded(row.blocks, width) for row in rows] + [[0] * width] * padding, torch.int32, device
            ),
        )
        return self.pool.graphs.bind(batch) if self.graphs else batch

    def _step(self, batch: _Batch, span: int) -> None:
        """One decode step of every row in the batch, all on the device: no host sync."""
        logits = self._decode(batch, span)
        alive = ~batch.done
        batch.length += alive  # the token fed is in the cache now
        tokens, logp = self.draw(logits, rows=batch.out_row, position=batch.position)
        self._record(batch.out_row, batch.position, batch.done, tokens, logp)
        batch.position += alive
        batch.done |= torch.isin(tokens, self.stop) | (batch.position >= self.C)
        batch.tokens.copy_(tokens)

    def _decode(self, batch: _Batch, span: int) -> torch.Tensor:
        if self.graphs:
            try:
                return self.pool.graphs.step(batch, span, self.weights, self.stats)
            except Exception as err:  # noqa: BLE001 - "auto" falls back on any capture failure but memory
                if self.graphs_required or isinstance(err, torch.OutOfMemoryError):
                    raise
                warnings.warn(f"CUDA graph capture failed, decoding without graphs: {err!r}", stacklevel=4)
                self.graphs, self.pool.graphs.failed = False, True
        rows = modeling.PagedRows(self.pool.kv, batch.table, batch.length)
        return self.model.decode_step(batch.tokens, rows, span, self.weights)

    def _record(self, out_row, position, done, tokens, logp) -> None:
        """Write drawn tokens into the outputs; dead and padding rows write into row N."""
        row, column = torch.where(done, self.N, out_row), position.clamp(max=self.C - 1)
        self.ids[row, column] = tokens
        self.logp[row, column] = logp
        self.mask[row, column] = True


def prefill_batches(groups: list[Group]) -> list[list[Group]]:
    """The admitted groups in prefill passes, in order: each as many as fit PREFILL_TOKENS once left-padded
    to the pass's longest prompt (at least one)."""
    batches = []
    for group in groups:
        last = batches[-1] if batches else []
        if last and (len(last) + 1) * max(g.prompt_len for g in [*last, group]) <= PREFILL_TOKENS:
            last.append(group)
        else:
            batches.append([group])
    return batches


def _padded(blocks: list[int], width: int) -> list[int]:
    return blocks + [0] * (width - len(blocks))


def _to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA from pinned memory, so the copy does not wait for the GPU."""
    tensor = torch.tensor(values, dtype=dtype, device="cpu")
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def _to_host(tensor: torch.Tensor) -> list:
    """A device tensor's values on the host: a sync on CUDA, and the only way the loop reads the device."""
    return tensor.to("cpu", copy=True).tolist()


# ----------------------------------------------------------------------------- graphs


class _Graphs:
    """The pool's fixed-shape steps replayed from graphs: static rows and logits per row bucket, one graph
    per (rows, span), all sharing one memory pool (they never run at once). They read the pool's blocks
    and decode weights at fixed addresses, so they serve every later call and step of the pool."""

    def __init__(self, pool: Pool):
        self.pool, self.failed = pool, False
        self.batches: dict[int, _Batch] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.captured: dict[tuple[int, int], object] = {}
        self.mempool = None

    def clear(self) -> None:
        self.captured.clear()

    def bind(self, batch: _Batch) -> _Batch:
        """The static rows of this batch's bucket, holding the batch's values: graphs read these addresses."""
        R = len(batch.tokens)
        if R not in self.batches:
            self.batches[R] = _Batch(*(getattr(batch, name).clone() for name in _Batch.__dataclass_fields__))
            return self.batches[R]
        return self.batches[R].copy_(batch)

    def step(self, batch: _Batch, span: int, weights, stats: SamplerStats) -> torch.Tensor:
        R, model, graph_class = len(batch.tokens), self.pool.model, self.pool.graph_class
        key = (R, span)
        if key not in self.captured:
            if R not in self.logits:
                self.logits[R] = torch.empty(R, model.config.vocab_size, dtype=model.dtype, device=model.device)
            logits, rows = self.logits[R], modeling.PagedRows(self.pool.kv, batch.table, batch.length)
            if self.mempool is None:
                self.mempool = graph_class.new_mempool()
            graph = graph_class()
            graph.capture(lambda: logits.copy_(model.decode_step(batch.tokens, rows, span, weights)), self.mempool)
            self.captured[key] = graph
            stats.captures += 1
        self.captured[key].replay()
        return self.logits[R]


class CudaGraph:
    """One decode step as a CUDA graph: warmed up twice, then captured, on a side stream, into the pool's
    shared memory pool. It calls CUDAGraph.capture_begin / capture_end itself: the torch.cuda.graph
    context manager would synchronize and empty the allocator's cache at every capture."""

    @staticmethod
    def new_mempool():
        return torch.cuda.graph_pool_handle()

    def capture(self, fn: Callable[[], object], mempool) -> None:
        current = torch.cuda.current_stream()
        side = torch.cuda.Stream()
        side.wait_stream(current)
        with torch.cuda.stream(side):
            for _ in range(2):  # kernel choice and workspace allocation, outside the graph
                fn()
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=mempool)
            try:
                fn()
            except BaseException:
                try:  # end the capture so the stream is usable again; the first error is the one to report
                    self.graph.capture_end()
                except Exception:  # noqa: BLE001
                    pass
                raise
            self.graph.capture_end()
        current.wait_stream(side)

    def replay(self) -> None:
        self.graph.replay()


class EagerGraph:
    """A stand-in for CudaGraph on any device: `capture` runs the step once (as a capture's warm-up does) and
    `replay` runs it again. It exercises all that graphs change about the loop (static rows updated in
    place, logits read from a static buffer, graphs kept per (rows, span) across calls and steps)."""

    @staticmethod
    def new_mempool():
        return None

    def capture(self, fn: Callable[[], object], mempool) -> None:
        self.fn = fn
        fn()

    def replay(self) -> None:
        self.fn()


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
    """One uniform in (0, 1] per key at its token position (an int or [R]), [R, 1] fp32: 24 hashed bits,
    exact in fp32."""
    h = _mix32(keys ^ position)
    return (((h >> 8) + 1).float() * 2.0**-24)[:, None]


# ----------------------------------------------------------------------------- drawing a token


def _sample(
    logits: torch.Tensor,
    *,
    keys: torch.Tensor,
    rows: torch.Tensor,
    position: torch.Tensor,
    temperature: float,
    top_p: float,
    top_k: int,
):
    """One token per row from logits [R, V] for the output rows `rows` [R] (indices into keys) at their
    token positions [R]; returns tokens [R] and their full-distribution logp [R]."""
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
