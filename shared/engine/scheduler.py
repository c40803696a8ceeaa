"""Scheduler: which sequences run in the engine's next step, within the prompt budget and the KV
blocks; it owns the queues and preemption. (The scheduler *service*, services/scheduler/, places
requests on workers; this one batches a worker's sequences.)

A step runs one batch of rows: a token per running sequence, and prompt chunks of waiting ones up
to a token budget (chunked prefill: a chunk each in line, then the rest in order; see
prompt_chunks). A prompt computed on another worker joins when its KV has landed (at once when
the batch has room: Engine.kv_arrived). When the pool runs dry the newest running sequence is
preempted (blocks freed, recomputed later, never dropped); so is one whose rope asks for it
(Phi-3's longrope past its trained length: Rotary).

Pure bookkeeping over the BlockManager: the Engine calls it under its lock.
"""

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.prompt_chunks import chunk_end, share_rest
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence


@dataclass
class Work:
    seq: Sequence
    start: int  # positions [start, end) computed this step
    end: int


@dataclass
class Batch:
    """One step's: remotely computed prompts that join (their KV is in their blocks), and rows."""

    loads: list[Sequence] = field(default_factory=list)
    work: list[Work] = field(default_factory=list)


class Scheduler:
    def __init__(
        self,
        blocks: BlockManager,
        chunk: int,
        recomputes_at: Callable[[int], bool],
        max_num_seqs: int,
        max_batch_tokens: int,
    ):
        if max_batch_tokens < chunk:
            raise ValueError("max_batch_tokens must be at least one prefill chunk")
        self.blocks = blocks
        self.chunk = chunk  # prompts are computed in chunks of this many tokens
        self.recomputes_at = recomputes_at  # a length at which a sequence's keys all change
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.waiting: deque[Sequence] = deque()  # prompt (or recompute) to run, in order
        self.loading: list[Sequence] = []  # remote KV arrived, to join the batch
        self.running: list[Sequence] = []
        self.preemptions = 0

    # -- sequences in and out ---------------------------------------------------------------

    def queue(self, seq: Sequence) -> None:
        """seq's prompt is computed here: behind every waiting sequence of its priority or
        higher, never ahead of one already started."""
        at = len(self.waiting)
        while (
            at > 0
            and self.waiting[at - 1].priority < seq.priority
            and not _started(self.waiting[at - 1])
        ):
            at -= 1
        self.waiting.insert(at, seq)

    def requeue(self, seq: Sequence) -> None:
        """A choice that could not share its group's KV: its prompt computed again, first."""
        self.waiting.appendleft(seq)

    def reserve(self, seq: Sequence) -> bool:
        """Reserves the blocks of seq's prompt now (its KV will arrive from a prefill worker)."""
        if not self.blocks.can_allocate(seq):
            return False
        self.blocks.allocate(seq)
        seq.move(SeqStatus.WAITING_KV)
        return True

    def kv_ready(self, seq: Sequence) -> bool:
        """seq's KV is in its blocks: True when it joins the batch at once (there is room and
        none waits before it), else it joins at a step (a group of n > 1 choices always does:
        its forks are a step's)."""
        seq.move(SeqStatus.KV_READY)
        room = len(self.running) < self.max_num_seqs and not self.loading
        if room and len(seq.first_tokens) == 1:
            return True
        self.loading.append(seq)
        return False

    def remove(self, seq: Sequence) -> None:
        for queue in (self.waiting, self.loading, self.running):
            if seq in queue:
                queue.remove(seq)

    def sampled(self, seq: Sequence) -> None:
        """seq took a token: it runs on, or (finished) leaves the batch and, unless a prefill
        keeps them until its KV is sent, its blocks."""
        if seq.status.finished:
            if seq in self.running:
                self.running.remove(seq)
            if not seq.prefill_only:
                self.blocks.deallocate(seq)
        elif seq.status is not SeqStatus.RUNNING:
            seq.move(SeqStatus.RUNNING)
            self.running.append(seq)

    def prompt_done(self, seq: Sequence) -> None:
        self.waiting.remove(seq)

    # -- the state ---------------------------------------------------------------------------

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    def prompt_tokens_queued(self) -> int:
        """Prompt tokens waiting here to be computed (what a new prompt queues behind)."""
        return sum(
            max(0, s.num_tokens - max(s.num_computed_tokens, s.num_cached_tokens))
            for s in self.waiting
        )

    # -- a step ------------------------------------------------------------------------------

    def schedule(self) -> Batch:
        work = [Work(seq, seq.num_tokens - 1, seq.num_tokens) for seq in self._decodable()]
        room = max(0, self.max_num_seqs - len(work))
        loads, self.loading = self.loading[:room], self.loading[room:]
        budget = self.max_batch_tokens - len(work)
        admitting, line = True, []  # line: [seq, end] of the prompts computed this step
        for seq in list(self.waiting):
            if budget <= 0 and line:
                break
            if not seq.block_table:
                # First come, first served: once one cannot start, later ones wait behind it;
                # those already started (holding their blocks) still go on.
                admitting = admitting and len(loads) + len(work) < self.max_num_seqs
                admitting = admitting and self._start(seq)
                if not admitting:
                    continue
            # A chunk each (one at least, whatever the decode rows took: prompts always advance),
            # then the rest of the budget in order (prompt_chunks).
            start = seq.num_computed_tokens
            end = chunk_end(start, seq.num_tokens, self.chunk, budget, not line, most=1)
            if end > start:
                line.append([seq, end])
                budget -= end - start
        share_rest(line, [seq.num_tokens for seq, _ in line], self.chunk, budget)
        work += [Work(seq, seq.num_computed_tokens, end) for seq, end in line]
        return Batch(loads, work)

    def _start(self, seq: Sequence) -> bool:
        """Gives a waiting (or preempted) sequence its blocks, when the pool has them."""
        if not self.blocks.can_allocate(seq):
            return False
        self.blocks.allocate(seq)
        if seq.status is SeqStatus.PREEMPTED:
            seq.move(SeqStatus.WAITING)
        seq.num_computed_tokens = seq.num_cached_tokens
        seq.cached_tokens = seq.cached_tokens or seq.num_cached_tokens
        seq.prefill_started = seq.prefill_started or time.time()
        return True

    def _decodable(self) -> list[Sequence]:
        """Running sequences with a block for their next token; preempts the newest when the
        pool is dry."""
        if self._all_decodable():
            for seq in self.running:
                self.blocks.may_append(seq)
            return list(self.running)
        ready = []
        for seq in list(self.running):
            if seq in self.running and self.recomputes_at(seq.num_tokens):
                self._preempt(seq)  # its every key changes at this length: computed again
            if seq not in self.running:
                continue  # preempted to make room for an older one, or to be computed again
            while not self.blocks.can_append(seq) and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if not self.blocks.can_append(seq):
                self._preempt(seq)
                continue
            self.blocks.may_append(seq)
            ready.append(seq)
        return ready

    def _all_decodable(self) -> bool:
        """The common step, told in one pass: no running sequence reaches a length it is
        computed again at, and the pool has a block for each that needs a new one. Then every
        one runs, in order, as the loop below would find one by one (~1 us a sequence less)."""
        blocks, needed = self.blocks, 0
        for seq in self.running:
            tokens = seq.num_tokens
            if self.recomputes_at(tokens):
                return False
            needed += blocks.blocks_for(tokens) - len(seq.block_table)
        return needed <= blocks.free

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.move(SeqStatus.PREEMPTED)
        self.waiting.appendleft(seq)
        self.preemptions += 1


def _started(seq: Sequence) -> bool:
    """Computing, or preempted after it had started (it resumes first, whatever its priority)."""
    return bool(seq.block_table or seq.prefill_started or seq.output_ids)
