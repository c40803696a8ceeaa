"""JobThread: one thread beside the event loop that runs jobs in order (a worker's model steps,
a gateway's tokenization), so the loop keeps serving while they compute.

The thread takes jobs from a queue and settles each job's asyncio future on its loop
(call_soon_threadsafe): a job costs one queue put and one wakeup of the loop, without the
concurrent Future, its Condition and the chaining of two futures that run_in_executor adds.
(For the engine's steps the difference was within the zero-time bench's noise; for the gateway's
tokenization, one job per request, run_in_executor had cost ~150 us of the gateway's ~1.7 ms
per 8-token request: docs/benchmarks.md, the control plane.)
"""

import asyncio
import queue
import threading
from collections.abc import Callable
from typing import TypeVar

R = TypeVar("R")


class JobThread:
    """Jobs run one at a time, in the order given: a job given while another runs runs after it
    (a worker's: between steps). `name`: the thread's (in py-spy's and the kernel's views)."""

    def __init__(self, name: str = "engine") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()  # the thread is started once, by the first job
        self._closed = False

    async def run(self, fn: Callable[..., R], *args) -> R:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.submit(loop, future, fn, *args)
        return await future

    def submit(self, loop: asyncio.AbstractEventLoop, future: asyncio.Future, fn, *args) -> None:
        """Runs fn(*args) in the thread; its result or exception settles `future`."""
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._name} thread is closed")
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
                self._thread.start()
            self._jobs.put((loop, future, fn, args))

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                result, error = fn(*args), None
            except BaseException as err:  # noqa: BLE001 (handed to the awaiting coroutine)
                result, error = None, err
            _settle_from_thread(loop, future, result, error)
            del job, future, result, error  # nothing of a finished job is kept alive here

    def close(self) -> None:
        """Waits for the job running to end; jobs not started are cancelled."""
        with self._lock:
            self._closed = True
            thread = self._thread
        pending = []
        while True:
            try:
                pending.append(self._jobs.get_nowait())
            except queue.Empty:
                break
        for job in pending:
            if job is not None:
                loop, future, _, _ = job
                _settle_from_thread(loop, future, None, asyncio.CancelledError())
        if thread is not None:
            self._jobs.put(None)
            thread.join()


def _settle_from_thread(loop, future: asyncio.Future, result, error) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, result, error)
    except RuntimeError:  # the loop is closed: nobody awaits the future any more
        pass


def _settle(future: asyncio.Future, result, error) -> None:
    if future.cancelled():
        return
    if isinstance(error, asyncio.CancelledError):
        future.cancel()
    elif error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
