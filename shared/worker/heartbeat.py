"""What a model worker tells the cluster about itself: one heartbeat builder for every role, and
the leak count every heartbeat carries. Each worker passes only what differs between roles (its
load, what it has served, which transports its KV took, which block tables are live)."""

import os
from collections.abc import Callable

from shared.control.bus import MessageBus
from shared.control.messages import WorkerHeartbeat
from shared.control.worker_roles import Role
from shared.dataplane.plane import DataPlane
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings


def heartbeat(
    runtime: WorkerRuntime,
    settings: WorkerSettings,
    plane: DataPlane,
    bus: MessageBus,
    *,
    role: Role,
    running: int,
    queued: int,
    served: int,
    leaked: int,
    transport: str,
    stopping: bool,
    quarantined: int = 0,
) -> WorkerHeartbeat:
    """The heartbeat of a worker: identity, layout and load from the runtime, KV counters from
    the data plane, dropped messages from the bus; the rest as the worker says."""
    return WorkerHeartbeat(
        worker_id=runtime.worker_id,
        role=role,
        host=runtime.host,
        pid=os.getpid(),
        ucx_address=plane.address,
        layout=runtime.layout,
        max_model_len=runtime.max_model_len,
        running=running,
        queued=queued,
        requests_served=served,
        **runtime.load_report(),
        messages_dropped=bus.dropped,
        kv_bytes_sent=plane.counters.bytes_sent,
        kv_bytes_received=plane.counters.bytes_received,
        kv_transfers_failed=plane.counters.transfers_failed,
        kv_blocks_leaked=leaked,
        kv_blocks_quarantined=quarantined,
        kv_transport=transport,
        zone=settings.zone,
        stopping=stopping,
    )


def leaked_blocks(runtime: WorkerRuntime, held_tables: Callable[[], list[list[int]]]) -> int:
    """Blocks that no live block table accounts for. `held_tables` is read under the engine lock,
    so the tables and the block counts are of one moment."""
    with runtime.engine.lock:
        return runtime.blocks.leaked(held_tables())
