"""Liveness: when each worker was last heard from, so a stream whose worker died moves (or fails)
fast instead of hanging.

A worker is dead when it has been silent for the timeout (missed heartbeats). `lost` can tell
sooner: a worker silent for a second whose ping subject has no subscriber left on NATS has lost
its connection, and a killed process loses it at once (the server sees the socket close). A worker
that is only slow answers, or at least still listens, and gets the whole timeout; so does every
worker for a timeout after this process's own NATS connection came back (subscriptions are still
coming back then).

Silence is evidence only while this process can hear: while its own connection is down, or the
server is stalled (it answers no ping and no heartbeat comes from anyone), nobody is declared
lost, and silence counts again from when hearing came back. A NATS outage is not a dead worker.
"""

import asyncio
import time
from collections.abc import Callable

from shared.control.bus import MessageBus, NoResponders
from shared.control.messages import Ping, SchedulerHeartbeat, TaskAck, WorkerHeartbeat
from shared.control.subjects import Subjects
from shared.telemetry.request_log import detached

QUICK_S = 1.0  # silent this long (two missed beats at the default interval): worth asking NATS
PROBE_TIMEOUT_S = 0.25


class Liveness:
    """Watches the workers' heartbeat subject. `async with Liveness(bus, subjects, timeout_s) as
    live:`. With `schedulers=True`, the scheduler replicas' instead."""

    def __init__(
        self,
        bus: MessageBus,
        subjects: Subjects,
        timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        schedulers: bool = False,
    ):
        self._bus = bus
        self._beats = subjects.scheduler_heartbeat if schedulers else subjects.heartbeat
        self._ping = subjects.scheduler_ping if schedulers else subjects.ping
        self._timeout = timeout_s
        self._quick = min(QUICK_S, timeout_s)
        self._clock = clock
        self._seen: dict[str, float] = {}
        # worker -> the ping in flight (shared by every asker)
        self._probes: dict[str, asyncio.Future] = {}
        self._probed: dict[str, float] = {}  # worker -> when a ping last found it still there
        self._reconnects = bus.reconnects
        self._hearing_from = clock()  # silence counts from here at the earliest (see _silent_s)
        self._heard_any = float("-inf")  # when a heartbeat last came from anyone
        self._deaf = False  # the last look found this process could not hear
        self._reach: asyncio.Future | None = None  # the server ping in flight (shared)
        self._sub = None

    async def __aenter__(self) -> "Liveness":
        self._sub = await self._bus.subscribe(self._beats, self.on_heartbeat)
        return self

    async def __aexit__(self, *exc) -> None:
        await self._sub.unsubscribe()

    async def on_heartbeat(self, beat: WorkerHeartbeat | SchedulerHeartbeat, respond) -> None:
        sender = beat.scheduler_id if isinstance(beat, SchedulerHeartbeat) else beat.worker_id
        now = self._clock()
        if self._deaf:  # hearing again: silence counts from now
            self._deaf, self._hearing_from = False, now
        self._seen[sender] = self._heard_any = now

    def alive(self, worker_id: str) -> bool:
        """False once a worker that was seen has been silent for the timeout while this process
        could hear it.

        A worker never seen yet counts as alive: this process may have started after its last
        beat; the timeout still applies from the first question asked about it.
        """
        return self._silent_s(worker_id) <= self._timeout

    async def lost(self, worker_id: str) -> bool:
        """True when the worker is gone: silent for the timeout (and this process can hear), or
        silent for QUICK_S and no longer subscribed on NATS. One ping per worker per QUICK_S at
        most, however many ask."""
        silent = self._silent_s(worker_id)
        if silent > self._timeout:
            return await self._hearing()
        now = self._clock()
        if (
            silent < self._quick
            or now - self._probed.get(worker_id, 0.0) < self._quick
            or now - self._hearing_from <= self._timeout  # subscriptions may be coming back
        ):
            return False
        probe = self._probes.get(worker_id)
        if probe is None:
            probe = self._probes[worker_id] = detached(self._gone(worker_id))  # shared by all
            probe.add_done_callback(lambda _: self._probes.pop(worker_id, None))
        gone = await asyncio.shield(probe)
        if not gone:
            self._probed[worker_id] = now
        return gone

    def _silent_s(self, worker_id: str) -> float:
        """How long the worker has been silent while this process could hear it."""
        now = self._clock()
        if self._bus.reconnects != self._reconnects or not self._bus.connected:
            self._reconnects, self._hearing_from = self._bus.reconnects, now
            self._deaf = not self._bus.connected
        seen = self._seen.setdefault(worker_id, now)
        return now - max(seen, self._hearing_from)

    async def _hearing(self) -> bool:
        """True when heartbeats can reach this process: one came from anyone lately, or the server
        answers a ping. If not, the silence so far is not evidence: it counts again from now."""
        if self._clock() - self._heard_any < self._quick and not self._deaf:
            return True
        if self._reach is None:
            self._reach = detached(self._bus.reachable(PROBE_TIMEOUT_S))
            self._reach.add_done_callback(lambda _: setattr(self, "_reach", None))
        reachable = await asyncio.shield(self._reach)
        if reachable and not self._deaf:
            return True
        # deaf now, or just hearing again: either way silence counts from now
        self._deaf, self._hearing_from = not reachable, self._clock()
        return False

    async def _gone(self, worker_id: str) -> bool:
        try:
            await self._bus.request(self._ping(worker_id), Ping(), PROBE_TIMEOUT_S, TaskAck)
        except NoResponders:
            return True
        except Exception:  # it listens but is slow, or NATS is (or is down): the timeout decides
            pass
        return False
