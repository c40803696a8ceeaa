"""A scheduler replica that hears no worker that could serve stands aside (Intake): it leaves the
schedulers' queue group, its heartbeats say so, and what is still sent to it by name is answered
at once "no worker" with Retry.ELSEWHERE; it joins again when a worker is heard."""

import asyncio

import pytest

from services.gateway.settings import GatewaySettings
from services.scheduler import roles
from services.scheduler.registry import WorkerRegistry
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.control.bus import NoResponders
from shared.control.failure import Code, Failure, Retry
from shared.control.messages import (
    DecodeAssignment,
    SchedulerHeartbeat,
    StatusReply,
    StatusRequest,
    SubmitReply,
    TaskAck,
    TokenChunk,
)
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus
from tests.unit.test_scheduler import CLUSTER, Clock, beat, fake_worker, service, task
from tests.unit.test_scheduler_pool import generate_via_pool

SUBJECTS = Subjects(CLUSTER)


def sample(svc, name: str, replica: str = "s1") -> float:
    return svc.metrics.registry.get_sample_value(name, {"role": "scheduler", "worker": replica})


async def beats_of(bus) -> list[SchedulerHeartbeat]:
    heard: list[SchedulerHeartbeat] = []

    async def on_beat(message: SchedulerHeartbeat, respond) -> None:
        heard.append(message)

    await bus.subscribe(SUBJECTS.scheduler_heartbeat, on_beat)
    return heard


async def ask_group(bus) -> SubmitReply:
    return await bus.request(SUBJECTS.submit, task(), 1.0, SubmitReply)


@pytest.mark.parametrize(
    ("mode", "fallback", "workers", "missing"),
    [
        ("disaggregated", "local", [], "no live decode worker"),
        ("disaggregated", "local", ["decode"], ""),  # the decode worker prefills
        ("disaggregated", "wait", ["decode"], "no live prefill worker (prefill_fallback=wait)"),
        ("disaggregated", "fail", ["decode"], "no live prefill worker (prefill_fallback=fail)"),
        ("disaggregated", "fail", ["decode", "prefill"], ""),
        ("disaggregated", "local", ["prefill"], "no live decode worker"),
        ("colocated", "local", ["decode"], "no live colocated worker"),
        ("colocated", "local", ["colocated"], ""),
        ("auto", "local", ["colocated"], ""),
        ("auto", "local", ["prefill"], "no live decode or colocated worker"),
    ],
)
def test_what_a_replica_lacks_to_serve_follows_its_mode_and_prefill_fallback(
    mode, fallback, workers, missing
):
    registry = WorkerRegistry(3.0, Clock())
    for role in workers:
        registry.update(beat(f"{role}-1", role=role))
    assert roles.missing(registry, mode, fallback) == missing


async def test_a_replica_starts_aside_and_joins_the_queue_group_when_it_hears_a_worker():
    svc, bus = service("auto")
    heard = await beats_of(bus)
    await fake_worker(bus, "d1", TaskAck(), [])
    stop = asyncio.Event()
    serving = asyncio.create_task(svc.serve(stop))
    try:
        await asyncio.sleep(0.15)  # a tick: it beat once
        with pytest.raises(NoResponders):  # out of the group: NATS hands it no share
            await ask_group(bus)
        with pytest.raises(NoResponders):  # nor of status requests: it would say "no worker"
            await bus.request(SUBJECTS.status, StatusRequest(), 1.0, StatusReply)
        assert heard and not heard[-1].accepting and sample(svc, "tandem_scheduler_accepting") == 0
        await bus.publish(SUBJECTS.heartbeat, beat("d1"))
        # in the group at once (not at the next tick), and a beat says so at once
        assert heard[-1].accepting and sample(svc, "tandem_scheduler_accepting") == 1
        assert await ask_group(bus) == SubmitReply(decode_worker="d1")
        status = await bus.request(SUBJECTS.status, StatusRequest(limit=8), 1.0, StatusReply)
        assert status.ready and [w.worker_id for w in status.workers] == ["d1"]
    finally:
        stop.set()
        await asyncio.wait_for(serving, 1.0)
    assert heard[-1].stopping and not heard[-1].accepting
    assert sample(svc, "tandem_scheduler_stood_aside_total") == 0  # a start is not standing aside


async def test_a_replica_whose_workers_fall_silent_stands_aside_answers_by_name_and_comes_back(
    caplog,
):
    svc, bus = service("auto", worker_timeout_s=0.3)
    heard = await beats_of(bus)
    await fake_worker(bus, "d1", TaskAck(), [])
    stop = asyncio.Event()
    serving = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0.01)  # it subscribed
    try:
        await bus.publish(SUBJECTS.heartbeat, beat("d1"))
        assert await ask_group(bus) == SubmitReply(decode_worker="d1")
        with caplog.at_level("INFO", logger="services.scheduler.metrics"):
            await asyncio.sleep(0.55)  # d1 silent past the timeout: the tick stands it aside
        assert (
            "s1 stood aside (left the queue group): no live decode or colocated worker"
            in caplog.text
        )
        assert not heard[-1].accepting and sample(svc, "tandem_scheduler_stood_aside_total") == 1
        with pytest.raises(NoResponders):
            await ask_group(bus)
        started = asyncio.get_running_loop().time()
        reply = await bus.request(SUBJECTS.submit_to("s1"), task(), 1.0, SubmitReply)
        # at once: another replica may hear a worker, so the gateway asks it next
        assert asyncio.get_running_loop().time() - started < 0.1
        assert reply == SubmitReply(
            Failure(Code.UNAVAILABLE, "no live decode or colocated worker", Retry.ELSEWHERE)
        )
        await bus.publish(SUBJECTS.heartbeat, beat("d1"))  # heard again
        assert heard[-1].accepting and await ask_group(bus) == SubmitReply(decode_worker="d1")
    finally:
        stop.set()
        await asyncio.wait_for(serving, 1.0)


