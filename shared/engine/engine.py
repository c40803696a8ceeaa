"""Engine: continuous batching over the paged KV pool. One step reads schedule -> run -> postprocess.

Every step runs, as one batch of rows through the model: one token for each running sequence,
whole prompt chunks of waiting sequences up to a token budget (chunked prefill), and the KV of
sequences whose prompt was computed on another worker is written into the pool. New sequences
join at step boundaries; finished ones leave at once and their blocks go back to the pool. When
the pool runs dry, the newest running sequence is preempted: its blocks are freed and it is
recomputed from its tokens later, never dropped.

`step()` runs in the engine thread; `admit`, `add` and `kv_arrived` may be called from the event
loop while a step runs, so the block bookkeeping sits behind one lock (the forward pass itself
runs outside it). `release` must be called between steps: a sequence in the running step's batch
is still being written.

Only blocks computed by a prompt pass (here or on a prefill worker) enter the prefix cache:
a token decoded alone gets slightly different bits than the same token inside a prompt chunk,
so caching decode-filled blocks would make a cache hit differ from a cold run.
"""

import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from shared.engine.block_manager import BlockManager
from shared.engine.model_runner import ModelRunner, SeqSpan
from shared.engine.sampler import logprob_of, sample
from shared.engine.sequence import SeqStatus, Sequence, StepOutput


@dataclass
class _Work:
    seq: Sequence
    start: int
    end: int


