"""InboundTransfer: one remote prefill's KV on the decode side, as one state machine.

    RESERVED -> RECEIVES_POSTED -> REQUESTED -> LANDING -> COMPLETE
        any of the four before COMPLETE -> ABORTING -> RELEASED | QUARANTINED

RESERVED: the prompt's blocks are held, nothing posted. RECEIVES_POSTED: a UCX receive waits
in every piece's place. REQUESTED: the PrefillTask is on its way. LANDING: the prefill worker
took it; pieces land as it computes. COMPLETE: every piece landed and the PrefillResult came:
the blocks belong to the engine. ABORTING: the transfer was aborted (its `cause` says why) and its
receives are being ended. RELEASED: no receive can write into the blocks any more; they may be
freed. QUARANTINED: a receive would not end; the blocks must never be reused.

Each event is one method (the table and its checks are TransferMachine's). While REQUESTED, an abort of this side's own (cancel, deadline, a
clock, a failed receive) waits for the prefill worker's answer, so that its TransferAbort cannot
overtake the task; a lost or silent prefill worker ends it at once. Events that may come late (a
piece, a result, a cancel, a clock) are ignored once the transfer has ended; a transition the
table does not allow is a bug and raises.
The I/O of each step (asking, telling the prefill worker, ending receives) is KVFetcher's
(fetch.py).
"""

import asyncio
import enum
import logging
import time
from dataclasses import dataclass, replace

from shared.control.failure import Code, Failure, failed, retry_anywhere, worker_failed
from shared.control.messages import PrefillResult, TaskAck
from shared.dataplane.plane import KVTransferError, PlaneRestarted
from shared.kvtransfer.machine import TransferMachine
from shared.kvtransfer.receiver import KVReceiver

log = logging.getLogger(__name__)


class TransferState(enum.Enum):
    RESERVED = "reserved"
    RECEIVES_POSTED = "receives_posted"
    REQUESTED = "requested"
    LANDING = "landing"
    COMPLETE = "complete"
    ABORTING = "aborting"
    RELEASED = "released"
    QUARANTINED = "quarantined"


S = TransferState
ALLOWED: dict[TransferState, frozenset[TransferState]] = {
    S.RESERVED: frozenset({S.RECEIVES_POSTED, S.ABORTING}),
    S.RECEIVES_POSTED: frozenset({S.REQUESTED, S.ABORTING}),
    S.REQUESTED: frozenset({S.LANDING, S.ABORTING}),
    S.LANDING: frozenset({S.COMPLETE, S.ABORTING}),
    S.COMPLETE: frozenset(),
    S.ABORTING: frozenset({S.RELEASED, S.QUARANTINED}),
    S.RELEASED: frozenset(),
    S.QUARANTINED: frozenset(),
}
ACTIVE = frozenset({S.RESERVED, S.RECEIVES_POSTED, S.REQUESTED, S.LANDING})


@dataclass(frozen=True)
class AbortCause:
    """Why a transfer was aborted: the request's failure (movable when the prefill worker failed
    or was full, not the request: it blames that worker), and what the prefill worker is told."""

    failure: Failure
    tell_prefill: bool  # it may hold the task and is not the one that ended it
    pieces_sent: int | None = None  # how far the prefill worker got, when it said so


