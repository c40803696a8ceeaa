"""`python -m services.scheduler`: the scheduler."""

import asyncio
import sys

from services.scheduler.service import SchedulerService
from services.scheduler.settings import SchedulerSettings
from shared.control.bus import BusTiming, NatsBus
from shared.lifecycle import stop_on_signals
from shared.settings import (
    load_settings,
    nats_options,
    setup_interpreter,
    setup_logging,
    started,
)
from shared.telemetry.metrics import MetricsServer
from shared.telemetry.tracing import start_tracing


async def run(settings: SchedulerSettings) -> None:
    stop = stop_on_signals()
    tracing = start_tracing("tandem-scheduler", settings.otlp_endpoint)
    try:
        # the connection is named by the replica's id: NATS's monitoring tells which is where
        async with NatsBus(
            settings.nats_url,
            settings.scheduler_id,
            nats_options(settings),
            role="scheduler",
            cluster=settings.cluster,
            tracing=tracing.enabled,
            timing=BusTiming(
                settings.nats_connect_timeout_s,
                settings.nats_ping_interval_s,
                settings.nats_reconnect_wait_s,
                settings.nats_drain_timeout_s,
            ),
        ) as bus:
            service = SchedulerService(settings, bus)
            registry = service.metrics.registry
            with MetricsServer(registry, settings.metrics_host, settings.metrics_port):
                started()
                await service.serve(stop)
    finally:
        tracing.shutdown()


def main(argv=None) -> int:
    settings = load_settings(SchedulerSettings, argv, prog="python -m services.scheduler")
    setup_logging(settings.log_level, "scheduler")
    setup_interpreter(settings)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
