"""SchedulerService: keeps the registry from heartbeats, routes submissions, answers status."""

import asyncio
import logging
import uuid
from pathlib import Path

from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import NoWorker, route
from services.scheduler.settings import SchedulerSettings
from shared.messages import (CancelRequest, DecodeAssignment, Discover, GenerateTask, StatusReply, StatusRequest,
                             SubmitReply, TaskAck, WorkerHeartbeat)
from shared.subjects import Subjects
from shared.transport.bus import MessageBus, NoResponders, RequestTimeout

log = logging.getLogger(__name__)

MAX_DISPATCH_ATTEMPTS = 3


class SchedulerService:
    def __init__(self, settings: SchedulerSettings, bus: MessageBus):
        self.settings = settings
        self.bus = bus
        self.subjects = Subjects(settings.cluster)
        self.registry = WorkerRegistry(settings.worker_timeout_s)
        self.scheduler_id = settings.scheduler_id or f"scheduler-{uuid.uuid4().hex[:8]}"
        self._inflight: set[asyncio.Task] = set()

    async def serve(self, stop: asyncio.Event) -> None:
        subs = [await self.bus.subscribe(self.subjects.heartbeat, self.on_heartbeat),
                await self.bus.subscribe(self.subjects.submit, self.on_submit, queue="schedulers"),
                await self.bus.subscribe(self.subjects.status, self.on_status, queue="schedulers")]
        await self.bus.publish(self.subjects.discover, Discover(scheduler_id=self.scheduler_id))
        log.info("%s up in %s mode on cluster %r", self.scheduler_id, self.settings.mode, self.settings.cluster)
        alive = asyncio.create_task(self._keep_alive()) if self.settings.alive_file else None
        try:
            await stop.wait()
        finally:
            if alive is not None:
                alive.cancel()
            for sub in subs:
                await sub.unsubscribe()
            if self._inflight:
                await asyncio.gather(*self._inflight, return_exceptions=True)

    async def _keep_alive(self) -> None:
        """Touches the alive file while the event loop runs (the container health check reads it)."""
        path = Path(self.settings.alive_file)
        while True:
            path.touch()
            await asyncio.sleep(1.0)

    def ready(self) -> bool:
        roles = ("colocated",) if self.settings.mode == "colocated" else ("prefill", "decode")
        return all(self.registry.live(role) for role in roles)

    async def on_heartbeat(self, beat: WorkerHeartbeat, respond) -> None:
        self.registry.update(beat)

    async def on_status(self, request: StatusRequest, respond) -> None:
        if respond is not None:
            await respond(StatusReply(mode=self.settings.mode, ready=self.ready(), workers=self.registry.live()))

    async def on_submit(self, task: GenerateTask, respond) -> None:
        # Dispatch beside the subscription, so one slow worker does not hold up other submissions.
        job = asyncio.create_task(self._dispatch(task, respond))
        self._inflight.add(job)
        job.add_done_callback(self._inflight.discard)

    async def _dispatch(self, task: GenerateTask, respond) -> None:
        reply = await self.dispatch(task)
        if respond is not None:
            await respond(reply)

    async def dispatch(self, task: GenerateTask) -> SubmitReply:
        """Routes the task and hands it to the chosen decode worker; tries another on refusal."""
        tried: set[str] = set()
        last = SubmitReply(ok=False, code="UNAVAILABLE", message="no worker accepted the request")
        for _ in range(MAX_DISPATCH_ATTEMPTS):
            try:
                chosen = route(self.registry, self.settings.mode, task, tried)
            except NoWorker as err:
                if tried and last.code == "RESOURCE_EXHAUSTED":
                    return last
                return SubmitReply(ok=False, code=err.code, message=str(err))
            prefill_id = chosen.prefill.worker_id if chosen.prefill else ""
            assignment = DecodeAssignment(task=task, prefill_worker=prefill_id)
            try:
                ack = await self.bus.request(self.subjects.worker_tasks(chosen.decode.worker_id), assignment,
                                             self.settings.dispatch_timeout_s, TaskAck)
            except NoResponders:  # gone since its last heartbeat: it holds nothing, try another
                self.registry.drop(chosen.decode.worker_id)
                tried.add(chosen.decode.worker_id)
                continue
            except RequestTimeout:
                # It may have taken the request after all: trying another could run it twice.
                log.warning("decode worker %s did not confirm %s in time", chosen.decode.worker_id, task.request_id)
                await self.bus.publish(self.subjects.cancel, CancelRequest(task.request_id, "dispatch timed out"))
                return SubmitReply(ok=False, code="UNAVAILABLE",
                                   message=f"decode worker {chosen.decode.worker_id} did not answer in time")
            if ack.ok:
                return SubmitReply(ok=True, prefill_worker=prefill_id, decode_worker=chosen.decode.worker_id)
            last = SubmitReply(ok=False, code=ack.code or "UNAVAILABLE", message=ack.message)
            if ack.code != "RESOURCE_EXHAUSTED":
                return last
            tried.add(chosen.decode.worker_id)
        return last
