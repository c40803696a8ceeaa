"""Rooms: while nothing waits in its queue a scheduler's heartbeat names the workers with room,
and a gateway places short first attempts there itself, spending the rooms as it goes; anything
else, or a worker that turns one away, goes through the scheduler."""

import asyncio
import dataclasses

from services.gateway.direct_rooms import DirectRooms, Placement
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
    WorkerHeartbeat,
)
from shared.control.subjects import Subjects
from shared.control.worker_roles import Mode
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, FakeContext
from tests.unit.test_scheduler import LAYOUT, Clock, beat, registry_with, service, task

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
    offered = rooms.offer(registry, Policy(mode=Mode.COLOCATED), 256, queued=0)
    assert offered.prompt_tokens == 256 and offered.prefill_rooms == []
    assert offered.rooms == [Room("d2", 7, 10 * 16), Room("d1", 2, 90 * 16)]
    assert rooms.offer(registry, Policy(mode=Mode.COLOCATED), 256, queued=1) == rooms.Offer()
    registry.reserve("d2", seqs=7)  # what this scheduler placed since counts
    offered = rooms.offer(registry, Policy(mode=Mode.COLOCATED), 9, 0)
    assert [r.worker_id for r in offered.rooms] == ["d1"]


def test_no_rooms_when_latency_bound_or_off_and_auto_keeps_its_local_limit():
    registry = registry_with(beat("d1", "decode", max_num_seqs=8), beat("p1", "prefill"))
    assert rooms.offer(registry, Policy(mode=Mode.AUTO, max_itl_ms=50), 256, 0) == rooms.Offer()
    assert rooms.offer(registry, Policy(mode=Mode.AUTO), 0, 0) == rooms.Offer()
    offered = rooms.offer(registry, Policy(mode=Mode.AUTO, local_prefill_tokens=64), 256, 0)
    assert offered.prompt_tokens == 64 and offered.rooms == [Room("d1", 8, 100 * 16)]
    assert offered.prefill_rooms == []  # auto's short prompts are prefilled where they decode


def elsewhere(worker: WorkerHeartbeat) -> WorkerHeartbeat:
    return dataclasses.replace(worker, host="another")


def test_disaggregated_rooms_name_the_nearest_prefill_workers_with_places_left():
    other = dataclasses.replace(LAYOUT, num_layers=LAYOUT.num_layers + 1)
    registry = registry_with(
        beat("d1", "decode", max_num_seqs=8, zone="z1"),
        beat("d2", "decode", max_num_seqs=4, zone="z1", layout=other),  # no prefill of its layout
        beat("p1", "prefill", max_queue=10, running=2, queued=3, zone="z1", tp=2),
        beat("p2", "prefill", max_queue=10, zone="z1", prefill_tokens_queued=500),  # dearer
        elsewhere(beat("p3", "prefill", max_queue=10, zone="z1")),  # another host: farther
        beat("p4", "prefill", max_queue=4, running=4, zone="z1"),  # its queue is full
        beat("p5", "prefill", zone="z1", prefill_tokens_queued=10**6),  # past max_prefill_wait_s
    )
    policy = Policy(mode=Mode.DISAGGREGATED, max_prefill_wait_s=60)
    offered = rooms.offer(registry, policy, 256, 0)
    assert offered.paired_rooms == [Room("d1", 8, 100 * 16, prefill_workers=["p1", "p2"])]
    assert offered.rooms == []  # a gateway that knows nothing of pairs sees none
    assert offered.prefill_rooms == [Room("p1", 5, 100 * 16, tp=2), Room("p2", 10, 100 * 16)]
    assert offered.prompt_tokens == 256
    farther = registry_with(beat("d1", "decode", max_num_seqs=8), elsewhere(beat("p3", "prefill")))
    named = rooms.offer(farther, policy, 256, 0)  # the nearest there is, when none is near
    assert named.paired_rooms[0].prefill_workers == ["p3"] and named.prefill_rooms[0].seats == 1024
    alone = registry_with(beat("d1", "decode", max_num_seqs=8))  # no prefill worker: the
    assert rooms.offer(alone, policy, 256, 0) == rooms.Offer()  # scheduler's fallback decides


