"""ClusterStatus of a large cluster: 1,000 workers with full heartbeats (UCX address, a 1,024-key
prefix summary, a long kernel label) come back whole, a page of slim WorkerStatus at a time.
Before, the scheduler's reply carried every full heartbeat: past about 26 workers it broke the
wire cap, could not be sent, and ClusterStatus (and the gateway's readiness) failed."""

from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.api import tandem_pb2 as pb
from shared.control.messages import KVLayout, WorkerHeartbeat
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, FakeContext

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
