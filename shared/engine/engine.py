"""Engine: continuous batching over the paged KV pool. One step reads schedule -> run -> postprocess.

A step runs one batch of rows through the model: a token per running sequence, and prompt chunks
of waiting ones up to a token budget (chunked prefill: a chunk each in line, then the rest in
order; see prompt_chunks). A prompt computed on another worker joins when its KV has landed, at
once when the batch has room (its first token goes out before the step in flight ends). When the
pool runs dry the newest running sequence is preempted (blocks freed, recomputed later, never
dropped); so is one whose rope asks for it (Phi-3's longrope past its trained length: Rotary).

`step()` runs in the engine thread; `admit`, `add`, `kv_arrived` may come from the event loop
meanwhile (block bookkeeping behind one lock, the forward pass outside it); `release` only between
steps (a sequence in the running step's batch is being written).

Only prompt-pass blocks (here or on a prefill worker) enter the prefix cache: a decoded token's bits
differ slightly from a prompt row's; a hit on decode-filled blocks would differ from a cold run.
"""

import threading
import time
from collections import deque
from dataclasses import dataclass

from shared.control.choices import choice_sampling
from shared.engine.block_manager import BlockManager
from shared.engine.fork import fork
from shared.engine.model_runner import ModelRunner, SeqSpan
from shared.engine.prompt_chunks import chunk_end, share_rest
from shared.engine.sampler import greedy_tokens, logprob_of, plain_greedy, sample
from shared.engine.sequence import SeqStatus, Sequence, StepOutput
from shared.engine.step_stats import StepStats


