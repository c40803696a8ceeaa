"""What a worker process opens before its workers serve, in one exit stack: tracing, the NATS
bus, the KV data plane and (for a worker that fetches KV from peers) their liveness; and the
types a service's worker is built from."""

import asyncio
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import Protocol

from shared.control.bus import BusTiming, MessageBus, NatsBus
from shared.control.liveness import Liveness
from shared.control.subjects import Subjects
from shared.control.worker_roles import Role
from shared.dataplane.helper_plane import HelperDataPlane
from shared.dataplane.plane import DataPlane
from shared.dataplane.ucx import UcxDataPlane
from shared.settings import nats_options
from shared.telemetry.tracing import start_tracing
from shared.worker.announcer import Announcer
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Worker(Protocol):
    announcer: Announcer

    async def serve(self, stop: asyncio.Event) -> None: ...


# (settings, runtime, bus, plane, liveness or None) -> the worker
BuildWorker = Callable[
    [WorkerSettings, WorkerRuntime, MessageBus, DataPlane, Liveness | None], Worker
]


async def open_links(
    stack: AsyncExitStack,
    settings: WorkerSettings,
    service: str,
    role: Role,
    name: str,
    plane: DataPlane,
    with_liveness: bool,
) -> tuple[MessageBus, DataPlane, Liveness | None]:
    """The bus (its connection named `name`), `plane` opened, and peers' liveness if asked."""
    tracing = start_tracing(f"tandem-{role}", settings.otlp_endpoint)
    stack.callback(tracing.shutdown)
    bus = await stack.enter_async_context(
        NatsBus(
            settings.nats_url,
            name,
            nats_options(settings),
            role=service,
            cluster=settings.cluster,
            tracing=tracing.enabled,
            timing=BusTiming(
                settings.nats_connect_timeout_s,
                settings.nats_ping_interval_s,
                settings.nats_reconnect_wait_s,
                settings.nats_drain_timeout_s,
            ),
        )
    )
    plane = await stack.enter_async_context(plane)
    liveness = None
    if with_liveness:
        liveness = await stack.enter_async_context(
            Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s)
        )
    return bus, plane, liveness


def data_plane(settings: WorkerSettings, runtime: WorkerRuntime | None) -> DataPlane:
    """The KV data plane: in a helper process over the shared pool (--kv-plane helper), or in
    this one (--kv-plane inprocess, a pool in GPU memory, which is not shared yet, and a fleet
    of mock workers: `runtime` None)."""
    options = (
        settings.ucx_net_devices,
        settings.ucx_tls,
        settings.ucx_error_handling,
        settings.ucx_progress_mode,
        settings.ucx_rndv_scheme,
    )
    regions = [pool.region for pool in runtime.pools] if runtime is not None else [None]
    if regions[0] is not None:  # every rank's pool: the helper moves each rank's KV in place
        return HelperDataPlane(regions, *options, settings.helper_timing())
    if settings.kv_plane == "helper" and runtime is not None:
        log.warning("KV pool on %s: the data plane runs in this process", runtime.runner.device)
    return UcxDataPlane(*options)
