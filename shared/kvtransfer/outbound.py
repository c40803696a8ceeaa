"""OutboundTransfer: one prompt's KV on the prefill side, as one state machine.

    QUEUED -> PREFILLING -> SENDING -> SENT -> RELEASED
        QUEUED, PREFILLING or SENDING -> ABORTING -> RELEASED

QUEUED: accepted, nothing computed yet. PREFILLING: the engine computes the prompt; each
segment goes on the wire as soon as its tokens are computed. SENDING: every segment is on the
wire and the decode worker has the first token; the blocks stay held until every piece has left.
SENT: every piece left. ABORTING: stopped (cancel, deadline, the decode worker's TransferAbort,
a failed step or send): no more segments, the blocks freed at once; pieces already on the wire
may still be leaving (the decode worker discards them). RELEASED: nothing of it is left here.

The blocks are freed exactly once: on entering ABORTING, or on SENT -> RELEASED. Cancels and
aborts from the decode worker arrive between engine steps and are acted on at the next one
(`pending_abort`). A transition the table does not allow is a bug and raises (TransferMachine).
The I/O of each step (staging, sending, telling the decode worker) is KVShipper's (ship.py).
"""

import enum
import time
from collections.abc import Callable

from shared.control.failure import Code, Failure, failed, retry_anywhere, worker_failed
from shared.control.messages import PrefillResult, PrefillTask, PromptLogprobs, TokenLogprob
from shared.dataplane.plane import KVTransferError, PlaneRestarted
from shared.engine.sequence import Sequence, StepOutput
from shared.kvtransfer.machine import TransferMachine
from shared.kvtransfer.plan import Segment
from shared.kvtransfer.sender import KVSender
from shared.telemetry import tracing


class OutboundState(enum.Enum):
    QUEUED = "queued"
    PREFILLING = "prefilling"
    SENDING = "sending"
    SENT = "sent"
    ABORTING = "aborting"
    RELEASED = "released"


S = OutboundState
ALLOWED: dict[OutboundState, frozenset[OutboundState]] = {
    S.QUEUED: frozenset({S.PREFILLING, S.ABORTING}),
    S.PREFILLING: frozenset({S.SENDING, S.ABORTING}),
    S.SENDING: frozenset({S.SENT, S.ABORTING}),
    S.SENT: frozenset({S.RELEASED}),
    S.ABORTING: frozenset({S.RELEASED}),
    S.RELEASED: frozenset(),
}
COMPUTING = frozenset({S.QUEUED, S.PREFILLING})  # segments may still be staged
HOLDING = frozenset({S.QUEUED, S.PREFILLING, S.SENDING, S.SENT})  # the blocks are held


