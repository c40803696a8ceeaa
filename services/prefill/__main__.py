"""`python -m services.prefill`: one prefill worker."""

import asyncio
import sys
from contextlib import AsyncExitStack

from services.prefill.settings import PrefillSettings
from services.prefill.worker import PrefillWorker
from shared.control.bus import NatsBus
from shared.dataplane.ucx import UcxDataPlane
from shared.lifecycle import stop_on_signals
from shared.settings import load_settings, nats_options, setup_logging
from shared.worker.runtime import load_runtime


async def run(settings: PrefillSettings) -> None:
    stop = stop_on_signals()
    runtime = await asyncio.to_thread(load_runtime, settings, "prefill")
    async with AsyncExitStack() as stack:
        bus = await stack.enter_async_context(
            NatsBus(settings.nats_url, runtime.worker_id, nats_options(settings), role="prefill")
        )
        plane = await stack.enter_async_context(
            UcxDataPlane(
                settings.ucx_net_devices,
                settings.ucx_tls,
                settings.ucx_error_handling,
                settings.ucx_progress_mode,
            )
        )
        await PrefillWorker(settings, runtime, bus, plane).serve(stop)


def main(argv=None) -> int:
    settings = load_settings(PrefillSettings, argv, prog="python -m services.prefill")
    setup_logging(settings.log_level, "prefill")
    asyncio.run(run(settings))
    return 0


if __name__ == "__main__":
    sys.exit(main())
