"""The decode loop: one sampler call's rows carried from prefill to their last token over a Pool (sample).

Sampling takes most of a GRPO step's wall clock, and on a GPU its speed is set by how many rows share
each pass over the weights, so the loop is built around memory held only for the tokens written:
- the keys and values live in the pool's blocks (engine/kv_cache.py), sized once and kept across calls
  and steps (engine/pool.py). A row holds blocks only for the tokens it has and asks for another when
  it fills one; the G rows of a prompt share the blocks their prompt fills;
- continuous batching: a call takes all of a step's prompts and keeps as many rows in flight as the pool
  holds (and max_rows allows). When rows finish, their blocks go back, and the next prompts are
  prefilled into the room within the step, instead of fixed calls that each wait for their longest row;
- when the pool runs out, the newest prompt group is preempted (engine/scheduler.py) and its unfinished
  rows are sampled again later, from the start;
- each distinct prompt is prefilled once, its last logits shared by its G rows.

Tokens are drawn by the `draw` the caller passes (rollout.generate: sampling.draw bound to the call's
rows), so pool size, max_rows, first_prompt splits and preemptions change no sample. Two decode loops
share the Scheduler and give the same samples:
- eager (the CPU default): the host reads the finished flags after every step (free on a CPU), drops
  finished rows at once (no copy: a row is an entry of the block table) and attends over exactly the
  slots filled, by prompt group (PromptGroups: each prompt's blocks copied once for its rows);
- fixed shapes (always on CUDA; `fixed=True` runs it on any device, which is how the CPU tests check
  it): the host reads the finished flags once every SYNC_EVERY steps, the only host sync of the loop,
  and allocates blocks ahead for that many tokens. Rows come in power-of-two buckets (padded with dead
  rows) and attention reads a power-of-two number of blocks covering the longest row, so a CUDA graph
  captured once per (rows, span) replays every step of that shape (engine/graphs.py).
"""

from __future__ import annotations

import itertools
import warnings
from typing import Callable

import torch

from engine.graphs import Batch, CudaGraph
from engine.kv_cache import PagedRows, PromptGroups, decode_step, prefill
from engine.pool import Pool
from engine.scheduler import Group, Row, SamplerStats, Scheduler
from model import Transformer

PAD_ID = 0  # fills left padding and finished rows; any id works because those slots are masked out
CUDA_GRAPHS = ("auto", "on", "off")
SYNC_EVERY = 16  # fixed shapes: decode steps between two reads of the finished flags (the loop's one host sync)
PREFILL_TOKENS = 8192  # prompt tokens (padding included) per prefill pass: bounds its activations
PREFILL_PADDING = 1 / 8  # the largest share of a prefill pass's tokens that may be padding, pure waste


