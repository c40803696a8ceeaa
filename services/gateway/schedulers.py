"""SchedulerPool: the scheduler replicas a gateway submits to, known from their heartbeats.

A request goes to one live replica by name (in turn), so the gateway knows who holds it while it
waits for a place: to one that accepts submissions, while any does (one that hears no worker that
could serve stands aside: services/scheduler/intake.py); when that replica is lost (its heartbeats stop and NATS says nobody listens on
its ping subject: a killed process, in about a second) the request is submitted again to another.
Before any replica was heard from (a gateway just started, or one whose NATS was away) a request
goes to the schedulers' queue group instead, as it always could. The rooms their heartbeats name
go to `rooms` (DirectRooms): where a request may skip them.
"""

import time
from collections.abc import Callable

from services.gateway.direct_rooms import DirectRooms
from shared.control.bus import MessageBus
from shared.control.liveness import Liveness
from shared.control.messages import SchedulerHeartbeat
from shared.control.subjects import Subjects

FORGET_S = 300.0  # a replica silent this long is forgotten (restarts come back under new names)


class SchedulerPool:
    def __init__(
        self,
        bus: MessageBus,
        subjects: Subjects,
        timeout_s: float,
        rooms: DirectRooms | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.rooms = rooms or DirectRooms(False, timeout_s, clock)  # what requests skip them for
        self._bus = bus
        self._subjects = subjects
        self._timeout = timeout_s
        self._clock = clock
        self._liveness = Liveness(bus, subjects, timeout_s, clock, schedulers=True)
        self._beats: dict[str, SchedulerHeartbeat] = {}
        self._seen: dict[str, float] = {}
        self._turn = 0
        self._sub = None

    async def __aenter__(self) -> "SchedulerPool":
        await self._liveness.__aenter__()
        self._sub = await self._bus.subscribe(self._subjects.scheduler_heartbeat, self.on_heartbeat)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._sub.unsubscribe()
        await self._liveness.__aexit__(*exc)

    async def on_heartbeat(self, beat: SchedulerHeartbeat, respond) -> None:
        now = self._clock()
        for gone in [s for s, seen in self._seen.items() if now - seen > FORGET_S]:
            del self._beats[gone], self._seen[gone]
        self._beats[beat.scheduler_id] = beat
        self._seen[beat.scheduler_id] = now
        self.rooms.heard(beat)

    def pick(self, avoid: set[str]) -> str:
        """A live replica that is not stopping and not in `avoid`, in turn: one that accepts
        submissions while any does, else one that stood aside (it answers at once that it hears
        no worker); "" when none is known (then the queue group)."""
        now = self._clock()
        live = sorted(
            s
            for s, beat in self._beats.items()
            if not beat.stopping and now - self._seen[s] <= self._timeout and s not in avoid
        )
        choice = [s for s in live if self._beats[s].accepting] or live
        if not choice:
            return ""
        self._turn += 1
        return choice[self._turn % len(choice)]

    async def lost(self, scheduler_id: str) -> bool:
        return await self._liveness.lost(scheduler_id)
