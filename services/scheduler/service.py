"""SchedulerService: keeps the registry from heartbeats, admits and routes submissions, answers status.

Submissions arrive on a NATS queue group, so any number of schedulers share them. Each goes
through this scheduler's AdmissionQueue: it is placed at once when a worker has room, waits
(bounded) when none has, and is refused with RESOURCE_EXHAUSTED and a retry-after hint when
the queue is full or the wait runs out. Placed requests are handed to their decode worker; one
that refuses as full counts as full until its next heartbeat, one draining or vanished is
excluded, and the request is placed again (at most MAX_DISPATCH_ATTEMPTS times). A replica that
knows no worker that could serve stands aside (Intake); "no worker" goes with Retry.ELSEWHERE.
"""

import asyncio
import logging
import time
from functools import partial

from services.scheduler import roles, rooms
from services.scheduler.admission import AdmissionQueue, Pending
from services.scheduler.answers import SHUTTING_DOWN, Answers, elsewhere, final
from services.scheduler.intake import Intake, Member
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.presence import Presence
from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import NoRoom, NoWorker, Route, Router
from services.scheduler.settings import SchedulerSettings
from services.scheduler.status import status_page
from shared.control.bus import BadReply, MessageBus, NoResponders, RequestTimeout
from shared.control.choices import all_ids
from shared.control.failure import Code, Failure, Retry, failed, worker_failed
from shared.control.messages import (
    CancelRequest,
    DecodeAssignment,
    GenerateTask,
    StatusRequest,
    SubmitReply,
    TaskAck,
    WorkerHeartbeat,
)
from shared.control.subjects import Subjects
from shared.telemetry import tracing

log = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3
SKIP_AHEAD = 8  # requests behind a head that fits nowhere that may be placed before it
MAX_SKIPS = 16  # times a head may be passed so; then it waits at the head until it fits
TICK_S = 0.1  # how often waits run out, placing is retried and presence kept (Presence.tick)


