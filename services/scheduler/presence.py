"""Presence: a scheduler replica's side of staying known and keeping its view honest.

It beats (SchedulerHeartbeat, every `beat_s`: half a second) so gateways submit to it by name
and notice within about a second when it is gone, naming the workers they may place on
themselves meanwhile (services/scheduler/rooms.py); it takes submissions or stands aside (Intake)
and beats at once when that changes; it answers pings; it touches the alive file for container
health checks; and it watches its own hearing: while its NATS connection is down or the server is
stalled, the workers' silence is excused (WorkerRegistry.excuse), after a reconnect it asks every
worker to announce itself (Discover), and until their heartbeats can have come a request that
finds no worker waits for them (beats_coming).
"""

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from services.scheduler.intake import Intake
from services.scheduler.registry import WorkerRegistry
from services.scheduler.rooms import Offer
from shared.control.bus import MessageBus
from shared.control.liveness import PROBE_TIMEOUT_S, QUICK_S
from shared.control.messages import Discover, Ping, SchedulerHeartbeat, TaskAck
from shared.control.subjects import Subjects

log = logging.getLogger(__name__)

BEAT_S = 0.5  # the default interval of the replica's heartbeats (Presence's beat_s)
# the alive file is touched this often; a container health check takes an older one for a hang
TOUCH_S = 1.0


class Presence:
    def __init__(
        self,
        bus: MessageBus,
        subjects: Subjects,
        scheduler_id: str,
        registry: WorkerRegistry,
        queued: Callable[[], int],
        intake: Intake,
        beat_s: float = BEAT_S,
        rooms: Callable[[], Offer] = Offer,
    ):
        self.bus = bus
        self.beat_s = beat_s
        self.subjects = subjects
        self.scheduler_id = scheduler_id
        self.registry = registry
        self.queued = queued
        self.rooms = rooms  # the workers gateways may place on themselves, and their prompts' limit
        self.intake = intake
        self._reconnects = bus.reconnects
        self._reach_checked = 0.0
        self._beaten = float("-inf")

    @property
    def reconnect_unnoticed(self) -> bool:
        """The connection came back and the workers were not asked to announce themselves yet."""
        return self.bus.reconnects != self._reconnects

    def beats_coming(self, excluded: set[str]) -> bool:
        """This scheduler just started or heard again after an outage, and none of the workers it
        knows is in `excluded`: the workers' heartbeats are on their way."""
        if not self.registry.settling() and not self.reconnect_unnoticed:
            return False
        return not any(w.worker_id in excluded for w in self.registry.live())

    async def discover(self) -> None:
        """Asks every worker to announce itself now."""
        await self.bus.publish(self.subjects.discover, Discover(scheduler_id=self.scheduler_id))

    async def follow(self) -> None:
        """Takes submissions or stands aside (Intake), and says which at once."""
        if await self.intake.follow():
            await self.beat()

    async def tick(self) -> None:
        await self.follow()
        if time.monotonic() - self._beaten >= self.beat_s:
            await self.beat()
        await self._keep_hearing()

    async def beat(self, stopping: bool = False) -> None:
        self._beaten = time.monotonic()
        accepting = self.intake.accepting and not stopping
        offer = self.rooms() if accepting else Offer()
        beat = SchedulerHeartbeat(
            self.scheduler_id,
            self.queued(),
            stopping,
            accepting=accepting,
            rooms=offer.rooms,
            paired_rooms=offer.paired_rooms,
            prefill_rooms=offer.prefill_rooms,
            direct_prompt_tokens=offer.prompt_tokens,
        )
        try:
            await self.bus.publish(self.subjects.scheduler_heartbeat, beat)
        except Exception as err:  # NATS away: the next beat will do
            log.debug("scheduler heartbeat not sent: %s", err)

    async def on_ping(self, message: Ping, respond) -> None:
        if respond is not None:
            await respond(TaskAck())

    async def keep_alive(self, alive_file: str) -> None:
        """Touches the alive file while the event loop runs (the container health check reads it)."""
        path = Path(alive_file)
        while True:
            path.touch()
            await asyncio.sleep(TOUCH_S)

    async def _keep_hearing(self) -> None:
        """While this scheduler cannot hear the workers (its connection down, the server stalled)
        their silence is excused; after a reconnect it asks every worker to announce itself."""
        if not self.bus.connected:
            self.registry.excuse(deaf=True)
        elif self.reconnect_unnoticed:
            self._reconnects = self.bus.reconnects
            self.registry.excuse()
            await self.discover()
        elif self.registry.quiet_s() > QUICK_S and time.monotonic() - self._reach_checked > QUICK_S:
            self._reach_checked = time.monotonic()
            if not await self.bus.reachable(PROBE_TIMEOUT_S):
                self.registry.excuse(deaf=True)
