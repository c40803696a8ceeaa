"""Liveness: when each worker was last heard from, so a stream whose worker died moves (or fails)
fast instead of hanging.

A worker is dead when it has been silent for the timeout (missed heartbeats). `lost` can tell
sooner: a worker silent for a second whose ping subject has no subscriber left on NATS has lost
its connection, and a killed process loses it at once (the server sees the socket close). A worker
that is only slow answers, or at least still listens, and gets the whole timeout; so does every
worker for a timeout after this process's own NATS connection came back (subscriptions are still
coming back then).
"""

import asyncio
import time
from collections.abc import Callable

from shared.control.bus import MessageBus, NoResponders
from shared.control.messages import Ping, TaskAck, WorkerHeartbeat
from shared.control.subjects import Subjects

QUICK_S = 1.0  # silent this long (two missed beats at the default interval): worth asking NATS
PROBE_TIMEOUT_S = 0.25


class Liveness:
    """Watches the heartbeat subject. `async with Liveness(bus, subjects, timeout_s) as live:`."""

    def __init__(
        self,
        bus: MessageBus,
        subjects: Subjects,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
    ):
        self._bus = bus
        self._subjects = subjects
        self._timeout = timeout_s
        self._quick = min(QUICK_S, timeout_s)
        self._clock = clock
        self._seen: dict[str, float] = {}
        # worker -> the ping in flight (shared by every asker)
        self._probes: dict[str, asyncio.Future] = {}
        self._probed: dict[str, float] = {}  # worker -> when a ping last found it still there
        self._reconnects, self._settled_from = bus.reconnects, clock()
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

    async def lost(self, worker_id: str) -> bool:
        """True when the worker is gone: silent for the timeout, or silent for QUICK_S and no
        longer subscribed on NATS. One ping per worker per QUICK_S at most, however many ask."""
        if not self.alive(worker_id):
            return True
        now = self._clock()
        if (
            now - self._seen[worker_id] < self._quick
            or now - self._probed.get(worker_id, 0.0) < self._quick
            or not self._settled()
        ):
            return False
        probe = self._probes.get(worker_id)
        if probe is None:
            probe = self._probes[worker_id] = asyncio.ensure_future(self._gone(worker_id))
            probe.add_done_callback(lambda _: self._probes.pop(worker_id, None))
        gone = await asyncio.shield(probe)
        if not gone:
            self._probed[worker_id] = now
        return gone

    async def _gone(self, worker_id: str) -> bool:
        try:
            await self._bus.request(
                self._subjects.ping(worker_id), Ping(), PROBE_TIMEOUT_S, TaskAck
            )
        except NoResponders:
            return True
        except Exception:  # it listens but is slow, or NATS is (or is down): the timeout decides
            pass
        return False

    def _settled(self) -> bool:
        """False for a timeout after this process's NATS connection came back."""
        if self._bus.reconnects != self._reconnects:
            self._reconnects, self._settled_from = self._bus.reconnects, self._clock()
        return self._clock() - self._settled_from > self._timeout
