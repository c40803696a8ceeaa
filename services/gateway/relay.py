"""RequestRelay: one request's token stream, followed across its attempts until it ends.

The relay submits an attempt to the schedulers, waits for its chunks, and when the worker serving
it is lost (dead, failed or full) moves the request to a new attempt that goes on after the tokens
the client has: the client sees one stream. A chunk lost on the way (NATS delivers at most once:
an outage loses what was in flight) is asked for again (StreamReplay) when a later one shows the
gap or the stream stays quiet; chunks come back in order, each once. Only a worker that no longer
has the stream has the request moved. It owns its attempts'
streams on the StreamRouter, and cancels on the cluster whatever an attempt it leaves unfinished
holds. A failure the client must see ends the call with its gRPC status (context.abort).
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc

from services.gateway.attempt import Attempt
from services.gateway.migration import FULL_MOVES, WorkerLost
from services.gateway.schedulers import SchedulerPool
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.control.bus import BadReply, MessageBus, NoResponders, RequestTimeout
from shared.control.failure import Code, Failure, Retry, worker_failed
from shared.control.liveness import Liveness
from shared.control.messages import (
    CancelRequest,
    GenerateTask,
    StreamReplay,
    SubmitReply,
    TaskAck,
    TokenChunk,
)
from shared.control.subjects import Subjects
from shared.control.wire import MessageError

log = logging.getLogger(__name__)

POLL_S = 0.5  # a silent stream: how often its worker's liveness and the timeouts are checked
REPLAY_AFTER_RECONNECT_S = 1.0  # quiet this long since NATS reconnected: ask for the stream again
REPLAY_AFTER_S = 2.0  # quiet this long anyway (a stalled server loses nothing, but delays): ask
REPLAY_TIMEOUT_S = 1.0
MAX_PICKS = 3  # scheduler replicas tried for one submission when the one picked is gone


class SchedulerLost(Exception):
    """The scheduler replica holding a submission was lost."""


def grpc_status(code: Code) -> grpc.StatusCode:
    """The status a client gets for a failure: Code names are grpc.StatusCode's."""
    return grpc.StatusCode[code.value]


