"""Engine: continuous batching over the paged KV pool. A step reads drain -> schedule -> forward ->
postprocess.

The Scheduler decides which sequences run in a step (and preempts); the ModelRunner computes the
batch; the Engine shapes the rows' logits (shaping.py: penalties, bias, min_tokens, masks) and samples each
row's next token, forks the choices of a request of n > 1 at its
first token (fork), and lands prompts computed on another worker once their KV is in their blocks.

`step()` runs in the engine thread; `admit`, `add`, `kv_arrived`, `abort` and `release` may come
from the event loop meanwhile (bookkeeping behind one lock, the forward pass outside it). Blocks
released while a step runs are freed when it ends: the step may still be writing them, and none
may be handed to another sequence (or to a KV transfer) before then. New sequences wait in an
inbox until the next step drains it.

Only prompt-pass blocks (here or on a prefill worker) enter the prefix cache: a decoded token's bits
differ slightly from a prompt row's; a hit on decode-filled blocks would differ from a cold run.
"""

import threading
import time

from shared.engine.block_manager import BlockManager
from shared.engine.fork import fork
from shared.engine.forward_batch import SeqSpan
from shared.engine.sampler import logprob_of, plain_greedy, sample
from shared.engine.scheduler import Scheduler, Work
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence, StepOutput
from shared.engine.shaping import shaped
from shared.engine.step_runner import StepRunner
from shared.engine.step_stats import StepStats
from shared.engine.token_ids import span_ids
from shared.engine.token_mask import RowMasks
from shared.values.sampling import SamplingParams, choice_sampling

Outputs = list[tuple[Sequence, StepOutput]]


