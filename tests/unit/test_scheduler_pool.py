"""The gateway submits to scheduler replicas by name (SchedulerPool) and moves a request held by
a replica that dies to another in about a second, not after the submit timeout."""

import asyncio
import time

import grpc

from services.gateway.schedulers import SchedulerPool
from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.api import tandem_pb2 as pb
from shared.control.failure import Code, Failure, Retry
from shared.control.liveness import Liveness
from shared.control.messages import SchedulerHeartbeat, SubmitReply, TaskAck, TokenChunk
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, Aborted, FakeContext

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


async def test_the_pool_prefers_replicas_that_accept_and_else_asks_one_that_stood_aside():
    pool = SchedulerPool(InMemoryBus(), SUBJECTS, timeout_s=3.0, clock=Clock())
    await pool.on_heartbeat(SchedulerHeartbeat("s1", accepting=False), None)
    await pool.on_heartbeat(SchedulerHeartbeat("s2"), None)
    await pool.on_heartbeat(SchedulerHeartbeat("s3"), None)
    assert {pool.pick(set()) for _ in range(6)} == {"s2", "s3"}
    assert {pool.pick({"s2", "s3"}) for _ in range(3)} == {"s1"}  # its answer comes at once
    await pool.on_heartbeat(SchedulerHeartbeat("s1"), None)  # it hears a worker again
    assert {pool.pick(set()) for _ in range(6)} == {"s1", "s2", "s3"}
    assert pool.pick({"s1", "s2", "s3"}) == ""


class Replica:
    """A scheduler replica on the in-memory bus: beats (`accepting` or not), answers pings; `hold`
    keeps submissions unanswered (and `die` ends it), `refuse` answers them so, else it places
    them and streams a short answer."""

    def __init__(
        self,
        bus: InMemoryBus,
        name: str,
        hold: bool = False,
        refuse: SubmitReply | None = None,
        accepting: bool = True,
    ):
        self.bus, self.name, self.hold, self.got, self.subs = bus, name, hold, [], []
        self.refuse, self.accepting = refuse, accepting
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
            beat = SchedulerHeartbeat(self.name, accepting=self.accepting)
            await self.bus.publish(SUBJECTS.scheduler_heartbeat, beat)
            await asyncio.sleep(0.2)

    async def on_ping(self, message, respond) -> None:
        await respond(TaskAck())

    async def on_submit(self, task, respond) -> None:
        self.got.append((time.monotonic(), task))
        if self.hold:
            return
        if self.refuse:
            await respond(self.refuse)
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


NO_WORKER = SubmitReply(
    Failure(Code.UNAVAILABLE, "no live decode or colocated worker", Retry.ELSEWHERE)
)


async def generate_via_pool(bus: InMemoryBus, tokenizer, settings: GatewaySettings, count: int):
    """`count` Generates, one after another, through a gateway that knows the replicas beating on
    `bus`: for each, (responses, context, seconds it took)."""
    async with (
        StreamRouter(bus, "gw.replies") as streams,
        Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s) as liveness,
        SchedulerPool(bus, Subjects(settings.cluster), settings.worker_timeout_s) as pool,
    ):
        await asyncio.sleep(0.25)  # every replica beat once
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness, pool)
        outcomes = []
        for i in range(count):
            request = pb.GenerateRequest(request_id=f"r{i}", prompt="Hi")
            responses, context, started = [], FakeContext(), time.monotonic()
            try:
                async for response in servicer.Generate(request, context):
                    responses.append(response)
            except Aborted:
                pass
            outcomes.append((responses, context, time.monotonic() - started))
        return outcomes


async def test_a_no_worker_answer_is_asked_of_the_next_replica_under_the_same_attempt(tokenizer):
    """A replica that went deaf since its last beat (the gateway still takes it for accepting)
    answers "no worker": the request goes to the other replica, and the client sees no error."""
    bus = InMemoryBus()
    deaf = await Replica(bus, "s1", refuse=NO_WORKER).start()
    healthy = await Replica(bus, "s2").start()
    try:
        outcomes = await generate_via_pool(bus, tokenizer, GatewaySettings(submit_timeout_s=30), 4)
    finally:
        deaf.beating.cancel(), healthy.beating.cancel()
    for responses, context, _ in outcomes:
        assert context.code is None and [t for r in responses for t in r.token_ids] == [7, 8]
        assert responses[-1].timing.migrations == 0
    assert len(healthy.got) == 4 and len(deaf.got) >= 2  # picked in turn with the other
    placed = {task.attempt_id for _, task in healthy.got}
    assert {task.attempt_id for _, task in deaf.got} < placed  # it held nothing: no new attempt


async def test_when_every_replica_hears_no_worker_the_client_is_told_so_at_once(tokenizer):
    bus = InMemoryBus()
    replicas = [
        await Replica(bus, name, refuse=NO_WORKER, accepting=False).start()
        for name in ("s1", "s2", "s3")
    ]
    try:
        outcomes = await generate_via_pool(bus, tokenizer, GatewaySettings(submit_timeout_s=30), 1)
    finally:
        for replica in replicas:
            replica.beating.cancel()
    [(responses, context, took)] = outcomes
    assert responses == [] and context.code == grpc.StatusCode.UNAVAILABLE
    assert context.message == "no live decode or colocated worker"
    assert [len(r.got) for r in replicas] == [1, 1, 1]  # each asked once, none twice
    assert took < 1.0  # not the 30 s submit timeout
