"""A fleet of mock workers in one process (`--engine mock --mock-workers N`), for measuring the
control plane with a thousand workers on one machine.

Each worker is a whole worker of its service, as `build` makes it: its own id, engine, block
manager, subscriptions, heartbeats, admission and streams, so a scheduler sees exactly what N
processes would send. What they share is what a process has once: the real model's tokenizer
and config, the NATS connection, the UCX data plane (each transfer has its own tags) and the
view of peers' liveness. Their heartbeats' KV byte counters are therefore the process's.
"""

import asyncio
import logging
import uuid
from contextlib import AsyncExitStack
from dataclasses import replace

from shared.control.worker_roles import Role
from shared.worker.links import BuildWorker, data_plane, open_links
from shared.worker.mock_runtime import MockModel, mock_runtime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


def fleet_ids(settings: WorkerSettings, role: Role) -> list[str]:
    """The workers' ids: <base>-0000, <base>-0001, ... (base: --worker-id or role-<random>)."""
    base = settings.worker_id or f"{role}-{uuid.uuid4().hex[:8]}"
    width = max(4, len(str(settings.mock_workers - 1)))
    return [f"{base}-{i:0{width}d}" for i in range(settings.mock_workers)]


async def run_fleet(
    settings: WorkerSettings,
    service: str,
    role: Role,
    build: BuildWorker,
    with_liveness: bool,
    stop: asyncio.Event,
) -> None:
    settings = replace(settings, kv_plane="inprocess")  # one plane for every pool here
    model = await asyncio.to_thread(MockModel.load, settings)
    ids = fleet_ids(settings, role)
    runtimes = [
        mock_runtime(replace(settings, worker_id=worker_id), role, model, quiet=True)
        for worker_id in ids
    ]
    async with AsyncExitStack() as stack:
        name = f"{ids[0]}..{ids[-1].rsplit('-', 1)[1]}"
        bus, plane, liveness = await open_links(
            stack, settings, service, role, name, data_plane(settings, None), with_liveness
        )
        workers = [
            build(replace(settings, worker_id=rt.worker_id), rt, bus, plane, liveness)
            for rt in runtimes
        ]
        log.info(
            "%s: a fleet of %d mock %s workers (%s)", name, len(workers), role, rt_line(runtimes)
        )
        await asyncio.gather(*(worker.serve(stop) for worker in workers))


def rt_line(runtimes) -> str:
    return runtimes[0].kernels if runtimes else ""
