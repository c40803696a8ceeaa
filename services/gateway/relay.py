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
import dataclasses
import logging
import time
from collections.abc import AsyncIterator

import grpc
from opentelemetry.context import Context

from services.gateway.attempt import Attempt
from services.gateway.chunk_waiter import ChunkWaiter
from services.gateway.direct_rooms import Placement
from services.gateway.joined_chunks import Run, joined
from services.gateway.migration import FULL_MOVES, WorkerLost
from services.gateway.schedulers import SchedulerPool
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.control.bus import BadReply, MessageBus, NoResponders, RequestTimeout
from shared.control.choices import all_ids, choice_ids
from shared.control.failure import Code, Failure, Retry
from shared.control.liveness import Liveness
from shared.control.messages import (
    CancelRequest,
    DecodeAssignment,
    GenerateTask,
    SubmitReply,
    TaskAck,
    TokenChunk,
)
from shared.control.subjects import Subjects
from shared.control.wire import MessageError
from shared.telemetry import tracing
from shared.telemetry.request_log import request_scope

log = logging.getLogger(__name__)

POLL_S = 0.5  # how often a replica holding a submission is checked for lost
MAX_PICKS = 3  # scheduler replicas tried for one submission when the one picked is gone
MOVE_RETRY_S = 0.5  # a moved request nobody could place is asked for again this often
NO_SCHEDULER = "no scheduler is running, or none hears a worker"  # none listens to the submission


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
        trace: Context | None = None,
    ):
        self.settings = settings
        self.trace = trace  # the request's root span: its messages carry it
        self.bus = bus
        self.streams = streams
        self.liveness = liveness
        self.context = context
        self.subjects = Subjects(settings.cluster)
        self.waiter = ChunkWaiter(settings, bus, streams, liveness, context)
        self.schedulers = schedulers  # None: submit to the queue group only
        self._lost_schedulers: set[str] = set()  # replicas lost while they held this request
        self._unplaced_since: float | None = None  # a move found no place first then (_waited)
        # where this gateway placed the request itself, and its task, until that attempt ends
        self._in_room: tuple[Placement, GenerateTask] | None = None

    async def place(self, task: GenerateTask) -> Attempt:
        """A request of n > 1 choices placed as one (its prompt is prefilled once, then forked),
        the stream of every choice open: each is then followed on its own (follow)."""
        attempt = self._open(Attempt(task))
        try:
            while not attempt.worker:
                try:
                    attempt = await self._submit(attempt)
                except WorkerLost as lost:
                    attempt = await self._move(attempt, lost.failure)
            return attempt
        except BaseException:
            self._close(attempt)
            await self.cancel_all(attempt.task)
            raise

    async def follow(
        self, task: GenerateTask, group: Attempt | None = None
    ) -> AsyncIterator[tuple[Attempt, TokenChunk]]:
        """Every chunk of the request's output, with the attempt as it is after that chunk.
        `group`: the request is a choice of this group, placed already (its stream open)."""
        attempt = dataclasses.replace(group, task=task) if group else self._open(Attempt(task))
        ended = False
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
                more = [] if ended else self.waiter.ready(attempt, Run(chunk).takes)
                if more:  # those already here go as one answer
                    attempt, ended = attempt.received(*more), bool(more[-1].finish_reason)
                    chunk = joined(chunk, *more)
                yield attempt, chunk
        finally:
            self.streams.close(attempt.id)
            self._leave_room()
            if not ended:  # client gone, deadline passed or a failure: free what the workers hold
                await self.cancel(attempt.id)

    def _open(self, attempt: Attempt) -> Attempt:
        for attempt_id in choice_ids(attempt.task):  # a group's: each choice's stream
            self.streams.open(attempt_id)
        self.waiter.reset()
        return attempt

    def _close(self, attempt: Attempt) -> None:
        for attempt_id in choice_ids(attempt.task):
            self.streams.close(attempt_id)

    async def _replace(self, ended: Attempt, following: Attempt) -> Attempt:
        """Ends an attempt (what the workers hold of it is freed) and opens the one after it."""
        self._leave_room()
        await self.cancel_all(ended.task)
        self._close(ended)
        return self._open(following)

    async def cancel_all(self, task: GenerateTask) -> None:
        """Frees what the workers hold of the request under any id (a group's: each choice's)."""
        for attempt_id in all_ids(task):
            await self.cancel(attempt_id)

    async def cancel(self, attempt_id: str) -> None:
        try:
            with tracing.within(self.trace):
                await self.bus.publish(self.subjects.cancel, CancelRequest(attempt_id, "cancelled"))
        except Exception as err:  # NATS down: the workers' own timeouts free the request
            log.warning("could not broadcast the cancel of %s: %s", attempt_id, err)

    async def _submit(self, attempt: Attempt) -> Attempt:
        """The attempt placed on a decode worker; or, when no scheduler placed it, the attempt to
        submit once more, this one ended: it goes to the schedulers' queue group again (another
        replica takes it). Raises WorkerLost when the worker chosen failed to take it. A short
        first attempt may go straight to a worker a scheduler named as having room (DirectRooms)."""
        direct = self.schedulers is not None and not attempt.resubmission
        placement = self.schedulers.rooms.take(attempt.task) if direct else None
        if placement is not None:
            placed = await self._place_directly(attempt, placement)
            if placed is not None:
                return placed
        with tracing.child(self.trace, "gateway.submit"):
            try:
                reply = await self._ask_scheduler(attempt)
            except NoResponders:  # no replica listens (each stood aside, or none runs)
                reply = SubmitReply(Failure(Code.UNAVAILABLE, NO_SCHEDULER, Retry.NEVER))
        if (reply is None or _handed_back(reply)) and not attempt.resubmission:
            log.warning("no scheduler placed %s; submitting it again", attempt.id)
            return await self._replace(attempt, attempt.resubmitted())
        if reply.failure:
            if await self._waited(attempt, reply.failure):
                return attempt  # asked again
            await self._refused(attempt, reply)
        self._unplaced_since = None
        self._log_placed(attempt, reply.prefill_worker or "(local)", reply.decode_worker)
        return attempt.placed(reply.decode_worker)

    async def _place_directly(self, attempt: Attempt, placement: Placement) -> Attempt | None:
        """The attempt placed by this gateway; None when the decode worker did not take it
        (full, draining, gone: a scheduler places it). One that did not answer in time may have
        taken it: that attempt ends (cancelled under every id) and the next is submitted."""
        worker = placement.decode
        assignment = DecodeAssignment(
            task=attempt.task, prefill_worker=placement.prefill, prefill_tp=placement.prefill_tp
        )
        with tracing.child(self.trace, "gateway.place"):
            try:
                ack = await self.bus.request(
                    self.subjects.decode_tasks(worker),
                    assignment,
                    self.settings.dispatch_timeout_s,
                    TaskAck,
                )
            except (NoResponders, MessageError):  # gone; too large (the scheduler says so)
                ack = None
            except (RequestTimeout, BadReply):
                self.schedulers.rooms.turned_away(worker)
                log.warning("%s: decode worker %s did not confirm it in time", attempt.id, worker)
                return await self._replace(attempt, attempt.resubmitted())
        if ack is None or ack.failure is not None:
            self.schedulers.rooms.turned_away(worker)
            return None
        prefill = placement.prefill or "(local)"
        self._log_placed(attempt, f"{prefill}, placed by this gateway", worker)
        self._in_room = placement, attempt.task
        return attempt.placed(worker)

    def _leave_room(self, failure: Failure | None = None) -> None:
        """The attempt placed directly ended: its rooms have the seats back. A prefill worker
        that failed it (it turned the prompt away as full, say) is offered no more until a beat
        names it again."""
        if self._in_room is not None:
            placement, task = self._in_room
            self.schedulers.rooms.returned(placement, task)
            if failure is not None and placement.prefill and failure.blame == placement.prefill:
                self.schedulers.rooms.turned_away(failure.blame)
            self._in_room = None

    def _log_placed(self, attempt: Attempt, prefill: str, decode: str) -> None:
        if not log.isEnabledFor(logging.INFO):  # the scopes cost more than the line's check
            return
        with request_scope(attempt.id), tracing.within(self.trace):  # the line names both
            log.info(
                "placed: %d prompt tokens -> prefill %s, decode %s",
                len(attempt.task.prompt_token_ids),
                prefill,
                decode,
            )

    async def _ask_scheduler(self, attempt: Attempt) -> SubmitReply | None:
        """The scheduler's reply; None when none came in time to a first submission, or the
        replica holding it was lost (then it is submitted again, to another). A replica that hands
        it back (it hears no worker that could serve it, or it stops) has it asked of each other
        replica not asked yet, then of the queue group; when nobody else answers, its answer is
        final. Raises NoResponders when no replica listens at all."""
        why, declined = _refusal_start(attempt), set()
        handed_back, gone = None, 0
        while True:
            avoid = self._lost_schedulers | declined
            target = self.schedulers.pick(avoid) if self.schedulers else ""
            try:
                reply = await self._ask(target, attempt, why)
            except NoResponders:
                if not target and handed_back:  # each replica known handed it back: no worker
                    return _final(handed_back)
                gone += 1
                if not target or gone == MAX_PICKS:
                    raise
                self._lost_schedulers.add(target)  # gone since its last beat: never had it
                continue
            if not (target and reply is not None and _handed_back(reply)):
                return reply
            log.info(
                "%s: scheduler %s handed it back (%s)", attempt.id, target, reply.failure.message
            )
            declined.add(target)
            handed_back = reply

    async def _ask(self, target: str, attempt: Attempt, why: str) -> SubmitReply | None:
        """The answer of scheduler `target` ("": the queue group's); None when none came in time
        to a first submission, or the replica was lost. Raises NoResponders: nobody listens."""
        subject = self.subjects.submit_to(target) if target else self.subjects.submit
        asking = self.bus.request(
            subject, attempt.task, self.settings.submit_timeout_s, SubmitReply
        )
        try:
            return await self._watched(target, asking)
        except MessageError as err:  # too large to send: the request's fault, not the cluster's
            await self.context.abort(grpc.StatusCode.INVALID_ARGUMENT, why + str(err))
        except BadReply as err:
            await self.context.abort(grpc.StatusCode.UNAVAILABLE, why + str(err))
        except (RequestTimeout, SchedulerLost) as err:
            if attempt.resubmission:
                await self.context.abort(grpc.StatusCode.UNAVAILABLE, why + _no_placement(err))
            if isinstance(err, SchedulerLost):
                self._lost_schedulers.add(target)
                log.warning("%s: %s", attempt.id, err)
            return None

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

    async def _waited(self, attempt: Attempt, failure: Failure) -> bool:
        """True when a moved request nobody could place has waited a while to be asked again:
        the cluster blamed no worker and the request has waited less than --move-wait-s (a NATS
        node cut off hides its clients for seconds; a worker restarts). The tokens the client
        has are not lost to a gap that short."""
        if attempt.moved_because is None or failure.avoid or failure.code is not Code.UNAVAILABLE:
            return False
        now = time.monotonic()
        since = self._unplaced_since = self._unplaced_since or now
        left = since + self.settings.move_wait_s - now
        if left <= 0:
            return False
        log.info("%s: %s; asking again for up to %.1fs", attempt.id, failure.message, left)
        await asyncio.sleep(min(MOVE_RETRY_S, left))
        return True

    async def _refused(self, attempt: Attempt, reply: SubmitReply) -> None:
        failure = reply.failure
        if failure.avoid:  # a worker failed it, not the request
            raise WorkerLost(failure)
        message = _refusal_start(attempt) + failure.message
        if self._unplaced_since is not None:
            message += f" (asked again for {self.settings.move_wait_s:g}s)"
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
        self._leave_room(failure)
        return await self._replace(attempt, moved)

    async def _next_chunk(self, attempt: Attempt) -> TokenChunk:
        """The chunk the attempt expects; WorkerLost when its worker is lost."""
        chunk = await self.waiter.next(attempt)
        failure = chunk.failure
        if failure and failure.movable:
            raise WorkerLost(failure)
        if failure:
            await self.context.abort(grpc_status(failure.code), failure.message)
        return chunk


def _handed_back(reply: SubmitReply) -> bool:
    """The scheduler did not place the request and blames no worker: another scheduler may."""
    return (
        bool(reply.failure) and reply.failure.retry is Retry.ELSEWHERE and not reply.failure.blame
    )


def _final(reply: SubmitReply) -> SubmitReply:
    """A handed-back reply no other scheduler took: the request ends with its failure."""
    return dataclasses.replace(reply, failure=dataclasses.replace(reply.failure, retry=Retry.NEVER))


def _no_placement(err: Exception) -> str:
    if isinstance(err, SchedulerLost):
        return str(err)
    return "the scheduler did not place the request in time"


def _refusal_start(attempt: Attempt) -> str:
    """What a refusal's message starts with: why the request was being moved, if it was."""
    return "" if attempt.moved_because is None else f"{attempt.moved_because}, and "
