"""`python -m services.decode`: one decode worker (or, with --colocated, a colocated worker)."""

import asyncio
import sys
from contextlib import AsyncExitStack

from services.decode.settings import DecodeSettings
from services.decode.worker import DecodeWorker
from shared.control.bus import NatsBus
from shared.control.liveness import Liveness
from shared.control.subjects import Subjects
from shared.dataplane.ucx import UcxDataPlane
from shared.lifecycle import stop_on_signals
from shared.settings import load_settings, nats_options, setup_logging
from shared.worker.runtime import load_runtime


async def run(settings: DecodeSettings) -> None:
    stop = stop_on_signals()
    runtime = await asyncio.to_thread(load_runtime, settings, settings.role)
    async with AsyncExitStack() as stack:
        bus = await stack.enter_async_context(
            NatsBus(settings.nats_url, runtime.worker_id, nats_options(settings), role="decode")
        )
        plane = await stack.enter_async_context(
            UcxDataPlane(
                settings.ucx_net_devices,
                settings.ucx_tls,
                settings.ucx_error_handling,
                settings.ucx_progress_mode,
            )
        )
        liveness = await stack.enter_async_context(
            Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s)
        )
        await DecodeWorker(settings, runtime, bus, plane, liveness).serve(stop)


def main(argv=None) -> int:
    settings = load_settings(DecodeSettings, argv, prog="python -m services.decode")
    setup_logging(settings.log_level, settings.role)
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