async def test_the_heartbeat_carries_the_rooms_and_none_once_a_request_waits():
    svc, bus = service("colocated", direct_prompt_tokens=128)
    beats = []

    async def heard(b: SchedulerHeartbeat, respond) -> None:
        beats.append(b)

    await bus.subscribe(svc.subjects.scheduler_heartbeat, heard)
    await svc.on_heartbeat(beat("d1", "colocated", max_num_seqs=4), None)  # it takes submissions
    await svc.presence.beat()
    assert beats[-1].rooms == [Room("d1", 4, 100 * 16)] and beats[-1].direct_prompt_tokens == 128
    assert beats[-1].prefill_rooms == []
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


def at(placement: Placement | None) -> str:
    """The decode worker a placement names ("": none, through a scheduler)."""
    return placement.decode if placement is not None else ""


def test_the_gateway_spends_the_roomiest_room_and_only_on_short_first_attempts():
    clock = Clock()
    direct = DirectRooms(True, 1.0, clock)
    assert at(direct.take(task())) == ""  # nothing named yet
    heard(direct, Room("d1", 2, 1000), Room("d2", 1, 1000))
    assert [at(direct.take(task())) for _ in range(4)] == ["d1", "d2", "d1", ""]  # roomiest, spent
    heard(direct, Room("d1", 5, 30))
    assert at(direct.take(task(prompt_len=10, max_tokens=6))) == "d1"  # 16 tokens of 30
    assert at(direct.take(task(prompt_len=10, max_tokens=6))) == ""  # 14 left
    heard(direct, Room("d1", 5, 10_000))
    assert at(direct.take(task(prompt_len=65))) == ""  # past the scheduler's prompt limit
    moved = task()
    moved.moves, moved.avoid_workers = 1, ["d9"]
    assert at(direct.take(moved)) == ""
    assert direct.placed == 4


def test_a_seat_comes_back_when_its_request_ends():
    direct = DirectRooms(True, 1.0, Clock())
    heard(direct, Room("d1", 1, 16))
    first = task(prompt_len=10, max_tokens=6)
    assert at(direct.take(first)) == "d1" and at(direct.take(task())) == ""
    direct.returned(Placement("d1"), first)
    assert at(direct.take(task())) == "d1"
    direct.returned(
        Placement("d9"), first
    )  # a room no beat names any more: nothing to give back to
    assert at(direct.take(task())) == ""


def test_a_waiting_request_a_stale_beat_or_a_turned_away_worker_sends_it_to_the_scheduler():
    clock = Clock()
    direct = DirectRooms(True, 1.0, clock)
    heard(direct, Room("d1", 8, 10_000))
    heard(direct, scheduler="s2", queued=3)  # another replica has a request waiting
    assert at(direct.take(task())) == ""
    heard(direct, scheduler="s2", queued=0, accepting=False)  # it stood aside: holds nothing
    heard(direct, Room("d1", 8, 10_000))
    assert at(direct.take(task())) == "d1"
    direct.turned_away("d1")
    assert at(direct.take(task())) == "" and direct.turned == 1
    heard(direct, Room("d1", 8, 10_000))
    heard(direct, scheduler="s3", stopping=True)  # another replica leaving: s1's rooms stand
    assert at(direct.take(task())) == "d1"
    heard(direct, scheduler="s1", stopping=True)  # the one that named them: none until one does
    assert at(direct.take(task())) == ""
    heard(direct, Room("d1", 8, 10_000))
    clock.now += 1.5  # the rooms are stale
    assert at(direct.take(task())) == ""
    assert DirectRooms(False, 1.0, clock).take(task()) is None  # --direct-placement off


