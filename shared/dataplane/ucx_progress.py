"""EventLoopProgress: drives a UCX worker from the asyncio event loop, woken by its event fd.

UCX's blocking-progress protocol: progress the worker until it has nothing left to do, then
`arm()` it; arming fails while events are pending (progress again), and once armed the worker's
epoll fd becomes readable at the next event. ucxx's own "blocking" mode (ucxx 0.46) arms the
worker once at start and never again after the first event: the fd then stays readable and the
event loop calls its reader back without pause, a whole core spinning for the life of the
process after the first transfer, measured at 100% of the decode worker's core, slowing its
model steps by a third. This class re-arms after every wake-up.

It also tells when requests complete (`done`): ucxx's own `request.wait()` outside its thread
mode polls, yielding to the event loop and coming straight back, so every receive posted for a
prompt that is still being prefilled kept the event loop busy for the whole prefill. Here a
request's completion is checked after each wake-up, when UCX has had something to do.
"""

import asyncio
import logging

from shared.dataplane import ucxx_compat

log = logging.getLogger(__name__)

SAFETY_INTERVAL_S = 1.0  # progress at least this often, in case an event is ever missed
# Progress rounds per wake-up before the event loop gets a turn. UCX can report progress on every
# round for as long as a peer's queue stays full (a keepalive it retries): unbounded, that loop
# held a receiver's event loop for good after a peer's death, in UCX's peer-failure mode on
# shared memory (bench/ucx_crash.py --error-handling; a core stuck in uct_mm_ep_am_bcopy).
MAX_ROUNDS = 1000


class EventLoopProgress:
    def __init__(self, worker, loop: asyncio.AbstractEventLoop):
        self.worker = worker
        self.loop = loop
        self.fd = worker.epoll_file_descriptor  # ucxx.init(progress_mode="blocking") set it up
        self._scheduled: asyncio.Handle | None = None  # the one wake-up queued for the next turn
        self._waiting: list[
            tuple[object, asyncio.Future]
        ] = []  # (request, its future), not done yet
        self.wakeups = 0
        loop.add_reader(self.fd, self.wake)
        self._safety = loop.create_task(self._every_interval())
        self.wake()

    def wake(self) -> None:
        """Progresses what is pending (at most MAX_ROUNDS rounds), then arms; if events came
        meanwhile, or work is left, again on the next turn of the loop: one wake-up queued at
        most, however often the event fd fires meanwhile (one queued per wake-up grew the queue
        every turn, until a turn took seconds: a sender's helper went silent after its peer
        died, `bench/ucx_crash.py --helper --kill receiver`)."""
        self.wakeups += 1
        rounds = 0
        while rounds < MAX_ROUNDS and self.worker.progress_once():
            rounds += 1
        self._check()
        if (rounds == MAX_ROUNDS or not self.worker.arm()) and self._scheduled is None:
            self._scheduled = self.loop.call_soon(self._wake_scheduled)

    def _wake_scheduled(self) -> None:
        self._scheduled = None
        self.wake()

    def done(self, request) -> asyncio.Future:
        """A future that ends as the UCX request does (raising its error, if it failed)."""
        future = self.loop.create_future()
        if not self._settle(request, future):
            self._waiting.append((request, future))
        return future

    def _check(self) -> None:
        if self._waiting:
            self._waiting = [
                (r, f) for r, f in self._waiting if not f.done() and not self._settle(r, f)
            ]

    @staticmethod
    def _settle(request, future: asyncio.Future) -> bool:
        if not request.completed:
            return False
        try:
            request.check_error()
            future.set_result(None)
        except Exception as err:
            future.set_exception(err)
        return True

    async def _every_interval(self) -> None:
        while True:
            await asyncio.sleep(SAFETY_INTERVAL_S)
            self.wake()

    def tasks(self) -> tuple:
        return (self._safety,)

    def stop(self) -> None:
        self._safety.cancel()
        if self._scheduled is not None:
            self._scheduled.cancel()
        self.loop.remove_reader(self.fd)


def install(loop: asyncio.AbstractEventLoop) -> EventLoopProgress:
    """Makes `loop` drive the UCX worker with EventLoopProgress instead of the progress task
    ucxx.init(progress_mode="blocking") started for it (ucxx keeps one per loop)."""
    return ucxx_compat.replace_progress(loop, lambda worker: EventLoopProgress(worker, loop))