# The token rule the loop samples with: sampling.draw bound to a call's keys and settings, called as
# draw(logits [R, V], rows=out_row [R], position=[R]) -> (tokens [R], old log-probs [R]).
Draw = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def sample(
    model: Transformer,
    prompts: list[list[int]],
    G: int,
    new_tokens: int,
    draw: Draw,
    stop: torch.Tensor,
    *,
    max_rows: int,
    fixed: bool,
    cuda_graphs: str,
    pool: Pool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, SamplerStats]:
    """G rows per prompt sampled until each draws a token of stop [S] or reaches new_tokens: completion ids,
    old log-probs and mask, each [N, new_tokens] (N = len(prompts) * G, prompt-major), and the call's stats.

    Runs in eval mode and inference mode. Without a pool, one that holds max_rows rows of the longest prompts
    at full length is made for the call (it never preempts). A pool too small for the longest prompt's group
    fails before any work; out of memory names the settings that lower it."""
    model.eval()
    loop = None
    try:
        if pool is None:
            largest = sorted(map(len, prompts), reverse=True)[: -(-max_rows // G)]
            pool = Pool.for_groups(model, largest, G, new_tokens)
        pool.check_fits([len(p) for p in prompts], G, new_tokens)
        with torch.inference_mode():
            loop = Loop(model, pool, prompts, G, new_tokens, draw, stop, max_rows, fixed, cuda_graphs)
            return (*loop.run(), loop.stats)
    except torch.OutOfMemoryError as err:
        raise torch.OutOfMemoryError(
            f"out of memory sampling {len(prompts)} prompts x {G} samples x {new_tokens} new tokens "
            f"({loop.stats.rows_max if loop else 0} rows in flight): lower max_rows (--rollout-batch) or the "
            f"pool's blocks"
        ) from err


def bucket(n: int) -> int:
    """The smallest power of two >= n: the row counts and attention spans (in blocks) of fixed-shape steps."""
    return 1 << (n - 1).bit_length()


class Loop:
    """One sampler call: the Scheduler's decisions carried out on the device."""

    def __init__(
        self,
        model: Transformer,
        pool: Pool,
        prompts: list[list[int]],
        G: int,
        C: int,
        draw: Draw,
        stop: torch.Tensor,
        max_rows: int,
        fixed: bool,
        cuda_graphs: str,
    ):
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
        # eager gather attention copies by prompt group (prompt_groups at every sync; None: row by row)
        self.grouped, self.groups = not fixed and pool.attention == "gather", None

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
        logits, passes = [], prefill_batches(groups)
        for part in passes:
            T = max(g.prompt_len for g in part)
            prompts = [self.prompts[g.prompt] for g in part]
            ids = _to_device([[PAD_ID] * (T - len(p)) + p for p in prompts], torch.long, device)
            pad = _to_device([[False] * (T - len(p)) + [True] * len(p) for p in prompts], torch.bool, device)
            table = _to_device([_padded(g.rows[0].blocks, self.pool.table_width) for g in part], torch.int32, device)
            rows = PagedRows(kv, table, torch.zeros(len(part), dtype=torch.long, device=device))
            logits.append(self.model.lm_head(prefill(self.model, ids, pad, rows)))
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
        place = {id(g): i for i, g in enumerate(g for part in passes for g in part)}  # its row of the logits
        group_of_row = _to_device([place[id(g)] for g in groups for _ in g.rows], torch.long, device)
        out_row = _to_device([row.out_row(self.G) for row in new_rows], torch.long, device)
        position = torch.zeros_like(out_row)
        tokens, logp = self.draw(torch.cat(logits)[group_of_row], rows=out_row, position=position)
        done = torch.zeros_like(out_row, dtype=torch.bool)
        self._record(out_row, position, done, tokens, logp)
        return tokens, done | torch.isin(tokens, self.stop) | (self.C <= 1)

    def _batch(self, old: Batch | None, old_rows: list[Row], new_rows: list[Row], new_tokens, new_done) -> Batch:
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
        if self.grouped:
            self.groups = prompt_groups(rows, device)
        batch = Batch(
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

    def _step(self, batch: Batch, span: int) -> None:
        """One decode step of every row in the batch, all on the device: no host sync."""
        logits = self._decode(batch, span)
        alive = ~batch.done
        batch.length += alive  # the token fed is in the cache now
        tokens, logp = self.draw(logits, rows=batch.out_row, position=batch.position)
        self._record(batch.out_row, batch.position, batch.done, tokens, logp)
        batch.position += alive
        batch.done |= torch.isin(tokens, self.stop) | (batch.position >= self.C)
        batch.tokens.copy_(tokens)

    def _decode(self, batch: Batch, span: int) -> torch.Tensor:
        if self.graphs:
            try:
                return self.pool.graphs.step(self.model, batch, span, self.weights, self.stats)
            except Exception as err:  # noqa: BLE001 - "auto" falls back on any capture failure but memory
                if self.graphs_required or isinstance(err, torch.OutOfMemoryError):
                    raise
                warnings.warn(f"CUDA graph capture failed, decoding without graphs: {err!r}", stacklevel=4)
                self.graphs, self.pool.graphs.failed = False, True
        rows = PagedRows(self.pool.kv, batch.table, batch.length, self.groups)
        return decode_step(self.model, batch.tokens, rows, span, self.weights)

    def _record(self, out_row, position, done, tokens, logp) -> None:
        """Write drawn tokens into the outputs; dead and padding rows write into row N."""
        row, column = torch.where(done, self.N, out_row), position.clamp(max=self.C - 1)
        self.ids[row, column] = tokens
        self.logp[row, column] = logp
        self.mask[row, column] = True


def prefill_batches(groups: list[Group]) -> list[list[Group]]:
    """The admitted groups in prefill passes, longest prompt first: a pass, left-padded to its first prompt, takes
    the next ones while it fits PREFILL_TOKENS and its padding stays within PREFILL_PADDING of its tokens (at
    least one group a pass)."""
    batches = []
    for group in sorted(groups, key=lambda g: -g.prompt_len):
        last = batches[-1] if batches else []
        tokens = (len(last) + 1) * last[0].prompt_len if last else 0  # left-padded to the first, the longest
        padding = tokens - group.prompt_len - sum(g.prompt_len for g in last)
        if last and tokens <= PREFILL_TOKENS and padding <= PREFILL_PADDING * tokens:
            last.append(group)
        else:
            batches.append([group])
    return batches


def prompt_groups(rows: list[Row], device: torch.device) -> PromptGroups | None:
    """The running rows by prompt group (the Scheduler keeps a group's rows together), with each row's blocks: the
    eager loop's, which cover its slots up to its next token's until the next sync, one step later. None where the
    groups' key sequences, each padded to the longest, hold more blocks than the rows' one by one (a few groups
    keeping many rows beside many keeping one): attention then copies the rows one by one."""
    groups = [list(members) for _, members in itertools.groupby(rows, key=lambda row: id(row.group))]
    shared = [len(g[0].group.shared) for g in groups]
    longest = max(n + sum(len(row.blocks) - n for row in g) for n, g in zip(shared, groups))
    if len(groups) * longest >= len(rows) * max(len(row.blocks) for row in rows):
        return None
    return PromptGroups.of([(n, [row.blocks for row in g]) for n, g in zip(shared, groups)], device)


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
