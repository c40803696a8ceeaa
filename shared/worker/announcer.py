"""Workers announce themselves and their load on NATS: every interval, at once when a scheduler
asks, and soon after a change worth telling (`nudge`: blocks freed by a cancel, say). They answer
a Ping too: while the process lives it has a subscription there (shared.control.liveness)."""

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from shared.control.bus import MessageBus
from shared.control.messages import Discover, Ping, TaskAck, WorkerHeartbeat
from shared.control.subjects import Subjects

log = logging.getLogger(__name__)

NUDGE_GAP_S = 0.05


class Announcer:
    def __init__(
        self,
        bus: MessageBus,
        subjects: Subjects,
        worker_id: str,
        snapshot: Callable[[], WorkerHeartbeat],
        interval_s: float,
        alive_file: str = "",
    ):
        self._bus = bus
        self._subjects = subjects
        self._worker_id = worker_id
        self._snapshot = snapshot
        self._interval = interval_s
        self._alive = Path(alive_file) if alive_file else None
        self._task: asyncio.Task | None = None
        self._subs = []
        self._soon = asyncio.Event()
        self.last: WorkerHeartbeat | None = None  # the latest heartbeat sent

    async def __aenter__(self) -> "Announcer":
        self._subs = [
            await self._bus.subscribe(self._subjects.discover, self._on_discover),
            await self._bus.subscribe(self._subjects.ping(self._worker_id), self._on_ping),
        ]
        await self.announce()
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        for sub in self._subs:
            await sub.unsubscribe()
        final = self._snapshot()
        final.stopping = True  # the scheduler drops us at once instead of after a timeout
        await self._bus.publish(self._subjects.heartbeat, final)

    async def announce(self) -> None:
        self.last = self._snapshot()
        await self._bus.publish(self._subjects.heartbeat, self.last)
        if self._alive is not None:
            self._alive.touch()

    def nudge(self) -> None:
        """Beat soon rather than at the next interval (at most every NUDGE_GAP_S)."""
        self._soon.set()

    async def _on_discover(self, message: Discover, respond) -> None:
        await self.announce()

    async def _on_ping(self, message: Ping, respond) -> None:
        if respond is not None and isinstance(message, Ping):
            await respond(TaskAck())

    async def _loop(self) -> None:
        while True:
            try:
                await asyncio.wait_for(self._soon.wait(), self._interval)
                # what else changes in the same moment goes in one beat
                await asyncio.sleep(NUDGE_GAP_S)
            except asyncio.TimeoutError:
                pass
            self._soon.clear()
            try:
                await self.announce()
            except Exception as err:  # NATS reconnecting: the next beat will do
                log.warning("heartbeat not sent: %s", err)
