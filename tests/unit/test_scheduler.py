"""Registry, router and dispatch of the scheduler, over the in-memory bus."""

import asyncio

import pytest

from services.scheduler.registry import WorkerRegistry
from services.scheduler.router import NoWorker, route
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.messages import (DecodeAssignment, GenerateTask, KVLayout, SamplingParams, StatusReply,
                             StatusRequest, SubmitReply, TaskAck, WorkerHeartbeat)
from shared.subjects import Subjects
from shared.transport.bus import InMemoryBus

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
CLUSTER = "unit"


def beat(worker_id: str, role: str = "decode", layout: KVLayout = LAYOUT, **kw) -> WorkerHeartbeat:
    values = dict(kv_blocks_total=100, block_size=16, max_model_len=8192)
    values.update(kw)
    return WorkerHeartbeat(worker_id=worker_id, role=role, host="h", pid=1, ucx_address=worker_id.encode(),
                           layout=layout, **values)


def task(prompt_len: int = 10, max_tokens: int = 6, request_id: str = "r1") -> GenerateTask:
    return GenerateTask(request_id=request_id, prompt_token_ids=[1] * prompt_len,
                        sampling=SamplingParams(max_tokens=max_tokens), reply_subject="g", arrival_time=0.0)


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
    registry.update(beat("d1", running=1))            # d1 beats again, p1 stays silent
    clock.now += 1.5
    assert [w.worker_id for w in registry.live()] == ["d1"]
    assert registry.live("decode")[0].running == 1
    clock.now += 3.1
    assert registry.live() == []


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


# --- router ------------------------------------------------------------------------------------


def test_route_picks_least_loaded_decode_and_prefill():
    registry = registry_with(beat("d1", running=3), beat("d2", running=1, queued=1), beat("d3", running=2),
                             beat("p1", role="prefill", queued=2), beat("p2", role="prefill", queued=0))
    chosen = route(registry, "disaggregated", task())
    assert (chosen.decode.worker_id, chosen.prefill.worker_id) == ("d2", "p2")


def test_route_breaks_ties_by_free_kv():
    registry = registry_with(beat("d1", kv_blocks_used=50), beat("d2", kv_blocks_used=10), beat("p", role="prefill"))
    assert route(registry, "disaggregated", task()).decode.worker_id == "d2"


def test_route_skips_workers_without_room():
    # prompt 100 + max_tokens 60 = 160 tokens = 10 blocks of 16
    registry = registry_with(beat("d1", kv_blocks_used=91), beat("d2", running=5, kv_blocks_used=90),
                             beat("p", role="prefill"))
    assert route(registry, "disaggregated", task(100, 60)).decode.worker_id == "d2"
    with pytest.raises(NoWorker):
        route(registry, "disaggregated", task(100, 61))


def test_route_skips_workers_with_a_short_context():
    registry = registry_with(beat("d1", max_model_len=100), beat("d2", running=9), beat("p", role="prefill"))
    assert route(registry, "disaggregated", task(90, 20)).decode.worker_id == "d2"


def test_route_honours_exclude():
    registry = registry_with(beat("d1"), beat("d2", running=4), beat("p", role="prefill"))
    assert route(registry, "disaggregated", task(), exclude={"d1"}).decode.worker_id == "d2"
    with pytest.raises(NoWorker):
        route(registry, "disaggregated", task(), exclude={"d1", "d2"})


def test_disaggregated_needs_a_prefill_worker():
    with pytest.raises(NoWorker, match="prefill"):
        route(registry_with(beat("d1")), "disaggregated", task())


def test_disaggregated_ignores_colocated_workers():
    with pytest.raises(NoWorker):
        route(registry_with(beat("c1", role="colocated"), beat("p", role="prefill")), "disaggregated", task())


def test_colocated_mode_routes_to_colocated_worker_without_prefill():
    registry = registry_with(beat("d1"), beat("p1", role="prefill"), beat("c1", role="colocated"))
    chosen = route(registry, "colocated", task())
    assert chosen.decode.worker_id == "c1" and chosen.decode.role == "colocated"
    assert chosen.prefill is None


