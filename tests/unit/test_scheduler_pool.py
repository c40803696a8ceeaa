"""The gateway submits to scheduler replicas by name (SchedulerPool) and moves a request held by
a replica that dies to another in about a second, not after the submit timeout."""

import asyncio
import time

from services.gateway.schedulers import SchedulerPool
from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.api import tandem_pb2 as pb
from shared.control.liveness import Liveness
from shared.control.messages import SchedulerHeartbeat, SubmitReply, TaskAck, TokenChunk
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, FakeContext

SUBJECTS = Subjects("default")


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def test_the_pool_picks_live_replicas_in_turn_and_skips_stopping_silent_and_avoided():
    clock = Clock()
    pool = SchedulerPool(InMemoryBus(), SUBJECTS, timeout_s=3.0, clock=clock)
    assert pool.pick(set()) == ""  # none heard from: the queue group
    for s in ("s1", "s2", "s3"):
        await pool.on_heartbeat(SchedulerHeartbeat(s), None)
    assert {pool.pick(set()) for _ in range(3)} == {"s1", "s2", "s3"}
    await pool.on_heartbeat(SchedulerHeartbeat("s3", stopping=True), None)
    assert {pool.pick({"s1"}) for _ in range(4)} == {"s2"}
    clock.now += 3.5
    await pool.on_heartbeat(SchedulerHeartbeat("s1"), None)
    assert {pool.pick(set()) for _ in range(4)} == {"s1"}  # s2 went silent


class Replica:
    """A scheduler replica on the in-memory bus: beats, answers pings; `hold` keeps submissions
    unanswered (and `die` ends it), else it places them and streams a short answer."""

    def __init__(self, bus: InMemoryBus, name: str, hold: bool = False):
        self.bus, self.name, self.hold, self.got, self.subs = bus, name, hold, [], []
        self.beating = None

    async def start(self) -> "Replica":
        self.subs = [
            await self.bus.subscribe(SUBJECTS.submit_to(self.name), self.on_submit),
            await self.bus.subscribe(SUBJECTS.scheduler_ping(self.name), self.on_ping),
        ]
        self.beating = asyncio.create_task(self._beat())
        return self

    async def _beat(self) -> None:
        while True:
            await self.bus.publish(SUBJECTS.scheduler_heartbeat, SchedulerHeartbeat(self.name))
            await asyncio.sleep(0.2)

    async def on_ping(self, message, respond) -> None:
        await respond(TaskAck())

    async def on_submit(self, task, respond) -> None:
        self.got.append((time.monotonic(), task))
        if self.hold:
            return
        await respond(SubmitReply(prefill_worker="", decode_worker="d1"))
        chunk = TokenChunk(task.attempt_id, 0, [7, 8], finish_reason="length", completion_tokens=2)
        asyncio.get_running_loop().call_later(
            0.05, lambda: asyncio.ensure_future(self.bus.publish(task.reply_subject, chunk))
        )

    async def die(self) -> None:
        self.beating.cancel()
        for sub in self.subs:
            await sub.unsubscribe()


async def test_a_request_held_by_a_replica_that_dies_moves_to_another_in_about_a_second(
    tokenizer,
):
    bus = InMemoryBus()
    settings = GatewaySettings(submit_timeout_s=30, worker_timeout_s=3.0)
    healthy, victim = await Replica(bus, "s1").start(), await Replica(bus, "s2", True).start()
    async with (
        StreamRouter(bus, "gw.replies") as streams,
        Liveness(bus, SUBJECTS, settings.worker_timeout_s) as liveness,
        SchedulerPool(bus, SUBJECTS, settings.worker_timeout_s) as pool,
    ):
        # both replicas heard from, and a timeout past the gateway's start (Liveness's quick rule)
        await asyncio.sleep(3.1)
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness, pool)
        request = pb.GenerateRequest(request_id="r", prompt="Hi", sampling=pb.SamplingParams())
        responses, context = [], FakeContext()

        async def kill_when_it_holds_the_request() -> float:
            while not victim.got:
                await asyncio.sleep(0.01)
            await victim.die()
            return time.monotonic()

        killing = asyncio.create_task(kill_when_it_holds_the_request())
        async for response in servicer.Generate(request, context):
            responses.append(response)
        died_at = await killing
    healthy.beating.cancel()
    assert context.code is None and [t for r in responses for t in r.token_ids] == [7, 8]
    (moved_at, moved), (_, first) = healthy.got[0], victim.got[0]
    assert moved.attempt_id != first.attempt_id and responses[-1].timing.migrations == 0
    print(f"moved {moved_at - died_at:.2f}s after its scheduler died")
    assert moved_at - died_at < 2.8  # about a second: before the 3 s timeout, far from 30 s