def test_a_disaggregated_room_is_taken_with_the_prefill_worker_with_most_places_left():
    direct = DirectRooms(True, 1.0, Clock())
    prefill_rooms = [Room("p1", 1, 1000, tp=2), Room("p2", 1, 1000), Room("p3", 5, 40)]
    pairs = [
        Room("d1", 8, 10_000, prefill_workers=["p1", "p2"]),
        Room("d2", 2, 10_000, prefill_workers=["p3"]),
    ]
    heard(direct, paired_rooms=pairs, prefill_rooms=prefill_rooms)
    assert direct.take(task()) == Placement("d1", "p1", 2)  # the cheapest pair on a tie
    assert direct.take(task()) == Placement("d1", "p2", 1)  # p1's place is spent
    assert direct.take(task()) == Placement("d2", "p3", 1)  # d1's prefill workers are full
    assert direct.take(task(prompt_len=50)) is None  # p3 holds no 50-token prompt
    direct.returned(Placement("d1", "p1", 2), task())  # its seat and p1's place come back
    assert direct.take(task()) == Placement("d1", "p1", 2)
    direct.turned_away("p3")
    assert direct.take(task()) is None and direct.turned == 1


# -- the relay's direct path --------------------------------------------------------------------


def answer_soon(bus: InMemoryBus, t) -> None:
    """The task's whole answer, two tokens, a moment from now (as a worker streams it)."""
    chunk = TokenChunk(t.attempt_id, 0, [7, 8], finish_reason="length", completion_tokens=2)
    asyncio.get_running_loop().call_later(
        0.02, lambda: asyncio.ensure_future(bus.publish(t.reply_subject, chunk))
    )


D1 = SchedulerHeartbeat("s1", rooms=[Room("d1", 4, 10_000)], direct_prompt_tokens=64)


async def through_a_gateway(
    bus, tokenizer, settings, direct: DirectRooms, count: int, named: SchedulerHeartbeat = D1
) -> list:
    """`count` Generates, one after another, through a gateway whose rooms are those `named`
    (d1's): for each, (its status code, its token ids)."""
    async with (
        StreamRouter(bus, "gw.replies") as streams,
        Liveness(bus, SUBJECTS, settings.worker_timeout_s) as liveness,
        SchedulerPool(bus, SUBJECTS, settings.worker_timeout_s, direct) as pool,
    ):
        await pool.on_heartbeat(named, None)
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
    assert (direct.placed, direct.turned) == (2, 1)


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
    assert (direct.placed, direct.turned) == (1, 1)


async def test_a_disaggregated_request_placed_directly_names_its_prefill_worker(tokenizer):
    """The assignment carries the prefill worker the room named; when that one turns the prompt
    away (full), the request moves through the scheduler and the prefill worker's room goes."""
    bus = InMemoryBus()
    settings = GatewaySettings(submit_timeout_s=5, worker_timeout_s=3.0)
    got, submitted = [], []

    async def decode_worker(assignment: DecodeAssignment, respond) -> None:
        got.append(assignment)
        await respond(TaskAck())
        t, full = assignment.task, worker_full("p1", "prefill worker p1 is full")
        if len(got) == 2:  # its KV never comes: the prefill worker refused the prompt
            chunk = TokenChunk(t.attempt_id, 0, [], failure=full)
            asyncio.get_running_loop().call_later(
                0.02, lambda: asyncio.ensure_future(bus.publish(t.reply_subject, chunk))
            )
        else:
            answer_soon(bus, t)

    async def scheduler(t, respond) -> None:
        submitted.append(t)
        await respond(SubmitReply(prefill_worker="p2", decode_worker="d2"))
        answer_soon(bus, t)

    await bus.subscribe(SUBJECTS.decode_tasks("d1"), decode_worker)
    await bus.subscribe(SUBJECTS.submit, scheduler)
    named = SchedulerHeartbeat(
        "s1",
        paired_rooms=[Room("d1", 4, 10_000, prefill_workers=["p1"])],
        prefill_rooms=[Room("p1", 4, 1000, tp=2)],
        direct_prompt_tokens=64,
    )
    direct = DirectRooms(True, 5.0)
    outcomes = await through_a_gateway(bus, tokenizer, settings, direct, 2, named)
    assert outcomes == [(None, [7, 8]), (None, [7, 8])]
    assert [(a.prefill_worker, a.prefill_tp) for a in got] == [("p1", 2), ("p1", 2)]
    assert len(submitted) == 1 and submitted[0].moves == 1  # the second, moved
    assert direct.take(task()) is None  # p1 is offered no more: d1 has no prefill worker left
    assert (direct.placed, direct.turned) == (2, 1)
