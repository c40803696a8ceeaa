"""Registry, router and dispatch of the scheduler, over the in-memory bus."""

import asyncio
import dataclasses

import pytest

from services.scheduler.admission import AdmissionQueue
from services.scheduler.registry import WorkerRegistry
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.control.failure import Code, Failure, Retry, failed, worker_failed, worker_full
from shared.control.messages import (
    CancelRequest,
    DecodeAssignment,
    GenerateTask,
    KVLayout,
    SamplingParams,
    StatusReply,
    StatusRequest,
    SubmitReply,
    TaskAck,
    WorkerHeartbeat,
)
from shared.control.subjects import Subjects
from shared.settings import load_settings
from tests.fakes.bus import InMemoryBus

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
CLUSTER = "unit"


def beat(worker_id: str, role: str = "decode", layout: KVLayout = LAYOUT, **kw) -> WorkerHeartbeat:
    values = dict(kv_blocks_total=100, block_size=16, max_model_len=8192)
    values.update(kw)
    return WorkerHeartbeat(
        worker_id=worker_id,
        role=role,
        host="h",
        pid=1,
        ucx_address=worker_id.encode(),
        layout=layout,
        **values,
    )


def task(
    prompt_len: int = 10, max_tokens: int = 6, attempt_id: str = "r1", priority: int = 0
) -> GenerateTask:
    return GenerateTask(
        attempt_id=attempt_id,
        prompt_token_ids=[1] * prompt_len,
        sampling=SamplingParams(max_tokens=max_tokens),
        reply_subject="g",
        arrival_time=0.0,
        priority=priority,
    )


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def registry_with(*beats: WorkerHeartbeat) -> WorkerRegistry:
    registry = WorkerRegistry(timeout_s=3.0, clock=Clock())
    for b in beats:
        registry.update(b)
    return registry


# --- registry ----------------------------------------------------------------------------------


def test_registry_expires_silent_workers():
    clock = Clock()
    registry = WorkerRegistry(timeout_s=3.0, clock=clock)
    registry.update(beat("d1"))
    registry.update(beat("p1", role="prefill"))
    clock.now += 2.0
    registry.update(beat("d1", running=1))  # d1 beats again, p1 stays silent
    clock.now += 1.5
    assert [w.worker_id for w in registry.live()] == ["d1"]
    assert registry.live("decode")[0].running == 1
    clock.now += 3.1
    assert registry.live() == []


def test_silence_the_registry_could_not_hear_is_excused():
    clock = Clock()
    registry = WorkerRegistry(timeout_s=3.0, clock=clock)
    registry.update(beat("d1"))
    clock.now += 10.0  # NATS was down: excused when the scheduler noticed
    registry.excuse()
    clock.now += 2.9
    assert [w.worker_id for w in registry.live()] == ["d1"] and registry.settling()
    assert abs(registry.quiet_s() - 12.9) < 1e-9
    clock.now += 0.2
    assert registry.live() == [] and not registry.settling()


def test_after_a_stall_the_registry_counts_silence_from_the_first_beat_heard():
    clock = Clock()
    registry = WorkerRegistry(timeout_s=3.0, clock=clock)
    registry.update(beat("d1"))
    registry.update(beat("p1", role="prefill"))
    clock.now += 3.5
    registry.excuse(deaf=True)  # the server stalled: the probe failed
    clock.now += 2.9  # then it resumes; p1's beat comes first
    registry.update(beat("p1", role="prefill"))
    clock.now += 0.2
    assert [w.worker_id for w in registry.live()] == ["d1", "p1"]  # d1 gets a timeout again
    clock.now += 2.9
    registry.update(beat("p1", role="prefill"))
    clock.now += 0.2
    assert [w.worker_id for w in registry.live()] == ["p1"]


def test_registry_filters_by_role_and_sorts():
    registry = registry_with(beat("d2"), beat("p1", role="prefill"), beat("d1"))
    assert [w.worker_id for w in registry.live("decode")] == ["d1", "d2"]
    assert [w.worker_id for w in registry.live("prefill")] == ["p1"]


