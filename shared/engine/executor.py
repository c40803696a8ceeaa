"""EngineExecutor: the thread the model runs on, beside the event loop."""

import asyncio
import concurrent.futures
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


class EngineExecutor:
    """One thread for the model, so the event loop keeps serving NATS and UCX while it computes."""

    def __init__(self) -> None:
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="engine"
        )

    async def run(self, fn: Callable[..., R], *args) -> R:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
