"""DecodeRequest: one request a decode worker holds: the engine's Sequence, the task it came as,
plus what the decode service alone keeps about it (why it was aborted, its stream position, who
prefilled it, its transfer).

Whether it ended is its sequence's status (SeqStatus.finished): a cancel or a failure aborts the
sequence through the engine at once, and keeps the cause here for the gateway.
"""

from shared.control.failure import Failure
from shared.control.messages import GenerateTask
from shared.engine.engine import Engine
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence
from shared.kvtransfer.inbound import InboundTransfer
from shared.telemetry import tracing


class DecodeRequest:
    def __init__(self, seq: Sequence, task: GenerateTask, engine: Engine, prefill_worker: str = ""):
        self.seq = seq
        self.task = task  # as it came (a choice's own, once forked: choices.choice_task)
        self.engine = engine
        self.prefill_worker = prefill_worker  # who computed the prompt (this worker, if local)
        self.transfer: InboundTransfer | None = None  # the remote prefill's KV, while it comes
        self.cancel_reason = ""  # aborted by a cancel: why
        self.failure: Failure | None = None  # aborted by a failure (movable: a worker's fault)
        self.chunk_index = 0  # of the next TokenChunk
        self.held = 0  # chunks in a row NATS could not take (see DecodeWorker._send)
        self.trace = tracing.current()  # its decode.admit span's context
        self.first_token_at = 0.0  # unix time its first token went out
        # the loop took its last output from the engine (a step sets a sequence's end before
        # the loop has the output that says so: until then it is not reaped)
        self.last_taken = False

    @property
    def attempt_id(self) -> str:
        return self.seq.attempt_id

    @property
    def ended(self) -> bool:
        """Finished or aborted: the loop takes it out and tells the gateway."""
        return self.seq.status.finished

    @property
    def reapable(self) -> bool:
        """Ended, and nothing more of it will come from the engine: aborted, or its last output
        taken."""
        return self.seq.status.finished and (self.last_taken or self.aborted)

    @property
    def aborted(self) -> bool:
        return self.seq.status is SeqStatus.FINISHED_ABORTED

    @property
    def may_free(self) -> bool:
        """No KV transfer can write into its blocks any more (or it never had one)."""
        return self.transfer is None or self.transfer.settled

    def cancel(self, reason: str) -> None:
        """Nobody wants it any more (no effect once it finished)."""
        if self.engine.abort(self.seq):
            self.cancel_reason = reason
            if self.transfer is not None:
                self.transfer.on_cancel(reason)

    def fail(self, failure: Failure) -> None:
        """It cannot go on here (no effect once it finished)."""
        if self.engine.abort(self.seq):
            self.failure = failure

    def next_chunk_index(self) -> int:
        index, self.chunk_index = self.chunk_index, self.chunk_index + 1
        return index
