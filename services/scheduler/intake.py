"""Intake: whether a scheduler replica takes its share of the gateways' new submissions and status
requests (the schedulers' queue group).

A replica that knows no live worker that could serve a request in its mode (roles.missing: its
NATS permissions or a partition keep the workers' heartbeats from it, say) would only fail the
share of submissions NATS hands it. So it stands aside: it leaves the queue group for
submissions and its heartbeats say so (SchedulerHeartbeat.accepting), so gateways pick the other
replicas. It keeps its own subject: a gateway left with no other replica to ask still gets its
answer, at once ("no live ... worker", which that gateway then asks the next replica about). It
joins again as soon as it hears a worker that could serve.

Status requests it answers while it hears any worker (its view is then the cluster's, a pool
missing or not); one that hears none at all would answer "no worker, not ready" for a cluster
that has them, and a gateway's readiness would flap, so it leaves that group too.

A replica starts aside and joins on the first worker it hears (its Discover at start has every
worker beat at once): a start never goes in and out. It leaves only once every such worker was
silent for the worker timeout: that timeout is the hold against flapping.
"""

import asyncio
from collections.abc import Callable

from shared.control.bus import Handler, MessageBus, Subscription

QUEUE_GROUP = "schedulers"  # the scheduler replicas' NATS queue group


class Member:
    """One subject's subscription in the queue group, joined or left."""

    def __init__(self, bus: MessageBus, subject: str, handler: Handler):
        self._bus, self._subject, self._handler = bus, subject, handler
        self._sub: Subscription | None = None

    @property
    def joined(self) -> bool:
        return self._sub is not None

    async def be(self, joined: bool) -> bool:
        """Joins or leaves; True when that changed."""
        if joined == self.joined:
            return False
        if joined:
            queue = QUEUE_GROUP
            self._sub = await self._bus.subscribe(self._subject, self._handler, queue=queue)
        else:
            sub, self._sub = self._sub, None
            await sub.unsubscribe()
        return True


class Intake:
    def __init__(
        self,
        submissions: Member,
        status: Member,
        missing: Callable[[], str],
        live_workers: Callable[[], list],
        changed: Callable[[bool, str], None] = lambda accepting, missing: None,
    ):
        self._submissions, self._status = submissions, status
        self.missing = missing  # what keeps the replica from serving any request ("": nothing)
        self._live_workers = live_workers  # the workers it knows live (the registry's)
        self._changed = changed  # told each change of `accepting`, and what was missing
        self._closed = False
        self._lock = asyncio.Lock()  # one change at a time: a heartbeat and the tick may race

    @property
    def accepting(self) -> bool:
        """In the queue group for submissions: taking its share of new ones."""
        return self._submissions.joined

    async def follow(self) -> bool:
        """Joins the queue group when the replica could serve, leaves it when it could not (for
        status: when it hears any worker, or none); True when `accepting` changed."""
        async with self._lock:
            if self._closed:
                return False
            missing = self.missing()
            await self._status.be(bool(self._live_workers()))
            if not await self._submissions.be(not missing):
                return False
            self._changed(self.accepting, missing)
            return True

    async def close(self) -> None:
        """Takes no more submissions nor status requests from the queue group (it stops)."""
        async with self._lock:
            self._closed = True
            await self._submissions.be(False)
            await self._status.be(False)