def test_stopping_beat_removes_at_once():
    registry = registry_with(beat("d1"), beat("d2"))
    registry.update(beat("d1", stopping=True))
    assert [w.worker_id for w in registry.live()] == ["d2"]
    registry.drop("d2")
    assert registry.live() == []


def test_reserve_counts_placed_work_until_the_next_heartbeat():
    registry = registry_with(beat("d1", queued=1, kv_blocks_used=10, prefill_tokens_queued=5))
    registry.reserve("d1", seqs=1, blocks=4, prompt_tokens=100)
    registry.reserve("gone", seqs=1)  # a worker dropped meanwhile: nothing to do
    w = registry.live("decode")[0]
    assert (w.queued, w.kv_blocks_used, w.prefill_tokens_queued) == (2, 14, 105)
    registry.update(beat("d1", queued=0))
    assert registry.live("decode")[0].queued == 0


def test_registry_keeps_each_workers_prefix_summary():
    registry = registry_with(beat("d1", prefix_summary=[1, 2, 3]))
    assert (
        registry.summary("d1") == frozenset({1, 2, 3}) and registry.summary("nobody") == frozenset()
    )


# --- admission queue ---------------------------------------------------------------------------


def test_queue_serves_priority_first_then_arrival_order():
    queue = AdmissionQueue(max_pending=10, timeout_s=5, clock=Clock())
    for rid, prio in (("a", 0), ("b", 5), ("c", 0), ("d", 5), ("e", -1)):
        queue.offer(task(attempt_id=rid, priority=prio), None)
    assert [queue.pop().task.attempt_id for _ in range(5)] == ["b", "d", "a", "c", "e"]


def test_queue_is_bounded_and_a_requeued_entry_keeps_its_place():
    queue = AdmissionQueue(max_pending=2, timeout_s=5, clock=Clock())
    first = queue.offer(task(attempt_id="a"), None)
    queue.offer(task(attempt_id="b"), None)
    assert queue.offer(task(attempt_id="c"), None) is None
    assert queue.pop() is first
    queue.requeue(first)
    assert queue.head() is first


def test_a_request_placed_again_goes_first_among_its_priority_and_past_a_full_queue():
    queue = AdmissionQueue(max_pending=2, timeout_s=5, clock=Clock())
    queue.offer(task(attempt_id="a"), None)
    queue.offer(task(attempt_id="b", priority=1), None)
    moved = dataclasses.replace(task(attempt_id="m"), moves=1)
    assert queue.offer(moved, None) is not None  # admitted before: the bound is for new requests
    assert queue.offer(task(attempt_id="c"), None) is None
    assert [queue.pop().task.attempt_id for _ in range(3)] == ["b", "m", "a"]


def test_queue_expires_long_waits_and_hints_when_to_retry():
    clock = Clock()
    queue = AdmissionQueue(max_pending=10, timeout_s=5, clock=clock)
    assert queue.retry_after_ms() == 1000  # nothing placed yet
    for i in range(4):
        queue.offer(task(attempt_id=f"r{i}"), None)
    for _ in range(2):
        clock.now += 1.0
        queue.pop()
        queue.placed()  # two placed, 1 s apart
    clock.now += 3.6
    queue.offer(task(attempt_id="late"), None)
    assert [e.task.attempt_id for e in queue.expired()] == ["r2", "r3"]
    assert len(queue) == 1
    # 2 placed over the last 4.6 s (at least 1 s): (1 waiting + 1) / (2 / 4.6 per second) = 4.6 s
    assert queue.retry_after_ms() == 4600
    clock.now += 20  # nothing placed in the window: no estimate
    assert queue.retry_after_ms() == 1000


# --- dispatch over the bus ---------------------------------------------------------------------


def service(mode: str = "disaggregated", **kw) -> tuple[SchedulerService, InMemoryBus]:
    bus = InMemoryBus()
    settings = SchedulerSettings(
        cluster=CLUSTER, mode=mode, dispatch_timeout_s=0.2, scheduler_id="s1", **kw
    )
    return SchedulerService(settings, bus), bus