class Engine:
    def __init__(
        self,
        runner: StepRunner,
        blocks: BlockManager,
        max_num_seqs: int = 64,
        max_batch_tokens: int = 512,
    ):
        self.runner = runner
        self.blocks = blocks
        self.scheduler = Scheduler(
            blocks, runner.chunk, runner.rotary.recomputes_at, max_num_seqs, max_batch_tokens
        )
        self.lock = threading.Lock()
        self.inbox: list[Sequence] = []  # added since the last step: its scheduler queues them
        self.stats = StepStats(runner.chunk)
        self.forked: list[Sequence] = []  # choices forked since the owner last took them
        self.masks = RowMasks(runner.kernels)  # constrained rows, with the runner's kernels
        self.stepping = False  # a step runs (set and cleared under the lock)
        self.releasing: list[Sequence] = []  # released while it runs: freed when it ends
        # news a step may schedule differently for (a sequence added, landed, ended or freed),
        # counted; `scheduled_at`: the count the last step scheduled with
        self.changes = 0
        self.scheduled_at = 0

    # -- from the event loop -------------------------------------------------------------------

    def admit(self, seq: Sequence) -> bool:
        """Reserves the blocks of seq's prompt now (its KV will arrive from a prefill worker)."""
        with self.lock:
            return self.scheduler.reserve(seq)

    def add(self, seq: Sequence) -> None:
        """seq's prompt is computed here: queued at the next step."""
        with self.lock:
            self.inbox.append(seq)
            self.changes += 1

    def kv_arrived(self, seq: Sequence) -> Outputs:
        """seq's KV is in its blocks and seq.first_tokens are set: it joins the batch now when
        there is room and none waits before it (its first token returned, to send at once),
        else at a step. Nothing for a sequence aborted meanwhile."""
        with self.lock:
            self.changes += 1
            if seq.status.finished or not self.scheduler.kv_ready(seq):
                return []
        return self._load(seq)

    def abort(self, seq: Sequence) -> bool:
        """Ends seq (cancelled, failed, expired): FINISHED_ABORTED, out of every queue, nothing
        more sampled for it; its blocks are freed by `release`. False when it had finished."""
        with self.lock:
            if seq in self.inbox:
                self.inbox.remove(seq)
            if seq.status.finished:
                return False
            self.changes += 1
            self.scheduler.remove(seq)
            seq.move(SeqStatus.FINISHED_ABORTED)
            seq.abandoned = True  # a step computing only abandoned sequences stops early
            return True

    def release(self, seq: Sequence) -> None:
        """Takes seq out of the engine (aborted first, unless it finished) and frees its blocks,
        at the end of the step running now if one is."""
        self.abort(seq)
        with self.lock:
            self.changes += 1
            if self.stepping:
                self.releasing.append(seq)
            else:
                self.blocks.deallocate(seq)

    def has_work(self) -> bool:
        return bool(self.inbox) or self.scheduler.has_work()

    def prompt_tokens_queued(self) -> int:
        """Prompt tokens waiting here to be computed (what a new prompt queues behind)."""
        with self.lock:
            inbox = sum(s.num_tokens - s.num_computed_tokens for s in self.inbox)
            return inbox + self.scheduler.prompt_tokens_queued()

    preemptions = property(lambda self: self.scheduler.preemptions)
    prefill_tokens_per_s = property(lambda self: self.stats.prefill_tokens_per_s)
    decode_step_s = property(lambda self: self.stats.decode_step_s)

    # -- the engine thread --------------------------------------------------------------------

    def step(self) -> Outputs | None:
        """What this step produced; None when nothing could be scheduled (wait for news)."""
        with self.lock:
            self.scheduled_at = self.changes
            self._drain()
            batch = self.scheduler.schedule()
            if not batch.loads and not batch.work:
                return None
            self.stepping = True
        try:
            return self._run(batch)
        finally:
            with self.lock:
                self.stepping = False
                for seq in self.releasing:
                    self.blocks.deallocate(seq)
                self.releasing.clear()

    def _run(self, batch) -> Outputs:
        outputs = [pair for seq in batch.loads for pair in self._load(seq)]
        if batch.work:
            rows, started = _rows(batch.work), time.perf_counter()  # counted before postprocess
            logits = self._forward(batch.work)
            if logits is None:  # every sequence in it was cancelled meanwhile: they are freed next
                return outputs
            forward_s = time.perf_counter() - started
            with self.lock:
                outputs += self._postprocess(batch.work, logits)
            self.stats.record(*rows, forward_s, time.perf_counter() - started, len(batch.work))
        return outputs

    def _drain(self) -> None:
        for seq in self.inbox:
            self.scheduler.queue(seq)
        self.inbox.clear()

    def _forward(self, work: list[Work]):
        """The batch's logits (one row per sequence), or None when all of it was abandoned."""
        spans = [
            SeqSpan(
                w.seq.block_table,
                span_ids(w.seq.prompt_token_ids, w.seq.output_ids),
                w.start,
                w.end,
                w.seq.computing_prompt,
                w.seq.prompt_scores if w.seq.computing_prompt else None,
            )
            for w in work
        ]
        return self.runner.forward(spans, abandon=lambda: all(w.seq.abandoned for w in work))

    def _load(self, seq: Sequence) -> Outputs:
        """A remotely computed prompt joins: its KV was received straight into its blocks."""
        with self.lock:
            if seq.status.finished:  # aborted while it waited to join
                return []
            seq.num_computed_tokens = seq.prompt_len
            self.blocks.commit(seq, seq.prompt_len)
            logprobs = seq.first_logprobs or [None] * len(seq.first_tokens)
            return self._first_of_each(seq, list(zip(seq.first_tokens, logprobs)))

    def _postprocess(self, work: list[Work], logits) -> Outputs:
        outputs, drawn = [], self._draw(work, logits)
        for row, w in enumerate(work):
            seq = w.seq
            if seq.status.finished:
                continue  # aborted while the step ran: nothing more for it
            if seq.computing_prompt:  # a prompt pass: its full blocks may be shared
                self.blocks.commit(seq, w.end)
            seq.num_computed_tokens = w.end
            if w.end < seq.num_tokens:
                continue  # more prompt chunks to go
            if seq.computing_prompt:
                self.scheduler.prompt_done(seq)
                if seq.prompt_scores is not None and seq.prompt_scores.done:
                    seq.prompt_logprobs = seq.prompt_scores.scores
                # Wall clocks: the arrival time is the gateway's, and a clock may step back.
                seq.prefill_ms = (
                    seq.prefill_ms or max(0.0, time.time() - seq.prefill_started) * 1000
                )
                seq.queue_ms = (
                    seq.queue_ms or max(0.0, seq.prefill_started - seq.arrival_time) * 1000
                )
            outputs += self._first_of_each(seq, _scored(seq, logits, row, drawn[row]))
        return outputs

    def _draw(self, work: list[Work], logits) -> dict[int, list[int]]:
        """The next token of each row that samples (its prompt done, not aborted), from its
        shaped logits; at the end of the prompt of a request of n > 1 choices, the first token
        of each choice. The rows that ask only for the argmax take it in one call."""
        rows = [
            row
            for row, w in enumerate(work)
            if w.end >= w.seq.num_tokens and not w.seq.status.finished
        ]
        plain = [False] * len(work)
        for row in rows:
            plain[row] = plain_greedy(work[row].seq.sampling)
        pairs = [(row, work[row].seq) for row in rows]
        with shaped(logits, pairs, self.masks, self.runner.argmax) as drawn:
            greedy = drawn.greedy(plain)
            return {
                row: [greedy[row]] if plain[row] else _sampled(work[row].seq, drawn[row])
                for row in rows
            }

    def _first_of_each(self, seq: Sequence, draws: list) -> Outputs:
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
        children = fork(seq, len(draws), self.blocks, self.runner)  # seq: choice 0 now
        self.forked.append(seq)  # renamed: its owner knows it under seq.group_id until now
        outputs = [(seq, self._emit(seq, *draws[0]))]
        for (child, shared), draw in zip(children, draws[1:]):
            self.forked.append(child)
            outputs.append((child, self._emit(child, *draw) if shared else child.append(*draw)))
            if not shared and not child.status.finished:
                self.scheduler.requeue(child)  # its prompt computed again, when there is room
        return outputs

    def take_forked(self) -> list[Sequence]:
        """The choices forked since the last call, each group's choice 0 (its own sequence,
        renamed) before its others: their owner adopts them."""
        with self.lock:
            forked, self.forked = self.forked, []
            return forked

    def _emit(self, seq: Sequence, token: int, logprob=None) -> StepOutput:
        out = seq.append(token, logprob)
        self.scheduler.sampled(seq)
        return out


def _choices(params: SamplingParams) -> list[SamplingParams]:
    """How each choice samples: the request itself, or (n > 1) each choice's own."""
    return [choice_sampling(params, i) for i in range(params.n)] if params.n > 1 else [params]


def _sampled(seq: Sequence, scores) -> list[int]:
    return [sample(scores, choice, seq.position) for choice in _choices(seq.sampling)]


def _scored(seq: Sequence, logits, row: int, tokens: list[int]) -> list[tuple]:
    """Each choice's token with its logprob under the raw logits of its row (None: not asked).
    The row is taken only where a logprob is (a tensor view per sequence and step otherwise)."""
    if seq.sampling.n == 1 and not seq.sampling.logprobs:
        return [(tokens[0], None)]
    return [
        (token, logprob_of(logits[row], token, choice.top_logprobs) if choice.logprobs else None)
        for token, choice in zip(tokens, _choices(seq.sampling))
    ]


def _rows(work: list[Work]) -> tuple[int, int]:
    """A batch's decode rows and prompt rows."""
    decoding = sum(1 for w in work if w.seq.status is SeqStatus.RUNNING)
    return decoding, sum(w.end - w.start for w in work if w.seq.computing_prompt)
