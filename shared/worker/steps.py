"""The step-and-drain loop every worker runs around its engine: step while there is work, sleep
until woken when there is none; on shutdown, keep stepping what is held for a bounded time.

`iterate` does one step and returns False when nothing could run; message handlers only record
events and set `wakeup`. The event is cleared before each step, never after: a handler that runs
while the step awaits (a cancel that takes the last sequence out of the engine, leaving only its
request to reap) wakes the next step instead of being lost."""

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from shared.lifecycle import wait_or_stop

Iterate = Callable[[], Awaitable[bool]]


async def step_until_stopped(iterate: Iterate, wakeup: asyncio.Event, stop: asyncio.Event) -> None:
    """Steps until `stop` is set."""
    while not stop.is_set():
        wakeup.clear()  # before the step: news during it (a cancel while it awaits) is kept
        if not await iterate():
            await wait_or_stop(wakeup.wait(), stop)


async def drain(
    iterate: Iterate,
    wakeup: asyncio.Event,
    busy: Callable[[], bool],
    timeout_s: float,
    poll_s: float | None = None,
) -> None:
    """Steps while `busy()` holds, for up to `timeout_s`. When idle it waits to be woken, or
    `poll_s` at most (for events no message announces, like a lease running out)."""
    deadline = time.monotonic() + timeout_s
    while busy() and time.monotonic() < deadline:
        wakeup.clear()  # before the step, as in step_until_stopped
        if not await iterate() and busy():  # the step may just have ended the last one
            wait_s = poll_s or max(0.01, deadline - time.monotonic())
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(wakeup.wait(), wait_s)
