"""Answers: how a scheduler replies to the submissions it holds, and the jobs still replying.

Every submission gets exactly one SubmitReply: placed, refused (with its Failure: a final one, or
a worker that failed it to place it again without, and a retry-after hint when trying again later
may succeed), or handed back (the scheduler shuts down, or knows no worker that could serve it) so
the gateway submits it to another one.
"""

import asyncio
import dataclasses
import logging
from collections.abc import Callable

from services.scheduler.admission import AdmissionQueue, Pending
from shared.control.failure import Code, Failure, Retry
from shared.control.messages import SubmitReply
from shared.telemetry.request_log import detached

log = logging.getLogger(__name__)

# no worker is blamed: the gateway submits the request again, and another scheduler takes it
SHUTTING_DOWN = Failure(Code.UNAVAILABLE, "the scheduler is shutting down", Retry.ELSEWHERE)


def final(failure: Failure) -> Failure:
    """The failure the request ends with: no worker is left to place it on."""
    return dataclasses.replace(failure, retry=Retry.NEVER)


def elsewhere(failure: Failure) -> Failure:
    """No worker this replica knows could serve the request: the gateway asks another replica
    (no worker is blamed), and ends the request with this failure when none places it."""
    return dataclasses.replace(failure, retry=Retry.ELSEWHERE, blame="")


class Answers:
    def __init__(self, queue: AdmissionQueue, refused: Callable[[str], None] = lambda code: None):
        self.queue = queue
        self._refused = refused  # told the code of every failure answered
        self._inflight: set[asyncio.Task] = set()

    def refuse(self, entry: Pending, failure: Failure, retry_after: bool = False) -> None:
        """Answers `failure`; `retry_after`: with a hint of when trying again may succeed."""
        reply = SubmitReply(
            failure, retry_after_ms=self.queue.retry_after_ms() if retry_after else 0
        )
        self.spawn(self.send(entry.respond, reply))

    def hand_back(self, entry: Pending) -> None:
        """Shutting down: the gateway submits the request again, and another scheduler takes it."""
        self.spawn(self.send(entry.respond, SubmitReply(SHUTTING_DOWN)))

    async def send(self, respond, reply: SubmitReply) -> None:
        if reply.failure is not None:
            self._refused(reply.failure.code.value)
        if respond is None:
            return
        try:
            await respond(reply)
        except Exception as err:  # the gateway's own timeout covers a reply that cannot be sent
            log.warning("could not answer a submission: %s", err)

    def spawn(self, coro) -> None:
        job = detached(coro)  # not the context of the message that happened to start it
        self._inflight.add(job)
        job.add_done_callback(self._inflight.discard)

    async def settle(self) -> None:
        """Waits until every answer (and every assignment) in flight has gone out."""
        while self._inflight:
            await asyncio.gather(*list(self._inflight), return_exceptions=True)
