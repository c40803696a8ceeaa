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
from shared.engine.step_runner import RunnerLost
from shared.lifecycle import stop_on_signals
from shared.model_store import ModelNotFound
from shared.settings import load_settings, setup_interpreter, setup_logging, started
from shared.telemetry.metrics import MetricsServer
from shared.worker.fleet import run_fleet
from shared.worker.links import BuildWorker, Worker, data_plane, open_links
from shared.worker.mock_runtime import load_mock_runtime
from shared.worker.placement import format_cpus, parse_cpus, pin
from shared.worker.runtime import WorkerRuntime, load_runtime
from shared.worker.settings import WorkerSettings
from shared.worker.tp_group import GroupFailed, TPError, rank_cores

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
    try:
        if runtime.group is not None:  # a rank gone: the worker stops, its requests move
            loop = asyncio.get_running_loop()
            runtime.group.on_failure(lambda: loop.call_soon_threadsafe(stop.set))
        async with AsyncExitStack() as stack:
            plane = data_plane(settings, runtime)
            bus, plane, liveness = await open_links(
                stack, settings, service, role, runtime.worker_id, plane, with_liveness
            )
            worker = build(settings, runtime, bus, plane, liveness)
            stack.enter_context(metrics_server(settings, runtime, plane, worker))
            started()
            await worker.serve(stop)
        if runtime.group is not None and runtime.group.failed.is_set():
            raise GroupFailed(runtime.group.failure)
    finally:
        await asyncio.to_thread(runtime.close)


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
        # a tensor-parallel worker's own process is its rank 0: the first share of its cores
        cpus = format_cpus(rank_cores(parse_cpus(settings.cpus), settings.tp)[0])
        try:
            cores = pin(cpus)
        except OSError as refused:  # cores this process may not use (a container's cpuset)
            log.error("cannot run on cores %s: %s", settings.cpus, refused.strerror)
            return 2
        settings = replace(settings, torch_threads=settings.torch_threads or cores)
    try:
        asyncio.run(run_worker(settings, service, settings.role, build, with_liveness))
    except (
        UnsupportedModel,
        ModelNotFound,
        TPError,
    ) as refused:  # said plainly, not as a traceback
        log.error("cannot serve this model: %s", refused)
        return 2
    except RunnerLost as lost:  # its requests were handed on; a supervisor starts a new worker
        log.error("this worker stops: %s", lost)
        return 3
    return 0