async def fake_worker(bus: InMemoryBus, worker_id: str, ack: TaskAck, log: list) -> None:
    async def on_task(assignment: DecodeAssignment, respond) -> None:
        log.append((worker_id, assignment))
        await respond(ack)

    await bus.subscribe(Subjects(CLUSTER).decode_tasks(worker_id), on_task)


async def submit(svc: SchedulerService, t: GenerateTask, timeout: float = 2.0) -> SubmitReply:
    answer = asyncio.get_running_loop().create_future()

    async def respond(reply: SubmitReply) -> None:
        answer.set_result(reply)

    await svc.on_submit(t, respond)
    return await asyncio.wait_for(answer, timeout)


async def test_dispatch_success_returns_the_pair():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(), log)
    svc.registry.update(beat("d1"))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await submit(svc, task(attempt_id="abc"))
    assert reply == SubmitReply(prefill_worker="p1", decode_worker="d1")
    [(worker, assignment)] = log
    assert (
        worker == "d1" and assignment.prefill_worker == "p1" and assignment.task.attempt_id == "abc"
    )
    assert svc.registry.live("decode")[0].queued == 1  # counted until d1's next heartbeat


async def test_dispatch_colocated_has_no_prefill_worker():
    svc, bus = service("colocated")
    log = []
    await fake_worker(bus, "c1", TaskAck(), log)
    svc.registry.update(beat("c1", role="colocated"))
    assert await submit(svc, task()) == SubmitReply(decode_worker="c1")
    assert log[0][1].prefill_worker == ""


@pytest.mark.parametrize("refusal", [worker_full("d1", "no"), worker_failed("d1", "no")])
async def test_a_full_or_draining_worker_makes_it_try_another(refusal):
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(refusal), log)
    await fake_worker(bus, "d2", TaskAck(), log)
    svc.registry.update(beat("d1"))  # least loaded: tried first
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await submit(svc, task())
    assert reply.ok and reply.decode_worker == "d2"
    assert [w for w, _ in log] == ["d1", "d2"]


async def test_a_request_cancelled_while_it_waits_leaves_the_queue_at_once():
    svc, _ = service()
    svc.registry.update(beat("d1", running=8, max_num_seqs=8))  # full: requests wait
    svc.registry.update(beat("p1", role="prefill"))
    answers = []

    async def respond(reply: SubmitReply) -> None:
        answers.append(reply)

    await svc.on_submit(task(attempt_id="a"), respond)
    await svc.on_submit(task(attempt_id="b"), respond)
    assert len(svc.queue) == 2
    await svc.on_cancel(CancelRequest("a", "client went away"), None)
    await asyncio.sleep(0)
    assert len(svc.queue) == 1 and svc.queue.head().task.attempt_id == "b"
    assert [(r.ok, r.failure.code) for r in answers] == [(False, Code.CANCELLED)]
    await svc.on_cancel(CancelRequest("nobody", ""), None)  # not waiting here: nothing happens
    assert len(svc.queue) == 1


async def test_a_worker_that_never_confirms_is_named_so_the_gateway_can_move_the_request():
    svc, bus = service()  # dispatch_timeout_s 0.2

    async def silent(assignment, respond) -> None:  # alive on the bus, but never answers
        pass

    await bus.subscribe(Subjects(CLUSTER).decode_tasks("d1"), silent)
    svc.registry.update(beat("d1"))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await submit(svc, task(attempt_id="x"))
    assert reply == SubmitReply(worker_failed("d1", "decode worker d1 did not answer in time"))
    # it may hold it: drop it
    cancels = [m for s, m in bus.published if s == Subjects(CLUSTER).cancel]
    assert [c.attempt_id for c in cancels] == ["x"]


