"""Readiness: the gateway reports SERVING while a scheduler answers and has the workers it needs."""

import asyncio
import logging

from grpc_health.v1 import health_pb2

from shared.control.bus import BusError, MessageBus
from shared.control.messages import StatusReply, StatusRequest
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
        self._serving = serving
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for service in SERVICES:
            await self._health.set(service, status)
        log.info("health: %s", "SERVING" if serving else "NOT_SERVING")

    async def _loop(self) -> None:
        while True:
            try:
                reply = await self._bus.request(
                    self._subjects.status, StatusRequest(), 1.0, StatusReply
                )
                await self._set(reply.ready)
            except BusError:
                await self._set(False)
            await asyncio.sleep(self._interval)
