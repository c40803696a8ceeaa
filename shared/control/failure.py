"""Failure: the one way a refusal or a failure is said, by every service and every message.

A failure has a status code (the gRPC code the client gets if it reaches the client), a message
for a person, the worker it blames, and what may be done about it:

- `Retry.NEVER`: the request itself is at fault (invalid, cancelled, out of time) or nothing
  can be done by us (every worker full: the client may try later, with a retry-after hint);
- `Retry.HERE`: place the request again, the blamed worker allowed (it was full, not broken), or
  with no worker blamed (a worker's own KV data plane restarted mid-transfer);
- `Retry.ELSEWHERE`: place the request again, avoiding the blamed worker (it failed or left);
  with no worker blamed, submit it again to another scheduler (this one is shutting down, or
  knows no live worker that could serve it: another replica may hear some).
"""

import enum
from dataclasses import dataclass


class Code(str, enum.Enum):
    """The gRPC status codes a request can end with (their names, as grpc.StatusCode has them)."""

    CANCELLED = "CANCELLED"
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    UNAVAILABLE = "UNAVAILABLE"
    INTERNAL = "INTERNAL"


class Retry(str, enum.Enum):
    NEVER = "never"
    HERE = "here"
    ELSEWHERE = "elsewhere"


@dataclass(frozen=True)
class Failure:
    code: Code
    message: str = ""
    retry: Retry = Retry.NEVER
    blame: str = ""  # the worker at fault (to avoid, with Retry.ELSEWHERE); "" = none

    @property
    def movable(self) -> bool:
        """Whether the gateway may place the request again instead of failing it."""
        return self.retry is not Retry.NEVER

    @property
    def avoid(self) -> str:
        """The worker the next placement must avoid ("" when none)."""
        return self.blame if self.retry is Retry.ELSEWHERE else ""


def failed(code: Code, message: str, blame: str = "") -> Failure:
    """A failure of the request itself: the client gets `code`."""
    return Failure(code, message, Retry.NEVER, blame)


def worker_full(worker: str, message: str) -> Failure:
    """`worker` had no room: place the request again, that worker allowed."""
    return Failure(Code.RESOURCE_EXHAUSTED, message, Retry.HERE, worker)


def retry_anywhere(message: str) -> Failure:
    """Nobody failed the request (a worker's KV data plane restarted under it): place it again,
    every worker allowed."""
    return Failure(Code.UNAVAILABLE, message, Retry.HERE)


def worker_failed(worker: str, message: str, code: Code = Code.UNAVAILABLE) -> Failure:
    """`worker` failed the request (died, left, did not answer): place it again without it."""
    return Failure(code, message, Retry.ELSEWHERE, worker)
