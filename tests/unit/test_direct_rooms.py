"""Rooms: while nothing waits in its queue a scheduler's heartbeat names the workers with room,
and a gateway places short first attempts there itself, spending the rooms as it goes; anything
else, or a worker that turns one away, goes through the scheduler."""

import asyncio

from services.gateway.direct_rooms import DirectRooms
from services.gateway.schedulers import SchedulerPool
from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.scheduler import rooms
from services.scheduler.router import Policy
from shared.api import tandem_pb2 as pb
from shared.control.failure import worker_full
from shared.control.liveness import Liveness
from shared.control.messages import (
    DecodeAssignment,
    Room,
    SchedulerHeartbeat,
    SubmitReply,
    TaskAck,
    TokenChunk,
)
from shared.control.subjects import Subjects
from shared.control.worker_roles import Mode
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, FakeContext
from tests.unit.test_scheduler import Clock, beat, registry_with, service, task

SUBJECTS = Subjects("default")


# -- the scheduler's offer ----------------------------------------------------------------------


def test_the_scheduler_names_the_roomiest_workers_while_nothing_waits():
    registry = registry_with(
        beat("d1", "colocated", max_num_seqs=8, running=6, kv_blocks_used=10),
        beat("d2", "colocated", max_num_seqs=8, running=1, kv_blocks_used=90),
        beat("d3", "colocated", max_num_seqs=8, running=8),  # no seat
        beat("d4", "colocated", max_num_seqs=8, stopping=False, kv_blocks_used=100),  # no block
        beat("p1", "prefill", max_num_seqs=8),  # holds no sequence
    )
    offered, limit = rooms.offer(registry, Policy(mode=Mode.COLOCATED), 256, queued=0)
    assert limit == 256
    assert offered == [Room("d2", 7, 10 * 16), Room("d1", 2, 90 * 16)]
    assert rooms.offer(registry, Policy(mode=Mode.COLOCATED), 256, queued=1) == ([], 0)
    registry.reserve("d2", seqs=7)  # what this scheduler placed since counts
    assert [r.worker_id for r in rooms.offer(registry, Policy(mode=Mode.COLOCATED), 9, 0)[0]] == [
        "d1"
    ]


def test_no_rooms_when_disaggregated_latency_bound_or_off_and_auto_keeps_its_local_limit():
    registry = registry_with(beat("d1", "decode", max_num_seqs=8))
    assert rooms.offer(registry, Policy(mode=Mode.DISAGGREGATED), 256, 0) == ([], 0)
    assert rooms.offer(registry, Policy(mode=Mode.AUTO, max_itl_ms=50), 256, 0) == ([], 0)
    assert rooms.offer(registry, Policy(mode=Mode.AUTO), 0, 0) == ([], 0)
    offered, limit = rooms.offer(registry, Policy(mode=Mode.AUTO, local_prefill_tokens=64), 256, 0)
    assert limit == 64 and [r.worker_id for r in offered] == ["d1"]


async def test_the_heartbeat_carries_the_rooms_and_none_once_a_request_waits():
    svc, bus = service("colocated", direct_prompt_tokens=128)
    beats = []

    async def heard(b: SchedulerHeartbeat, respond) -> None:
        beats.append(b)

    await bus.subscribe(svc.subjects.scheduler_heartbeat, heard)
    await svc.on_heartbeat(beat("d1", "colocated", max_num_seqs=4), None)  # it takes submissions
    await svc.presence.beat()
    assert beats[-1].rooms == [Room("d1", 4, 100 * 16)] and beats[-1].direct_prompt_tokens == 128
    await svc.on_heartbeat(beat("d1", "colocated", max_num_seqs=4, running=4), None)
    await svc.on_submit(task(attempt_id="waits"), None)  # no room: it waits in the queue
    await svc.presence.beat()
    assert beats[-1].queued == 1 and beats[-1].rooms == [] and not beats[-1].direct_prompt_tokens
    await svc.presence.beat(stopping=True)
    assert beats[-1].rooms == []


# -- the gateway's rooms ------------------------------------------------------------------------


def heard(direct: DirectRooms, *named: Room, scheduler="s1", queued=0, limit=64, **kw) -> None:
    direct.heard(
        SchedulerHeartbeat(scheduler, queued, rooms=list(named), direct_prompt_tokens=limit, **kw)
    )


def test_the_gateway_spends_the_roomiest_room_and_only_on_short_first_attempts():
    clock = Clock()
    direct = DirectRooms(True, 1.0, clock)
    assert direct.take(task()) == ""  # nothing named yet
    heard(direct, Room("d1", 2, 1000), Room("d2", 1, 1000))
    assert [direct.take(task()) for _ in range(4)] == ["d1", "d2", "d1", ""]  # roomiest, spent
    heard(direct, Room("d1", 5, 30))
    assert direct.take(task(prompt_len=10, max_tokens=6)) == "d1"  # 16 tokens of 30
    assert direct.take(task(prompt_len=10, max_tokens=6)) == ""  # 14 left
    heard(direct, Room("d1", 5, 10_000))
    assert direct.take(task(prompt_len=65)) == ""  # past the scheduler's prompt limit
    moved = task()
    moved.moves, moved.avoid_workers = 1, ["d9"]
    assert direct.take(moved) == ""
    assert direct.placed == 4


def test_a_seat_comes_back_when_its_request_ends():
    direct = DirectRooms(True, 1.0, Clock())
    heard(direct, Room("d1", 1, 16))
    first = task(prompt_len=10, max_tokens=6)
    assert direct.take(first) == "d1" and direct.take(task()) == ""
    direct.returned("d1", first)
    assert direct.take(task()) == "d1"
    direct.returned("d9", first)  # a room no beat names any more: nothing to give back to
    assert direct.take(task()) == ""


