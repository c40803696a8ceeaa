"""The gateway's readiness probe: SERVING while a scheduler answers ready, and it goes on after
any failure of a check (a broken reply, a bug), not only after the bus's own errors."""

import asyncio

from grpc_health.v1 import health_pb2

from services.gateway.health import ReadinessProbe
from shared.control.bus import BusError
from shared.control.messages import StatusReply
from shared.control.subjects import Subjects

SERVING = health_pb2.HealthCheckResponse.SERVING


class ScriptedBus:
    """Answers each status request with the next of `outcomes` (an exception is raised), then
    with the last one for ever."""

    def __init__(self, outcomes: list):
        self.outcomes = outcomes
        self.asked = 0

    async def request(self, subject, message, timeout, reply_type):
        outcome = self.outcomes[min(self.asked, len(self.outcomes) - 1)]
        self.asked += 1
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome


class RecordingHealth:
    def __init__(self):
        self.status: dict[str, int] = {}

    async def set(self, service: str, status: int) -> None:
        self.status[service] = status


async def _serving_after(outcomes: list) -> tuple[bool, ScriptedBus]:
    bus, health = ScriptedBus(outcomes), RecordingHealth()
    async with ReadinessProbe(bus, Subjects("c"), health, interval_s=0.01):
        for _ in range(200):
            await asyncio.sleep(0.01)
            if bus.asked > len(outcomes) and health.status.get("") == SERVING:
                return True, bus
    return False, bus


async def test_serving_once_a_scheduler_answers_ready():
    ready = StatusReply(mode="disaggregated", ready=True)
    assert (await _serving_after([BusError("no responders"), ready]))[0]


async def test_any_failure_of_a_check_leaves_the_probe_running():
    ready = StatusReply(mode="disaggregated", ready=True)
    serving, bus = await _serving_after([RuntimeError("a bug"), ValueError("bad reply"), ready])
    assert serving, f"readiness froze after {bus.asked} checks"


async def test_not_ready_is_not_serving():
    bus, health = ScriptedBus([StatusReply(mode="auto", ready=False)]), RecordingHealth()
    async with ReadinessProbe(bus, Subjects("c"), health, interval_s=0.01):
        await asyncio.sleep(0.1)
        assert bus.asked > 1 and health.status[""] != SERVING