class Engine:
    def __init__(
        self,
        runner: ModelRunner,
        blocks: BlockManager,
        max_num_seqs: int = 64,
        max_batch_tokens: int = 512,
    ):
        if max_batch_tokens < runner.chunk:
            raise ValueError("max_batch_tokens must be at least one prefill chunk")
        self.runner = runner
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max_batch_tokens
        self.lock = threading.Lock()
        self.waiting: deque[Sequence] = (
            deque()
        )  # prompt (or recompute) to run here, first come first
        self.loading: list[Sequence] = []  # remote KV arrived, to be written into the pool
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefill_tokens_per_s = 0.0  # prompt rows per second of step, smoothed
        self.decode_step_s = 0.0  # wall time of a step with decode rows, smoothed
        # told of each step that ran rows: (kind: prefill, decode or mixed, seconds, sequences)
        self.observer: Callable[[str, float, int], None] | None = None

    # -- from the event loop -------------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Reserves the blocks of seq's prompt now (its KV will arrive from a prefill worker)."""
        with self.lock:
            if not self.blocks.can_allocate(seq):
                return False
            self.blocks.allocate(seq)
            return True

    def add(self, seq: Sequence) -> None:
        """Queues seq to be prefilled here: behind every waiting sequence of its priority or higher."""
        with self.lock:
            seq.status = SeqStatus.WAITING
            at = len(self.waiting)
            while (
                at > 0
                and self.waiting[at - 1].task.priority < seq.task.priority
                and not self._started(self.waiting[at - 1])
            ):  # never ahead of one already started
                at -= 1
            self.waiting.insert(at, seq)

    @staticmethod
    def _started(seq: Sequence) -> bool:
        """Computing, or preempted after it had started (it resumes first, whatever its priority)."""
        return bool(seq.block_table or seq.prefill_started or seq.output_ids)

    def prompt_tokens_queued(self) -> int:
        """Prompt tokens waiting here to be computed (what a new prompt queues behind)."""
        with self.lock:
            return sum(
                max(0, s.num_tokens - max(s.num_computed_tokens, s.num_cached_tokens))
                for s in self.waiting
            )

    def kv_arrived(self, seq: Sequence) -> None:
        """seq's KV is in its blocks and seq.first_token is set: it joins the batch at the next step."""
        with self.lock:
            seq.status = SeqStatus.KV_READY
            self.loading.append(seq)

    def release(self, seq: Sequence) -> None:
        """Takes seq out of the engine and frees its blocks (finished, cancelled or failed)."""
        with self.lock:
            for queue in (self.waiting, self.loading, self.running):
                if seq in queue:
                    queue.remove(seq)
            self.blocks.deallocate(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.loading or self.running)

    # -- the engine thread --------------------------------------------------------------------

    def step(self) -> list[tuple[Sequence, StepOutput]] | None:
        """What this step produced; None when nothing could be scheduled (wait for news)."""
        with self.lock:
            loads, work = self._schedule()
        if not loads and not work:
            return None
        outputs = [(seq, self._load(seq)) for seq in loads]
        if work:
            decoding = any(w.seq.status is SeqStatus.RUNNING for w in work)
            kind = _kind(work, decoding)  # before the step moves prompts on to RUNNING
            started = time.perf_counter()
            logits = self.runner.forward(
                [SeqSpan(w.seq.block_table, w.seq.token_ids, w.start, w.end) for w in work],
                abandon=lambda: all(w.seq.abandoned for w in work),
            )
            if logits is None:  # every sequence in it was cancelled meanwhile: they are freed next
                return outputs
            self._measure(work, time.perf_counter() - started)
            with self.lock:
                outputs += self._postprocess(work, logits)
            seconds = time.perf_counter() - started
            if decoding:
                self._measure_step(seconds)
            if self.observer is not None:
                self.observer(kind, seconds, len(work))
        return outputs

    def _measure_step(self, seconds: float) -> None:
        """How long a step takes while sequences decode: the gap between their tokens, which the
        scheduler keeps under its ITL target (prompt chunks in the step count: they delay the tokens)."""
        self.decode_step_s = (
            seconds if not self.decode_step_s else 0.8 * self.decode_step_s + 0.2 * seconds
        )

    def _measure(self, work: list[_Work], seconds: float) -> None:
        """Prompt throughput, for the scheduler's wait estimates (steps with many prompt rows only:
        a step of a few rows says little about how fast a long prompt goes)."""
        prompt_rows = sum(w.end - w.start for w in work if w.seq.status is SeqStatus.WAITING)
        if prompt_rows >= self.runner.chunk and seconds > 0:
            rate = prompt_rows / seconds
            self.prefill_tokens_per_s = (
                rate
                if not self.prefill_tokens_per_s
                else 0.8 * self.prefill_tokens_per_s + 0.2 * rate
            )

    def _schedule(self) -> tuple[list[Sequence], list[_Work]]:
        work = [_Work(seq, seq.num_tokens - 1, seq.num_tokens) for seq in self._decodable()]
        room = max(0, self.max_num_seqs - len(work))
        loads, self.loading = self.loading[:room], self.loading[room:]
        budget = self.max_batch_tokens - len(work)
        admitting, prefilling = True, False
        for seq in list(self.waiting):
            if budget <= 0 and prefilling:
                break
            if not seq.block_table:
                # First come, first served: once one cannot start, later ones wait behind it;
                # those already started (holding their blocks) still go on.
                admitting = (
                    admitting
                    and len(loads) + len(work) < self.max_num_seqs
                    and self.blocks.can_allocate(seq)
                )
                if not admitting:
                    continue
                self.blocks.allocate(seq)
                seq.num_computed_tokens = seq.num_cached_tokens
                seq.cached_tokens = seq.cached_tokens or seq.num_cached_tokens
                seq.prefill_started = seq.prefill_started or time.time()
            # One chunk per step at least, whatever the decode rows took, so prompts always advance.
            end = self._chunk_end(seq, budget, first=not prefilling)
            if end > seq.num_computed_tokens:
                work.append(_Work(seq, seq.num_computed_tokens, end))
                budget -= end - seq.num_computed_tokens
                prefilling = True
        return loads, work

    def _decodable(self) -> list[Sequence]:
        """Running sequences with a block for their next token; preempts the newest when the pool is dry."""
        ready = []
        for seq in list(self.running):
            if seq not in self.running:
                continue  # preempted below to make room for an older one
            while not self.blocks.can_append(seq) and self.running[-1] is not seq:
                self._preempt(self.running[-1])
            if not self.blocks.can_append(seq):
                self._preempt(seq)
                continue
            self.blocks.may_append(seq)
            ready.append(seq)
        return ready

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _chunk_end(self, seq: Sequence, budget: int, first: bool) -> int:
        """Whole chunks (aligned to absolute positions) that fit the budget; one at least when first."""
        chunk, start, end = self.runner.chunk, seq.num_computed_tokens, seq.num_computed_tokens
        while end < seq.num_tokens:
            nxt = min(seq.num_tokens, (end // chunk + 1) * chunk)
            if nxt - start > budget and not (first and end == start):
                break
            end = nxt
        return end

    def _load(self, seq: Sequence) -> StepOutput:
        """A remotely computed prompt joins: its KV was received straight into its blocks."""
        with self.lock:
            seq.num_computed_tokens = seq.prompt_len
            self.blocks.commit(seq, seq.prompt_len)
            return self._emit(seq, seq.first_token, seq.first_logprob)

    def _postprocess(self, work: list[_Work], logits) -> list[tuple[Sequence, StepOutput]]:
        outputs = []
        for row, w in enumerate(work):
            seq = w.seq
            if seq.status is SeqStatus.WAITING:  # a prompt pass: its full blocks may be shared
                self.blocks.commit(seq, w.end)
            seq.num_computed_tokens = w.end
            if w.end < seq.num_tokens:
                continue  # more prompt chunks to go
            if seq.status is SeqStatus.WAITING:
                self.waiting.remove(seq)
                # Wall clocks: the arrival time is the gateway's, and a clock may step back.
                seq.prefill_ms = (
                    seq.prefill_ms or max(0.0, time.time() - seq.prefill_started) * 1000
                )
                seq.queue_ms = (
                    seq.queue_ms or max(0.0, seq.prefill_started - seq.task.arrival_time) * 1000
                )
            outputs.append((seq, self._sample(seq, logits[row])))
        return outputs

    def _sample(self, seq: Sequence, logits) -> StepOutput:
        """The next token from seq's logits [vocab], with its logprob when the request asked."""
        token = sample(logits, seq.sampling, seq.position)
        params = seq.sampling
        logprob = logprob_of(logits, token, params.top_logprobs) if params.logprobs else None
        return self._emit(seq, token, logprob)

    def _emit(self, seq: Sequence, token: int, logprob=None) -> StepOutput:
        out = seq.append(token, logprob)
        if seq.status is SeqStatus.FINISHED:
            if seq in self.running:
                self.running.remove(seq)
            if not seq.prefill_only:  # a prefill keeps its blocks until its KV is sent
                self.blocks.deallocate(seq)
        else:
            seq.status = SeqStatus.RUNNING
            if seq not in self.running:
                self.running.append(seq)
        return out


def _kind(work: list[_Work], decoding: bool) -> str:
    prompting = any(w.seq.status is not SeqStatus.RUNNING for w in work)
    return ("mixed" if prompting else "decode") if decoding else "prefill"