def test_a_waiting_request_a_stale_beat_or_a_turned_away_worker_sends_it_to_the_scheduler():
    clock = Clock()
    direct = DirectRooms(True, 1.0, clock)
    heard(direct, Room("d1", 8, 10_000))
    heard(direct, scheduler="s2", queued=3)  # another replica has a request waiting
    assert direct.take(task()) == ""
    heard(direct, scheduler="s2", queued=0, accepting=False)  # it stood aside: holds nothing
    heard(direct, Room("d1", 8, 10_000))
    assert direct.take(task()) == "d1"
    direct.turned_away("d1")
    assert direct.take(task()) == "" and direct.refused == 1
    heard(direct, Room("d1", 8, 10_000))
    heard(direct, scheduler="s3", stopping=True)  # another replica leaving: s1's rooms stand
    assert direct.take(task()) == "d1"
    heard(direct, scheduler="s1", stopping=True)  # the one that named them: none until one does
    assert direct.take(task()) == ""
    heard(direct, Room("d1", 8, 10_000))
    clock.now += 1.5  # the rooms are stale
    assert direct.take(task()) == ""
    assert DirectRooms(False, 1.0, clock).take(task()) == ""  # --direct-placement off


# -- the relay's direct path --------------------------------------------------------------------


def answer_soon(bus: InMemoryBus, t) -> None:
    """The task's whole answer, two tokens, a moment from now (as a worker streams it)."""
    chunk = TokenChunk(t.attempt_id, 0, [7, 8], finish_reason="length", completion_tokens=2)
    asyncio.get_running_loop().call_later(
        0.02, lambda: asyncio.ensure_future(bus.publish(t.reply_subject, chunk))
    )


async def through_a_gateway(bus, tokenizer, settings, direct: DirectRooms, count: int) -> list:
    """`count` Generates, one after another, through a gateway whose rooms name d1: for each,
    (its status code, its token ids)."""
    async with (
        StreamRouter(bus, "gw.replies") as streams,
        Liveness(bus, SUBJECTS, settings.worker_timeout_s) as liveness,
        SchedulerPool(bus, SUBJECTS, settings.worker_timeout_s, direct) as pool,
    ):
        await pool.on_heartbeat(
            SchedulerHeartbeat("s1", rooms=[Room("d1", 4, 10_000)], direct_prompt_tokens=64), None
        )
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness, pool)
        outcomes = []
        for i in range(count):
            request, context = pb.GenerateRequest(request_id=f"r{i}", prompt="Hi"), FakeContext()
            responses = [r async for r in servicer.Generate(request, context)]
            outcomes.append((context.code, [t for r in responses for t in r.token_ids]))
        return outcomes


async def test_a_request_goes_straight_to_the_named_worker_and_a_full_one_hands_it_over(
    tokenizer,
):
    """Through a gateway's Generate: the first request lands on the worker the beat named without
    a submit; that worker then refuses one as full, and the scheduler places it (no error)."""
    bus = InMemoryBus()
    settings = GatewaySettings(submit_timeout_s=5, worker_timeout_s=3.0)
    got, submitted = [], []

    async def worker(assignment: DecodeAssignment, respond) -> None:
        got.append(assignment.task)
        if len(got) > 1:
            await respond(TaskAck(worker_full("d1", "decode worker d1 is full")))
            return
        await respond(TaskAck())
        answer_soon(bus, assignment.task)

    async def scheduler(t, respond) -> None:
        submitted.append(t)
        await respond(SubmitReply(decode_worker="d2"))
        answer_soon(bus, t)

    await bus.subscribe(SUBJECTS.decode_tasks("d1"), worker)
    await bus.subscribe(SUBJECTS.submit, scheduler)
    direct = DirectRooms(True, 5.0)
    outcomes = await through_a_gateway(bus, tokenizer, settings, direct, 2)
    assert outcomes == [(None, [7, 8]), (None, [7, 8])]
    assert not direct.take(task())  # the room the worker turned away is named no more
    assert len(got) == 2 and len(submitted) == 1  # the first placed directly, the second not
    assert submitted[0].attempt_id == got[1].attempt_id  # the refused attempt, as it was
    assert (direct.placed, direct.refused) == (2, 1)


async def test_a_worker_that_never_confirms_has_the_attempt_cancelled_and_a_new_one_submitted(
    tokenizer,
):
    """It may have taken the request: running it elsewhere under the same id could run it twice.
    The attempt is cancelled under its id and a new attempt goes to the scheduler."""
    bus = InMemoryBus()
    settings = GatewaySettings(submit_timeout_s=5, worker_timeout_s=3.0, dispatch_timeout_s=0.2)
    got, submitted, cancelled = [], [], []

    async def silent_worker(assignment: DecodeAssignment, respond) -> None:
        got.append(assignment.task)

    async def scheduler(t, respond) -> None:
        submitted.append(t)
        await respond(SubmitReply(decode_worker="d2"))
        answer_soon(bus, t)

    async def on_cancel(message, respond) -> None:
        cancelled.append(message.attempt_id)

    await bus.subscribe(SUBJECTS.decode_tasks("d1"), silent_worker)
    await bus.subscribe(SUBJECTS.submit, scheduler)
    await bus.subscribe(SUBJECTS.cancel, on_cancel)
    direct = DirectRooms(True, 5.0)
    outcomes = await through_a_gateway(bus, tokenizer, settings, direct, 1)
    assert outcomes == [(None, [7, 8])]
    assert len(got) == 1 and len(submitted) == 1
    assert got[0].attempt_id != submitted[0].attempt_id  # a new attempt
    assert got[0].attempt_id in cancelled  # the one the worker may hold is freed
    assert (direct.placed, direct.refused) == (1, 1)