async def test_a_moved_request_avoids_the_workers_that_failed_it():
    svc, bus = service("auto")
    log = []
    for worker in ("d1", "d2"):
        await fake_worker(bus, worker, TaskAck(), log)
    svc.registry.update(beat("d1"))  # the emptiest, but it failed this request
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    # a long prompt
    assert (await submit(svc, task(600, attempt_id="first"))).prefill_worker == "p1"
    moved = task(600)
    moved.avoid_workers = ["d1", "p1"]  # its decode worker, then its prefill worker, died
    reply = await submit(svc, moved)
    assert (reply.decode_worker, reply.prefill_worker) == (
        "d2",
        "",
    )  # auto: prefilled locally instead
    moved = task(attempt_id="again")
    moved.avoid_workers = ["d1", "d2"]
    reply = await submit(svc, moved)
    assert (reply.ok, reply.failure.code, reply.failure.retry) == (
        False,
        Code.UNAVAILABLE,
        Retry.NEVER,
    )


async def test_workers_that_refuse_as_full_count_as_full_until_they_beat_again():
    svc, bus = service(queue_timeout_s=0.3)
    stop = asyncio.Event()
    server = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0)
    log = []
    for name in ("d1", "d2"):
        await fake_worker(bus, name, TaskAck(worker_full(name, "full")), log)
        svc.registry.update(beat(name))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await submit(svc, task())  # both refuse; it waits for room, then gives up
    assert reply.failure.code is Code.RESOURCE_EXHAUSTED and reply.retry_after_ms > 0
    assert not reply.failure.movable
    assert sorted(w for w, _ in log) == ["d1", "d2"]  # each asked once, not again while full
    stop.set()
    await asyncio.wait_for(server, 1.0)


async def test_shutdown_hands_waiting_requests_back_for_another_scheduler():
    svc, bus = service()
    stop = asyncio.Event()
    server = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0)
    svc.registry.update(beat("d1", running=8, max_num_seqs=8))
    svc.registry.update(beat("p1", role="prefill"))
    waiting = asyncio.ensure_future(submit(svc, task()))
    await asyncio.sleep(0.05)
    stop.set()
    reply = await asyncio.wait_for(waiting, 1.0)
    handed_back = SubmitReply(
        Failure(Code.UNAVAILABLE, "the scheduler is shutting down", Retry.ELSEWHERE)
    )
    assert reply == handed_back
    await asyncio.wait_for(server, 1.0)
    late = await submit(svc, task(attempt_id="late"))
    assert late == handed_back


async def test_other_refusals_are_final():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(failed(Code.INVALID_ARGUMENT, "bad", "d1")), log)
    await fake_worker(bus, "d2", TaskAck(), log)
    svc.registry.update(beat("d1"))
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await submit(svc, task())
    assert reply == SubmitReply(failed(Code.INVALID_ARGUMENT, "bad", "d1"))
    assert len(log) == 1


async def test_silent_worker_is_dropped_and_another_tried():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d2", TaskAck(), log)
    svc.registry.update(beat("d1"))  # announced, but nobody listens on its subject
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await submit(svc, task())
    assert reply.ok and reply.decode_worker == "d2"
    assert [w.worker_id for w in svc.registry.live("decode")] == ["d2"]


async def test_no_workers_is_unavailable_after_a_timeout_of_waiting_for_heartbeats():
    svc, _ = service(worker_timeout_s=0.3)
    stop = asyncio.Event()
    serving = asyncio.create_task(svc.serve(stop))
    try:
        started = asyncio.get_running_loop().time()
        reply = await submit(svc, task())
        waited = asyncio.get_running_loop().time() - started
    finally:
        stop.set()
        await serving
    # this replica hears no worker at all: another may, so the gateway asks it next (ELSEWHERE)
    assert (reply.ok, reply.failure.code, reply.failure.retry, reply.failure.blame) == (
        False,
        Code.UNAVAILABLE,
        Retry.ELSEWHERE,
        "",
    )
    assert waited >= 0.2  # it waited for heartbeats a fresh scheduler had not heard yet


