"""`python -m services.<role>`: the start-up every worker shares. Settings from flags and the
environment, read once; the model loaded off the event loop; the bus, the KV data plane (and, for
a worker that fetches KV from peers, their liveness) opened in one exit stack; then the worker
serves until SIGINT or SIGTERM."""

import asyncio
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import replace
from typing import Protocol

from shared.control.bus import MessageBus, NatsBus
from shared.control.liveness import Liveness
from shared.control.subjects import Subjects
from shared.dataplane.helper_plane import HelperDataPlane
from shared.dataplane.plane import DataPlane
from shared.dataplane.ucx import UcxDataPlane
from shared.engine.architecture import UnsupportedModel
from shared.lifecycle import stop_on_signals
from shared.model_store import ModelNotFound
from shared.settings import load_settings, nats_options, setup_logging
from shared.telemetry.metrics import MetricsServer
from shared.telemetry.tracing import start_tracing
from shared.worker.announcer import Announcer
from shared.worker.placement import pin
from shared.worker.runtime import WorkerRuntime, load_runtime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class Worker(Protocol):
    announcer: Announcer

    async def serve(self, stop: asyncio.Event) -> None: ...


# (settings, runtime, bus, plane, liveness or None) -> the worker
BuildWorker = Callable[
    [WorkerSettings, WorkerRuntime, MessageBus, DataPlane, Liveness | None], Worker
]


async def run_worker(
    settings: WorkerSettings, service: str, role: str, build: BuildWorker, with_liveness: bool
) -> None:
    """Serves one worker of `role` until a signal; `service` names its bus permissions."""
    stop = stop_on_signals()
    runtime = await asyncio.to_thread(load_runtime, settings, role)
    async with AsyncExitStack() as stack:
        tracing = start_tracing(f"tandem-{role}", settings.otlp_endpoint)
        stack.callback(tracing.shutdown)
        bus = await stack.enter_async_context(
            NatsBus(
                settings.nats_url,
                runtime.worker_id,
                nats_options(settings),
                role=service,
                cluster=settings.cluster,
                tracing=tracing.enabled,
            )
        )
        plane = await stack.enter_async_context(data_plane(settings, runtime))
        liveness = None
        if with_liveness:
            liveness = await stack.enter_async_context(
                Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s)
            )
        worker = build(settings, runtime, bus, plane, liveness)
        stack.enter_context(metrics_server(settings, runtime, plane, worker))
        await worker.serve(stop)


def metrics_server(
    settings: WorkerSettings, runtime: WorkerRuntime, plane: DataPlane, worker: Worker
) -> MetricsServer:
    """The worker's Prometheus endpoint (none with --metrics-port -1): its engine steps, KV
    transfers and moves as they happen; its load and counters from its latest heartbeat."""
    metrics = runtime.metrics
    metrics.registry.register(
        metrics.status_collector(
            lambda: worker.announcer.last,
            lambda: runtime.blocks.hits,
            lambda: plane.counters.plane_restarts,
        )
    )
    return MetricsServer(metrics.registry, settings.metrics_host, settings.metrics_port)


def data_plane(settings: WorkerSettings, runtime: WorkerRuntime) -> DataPlane:
    """The KV data plane: in a helper process over the shared pool (--kv-plane helper), or in
    this one (--kv-plane inprocess, and for a pool in GPU memory, which is not shared yet)."""
    options = (
        settings.ucx_net_devices,
        settings.ucx_tls,
        settings.ucx_error_handling,
        settings.ucx_progress_mode,
        settings.ucx_rndv_scheme,
    )
    region = runtime.runner.pool.region
    if region is not None:
        return HelperDataPlane([region], *options)
    if settings.kv_plane == "helper":
        log.warning("KV pool on %s: the data plane runs in this process", runtime.runner.device)
    return UcxDataPlane(*options)


def worker_main(
    settings_class: type[WorkerSettings],
    service: str,
    build: BuildWorker,
    argv=None,
    with_liveness: bool = False,
) -> int:
    """The whole of `python -m services.<service>`; the role is the settings' `role`."""
    settings = load_settings(settings_class, argv, prog=f"python -m services.{service}")
    setup_logging(settings.log_level, settings.role)
    if settings.cpus:  # before any thread pool starts: its threads inherit the cores
        try:
            cores = pin(settings.cpus)
        except OSError as refused:  # cores this process may not use (a container's cpuset)
            log.error("cannot run on cores %s: %s", settings.cpus, refused.strerror)
            return 2
        settings = replace(settings, torch_threads=settings.torch_threads or cores)
    try:
        asyncio.run(run_worker(settings, service, settings.role, build, with_liveness))
    except (UnsupportedModel, ModelNotFound) as refused:  # said plainly, not as a traceback
        log.error("cannot serve this model: %s", refused)
        return 2
    return 0