class OutboundTransfer(TransferMachine[OutboundState]):
    ALLOWED = ALLOWED

    def __init__(
        self,
        task: PrefillTask,
        seq: Sequence,
        sender: KVSender,
        free_blocks: Callable[[Sequence], None],
    ):
        super().__init__(task.attempt_id, S.QUEUED)
        self.task = task
        self.seq = seq
        self.sender = sender
        self._free_blocks = free_blocks  # the engine's release: between steps only
        self.first_tokens: list[int] = []
        self.first_logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: PromptLogprobs | None = None
        self.computed_at = 0.0  # unix time the prompt's last chunk was computed
        self.received_at = time.time()
        self.trace = tracing.current()  # the decode worker's, from the task's message headers
        self.cancel_reason = ""  # a CancelRequest came
        self.abort_reason = ""  # the decode worker's TransferAbort came

    @property
    def computing(self) -> bool:
        return self.state in COMPUTING

    @property
    def holds_blocks(self) -> bool:
        return self.state in HOLDING

    def _moved(self, before: OutboundState, after: OutboundState) -> None:
        if before in HOLDING and after not in HOLDING:
            self._free_blocks(self.seq)

    # -- events from the control plane (acted on between engine steps) ---------------------------

    def on_cancel(self, reason: str) -> None:
        if self.computing and not self.seq.status.finished:
            self.cancel_reason = reason
            self.seq.abandoned = True  # a step computing only abandoned prompts stops early

    def on_transfer_abort(self, base_tag: int, reason: str) -> bool:
        """The decode worker gave up on this transfer; False when it is not this one's."""
        if base_tag != self.task.destination.base_tag or self.state not in HOLDING:
            return False
        self.abort_reason = reason or "aborted"
        self.seq.abandoned = True  # a step computing it may stop
        return True

    def pending_abort(self) -> Failure | None:
        """The abort due now, between steps, if any (the request's, not this worker's fault)."""
        if self.state not in HOLDING or self.state is S.SENT:
            return None
        if self.abort_reason:
            return failed(Code.CANCELLED, f"aborted by the decode worker: {self.abort_reason}")
        if not self.computing:
            return None
        if self.cancel_reason:
            return failed(Code.CANCELLED, "cancelled before its prefill finished")
        if self.seq.expired:
            return failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed")
        return None

    # -- the normal path ---------------------------------------------------------------------------

    def ready(self) -> list[Segment]:
        """The segments computed since the last step, not staged yet (PREFILLING from the first)."""
        if not self.computing:
            return []
        if self.state is S.QUEUED and self.seq.num_computed_tokens:
            self._to(S.PREFILLING)
        return self.sender.ready(self.seq.num_computed_tokens)

    def on_prompt_done(self, out: StepOutput) -> None:
        """The prompt is computed: `out` holds the first token of each choice (and logprobs),
        drawn under the request's penalties, bias and min_tokens. Only the tokens travel: the
        decode worker rebuilds each choice's counts from its prompt (a moved request's resumed
        tail counted as output) and the first token (shared/engine/penalties.py)."""
        self.first_tokens, self.computed_at = out.token_ids, time.time()
        self.first_logprobs, self.prompt_logprobs = out.logprobs, out.prompt_logprobs

    def on_all_staged(self) -> bool:
        """Every segment is on the wire: SENDING (True) unless it ended meanwhile."""
        if not self.sender.all_staged or not self.computing:
            return False
        if self.state is S.QUEUED:
            self._to(S.PREFILLING)
        self._to(S.SENDING)
        return True

    def on_sends_done(self) -> None:
        """Every piece has left (or failed after an abort): nothing of it is left here."""
        if self.state is S.SENDING:
            self._to(S.SENT)
        self._to(S.RELEASED)

    # -- the abort path ----------------------------------------------------------------------------

    def abort(self) -> bool:
        """ABORTING: no more segments, the blocks freed now. True when pieces may still be
        leaving (the owner waits for them, then `on_sends_done`); else RELEASED at once."""
        was_sending = self.state is S.SENDING
        self._to(S.ABORTING)
        if self.sender.sends and not was_sending:
            return True
        if not self.sender.sends:
            self._to(S.RELEASED)
        return False

    def result(self, worker_id: str, transport: str) -> PrefillResult:
        self._record_spans()
        return PrefillResult(
            attempt_id=self.attempt_id,
            base_tag=self.task.destination.base_tag,
            first_tokens=self.first_tokens,
            first_logprobs=self.first_logprobs,
            prompt_logprobs=self.prompt_logprobs,
            kv_bytes=self.sender.plan.nbytes,
            queue_ms=self.seq.queue_ms,
            prefill_ms=self.seq.prefill_ms,
            prefill_worker=worker_id,
            transport=transport,
            computed_at=self.computed_at,
            sent_at=self.sender.first_sent_at,
            cached_tokens=self.seq.cached_tokens,
        )

    def _record_spans(self) -> None:
        started = self.seq.prefill_started or self.received_at
        tracing.record("prefill.queue", self.trace, self.received_at, started)
        tracing.record(
            "prefill.compute",
            self.trace,
            started,
            self.computed_at,
            prompt_tokens=len(self.task.task.prompt_token_ids),
            cached_tokens=self.seq.cached_tokens,
        )
        tracing.record(
            "prefill.kv_send",
            self.trace,
            self.computed_at,
            time.time(),
            bytes=self.sender.plan.nbytes,
        )

    def aborted(self, worker_id: str, failure: Failure) -> PrefillResult:
        return PrefillResult(
            attempt_id=self.attempt_id,
            base_tag=self.task.destination.base_tag,
            failure=failure,
            pieces_sent=self.sender.pieces_sent,
            prefill_worker=worker_id,
        )


def send_failure(worker_id: str, err: KVTransferError) -> Failure:
    """A send failed: this worker's own data plane restarted under it (retried anywhere), or the
    transfer failed here (placed again without this worker)."""
    if isinstance(err, PlaneRestarted):
        return retry_anywhere(f"prefill worker {worker_id}'s KV data plane restarted mid-transfer")
    return worker_failed(worker_id, "KV transfer failed")
