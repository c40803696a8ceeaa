"""ClusterStatus of a large cluster: 1,000 workers with full heartbeats (UCX address, a 1,024-key
prefix summary, a long kernel label) come back whole, a page of slim WorkerStatus at a time.
Before, the scheduler's reply carried every full heartbeat: past about 26 workers it broke the
wire cap, could not be sent, and ClusterStatus (and the gateway's readiness) failed."""

import time

import grpc
import pytest

from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.api import tandem_pb2 as pb
from shared.control.messages import KVLayout, WorkerHeartbeat
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, Aborted, FakeContext

LAYOUT = KVLayout(model="m", dtype="float32", num_layers=30, num_kv_heads=3, head_dim=64)


def full_beat(i: int) -> WorkerHeartbeat:
    return WorkerHeartbeat(
        worker_id=f"worker-{i:04d}",
        role="decode" if i % 2 else "prefill",
        host=f"host-{i // 8}.rack-{i // 64}.example.internal",
        pid=1000 + i,
        ucx_address=bytes(range(256)) * 2,
        layout=LAYOUT,
        max_model_len=8192,
        kv_blocks_total=4096,
        kv_blocks_used=i,
        kv_blocks_quarantined=i % 3,
        prefix_granularity=128,
        prefix_summary=[(i << 20) + k for k in range(1024)],
        kernels="k" * 256,
        zone=f"zone-{i % 4}",
    )


async def test_a_status_of_1000_workers_comes_back_whole():
    bus, cluster = InMemoryBus(), "default"
    scheduler = SchedulerService(SchedulerSettings(cluster=cluster, scheduler_id="s1"), bus)
    for i in range(1000):
        scheduler.registry.update(full_beat(i))
    await bus.subscribe(Subjects(cluster).status, scheduler.on_status, queue="schedulers")
    asked, request = [], bus.request

    async def counted(subject, message, *rest):
        asked.append(message)
        return await request(subject, message, *rest)

    bus.request = counted
    servicer = TandemServicer(GatewaySettings(), bus, None, None, LIMITS, None)
    context = FakeContext()
    status = await servicer.ClusterStatus(pb.ClusterStatusRequest(), context)
    assert context.code is None
    assert [w.id for w in status.workers] == [f"worker-{i:04d}" for i in range(1000)]
    assert [w.kv_blocks_used for w in status.workers] == list(range(1000))
    assert sum(w.kv_blocks_quarantined for w in status.workers) == sum(i % 3 for i in range(1000))
    assert status.workers[7].host == "host-0.rack-0.example.internal"
    assert status.workers[7].kernels == "k" * 256
    assert len(asked) == 8  # pages of 128
    assert asked[1].after == "worker-0127" and all(a.limit == 128 for a in asked)


class DeadlineContext(FakeContext):
    def __init__(self, seconds: float):
        super().__init__()
        self._deadline = time.monotonic() + seconds

    def time_remaining(self) -> float:
        return self._deadline - time.monotonic()


async def test_a_cut_off_scheduler_costs_an_ask_within_the_calls_deadline():
    """A replica that swallows status requests (cut off, its subscription not yet given up) is
    asked past: another answers, each ask waiting a share of the call's deadline; with none to
    answer, UNAVAILABLE comes before the deadline, not after it."""
    bus, cluster = InMemoryBus(), "default"
    live = SchedulerService(SchedulerSettings(cluster=cluster, scheduler_id="s1"), bus)
    live.registry.update(full_beat(1))

    async def cut_off(message, respond) -> None:
        pass

    subject = Subjects(cluster).status
    await bus.subscribe(subject, cut_off, queue="schedulers")  # asked first, in turn
    await bus.subscribe(subject, live.on_status, queue="schedulers")
    servicer = TandemServicer(GatewaySettings(), bus, None, None, LIMITS, None)
    started = time.monotonic()
    status = await servicer.ClusterStatus(pb.ClusterStatusRequest(), DeadlineContext(0.9))
    assert [w.id for w in status.workers] == ["worker-0001"]
    assert time.monotonic() - started < 0.9

    alone = InMemoryBus()
    await alone.subscribe(subject, cut_off, queue="schedulers")
    servicer = TandemServicer(GatewaySettings(), alone, None, None, LIMITS, None)
    context, started = DeadlineContext(0.9), time.monotonic()
    with pytest.raises(Aborted):
        await servicer.ClusterStatus(pb.ClusterStatusRequest(), context)
    assert context.code == grpc.StatusCode.UNAVAILABLE and time.monotonic() - started < 0.9


async def test_with_no_scheduler_in_the_queue_group_the_status_says_why_none_answered():
    """None runs, or every replica stood aside (it hears no worker): nobody answers at all."""
    servicer = TandemServicer(GatewaySettings(), InMemoryBus(), None, None, LIMITS, None)
    context = FakeContext()
    with pytest.raises(Aborted):
        await servicer.ClusterStatus(pb.ClusterStatusRequest(), context)
    assert context.code == grpc.StatusCode.UNAVAILABLE
    assert context.message == "no scheduler answered: none is running, or none hears a worker"