async def test_after_a_reconnect_the_scheduler_asks_for_heartbeats_and_waits_for_them():
    """The registry is empty after an outage: a request waits for the workers' beats instead of
    being refused "no worker" (it was, before)."""
    # the window in which silence is excused (a worker timeout after start or reconnect) is 3 s,
    # not 1: a CI machine busy building images stalled this test past 1 s once
    svc, bus = service(worker_timeout_s=3.0)
    log, asked = [], []
    await fake_worker(bus, "d1", TaskAck(), log)

    async def on_discover(message, respond) -> None:  # the workers answer Discover with a beat
        asked.append(message)
        await asyncio.sleep(0.3)
        await svc.on_heartbeat(beat("d1"), None)
        await svc.on_heartbeat(beat("p1", role="prefill"), None)

    await bus.subscribe(Subjects(CLUSTER).discover, on_discover)
    stop = asyncio.Event()
    serving = asyncio.create_task(svc.serve(stop))
    try:
        await asyncio.sleep(3.2)  # the Discover of its start was answered; the beats go quiet
        svc.registry.drop("d1"), svc.registry.drop("p1")
        bus.reconnects += 1
        await asyncio.sleep(0.05)
        reply = await submit(svc, task())
    finally:
        stop.set()
        await serving
    assert reply.ok and reply.decode_worker == "d1", reply
    assert len(asked) == 2  # at its start, and after the reconnect


async def test_a_request_waits_for_room_and_is_placed_when_a_heartbeat_brings_it():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(), log)
    svc.registry.update(beat("d1", running=8, max_num_seqs=8))  # batch full
    svc.registry.update(beat("p1", role="prefill"))
    pending = asyncio.ensure_future(submit(svc, task()))
    await asyncio.sleep(0.05)
    assert not pending.done() and len(svc.queue) == 1
    await svc.on_heartbeat(beat("d1", running=7, max_num_seqs=8), None)
    assert (await pending).ok and len(svc.queue) == 0


async def test_overload_is_refused_at_once_when_the_queue_is_full_and_after_the_wait_otherwise():
    svc, bus = service(max_pending=1, queue_timeout_s=0.3)
    stop = asyncio.Event()
    server = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0)
    svc.registry.update(beat("d1", running=8, max_num_seqs=8))
    svc.registry.update(beat("p1", role="prefill"))
    waiting = asyncio.ensure_future(submit(svc, task(attempt_id="a")))
    await asyncio.sleep(0.05)
    refused = await submit(svc, task(attempt_id="b"), timeout=0.1)  # at once: the queue is full
    assert (refused.failure.code, refused.retry_after_ms > 0) == (Code.RESOURCE_EXHAUSTED, True)
    late = await asyncio.wait_for(waiting, 1.0)  # after queue_timeout_s
    assert (late.failure.code, "within" in late.failure.message, late.retry_after_ms > 0) == (
        Code.RESOURCE_EXHAUSTED,
        True,
        True,
    )
    stop.set()
    await asyncio.wait_for(server, 1.0)


async def test_higher_priority_is_placed_first_when_room_comes():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(), log)
    svc.registry.update(beat("d1", running=8, max_num_seqs=8))
    svc.registry.update(beat("p1", role="prefill"))
    low = asyncio.ensure_future(submit(svc, task(attempt_id="low")))
    await asyncio.sleep(0.01)
    high = asyncio.ensure_future(submit(svc, task(attempt_id="high", priority=3)))
    await asyncio.sleep(0.01)
    await svc.on_heartbeat(beat("d1", running=7, max_num_seqs=8), None)  # room for one
    assert (await high).ok
    await asyncio.sleep(0.05)
    assert not low.done() and [a.task.attempt_id for _, a in log] == ["high"]
    await svc.on_heartbeat(beat("d1", running=6, max_num_seqs=8), None)
    assert (await low).ok


async def test_serve_answers_submit_and_status_over_the_bus():
    svc, bus = service()
    subjects = Subjects(CLUSTER)
    stop = asyncio.Event()
    server = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0)
    await fake_worker(bus, "d1", TaskAck(), [])
    await bus.publish(subjects.heartbeat, beat("d1"))
    status = await bus.request(subjects.status, StatusRequest(), 1.0, StatusReply)
    assert not status.ready  # no prefill worker yet
    await bus.publish(subjects.heartbeat, beat("p1", role="prefill"))
    status = await bus.request(subjects.status, StatusRequest(limit=10), 1.0, StatusReply)
    assert status.ready and [w.worker_id for w in status.workers] == ["d1", "p1"]
    assert not status.more
    reply = await bus.request(subjects.submit, task(), 1.0, SubmitReply)
    assert reply == SubmitReply(prefill_worker="p1", decode_worker="d1")
    stop.set()
    await asyncio.wait_for(server, 1.0)