@dataclass
class _Work:
    seq: Sequence
    start: int  # positions [start, end) computed this step
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
        self.waiting: deque[Sequence] = deque()  # prompt (or recompute) to run, in order
        self.loading: list[Sequence] = []  # remote KV arrived, to be written into the pool
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.stats = StepStats(runner.chunk)
        self.forked: list[Sequence] = []  # choices forked since the owner last took them

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

    def kv_arrived(self, seq: Sequence) -> list[tuple[Sequence, StepOutput]]:
        """seq's KV is in its blocks and seq.first_tokens are set: it joins the batch now when
        there is room and none waits before it (its first token returned, to send at once),
        else at a step (a group of n > 1 choices always does: its forks are a step's)."""
        with self.lock:
            seq.status = SeqStatus.KV_READY
            room = len(self.running) < self.max_num_seqs and not self.loading
            if not (room and len(seq.first_tokens) == 1):
                self.loading.append(seq)
                return []
        return self._load(seq)

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
        outputs = [pair for seq in loads for pair in self._load(seq)]
        if work:
            # counted before the step moves prompts on to RUNNING
            decoding = sum(1 for w in work if w.seq.status is SeqStatus.RUNNING)
            prompt_rows = sum(w.end - w.start for w in work if w.seq.status is SeqStatus.WAITING)
            started = time.perf_counter()
            spans = [
                SeqSpan(w.seq.block_table, w.seq.token_ids, w.start, w.end, w.seq.computing_prompt)
                for w in work
            ]
            logits = self.runner.forward(spans, abandon=lambda: all(w.seq.abandoned for w in work))
            if logits is None:  # every sequence in it was cancelled meanwhile: they are freed next
                return outputs
            forward_s = time.perf_counter() - started
            with self.lock:
                outputs += self._postprocess(work, logits)
            step_s = time.perf_counter() - started
            self.stats.record(decoding, prompt_rows, forward_s, step_s, len(work))
        return outputs

    prefill_tokens_per_s = property(lambda self: self.stats.prefill_tokens_per_s)
    decode_step_s = property(lambda self: self.stats.decode_step_s)

    def _schedule(self) -> tuple[list[Sequence], list[_Work]]:
        work = [_Work(seq, seq.num_tokens - 1, seq.num_tokens) for seq in self._decodable()]
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
            # A chunk each (one at least, whatever the decode rows took: prompts always advance),
            # then the rest of the budget in order (prompt_chunks).
            start = seq.num_computed_tokens
            end = chunk_end(start, seq.num_tokens, self.runner.chunk, budget, not line, most=1)
            if end > start:
                line.append([seq, end])
                budget -= end - start
        share_rest(line, [seq.num_tokens for seq, _ in line], self.runner.chunk, budget)
        work += [_Work(seq, seq.num_computed_tokens, end) for seq, end in line]
        return loads, work

    def _decodable(self) -> list[Sequence]:
        """Running sequences with a block for their next token; preempts the newest when the pool is dry."""
        ready = []
        for seq in list(self.running):
            if seq in self.running and self.runner.rotary.recomputes_at(seq.num_tokens):
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

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.deallocate(seq)
        seq.num_computed_tokens = 0
        seq.status = SeqStatus.WAITING
        self.waiting.appendleft(seq)
        self.preemptions += 1

    def _load(self, seq: Sequence) -> list[tuple[Sequence, StepOutput]]:
        """A remotely computed prompt joins: its KV was received straight into its blocks."""
        with self.lock:
            seq.num_computed_tokens = seq.prompt_len
            self.blocks.commit(seq, seq.prompt_len)
            logprobs = seq.first_logprobs or [None] * len(seq.first_tokens)
            return self._first_of_each(seq, list(zip(seq.first_tokens, logprobs)))

    def _postprocess(self, work: list[_Work], logits) -> list[tuple[Sequence, StepOutput]]:
        ends = [w.end >= w.seq.num_tokens and plain_greedy(w.seq.sampling) for w in work]
        outputs, greedy = [], greedy_tokens(logits, ends)
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
            outputs += self._sample(seq, logits[row], greedy[row])
        return outputs

    def _sample(self, seq: Sequence, logits, greedy: int) -> list[tuple[Sequence, StepOutput]]:
        """The next token from seq's logits [vocab] (with its logprob when asked); at the end of
        the prompt of a request of n > 1 choices, the first token of each choice. `greedy`: the
        row's argmax, when it is all the request asks for (-1: not computed)."""
        params = seq.sampling
        if greedy >= 0:
            return self._first_of_each(seq, [(greedy, None)])
        choices = (
            [choice_sampling(params, i) for i in range(params.n)] if params.n > 1 else [params]
        )
        draws = []
        for choice in choices:
            token = sample(logits, choice, seq.position)
            logprob = logprob_of(logits, token, choice.top_logprobs) if choice.logprobs else None
            draws.append((token, logprob))
        return self._first_of_each(seq, draws)

    def _first_of_each(self, seq: Sequence, draws: list) -> list[tuple[Sequence, StepOutput]]:
        """seq takes draws[0]; the other choices (a prefill worker: the decode worker's to fork;
        else forked here) take the others."""
        if len(draws) == 1:
            return [(seq, self._emit(seq, *draws[0]))]
        if seq.prefill_only:
            seq.sampling = choice_sampling(seq.sampling, 0)  # a prefill: nothing after this
            out = self._emit(seq, *draws[0])
            out.token_ids = [token for token, _ in draws]
            out.logprobs = [logprob for _, logprob in draws if logprob is not None]
            return [(seq, out)]
        children = fork(seq, len(draws), self.blocks, self.runner.pool)  # seq: choice 0 now
        self.forked.append(seq)  # renamed: its owner knows it under seq.group_id until now
        outputs = [(seq, self._emit(seq, *draws[0]))]
        for (child, shared), draw in zip(children, draws[1:]):
            self.forked.append(child)
            outputs.append((child, self._emit(child, *draw) if shared else child.append(*draw)))
            if not shared and child.status is not SeqStatus.FINISHED:
                child.status = SeqStatus.WAITING  # its prompt computed again, when there is room
                self.waiting.appendleft(child)
        return outputs

    def take_forked(self) -> list[Sequence]:
        """The choices forked since the last call, each group's choice 0 (its own sequence,
        renamed) before its others: their owner adopts them."""
        with self.lock:
            forked, self.forked = self.forked, []
            return forked

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
