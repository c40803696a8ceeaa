"""Stepper: the engine's steps run one after another in the engine thread, each step's outputs
handed to the event loop as it ends, without the loop starting each step.

A run (one job on the engine thread) steps while there is work and fewer than `ahead` steps'
outputs wait for the loop; then it waits for the loop to take them (a Condition: the thread
sleeps without the GIL). The loop takes every step waiting at once: when it fell behind (a
burst of new requests, NATS slow), a stream's tokens of several steps go out as one chunk, and
none waits for a step of its own to be published. A run ends when a step finds nothing to run
(STARVED: the loop starts the next once something changed since that step scheduled,
Engine.changes), when a step fails (its error is handed over as its outputs are), or when the
loop pauses it (PAUSED).

One hand-off a step: the thread wakes the loop when the first waiting step comes in; the loop
wakes the thread only when it was waiting for room.
"""

import asyncio
import enum
import threading
from collections.abc import Callable

from shared.engine.engine import Engine, Outputs
from shared.job_thread import JobThread


class RunEnd(enum.Enum):
    STARVED = "starved"  # a step found nothing it could run
    FAILED = "failed"  # a step raised (the error is in the outbox, after the steps before it)
    PAUSED = "paused"  # the loop asked it to stop (pause)


class Stepper:
    def __init__(self, engine: Engine, executor: JobThread, ahead: int):
        if ahead < 1:
            raise ValueError("ahead must be at least 1")
        self.engine = engine
        self.executor = executor
        self.ahead = ahead
        # called on the loop when a step's outputs wait or a run ended (its owner's to set)
        self.wake: Callable[[], None] = _nothing
        self._cond = threading.Condition()
        self._outbox: list[Outputs | BaseException] = []  # taken by the loop, oldest first
        self._paused = False
        self.run: asyncio.Future | None = None  # the run in the engine thread, if any

    def start(self) -> None:
        """A run starts (the loop's: none runs now)."""
        loop = asyncio.get_running_loop()
        with self._cond:
            self._paused = False
        self.run = loop.create_future()
        self.run.add_done_callback(lambda _: self.wake())
        self.executor.submit(loop, self.run, self._steps, loop)

    def ended(self) -> RunEnd | None:
        """How the last run ended, once (None: it runs, or was seen to end already). Raises what
        the engine thread itself raised (RunnerLost: the worker goes)."""
        if self.run is None or not self.run.done():
            return None
        run, self.run = self.run, None
        return run.result()

    def take(self) -> list[Outputs | BaseException]:
        """Every step's outputs waiting, oldest first (a failed step's error in its place)."""
        with self._cond:
            taken, self._outbox = self._outbox, []
            self._cond.notify()
        return taken

    def halt(self) -> None:
        """The run (if any) ends after the step it runs now, and starts no other."""
        with self._cond:
            self._paused = True
            self._cond.notify()

    async def pause(self) -> None:
        """No step runs after this returns (until the next start); what ran is in the outbox."""
        self.halt()
        if self.run is not None:
            await asyncio.wait([self.run])

    # -- the engine thread ------------------------------------------------------------------

    def _steps(self, loop: asyncio.AbstractEventLoop) -> RunEnd:
        while self._room():
            try:
                outputs = self.engine.step()
            except Exception as err:  # the loop fails the requests it held; BaseException goes
                self._hand(loop, err)
                return RunEnd.FAILED
            if outputs is None:
                return RunEnd.STARVED
            self._hand(loop, outputs)
        return RunEnd.PAUSED

    def _room(self) -> bool:
        """Waits until fewer than `ahead` steps wait for the loop; False once paused."""
        with self._cond:
            while len(self._outbox) >= self.ahead and not self._paused:
                self._cond.wait()
            return not self._paused

    def _hand(self, loop: asyncio.AbstractEventLoop, item: Outputs | BaseException) -> None:
        with self._cond:
            self._outbox.append(item)
            first = len(self._outbox) == 1
        if first:
            try:
                loop.call_soon_threadsafe(self.wake)
            except RuntimeError:  # the loop is closed: nobody takes it any more
                pass


def _nothing() -> None:
    """No one to wake yet."""
