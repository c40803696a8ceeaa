"""Liveness: when each worker was last heard from, so a stream whose worker died fails fast instead of hanging."""

import time
from typing import Callable

from shared.messages import WorkerHeartbeat
from shared.subjects import Subjects
from shared.transport.bus import MessageBus


class Liveness:
    """Watches the heartbeat subject. `async with Liveness(bus, subjects, timeout_s) as live:`."""

    def __init__(self, bus: MessageBus, subjects: Subjects, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic):
        self._bus = bus
        self._subjects = subjects
        self._timeout = timeout_s
        self._clock = clock
        self._seen: dict[str, float] = {}
        self._sub = None

    async def __aenter__(self) -> "Liveness":
        self._sub = await self._bus.subscribe(self._subjects.heartbeat, self.on_heartbeat)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._sub.unsubscribe()

    async def on_heartbeat(self, beat: WorkerHeartbeat, respond) -> None:
        self._seen[beat.worker_id] = self._clock()

    def alive(self, worker_id: str) -> bool:
        """False once a worker that was seen has been silent for the timeout.

        A worker never seen yet counts as alive: this process may have started after its last
        beat; the timeout still applies from the first question asked about it.
        """
        seen = self._seen.setdefault(worker_id, self._clock())
        return self._clock() - seen <= self._timeout
