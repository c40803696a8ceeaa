"""`python -m services.<role>`: the start-up every worker shares. Settings from flags and the
environment, read once; the model loaded off the event loop; the bus, the KV data plane (and, for
a worker that fetches KV from peers, their liveness) opened in one exit stack; then the worker
serves until SIGINT or SIGTERM."""

import asyncio
import logging
from contextlib import AsyncExitStack
from dataclasses import replace

from shared.control.worker_roles import Role
from shared.dataplane.plane import DataPlane
from shared.engine.architecture import UnsupportedModel
from shared.lifecycle import stop_on_signals
from shared.model_store import ModelNotFound
from shared.settings import load_settings, setup_interpreter, setup_logging
from shared.telemetry.metrics import MetricsServer
from shared.worker.fleet import run_fleet
from shared.worker.links import BuildWorker, Worker, data_plane, open_links
from shared.worker.mock_runtime import load_mock_runtime
from shared.worker.placement import pin
from shared.worker.runtime import WorkerRuntime, load_runtime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


async def run_worker(
    settings: WorkerSettings, service: str, role: Role, build: BuildWorker, with_liveness: bool
) -> None:
    """Serves one worker of `role` (or, with --mock-workers, a fleet of mock ones) until a
    signal; `service` names its bus permissions."""
    stop = stop_on_signals()
    if settings.mock_workers > 1:
        await run_fleet(settings, service, role, build, with_liveness, stop)
        return
    load = load_mock_runtime if settings.engine == "mock" else load_runtime
    runtime = await asyncio.to_thread(load, settings, role)
    async with AsyncExitStack() as stack:
        plane = data_plane(settings, runtime)
        bus, plane, liveness = await open_links(
            stack, settings, service, role, runtime.worker_id, plane, with_liveness
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
    setup_interpreter(settings)
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
