"""A worker's life from its first subscription to its last: the same order for every role.

serve: subscribe -> announce (heartbeats start) -> run until stopped -> stop accepting work and
announce it (the scheduler drops the worker at once) -> drain for `drain_timeout_s` -> abort what
is left (its owners hear why) -> on every path: cancel the worker's own tasks, unsubscribe, wait
for what may still settle (each bounded by a lease), close the engine thread."""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from shared.control.bus import MessageBus
from shared.engine.step_runner import RunnerLost
from shared.job_thread import JobThread
from shared.worker.announcer import Announcer

log = logging.getLogger(__name__)
Handler = Callable[..., Awaitable[None]]


async def _nothing() -> None:
    return None


@dataclass
class WorkerLifecycle:
    bus: MessageBus
    announcer: Announcer
    executor: JobThread
    drain_timeout_s: float
    subscriptions: list[tuple[str, Handler]]  # subject -> handler
    run: Callable[[asyncio.Event], Awaitable[None]]  # steps until the event is set
    stop_accepting: Callable[[], None]  # new work is refused from now on
    drain: Callable[[float], Awaitable[None]]  # finishes what is held, for up to that long
    abort_rest: Callable[[], Awaitable[None]]  # ends what the drain did not
    cancel_tasks: Callable[[], None] = field(default=lambda: None)
    settle_tasks: Callable[[], Awaitable[None]] = field(default=_nothing)

    async def serve(self, stop: asyncio.Event) -> None:
        subs = [
            await self.bus.subscribe(subject, handler) for subject, handler in self.subscriptions
        ]
        try:
            async with self.announcer as announcer:
                try:
                    await self.run(stop)
                    self.stop_accepting()  # no new work; the scheduler drops this worker now
                    await announcer.announce()
                    await self.drain(self.drain_timeout_s)
                except RunnerLost as lost:  # nothing more can be computed here
                    log.error("%s: this worker's requests are placed elsewhere", lost)
                    self.stop_accepting()
                    await announcer.announce()
                    await self.abort_rest()
                    raise
                await self.abort_rest()
        finally:
            self.cancel_tasks()
            for sub in subs:
                await sub.unsubscribe()
            await self.settle_tasks()
            self.executor.close()
