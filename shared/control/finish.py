"""FinishReason: why a request's stream ended without a failure, as the client is told it.

A decode worker derives it from its sequence's status (the engine's SeqStatus.FINISHED_STOPPED and
FINISHED_LENGTH) or from the cancel that aborted it; a failure travels as a Failure instead.
"""

import enum


class FinishReason(enum.StrEnum):
    STOP = "stop"  # an end-of-sequence token or a stop string
    LENGTH = "length"  # max_tokens, or the model's length
    CANCELLED = "cancelled"  # the client (or the gateway for it) cancelled it
