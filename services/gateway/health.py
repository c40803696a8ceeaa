"""Readiness: the gateway reports SERVING while a scheduler answers and has the workers it needs."""

import asyncio
import contextlib
import logging

from grpc_health.v1 import health_pb2

from services.gateway.status_asks import ask_status
from shared.control.bus import BusError, MessageBus
from shared.control.messages import StatusRequest
from shared.control.subjects import Subjects

log = logging.getLogger(__name__)

SERVICES = ("", "tandem.v1.Tandem")


class ReadinessProbe:
    def __init__(
        self, bus: MessageBus, subjects: Subjects, health_servicer, interval_s: float = 1.0
    ):
        self._bus = bus
        self._subjects = subjects
        self._health = health_servicer
        self._interval = interval_s
        self._serving: bool | None = None
        self._task: asyncio.Task | None = None

    @property
    def serving(self) -> bool:
        return bool(self._serving)

    async def __aenter__(self) -> "ReadinessProbe":
        await self._set(False)
        self._task = asyncio.create_task(self._loop())
        return self

    async def __aexit__(self, *exc) -> None:
        self._task.cancel()
        await self._set(False)

    async def _set(self, serving: bool) -> None:
        if serving == self._serving:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in SERVICES:
            await self._health.set(service, status)
        self._serving = serving  # only once every service has it: a failed set is tried again
        log.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    async def _loop(self) -> None:
        """Checks every interval for as long as the gateway runs: a check that fails in any way
        (a bug, a reply it cannot read) reads as not ready, is logged once in a row, and the
        next check comes all the same."""
        failing = False
        while True:
            try:
                await self._set(await self._ready())
                failing = False
            except Exception:
                if not failing:
                    log.exception("readiness check failed: NOT_SERVING until one passes")
                failing = True
                with contextlib.suppress(Exception):
                    await self._set(False)
            await asyncio.sleep(self._interval)

    async def _ready(self) -> bool:
        try:  # asked again once when unanswered: a scheduler cut off (not yet given up by its
            # server) is not the gateway's readiness
            reply = await ask_status(self._bus, self._subjects, StatusRequest(), 1.0, asks=2)
        except BusError:  # no scheduler answers (yet): not ready, nothing to log
            return False
        return reply.ready