async def test_auto_mode_is_ready_with_decode_workers_alone():
    svc, _ = service("auto")
    svc.registry.update(beat("d1"))
    assert svc.ready()


async def test_a_head_that_fits_nowhere_lets_smaller_requests_by_a_bounded_number_of_times(
    monkeypatch,
):
    """Before, the head waited and every request behind it waited too."""
    from services.scheduler import service as scheduler_service

    monkeypatch.setattr(scheduler_service, "MAX_SKIPS", 2)
    svc, bus = service("colocated")
    log = []
    await fake_worker(bus, "c1", TaskAck(), log)
    # 4 blocks of 16 free: a 100-token prompt waits, a 10-token one fits
    svc.registry.update(beat("c1", role="colocated", kv_blocks_total=10, kv_blocks_used=6))
    big = svc.queue.offer(task(100, attempt_id="big"), None)
    for n in range(3):
        svc.queue.offer(task(10, max_tokens=6, attempt_id=f"small{n}"), None)
        svc.pump()
        svc.registry.update(beat("c1", role="colocated", kv_blocks_total=10, kv_blocks_used=6))
    await asyncio.sleep(0.05)
    placed = [a.task.attempt_id for _, a in log]
    assert placed == ["small0", "small1"]  # passed the big one twice: then it holds the head
    assert big.skipped == 2 and svc.queue.head() is big and len(svc.queue) == 2


# --- disaggregated with no live prefill worker: prefill_fallback -------------------------------


def test_prefill_fallback_is_a_setting_local_by_default():
    assert load_settings(SchedulerSettings, [], env={}).policy().prefill_fallback == "local"
    flag = load_settings(SchedulerSettings, ["--prefill-fallback", "wait"], env={})
    env = load_settings(SchedulerSettings, [], env={"TANDEM_PREFILL_FALLBACK": "fail"})
    assert (flag.policy().prefill_fallback, env.policy().prefill_fallback) == ("wait", "fail")
    with pytest.raises(ValueError, match="prefill_fallback"):
        SchedulerSettings(prefill_fallback="later")


async def test_a_local_prefill_fallback_is_placed_counted_and_logged(caplog):
    svc, bus = service(worker_timeout_s=0.2)
    await asyncio.sleep(0.25)  # past the start's settling time
    log = []
    await fake_worker(bus, "d1", TaskAck(), log)
    svc.registry.update(beat("d1"))
    svc.registry.update(beat("p1", role="prefill"))
    moved = task(600, attempt_id="moved")
    moved.avoid_workers = ["p1"]  # the only prefill worker died under it
    with caplog.at_level("WARNING", logger="services.scheduler.metrics"):
        assert await submit(svc, moved) == SubmitReply(decode_worker="d1")
    assert log[0][1].prefill_worker == ""
    fallbacks = svc.metrics.registry.get_sample_value(
        "tandem_scheduler_prefill_fallbacks_total", {"role": "scheduler", "worker": "s1"}
    )
    assert fallbacks == 1 and "no live prefill worker: moved" in caplog.text


async def test_with_prefill_fallback_wait_a_request_is_placed_when_a_prefill_worker_comes():
    svc, bus = service(worker_timeout_s=0.2, prefill_fallback="wait")
    await asyncio.sleep(0.25)
    log = []
    await fake_worker(bus, "d1", TaskAck(), log)
    svc.registry.update(beat("d1"))
    pending = asyncio.ensure_future(submit(svc, task(600)))
    await asyncio.sleep(0.05)
    assert not pending.done() and len(svc.queue) == 1
    await svc.on_heartbeat(beat("d1"), None)
    await svc.on_heartbeat(beat("p1", role="prefill"), None)  # the replacement
    assert await pending == SubmitReply(prefill_worker="p1", decode_worker="d1")
