"""Which prompt groups hold rows in the KV pool, decided on the host in block counts (Scheduler).

The scheduler holds no tensors: the decode loop (engine/sampler.py) carries out its decisions on the
device, and the memory plan runs the same code with no model to simulate a step's sampling
(memory.simulate_rollout). When the pool runs out, the newest prompt group is preempted: its blocks are
freed and its unfinished rows are sampled again later, from the start, which changes no sample (each
row's random stream is its own: sampling.py).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

ADMIT_WATERMARK = 0.05  # share of the pool a new prompt group must leave free (Scheduler)


@dataclass
class SamplerStats:
    """What a sampler call did, for benchmarks, tests and the memory plan's estimates: the decode loop's
    counts, which memory.simulate_rollout derives from the Scheduler alone."""

    decode_steps: int = 0  # passes over the weights with one token per row in flight
    prefills: int = 0  # prefill passes
    rows_max: int = 0  # most rows in flight at once
    row_steps: int = 0  # rows in flight summed over decode steps: rows_mean = row_steps / decode_steps
    preempted: int = 0  # prompt groups preempted (their unfinished rows sampled again from the start)
    captures: int = 0  # CUDA graphs captured during the call (0 once the pool has them all)

    @property
    def rows_mean(self) -> float:
        return self.row_steps / max(1, self.decode_steps)

    def __add__(self, other: SamplerStats) -> SamplerStats:
        """Two calls' counts as one: the larger rows_max, the other counts summed."""
        mine, theirs = vars(self), vars(other)
        return SamplerStats(**{k: max(v, theirs[k]) if k == "rows_max" else v + theirs[k] for k, v in mine.items()})


def group_blocks(prompt_len: int, G: int, new_tokens: int, block_size: int) -> int:
    """Blocks a prompt's G rows hold at full length: the blocks the prompt fills, shared, and each row's own
    (its copy of the prompt's last, partly filled block, then its tokens)."""
    shared = prompt_len // block_size
    return shared + G * (-(-(prompt_len + new_tokens - 1) // block_size) - shared)


@dataclass(eq=False)
class Group:
    """A prompt and the samples of it still to draw; while admitted, its running rows and shared blocks. Its rows
    are admitted together and advance together, so they hold the same length, position and number of blocks:
    the Scheduler decides for the group by its first row."""

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
    The watermark trades a few more decode passes for far fewer preemptions (docs/engine.md gives the
    simulated figures for the 8B preset).
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
        """The last n free blocks, newest first (in place: a pool holds thousands of free blocks)."""
        if n <= 0:
            return []
        taken = self.free[-n:]
        del self.free[-n:]
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
                self._blocks(g.prompt_len, g.rows[0].length + self.chunk) - len(g.rows[0].blocks) for g in self.admitted
            ]
            if sum(n * len(g.rows) for g, n in zip(self.admitted, needs)) <= len(self.free):
                break
            if len(self.admitted) == 1:
                raise RuntimeError(
                    "pool: one prompt group outgrew the whole pool (Pool.check_fits should have refused the call)"
                )
            preempted.append(self.admitted[-1])
            self._preempt(self.admitted[-1])
        for group, n in zip(self.admitted, needs):
            if n:
                for row in group.rows:
                    row.blocks += self._take(n)
        admitted = []
        while self.waiting and not preempted and self._admits(self.waiting[0]):
            group = self.waiting.popleft()
            p = group.prompt_len
            shared = p // self.block_size
            own = self._blocks(p, p + self.chunk) - shared
            group.shared = self._take(shared)
            group.rows = [Row(group, member, p, 1, group.shared + self._take(own)) for member in group.members]
            self.admitted.append(group)
            admitted.append(group)
        return preempted, admitted

    def _admits(self, group: Group) -> bool:
        """Whether the waiting group fits beside the running rows: within max_rows, and its prompt and first chunk
        leave the reserve free, unless all its rows can run to full length beside the running ones'."""
        p, m = group.prompt_len, len(group.members)
        if sum(len(g.rows) for g in self.admitted) + m > self.max_rows:
            return False
        free = len(self.free)
        # a group whose rows can all run to full length beside the others' needs no reserve
        if group_blocks(p, m, self.new_tokens, self.block_size) + self._to_full_length() <= free:
            return True
        shared = p // self.block_size
        own = self._blocks(p, p + self.chunk) - shared
        reserve = self._next_growth() + m * self._growth(p, p) + int(ADMIT_WATERMARK * self.blocks)
        return shared + m * own + reserve <= free

    def _growth(self, prompt_len: int, length: int) -> int:
        """Blocks a row of `length` slots asks for at the sync after next (none past its full length)."""
        return self._blocks(prompt_len, length + 2 * self.chunk) - self._blocks(prompt_len, length + self.chunk)

    def _next_growth(self) -> int:
        """Blocks the running rows ask for at the sync after next."""
        return sum(len(g.rows) * self._growth(g.prompt_len, g.rows[0].length) for g in self.admitted)

    def _to_full_length(self) -> int:
        """Blocks the running rows still ask for until each reaches its full length."""
        return sum(
            len(g.rows) * (self._blocks(g.prompt_len, g.prompt_len + self.new_tokens) - len(g.rows[0].blocks))
            for g in self.admitted
        )

    def chunk_steps(self) -> int:
        """Decode steps until the next sync: a chunk, or fewer when every running row reaches its cap sooner."""
        return min(self.chunk, max(self.new_tokens - group.rows[0].position for group in self.admitted))

    def advance(self, steps: int) -> None:
        """The host's view of `steps` decode steps: every running row wrote and drew that many tokens (a row
        that finished meanwhile is reported, and dropped, at the next sync)."""
        for row in self.running:
            row.length += steps
            row.position += steps