def test_prefill_with_another_layout_is_excluded():
    other = KVLayout(model="other", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
    registry = registry_with(beat("d1"), beat("p1", role="prefill", layout=other),
                             beat("p2", role="prefill", queued=5))
    assert route(registry, "disaggregated", task()).prefill.worker_id == "p2"
    registry.drop("p2")
    with pytest.raises(NoWorker, match="layout"):
        route(registry, "disaggregated", task())


# --- dispatch over the bus ---------------------------------------------------------------------


def service(mode: str = "disaggregated") -> tuple[SchedulerService, InMemoryBus]:
    bus = InMemoryBus()
    settings = SchedulerSettings(cluster=CLUSTER, mode=mode, dispatch_timeout_s=0.2, scheduler_id="s1")
    return SchedulerService(settings, bus), bus


async def fake_worker(bus: InMemoryBus, worker_id: str, ack: TaskAck, log: list) -> None:
    async def on_task(assignment: DecodeAssignment, respond) -> None:
        log.append((worker_id, assignment))
        await respond(ack)

    await bus.subscribe(Subjects(CLUSTER).worker_tasks(worker_id), on_task)


async def test_dispatch_success_returns_the_pair():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(ok=True), log)
    svc.registry.update(beat("d1"))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await svc.dispatch(task(request_id="abc"))
    assert reply == SubmitReply(ok=True, prefill_worker="p1", decode_worker="d1")
    [(worker, assignment)] = log
    assert worker == "d1" and assignment.prefill_worker == "p1" and assignment.task.request_id == "abc"


async def test_dispatch_colocated_has_no_prefill_worker():
    svc, bus = service("colocated")
    log = []
    await fake_worker(bus, "c1", TaskAck(ok=True), log)
    svc.registry.update(beat("c1", role="colocated"))
    assert await svc.dispatch(task()) == SubmitReply(ok=True, decode_worker="c1")
    assert log[0][1].prefill_worker == ""


async def test_exhausted_worker_makes_it_try_another():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(ok=False, code="RESOURCE_EXHAUSTED", message="full"), log)
    await fake_worker(bus, "d2", TaskAck(ok=True), log)
    svc.registry.update(beat("d1"))                  # least loaded: tried first
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await svc.dispatch(task())
    assert reply.ok and reply.decode_worker == "d2"
    assert [w for w, _ in log] == ["d1", "d2"]


async def test_all_exhausted_reports_resource_exhausted():
    svc, bus = service()
    log = []
    for name in ("d1", "d2"):
        await fake_worker(bus, name, TaskAck(ok=False, code="RESOURCE_EXHAUSTED", message="full"), log)
        svc.registry.update(beat(name))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await svc.dispatch(task())
    assert (reply.ok, reply.code) == (False, "RESOURCE_EXHAUSTED")
    assert len(log) == 2


async def test_other_refusals_are_final():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d1", TaskAck(ok=False, code="INVALID_ARGUMENT", message="bad"), log)
    await fake_worker(bus, "d2", TaskAck(ok=True), log)
    svc.registry.update(beat("d1"))
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await svc.dispatch(task())
    assert (reply.ok, reply.code, reply.message) == (False, "INVALID_ARGUMENT", "bad")
    assert len(log) == 1


async def test_silent_worker_is_dropped_and_another_tried():
    svc, bus = service()
    log = []
    await fake_worker(bus, "d2", TaskAck(ok=True), log)
    svc.registry.update(beat("d1"))                  # announced, but nobody listens on its subject
    svc.registry.update(beat("d2", running=3))
    svc.registry.update(beat("p1", role="prefill"))
    reply = await svc.dispatch(task())
    assert reply.ok and reply.decode_worker == "d2"
    assert [w.worker_id for w in svc.registry.live("decode")] == ["d2"]


async def test_no_workers_is_unavailable():
    svc, _ = service()
    reply = await svc.dispatch(task())
    assert (reply.ok, reply.code) == (False, "UNAVAILABLE")


async def test_serve_answers_submit_and_status_over_the_bus():
    svc, bus = service()
    subjects = Subjects(CLUSTER)
    stop = asyncio.Event()
    server = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0)
    await fake_worker(bus, "d1", TaskAck(ok=True), [])
    await bus.publish(subjects.heartbeat, beat("d1"))
    status = await bus.request(subjects.status, StatusRequest(), 1.0, StatusReply)
    assert not status.ready                          # no prefill worker yet
    await bus.publish(subjects.heartbeat, beat("p1", role="prefill"))
    status = await bus.request(subjects.status, StatusRequest(), 1.0, StatusReply)
    assert status.ready and [w.worker_id for w in status.workers] == ["d1", "p1"]
    reply = await bus.request(subjects.submit, task(), 1.0, SubmitReply)
    assert reply == SubmitReply(ok=True, prefill_worker="p1", decode_worker="d1")
    stop.set()
    await asyncio.wait_for(server, 1.0)
