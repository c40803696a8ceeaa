"""DecodeRequest: one request a decode worker holds: the engine's Sequence, plus what the decode
service alone keeps about it (how it ended, its stream position, who prefilled it, its transfer).
"""

from shared.control.failure import Failure
from shared.engine.sequence import SeqStatus, Sequence
from shared.kvtransfer.inbound import InboundTransfer
from shared.telemetry import tracing


class DecodeRequest:
    def __init__(self, seq: Sequence, prefill_worker: str = ""):
        self.seq = seq
        self.prefill_worker = prefill_worker  # who computed the prompt (this worker, if local)
        self.transfer: InboundTransfer | None = None  # the remote prefill's KV, while it comes
        self.cancel_reason = ""
        self.failure: Failure | None = None  # how it failed (movable: a worker's fault)
        self.chunk_index = 0  # of the next TokenChunk
        self.held = 0  # chunks in a row NATS could not take (see DecodeWorker._send)
        self.trace = tracing.current()  # its decode.admit span's context
        self.first_token_at = 0.0  # unix time its first token went out

    @property
    def attempt_id(self) -> str:
        return self.seq.attempt_id

    @property
    def ended(self) -> bool:
        """Finished, failed or cancelled: the loop takes it out and tells the gateway."""
        return (
            self.seq.status is SeqStatus.FINISHED
            or self.failure is not None
            or bool(self.cancel_reason)
        )

    @property
    def may_free(self) -> bool:
        """No KV transfer can write into its blocks any more (or it never had one)."""
        return self.transfer is None or self.transfer.settled

    def cancel(self, reason: str) -> None:
        self.cancel_reason = reason
        self.seq.abandoned = True  # a step computing only abandoned sequences stops early
        if self.transfer is not None:
            self.transfer.on_cancel(reason)

    def fail(self, failure: Failure) -> None:
        self.failure = failure

    def next_chunk_index(self) -> int:
        index, self.chunk_index = self.chunk_index, self.chunk_index + 1
        return index