async def test_a_replica_that_knows_live_workers_refuses_for_good_when_none_may_take_it():
    """Workers it could use are live, but the request avoids them all: another replica would not
    do better, so the answer is final (no hand-back)."""
    svc, bus = service("colocated", worker_timeout_s=0.2)
    await asyncio.sleep(0.25)  # past the start's settling time
    svc.registry.update(beat("c1", role="colocated"))
    moved = task()
    moved.avoid_workers = ["c1"]
    reply = await asyncio.wait_for(_submit(svc, moved), 1.0)
    assert (reply.failure.code, reply.failure.retry) == (Code.UNAVAILABLE, Retry.NEVER)


async def _submit(svc, t) -> SubmitReply:
    answer = asyncio.get_running_loop().create_future()

    async def respond(reply: SubmitReply) -> None:
        answer.set_result(reply)

    await svc.on_submit(t, respond)
    return await answer


class Deafened:
    """The shared bus, as a client whose NATS permissions deny it `denied`: its subscription
    there gets nothing (as NATS's does); all else goes through."""

    def __init__(self, bus: InMemoryBus, denied: str):
        self._bus, self._denied = bus, denied

    def __getattr__(self, name: str):
        return getattr(self._bus, name)

    async def subscribe(self, subject: str, handler, queue: str = ""):
        async def nothing(message, respond) -> None:
            pass

        return await self._bus.subscribe(subject, nothing if subject == self._denied else handler)


async def streaming_worker(bus: InMemoryBus, worker_id: str) -> asyncio.Task:
    """A decode worker that takes every assignment and answers it with two tokens; it beats every
    0.1 s (the task returned)."""

    async def on_task(assignment: DecodeAssignment, respond) -> None:
        await respond(TaskAck())
        task = assignment.task
        done = TokenChunk(task.attempt_id, 0, [7, 8], finish_reason="length", completion_tokens=2)
        await bus.publish(task.reply_subject, done)

    async def beating() -> None:
        while True:
            await bus.publish(SUBJECTS.heartbeat, beat(worker_id))
            await asyncio.sleep(0.1)

    await bus.subscribe(SUBJECTS.decode_tasks(worker_id), on_task)
    return asyncio.create_task(beating())


async def test_with_a_replica_that_hears_no_worker_every_request_is_served(tokenizer):
    """Two real replicas, one denied the workers' heartbeats: before, about half the requests
    went to it and failed UNAVAILABLE."""
    bus, stop, replicas = InMemoryBus(), asyncio.Event(), []
    for name, replica_bus in (("sees", bus), ("deaf", Deafened(bus, SUBJECTS.heartbeat))):
        settings = SchedulerSettings(
            cluster=CLUSTER, mode="auto", scheduler_id=name, worker_timeout_s=0.3
        )
        replicas.append(SchedulerService(settings, replica_bus))
    serving = [asyncio.create_task(r.serve(stop)) for r in replicas]
    beating = await streaming_worker(bus, "d1")
    await asyncio.sleep(0.4)  # the deaf one is past its wait for heartbeats
    try:
        gateway = GatewaySettings(cluster=CLUSTER, submit_timeout_s=30)
        outcomes = await generate_via_pool(bus, tokenizer, gateway, 6)
    finally:
        beating.cancel()
        stop.set()
        await asyncio.gather(*serving)
    assert [context.code for _, context, _ in outcomes] == [None] * 6
    assert all(
        [t for r in responses for t in r.token_ids] == [7, 8] for responses, _, _ in outcomes
    )
    sees, deaf = replicas
    placed = {"role": "scheduler", "worker": "sees", "path": "local"}
    assert sees.metrics.registry.get_sample_value("tandem_scheduler_placements_total", placed) == 6
    assert sample(deaf, "tandem_scheduler_accepting", "deaf") == 0  # it never took a share


async def test_a_replica_missing_one_pool_stands_aside_but_still_answers_status():
    """Disaggregated, no prefill worker, and the fallback fails such requests: it takes no
    submission, but the status it answers is the cluster's (a decode worker, not ready); only a
    replica that hears no worker at all answers no status."""
    svc, bus = service(prefill_fallback="fail")
    stop = asyncio.Event()
    serving = asyncio.create_task(svc.serve(stop))
    await asyncio.sleep(0.01)
    try:
        await bus.publish(SUBJECTS.heartbeat, beat("d1"))
        with pytest.raises(NoResponders):
            await ask_group(bus)
        status = await bus.request(SUBJECTS.status, StatusRequest(limit=8), 1.0, StatusReply)
        assert not status.ready and [w.worker_id for w in status.workers] == ["d1"]
        assert svc.intake.missing() == "no live prefill worker (prefill_fallback=fail)"
    finally:
        stop.set()
        await asyncio.wait_for(serving, 1.0)