class SchedulerService:
    def __init__(self, settings: SchedulerSettings, bus: MessageBus):
        self.settings = settings
        self.bus = bus
        self.subjects = Subjects(settings.cluster)
        self.registry = WorkerRegistry(settings.worker_timeout_s)
        self.router = Router(self.registry, settings.policy())
        self.queue = AdmissionQueue(settings.max_pending, settings.queue_timeout_s)
        self.scheduler_id = settings.scheduler_id
        self.metrics = SchedulerMetrics(self.scheduler_id)
        self.answers = Answers(self.queue, self.metrics.refused)
        self._closing = False
        missing = partial(roles.missing, self.registry, settings.mode, settings.prefill_fallback)
        submissions = Member(bus, self.subjects.submit, self.on_submit)
        status = Member(bus, self.subjects.status, self.on_status)
        self.intake = Intake(submissions, status, missing, self.registry.live, self.metrics.intake)
        self.presence = Presence(
            bus,
            self.subjects,
            self.scheduler_id,
            self.registry,
            lambda: len(self.queue),
            self.intake,
            settings.heartbeat_interval_s,
            self._rooms,
        )

    async def serve(self, stop: asyncio.Event) -> None:
        subs = [
            await self.bus.subscribe(self.subjects.heartbeat, self.on_heartbeat),
            await self.bus.subscribe(self.subjects.cancel, self.on_cancel),
            await self.bus.subscribe(self.subjects.submit_to(self.scheduler_id), self.on_submit),
            await self.bus.subscribe(
                self.subjects.scheduler_ping(self.scheduler_id), self.presence.on_ping
            ),
        ]
        await self.presence.discover()
        mode, cluster = self.settings.mode, self.settings.cluster
        log.info("%s up in %s mode on cluster %r", self.scheduler_id, mode, cluster)
        tickers = [asyncio.create_task(self._tick())]
        if self.settings.alive_file:
            tickers.append(asyncio.create_task(self.presence.keep_alive(self.settings.alive_file)))
        try:
            await stop.wait()
        finally:
            for ticker in tickers:
                ticker.cancel()
            await self.intake.close()
            for sub in subs:
                await sub.unsubscribe()
            await self.presence.beat(stopping=True)  # gateways stop picking this replica now
            self._closing = True  # from here on nothing is placed: what waits is handed back
            while len(self.queue):
                self.answers.hand_back(self.queue.pop())
            await self.answers.settle()

    async def _tick(self) -> None:
        """Ends the waits that ran out, places what the last heartbeats made room for, and keeps
        this replica known, taking submissions or standing aside (Presence, Intake)."""
        while True:
            await asyncio.sleep(TICK_S)
            try:
                await self.presence.tick()
                self.metrics.tick(self.queue.priorities(), self.registry.live())
                for entry in self.queue.expired():
                    wait_s = self.settings.queue_timeout_s
                    self.answers.refuse(
                        entry,
                        failed(Code.RESOURCE_EXHAUSTED, f"no worker had room within {wait_s:.0f}s"),
                        retry_after=True,
                    )
                self.pump()
            except Exception:  # a bug: log it, keep expiring and placing
                log.exception("scheduler tick failed")

    def _rooms(self) -> rooms.Offer:
        """The workers gateways may place on without asking, and the longest prompt they may."""
        if self._closing:
            return rooms.Offer()
        limit = self.settings.direct_prompt_tokens
        return rooms.offer(self.registry, self.router.policy, limit, len(self.queue))

    def ready(self) -> bool:
        return roles.ready(self.registry, self.settings.mode)

    async def on_heartbeat(self, beat: WorkerHeartbeat, respond) -> None:
        self.registry.update(beat)
        if not self.intake.accepting:  # a worker heard: take submissions now, not at the tick
            await self.presence.follow()
        self.pump()

    async def on_status(self, request: StatusRequest, respond) -> None:
        if respond is not None:
            live = self.registry.live()
            await respond(
                status_page(live, request, self.settings.mode, self.ready(), self.bus.dropped)
            )

    async def on_submit(self, task: GenerateTask, respond) -> None:
        if self._closing:
            await self.answers.send(respond, SubmitReply(SHUTTING_DOWN))
        elif (entry := self.queue.offer(task, respond)) is not None:
            entry.trace = tracing.current()
            self.pump()
        else:
            waiting = self.settings.max_pending
            full = failed(
                Code.RESOURCE_EXHAUSTED,
                f"the scheduler's queue is full ({waiting} requests waiting)",
            )
            await self.answers.send(
                respond, SubmitReply(full, retry_after_ms=self.queue.retry_after_ms())
            )

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        """A request cancelled while it waits here leaves the queue at once (one already placed is
        the workers' to end: they hear the same cancel)."""
        entry = self.queue.remove(message.attempt_id)
        if entry is not None:
            why = f"cancelled while waiting for room: {message.reason}"
            self.answers.refuse(entry, failed(Code.CANCELLED, why))

    # -- placing ------------------------------------------------------------------------------

    def pump(self) -> None:
        """Places queued requests in order while workers have room. A head that fits no worker
        now lets up to SKIP_AHEAD requests behind it go first, MAX_SKIPS times at most; then it
        waits at the head until it fits (a big request is not starved by small ones)."""
        while not self._closing and len(self.queue):
            head, *behind = self.queue.first(SKIP_AHEAD + 1)
            candidates = [head] + (behind if head.skipped < MAX_SKIPS else [])
            went = next((entry for entry in candidates if self._settle(entry)), None)
            if went is None:
                return
            if went is not head:
                head.skipped += 1

    def _settle(self, entry: Pending) -> bool:
        """Places or refuses one waiting request; False when it waits for room."""
        if entry.task.deadline and time.time() > entry.task.deadline:
            self.answers.refuse(
                self.queue.take(entry),
                failed(Code.DEADLINE_EXCEEDED, "the deadline passed while it waited for room"),
            )
            return True
        started = time.perf_counter()
        try:
            chosen = self.router.route(entry.task, entry.tried)
            self.metrics.routed(entry, started, chosen)
        except NoRoom:
            return False
        except NoWorker as err:  # none, but the workers' heartbeats may be on their way: wait
            excluded = entry.tried | set(entry.task.avoid_workers)
            if type(err) is NoWorker and self.presence.beats_coming(excluded):
                return False
            # every worker that could take it refused: say why the last one did (none here could
            # serve it: another replica may hear one)
            failure = final(entry.failure) if entry.failure else err.failure
            if not entry.failure and type(err) is NoWorker and self.intake.missing():
                failure = elsewhere(failure)
            self.answers.refuse(
                self.queue.take(entry),
                failure,
                retry_after=failure.code is Code.RESOURCE_EXHAUSTED and err.retry_later,
            )
            return True
        except Exception:  # a bug: this request fails, the others go on
            log.exception("routing %s failed", entry.task.attempt_id)
            self.answers.refuse(
                self.queue.take(entry),
                failed(Code.INTERNAL, "the scheduler failed to route the request"),
            )
            return True
        self.queue.take(entry)
        self._reserve(entry, chosen)
        self.answers.spawn(self._assign(entry, chosen))
        return True

    def _reserve(self, entry: Pending, chosen: Route) -> None:
        n = entry.task.sampling.n  # a group: one sequence per choice once forked
        self.registry.reserve(chosen.decode.worker_id, seqs=n, blocks=chosen.blocks)
        if chosen.prefill:  # its queue's place is taken too, until its next heartbeat says
            prefill = chosen.prefill.worker_id
            self.registry.reserve(prefill, seqs=1, prompt_tokens=chosen.compute_tokens)
        else:
            self.registry.reserve(chosen.decode.worker_id, prompt_tokens=chosen.compute_tokens)

    async def _assign(self, entry: Pending, chosen: Route) -> None:
        """Hands the request to its decode worker; places it again if that one refuses."""
        task, decode_id = entry.task, chosen.decode.worker_id
        prefill_id = chosen.prefill.worker_id if chosen.prefill else ""
        prefill_tp = chosen.prefill.tp if chosen.prefill else 1
        entry.attempts += 1
        try:
            with tracing.within(entry.trace):  # the assignment's message carries the route span
                failure = await self._offer(task, decode_id, prefill_id, prefill_tp)
        except (RequestTimeout, BadReply):
            # It may have taken (and forked) it: placing it elsewhere could run it twice. The
            # gateway moves it on (a new attempt id); this one is cancelled under every id.
            log.warning("decode worker %s did not confirm %s in time", decode_id, task.attempt_id)
            for attempt_id in all_ids(task):
                await self._cancel(attempt_id, "dispatch timed out")
            late = worker_failed(decode_id, f"decode worker {decode_id} did not answer in time")
            self.answers.refuse(entry, late)
            return
        except Exception:  # a bug or a broken connection: this request fails, nothing hangs
            log.exception("assigning %s to %s failed", task.attempt_id, decode_id)
            failure = failed(Code.UNAVAILABLE, "the scheduler could not reach the decode worker")
        if failure is None:
            self.queue.placed()
            self.metrics.placed(bool(prefill_id))
            await self.answers.send(
                entry.respond,
                SubmitReply(prefill_worker=prefill_id, decode_worker=decode_id),
            )
        elif failure.movable and entry.attempts < MAX_DISPATCH_ATTEMPTS:
            self._place_again(entry, failure)
        else:
            self.answers.refuse(
                entry, final(failure), retry_after=failure.code is Code.RESOURCE_EXHAUSTED
            )

    def _place_again(self, entry: Pending, failure: Failure) -> None:
        """The decode worker refused: a full one waits for its next heartbeat (or the request goes
        elsewhere), a draining or vanished one is not tried again."""
        if failure.retry is Retry.HERE:
            self.registry.mark_full(failure.blame)
        else:
            entry.tried.add(failure.blame)
        entry.failure = failure
        if self._closing:
            self.answers.hand_back(entry)
        else:
            self.queue.requeue(entry)
            self.pump()

    async def _offer(
        self, task: GenerateTask, decode_id: str, prefill_id: str, prefill_tp: int
    ) -> Failure | None:
        """Asks the decode worker to take the request (its KV from `prefill_id`, of `prefill_tp`
        ranks): None when it did, else why not. Raises RequestTimeout or BadReply when it did
        not answer."""
        try:
            ack = await self.bus.request(
                self.subjects.decode_tasks(decode_id),
                DecodeAssignment(task=task, prefill_worker=prefill_id, prefill_tp=prefill_tp),
                self.settings.dispatch_timeout_s,
                TaskAck,
            )
        except NoResponders:  # gone since its last heartbeat: it holds nothing, try another
            self.registry.drop(decode_id)
            return worker_failed(decode_id, f"decode worker {decode_id} is gone")
        return ack.failure  # full: blames itself, Retry.HERE; draining: Retry.ELSEWHERE

    async def _cancel(self, attempt_id: str, reason: str) -> None:
        try:
            await self.bus.publish(self.subjects.cancel, CancelRequest(attempt_id, reason))
        except Exception as err:  # NATS down: the worker's own timeouts free the request
            log.warning("could not broadcast the cancel of %s: %s", attempt_id, err)
