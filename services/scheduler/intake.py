"""Intake: whether a scheduler replica takes its share of the gateways' new submissions and status
requests (the schedulers' queue group).

A replica that knows no live worker that could serve a request in its mode (roles.missing: its
NATS permissions or a partition keep the workers' heartbeats from it, say) would only fail the
share of submissions NATS hands it, and answer its share of status requests with no worker and
not ready (a gateway's readiness would flap). So it stands aside: it leaves the queue group and
its heartbeats say so (SchedulerHeartbeat.accepting), so gateways pick the other replicas. It
keeps its own subject: a gateway left with no other replica to ask still gets its answer, at
once ("no live ... worker", which that gateway then asks the next replica about). It joins again
as soon as it hears a worker that could serve.

A replica starts aside and joins on the first such worker it hears (its Discover at start has
every worker beat at once): a start never goes in and out. It leaves only once every such worker
was silent for the worker timeout: that timeout is the hold against flapping.
"""

import asyncio
from collections.abc import Callable

from shared.control.bus import Handler, MessageBus, Subscription

QUEUE_GROUP = "schedulers"  # the scheduler replicas' NATS queue group


class Intake:
    def __init__(
        self,
        bus: MessageBus,
        handlers: dict[str, Handler],
        missing: Callable[[], str],
        changed: Callable[[bool, str], None] = lambda accepting, missing: None,
    ):
        self._bus, self._handlers = bus, handlers  # subject -> its handler, in the queue group
        self.missing = missing  # what keeps the replica from serving any request ("": nothing)
        self._changed = changed  # told each change, and what was missing (metrics, the log)
        self._subs: list[Subscription] = []
        self._closed = False
        self._lock = asyncio.Lock()  # one change at a time: a heartbeat and the tick may race

    @property
    def accepting(self) -> bool:
        """In the queue group: taking its share of new submissions and status requests."""
        return bool(self._subs)

    async def follow(self) -> bool:
        """Joins the queue group when the replica could serve, leaves it when it could not; True
        when that changed."""
        async with self._lock:
            missing = self.missing()
            if self._closed or self.accepting == (not missing):
                return False
            if missing:
                await self._leave()
            else:
                for subject, handler in self._handlers.items():
                    sub = await self._bus.subscribe(subject, handler, queue=QUEUE_GROUP)
                    self._subs.append(sub)
            self._changed(self.accepting, missing)
            return True

    async def close(self) -> None:
        """Takes no more submissions from the queue group (the replica stops)."""
        async with self._lock:
            self._closed = True
            await self._leave()

    async def _leave(self) -> None:
        subs, self._subs = self._subs, []
        for sub in subs:
            await sub.unsubscribe()