class InboundTransfer(TransferMachine[TransferState]):
    ALLOWED = ALLOWED

    def __init__(
        self,
        attempt_id: str,
        prefill_worker: str,
        receiver: KVReceiver,
        lease_s: float,
        timeout_s: float,
        deadline: float = 0.0,
    ):
        super().__init__(attempt_id, S.RESERVED)
        self.prefill_worker = prefill_worker
        self.choices = 1  # the request's n: the first tokens a complete result brings
        self.receiver = receiver
        self.lease_s = lease_s
        self.timeout_s = timeout_s  # the prefill worker's time from accepting to the last piece
        self.deadline = deadline  # the request's, unix time; 0 = none
        self.result: PrefillResult | None = None
        self.cause: AbortCause | None = None
        self.announced = 0.0  # monotonic time the PrefillResult came
        self.gives_up_at = 0.0  # monotonic; set when the prefill worker accepts
        self.deferred: Failure | None = None  # an abort due once the prefill worker answers
        self.news = asyncio.Event()  # set at every change of state: wakes whoever drives it

    @property
    def base_tag(self) -> int:
        return self.receiver.plan.destination.base_tag

    @property
    def active(self) -> bool:
        return self.state in ACTIVE

    @property
    def settled(self) -> bool:
        """No receive of it can write into the blocks any more: the owner may free them (or, when
        QUARANTINED, has already taken them out of use)."""
        return self.state in (S.COMPLETE, S.RELEASED, S.QUARANTINED)

    def _moved(self, before: TransferState, after: TransferState) -> None:
        self.news.set()

    # -- the normal path ------------------------------------------------------------------------

    def post_receives(self) -> None:
        self._to(S.RECEIVES_POSTED)
        self.receiver.start(self.on_piece_landed)

    def requested(self) -> None:
        """The PrefillTask is about to go out."""
        self._to(S.REQUESTED)

    def on_ack(self, ack: TaskAck) -> None:
        if self.state is not S.REQUESTED:
            return  # ended meanwhile
        if ack.failure is not None:  # it blames the prefill worker when that one is at fault
            self.abort(ack.failure, False, pieces_sent=0)
            return
        self.gives_up_at = time.monotonic() + self.timeout_s
        self._to(S.LANDING)
        if self.deferred is not None:
            self.abort(self.deferred)
        else:
            self._maybe_complete()

    def on_piece_landed(self) -> None:
        """A receive ended: a piece landed, or it failed."""
        if not self.active:
            return  # a receive ended by the abort
        try:
            self.receiver.check(float("inf"))
        except KVTransferError as err:
            self._receive_failed(err)
            return
        self._maybe_complete()

    def on_result(self, result: PrefillResult) -> None:
        if result.failure is not None:
            if self.active:
                self.abort(result.failure, False, result.pieces_sent)
            elif self.cause is not None and self.cause.pieces_sent is None:
                self._note_pieces_sent(result.pieces_sent)  # what the drain waits for
            return
        if self.active:
            self.result, self.announced = result, time.monotonic()
            self._maybe_complete()

    def _maybe_complete(self) -> None:
        if self.state is S.LANDING and self.receiver.complete and self.result is not None:
            self._to(S.COMPLETE)

    @property
    def kv_transfer_ms(self) -> float:
        """The first piece put on the wire (the prefill worker's clock) -> the last one landed; a
        transfer may be one piece, so the first landing cannot be its start."""
        start = self.result.sent_at or self.receiver.first_landed
        return max(0.0, self.receiver.last_landed - start) * 1000

    @property
    def kv_exposed_ms(self) -> float:
        """The prompt's last chunk computed -> its last piece landed."""
        return max(0.0, self.receiver.last_landed - self.result.computed_at) * 1000

    # -- the abort paths ------------------------------------------------------------------------

    def on_cancel(self, reason: str) -> None:
        self._end(failed(Code.CANCELLED, reason))

    def on_deadline(self) -> None:
        self._end(failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed"))

    def on_lease_expired(self) -> None:
        """The PrefillResult came, and then no piece landed for a whole lease."""
        self._end(self._prefill_failed(f"the KV transfer stalled for {self.lease_s:.0f}s"))

    def on_timeout(self) -> None:
        message = f"prefill worker {self.prefill_worker} did not finish in time"
        self._end(self._prefill_failed(message))

    def _prefill_failed(self, message: str) -> Failure:
        """The prefill worker failed the request: it is placed again without that worker."""
        return worker_failed(self.prefill_worker, message)

    def _end(self, failure: Failure) -> None:
        """Aborts now, or, while the PrefillTask waits for its answer, once it came: a
        TransferAbort that overtook its task would find nothing to stop there, and the prefill
        worker would then send into released receives until its lease ran out."""
        if self.state is S.REQUESTED:
            self.deferred = self.deferred or failure
        elif self.active:
            self.abort(failure)

    def on_peer_lost(self) -> None:
        if self.active:
            message = f"prefill worker {self.prefill_worker} stopped responding"
            self.abort(self._prefill_failed(message), tell_prefill=self.state is S.LANDING)

    def on_no_answer(self) -> None:
        """The PrefillTask got no TaskAck (the bus timed out, or nobody listens)."""
        if self.active:
            message = f"prefill worker {self.prefill_worker} did not answer"
            self.abort(self._prefill_failed(message), tell_prefill=True)

    def on_bug(self, err: Exception) -> None:
        if self.active:
            message = f"KV fetch failed: {type(err).__name__}"
            self.abort(failed(Code.INTERNAL, message), tell_prefill=self.state is S.LANDING)

    def _receive_failed(self, err: KVTransferError) -> None:
        if self.deferred is None:
            log.error("%s: %s", self.attempt_id, err)
        if isinstance(err, PlaneRestarted):  # ours, not the prefill worker's
            self._end(retry_anywhere("this decode worker's KV data plane restarted mid-transfer"))
        else:
            self._end(self._prefill_failed("the KV transfer from the prefill worker failed"))

    def tick(self) -> None:
        """The clocks: the request's deadline, a stalled receive, the lease, the prefill timeout."""
        now = time.monotonic()
        if self.active and self.deadline and time.time() > self.deadline:
            self.on_deadline()
        if self.active and self.state is not S.RESERVED:
            try:
                self.receiver.check(self.lease_s)
            except KVTransferError as err:
                self._receive_failed(err)
        last = max(self.announced, self.receiver.last_progress)
        if self.active and self.announced and now - last > self.lease_s:
            self.on_lease_expired()
        if self.active and self.gives_up_at and now > self.gives_up_at:
            self.on_timeout()

    def abort(self, failure: Failure, tell_prefill: bool | None = None, pieces_sent=None) -> None:
        """Ends the transfer: ABORTING until the owner has ended every receive (`released` or
        `quarantined`). By default the prefill worker is told once it may hold the task."""
        if tell_prefill is None:
            tell_prefill = self.state in (S.REQUESTED, S.LANDING)
        self.cause = AbortCause(failure, tell_prefill, pieces_sent)
        self._to(S.ABORTING)

    def _note_pieces_sent(self, pieces_sent: int) -> None:
        self.cause = replace(self.cause, pieces_sent=pieces_sent)
        self.news.set()

    def released(self) -> None:
        """Every receive has ended: nothing writes into the blocks any more."""
        self._to(S.RELEASED)

    def quarantined(self) -> None:
        """A receive did not end: its blocks must stay out of use for good."""
        self._to(S.QUARANTINED)