class RequestRelay:
    def __init__(
        self,
        settings: GatewaySettings,
        bus: MessageBus,
        streams: StreamRouter,
        liveness: Liveness,
        context,
        schedulers: SchedulerPool | None = None,
    ):
        self.settings = settings
        self.bus = bus
        self.streams = streams
        self.liveness = liveness
        self.context = context
        self.subjects = Subjects(settings.cluster)
        self._early: dict[int, TokenChunk] = {}  # chunks that came before one still missing
        self._replayed_at = float("-inf")  # when the stream was last asked for again
        self.schedulers = schedulers  # None: submit to the queue group only
        self._lost_schedulers: set[str] = set()  # replicas lost while they held this request

    async def follow(self, task: GenerateTask) -> AsyncIterator[tuple[Attempt, TokenChunk]]:
        """Every chunk of the request's output, with the attempt as it is after that chunk."""
        attempt, ended = self._open(Attempt(task)), False
        try:
            while not ended:
                try:
                    if not attempt.worker:
                        attempt = await self._submit(attempt)
                        continue
                    chunk = await self._next_chunk(attempt)
                except WorkerLost as lost:  # move it: a new attempt goes on after the tokens sent
                    attempt = await self._move(attempt, lost.failure)
                    continue
                attempt, ended = attempt.received(chunk), bool(chunk.finish_reason)
                yield attempt, chunk
        finally:
            self.streams.close(attempt.id)
            if not ended:  # client gone, deadline passed or a failure: free what the workers hold
                await self._cancel(attempt.id)

    def _open(self, attempt: Attempt) -> Attempt:
        self.streams.open(attempt.id)
        self._early.clear()
        return attempt

    async def _replace(self, ended: Attempt, following: Attempt) -> Attempt:
        """Ends an attempt (what the workers hold of it is freed) and opens the one after it."""
        await self._cancel(ended.id)
        self.streams.close(ended.id)
        return self._open(following)

    async def _cancel(self, attempt_id: str) -> None:
        try:
            await self.bus.publish(self.subjects.cancel, CancelRequest(attempt_id, "cancelled"))
        except Exception as err:  # NATS down: the workers' own timeouts free the request
            log.warning("could not broadcast the cancel of %s: %s", attempt_id, err)

    async def _submit(self, attempt: Attempt) -> Attempt:
        """The attempt placed on a decode worker; or, when no scheduler placed it, the attempt to
        submit once more, this one ended: it goes to the schedulers' queue group again (another
        replica takes it). Raises WorkerLost when the worker chosen failed to take it."""
        reply = await self._ask_scheduler(attempt)
        if (reply is None or _handed_back(reply)) and not attempt.resubmission:
            log.warning("no scheduler placed %s; submitting it again", attempt.id)
            return await self._replace(attempt, attempt.resubmitted())
        if reply.failure:
            await self._refused(attempt, reply)
        log.info(
            "request %s: %d prompt tokens -> prefill %s, decode %s",
            attempt.id,
            len(attempt.task.prompt_token_ids),
            reply.prefill_worker or "(local)",
            reply.decode_worker,
        )
        return attempt.placed(reply.decode_worker)

    async def _ask_scheduler(self, attempt: Attempt) -> SubmitReply | None:
        """The scheduler's reply; None when none came in time to a first submission, or the
        replica holding it was lost (then it is submitted again, to another)."""
        why = _refusal_start(attempt)
        for _ in range(MAX_PICKS):
            target = self.schedulers.pick(self._lost_schedulers) if self.schedulers else ""
            subject = self.subjects.submit_to(target) if target else self.subjects.submit
            asking = self.bus.request(
                subject, attempt.task, self.settings.submit_timeout_s, SubmitReply
            )
            try:
                return await self._watched(target, asking)
            except MessageError as err:  # too large to send: the request's fault, not the cluster's
                await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, why + str(err))
            except NoResponders:
                if not target:
                    await self.context.abort(
                        grpc.StatusCode.UNAVAILABLE, why + "no scheduler is running"
                    )
                self._lost_schedulers.add(target)  # gone since its last beat: never had it
            except BadReply as err:
                await self.context.abort(grpc.StatusCode.UNAVAILABLE, why + str(err))
            except (RequestTimeout, SchedulerLost) as err:
                if attempt.resubmission:
                    await self.context.abort(
                        grpc.StatusCode.UNAVAILABLE,
                        why + _no_placement(err),
                    )
                if isinstance(err, SchedulerLost):
                    self._lost_schedulers.add(target)
                    log.warning("%s: %s", attempt.id, err)
                return None
        await self.context.abort(grpc.StatusCode.UNAVAILABLE, why + "no scheduler is running")

    async def _watched(self, target: str, asking) -> SubmitReply:
        """The answer to `asking`; SchedulerLost when the replica `target` is lost meanwhile."""
        task = asyncio.ensure_future(asking)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=POLL_S)
                if done:
                    return task.result()
                if target and await self.schedulers.lost(target):
                    raise SchedulerLost(f"scheduler {target} was lost while it held the request")
        finally:
            task.cancel()  # no answer is awaited any more (nats-py frees its reply slot)

    async def _refused(self, attempt: Attempt, reply: SubmitReply) -> None:
        failure = reply.failure
        if failure.avoid:  # a worker failed it, not the request
            raise WorkerLost(failure)
        message = _refusal_start(attempt) + failure.message
        if reply.retry_after_ms:
            self.context.set_trailing_metadata((("retry-after-ms", str(reply.retry_after_ms)),))
            message += f" (retry after {reply.retry_after_ms / 1000:.1f}s)"
        await self.context.abort(grpc_status(failure.code), message)

    async def _move(self, attempt: Attempt, failure: Failure) -> Attempt:
        """Ends the failed attempt and opens the next one (to be submitted); past the limit of
        moves for this reason, the client gets the failure's status."""
        moved = attempt.moved(failure)
        limit = FULL_MOVES if failure.retry is Retry.HERE else self.settings.max_migrations
        if moved.moves(failure.retry) > limit:
            await self.context.abort(
                grpc_status(failure.code),
                f"{failure.message}; the request was already moved {limit} time(s), the limit",
            )
        log.warning(
            "%s: %s; moving it after %d token(s)", attempt.id, failure.message, len(attempt.sent)
        )
        return await self._replace(attempt, moved)

    async def _next_chunk(self, attempt: Attempt) -> TokenChunk:
        """The chunk the attempt expects; WorkerLost when its worker is lost."""
        chunk = await self._wait_for_chunk(attempt)
        failure = chunk.failure
        if failure and failure.movable:
            raise WorkerLost(failure)
        if failure:
            await self.context.abort(grpc_status(failure.code), failure.message)
        return chunk

    async def _wait_for_chunk(self, attempt: Attempt) -> TokenChunk:
        """The chunk with the index expected: later ones wait for it (and have it asked for
        again), ones already had are dropped."""
        idle_since, reconnects = time.monotonic(), self.bus.reconnects
        while (chunk := self._early.pop(attempt.expected, None)) is None:
            try:
                chunk = await self.streams.next(attempt.id, POLL_S)
            except asyncio.TimeoutError:
                await self._check_silence(attempt, idle_since, reconnects)
                continue
            if chunk.index == attempt.expected:
                return chunk
            if chunk.index > attempt.expected:  # one before it was lost on the way
                self._early[chunk.index] = chunk
                await self._ask_again(attempt)
        return chunk

    async def _check_silence(self, attempt: Attempt, idle_since: float, reconnects: int) -> None:
        """Raises WorkerLost, or ends the call, when a silent stream is not worth waiting for; asks
        for the stream again when a chunk may have been lost."""
        worker = attempt.worker
        if await self.liveness.lost(worker):
            lost = worker_failed(worker, f"decode worker {worker} stopped responding")
            raise WorkerLost(lost) from None
        silent_s = time.monotonic() - idle_since
        reconnected = self.bus.reconnects != reconnects
        if silent_s > (REPLAY_AFTER_RECONNECT_S if reconnected else REPLAY_AFTER_S):
            await self._ask_again(attempt)
        if silent_s > self.settings.stream_idle_timeout_s:
            await self.context.abort(
                grpc.StatusCode.UNAVAILABLE,
                f"the worker sent nothing for {self.settings.stream_idle_timeout_s:.0f}s",
            )

    async def _ask_again(self, attempt: Attempt) -> None:
        """Asks the worker for the stream again from the chunk expected (at most once per
        REPLAY_AFTER_S). WorkerLost when it no longer has the stream: the request goes on from
        the tokens the client has. No answer: NATS or the worker is away; liveness decides."""
        if time.monotonic() - self._replayed_at < REPLAY_AFTER_S:
            return
        self._replayed_at = time.monotonic()
        subject = self.subjects.stream_replay(attempt.worker)
        ask = StreamReplay(attempt.id, attempt.expected)
        try:
            ack = await self.bus.request(subject, ask, REPLAY_TIMEOUT_S, TaskAck)
        except (NoResponders, RequestTimeout, BadReply) as err:  # every 2 s per stream: debug
            log.debug(
                "%s: asked %s for chunk %d again: %s",
                attempt.id,
                attempt.worker,
                ask.from_index,
                err,
            )
            return
        if ack.failure:
            lost = f"the token stream from {attempt.worker} lost chunk {attempt.expected}"
            raise WorkerLost(worker_failed("", f"{lost}; {ack.failure.message}"))


def _handed_back(reply: SubmitReply) -> bool:
    """The scheduler did not place the request and blames no worker: another scheduler may."""
    return (
        bool(reply.failure) and reply.failure.retry is Retry.ELSEWHERE and not reply.failure.blame
    )


def _no_placement(err: Exception) -> str:
    if isinstance(err, SchedulerLost):
        return str(err)
    return "the scheduler did not place the request in time"


def _refusal_start(attempt: Attempt) -> str:
    """What a refusal's message starts with: why the request was being moved, if it was."""
    return "" if attempt.moved_because is None else f"{attempt.moved_because}, and "
