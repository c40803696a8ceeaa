"""DecodeLoop: the decode worker's loop — drain inputs -> schedule -> run -> publish.

The Engine does the batching; this loop feeds it from the event loop, runs its step in the
engine thread, publishes what each step produced, and ends requests that finished, failed,
were cancelled or ran past their deadline. Message handlers only record events and wake the loop.

Steps are pipelined: once step N is back, the requests it did not touch are reaped (their blocks
freed: no step runs then), step N+1 starts in the engine thread, and step N's tokens are
published while it runs. Every stream of a step goes out together, one hand-off per step.
A request that finished in step N is reaped at the next turn, after its last chunk went out.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from services.decode.request import DecodeRequest
from shared.control.failure import Code, Failure, failed
from shared.engine.engine import Engine
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence, StepOutput
from shared.engine.step_runner import RunnerLost
from shared.job_thread import JobThread
from shared.worker import steps

log = logging.getLogger(__name__)

Publish = Callable[[list[tuple[DecodeRequest, StepOutput]]], Awaitable[None]]  # one step's
Finish = Callable[[DecodeRequest], Awaitable[None]]
Adopt = Callable[[Sequence], DecodeRequest]
# where a sequence may be when a step fails (WAITING_KV ones are not in it)
STEPPED = (SeqStatus.WAITING, SeqStatus.PREEMPTED, SeqStatus.RUNNING, SeqStatus.KV_READY)
RUNS = (SeqStatus.RUNNING, SeqStatus.KV_READY)  # what the heartbeat counts as running
QUEUED = (SeqStatus.WAITING_KV, SeqStatus.WAITING, SeqStatus.PREEMPTED)  # and as queued


class DecodeLoop:
    def __init__(
        self,
        engine: Engine,
        executor: JobThread,
        publish: Publish,
        finish: Finish,
        adopt: Adopt,
    ):
        self.engine = engine
        self.executor = executor
        self.publish = publish
        self.finish = finish
        self.adopt = adopt  # a choice the engine forked becomes a request of its own
        self.requests: dict[str, DecodeRequest] = {}  # every request this worker holds, by id
        self.wakeup = asyncio.Event()
        self.running: asyncio.Future | None = None  # the step in the engine thread, if any

    def add(self, req: DecodeRequest, local_prefill: bool) -> None:
        self.requests[req.attempt_id] = req
        if local_prefill:
            self.engine.add(req.seq)
        self.wakeup.set()

    def count(self, *statuses: SeqStatus) -> int:
        return sum(1 for r in self.requests.values() if r.seq.status in statuses)

    async def run(self, stop: asyncio.Event) -> None:
        """Steps until `stop` is set."""
        await steps.step_until_stopped(self._iterate, self.wakeup, stop)

    async def drain(self, timeout_s: float) -> None:
        """Keeps stepping the sequences already held until they finish or `timeout_s` passes."""
        await steps.drain(self._iterate, self.wakeup, lambda: bool(self.requests), timeout_s)

    async def abort_all(self, failure: Failure) -> None:
        """Ends every request still held (shutdown): each gets the failure, each frees its blocks."""
        await self._settle()
        for req in self.requests.values():
            req.fail(failure)  # (no effect on one that finished)
        await self._reap()

    async def _settle(self) -> None:
        """No step runs after this: the one started last (if any) is over, its tokens sent, and
        the engine thread idle (a cancelled wait for a step leaves the step running there)."""
        if self.running is not None:
            outputs = None
            with contextlib.suppress(RunnerLost):  # the worker goes anyway
                outputs = await self._stepped()
            produced = self._produced(outputs) if outputs else []
            if produced:
                await self.publish(produced)
        await self.executor.run(_nothing)

    async def _iterate(self) -> bool:
        """Takes the step started last turn (if any), reaps, starts the next one and publishes
        this one's tokens while it runs; False when nothing could run (then wait for news)."""
        stepped = self.running is not None
        outputs = await self._stepped() if stepped else None
        produced = self._produced(outputs) if outputs else []
        # a request whose last chunk is in `produced` is reaped next turn, once it went out
        await self._reap(keep={id(req) for req, _ in produced})
        if (outputs is not None or not stepped) and self.engine.has_work():
            self.running = self._start_step()
        if produced:
            await self.publish(produced)
        return outputs is not None or self.running is not None

    def _start_step(self) -> asyncio.Future:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self.executor.submit(loop, future, self.engine.step)
        return future

    async def _stepped(self):
        """The output of the step that was running; None when nothing could be scheduled; none
        ([]) when it failed (its requests fail: the gateway moves them)."""
        running, self.running = self.running, None
        try:
            return await running
        except RunnerLost:
            raise  # the worker goes; its requests are placed elsewhere (shared.worker.serve)
        except Exception as err:
            log.exception("engine step failed")
            for req in self.requests.values():
                if req.seq.status in STEPPED:
                    req.fail(failed(Code.INTERNAL, f"model step failed: {type(err).__name__}"))
            return []

    def _produced(self, outputs) -> list[tuple[DecodeRequest, StepOutput]]:
        """Each output with its request: each group's other choices first (they go as the group
        went), then its own sequence, choice 0 now (re-keyed; a cancel of that choice alone
        applies to it alone)."""
        for seq in sorted(self.engine.take_forked(), key=lambda s: s.forked_from is None):
            self.requests[seq.attempt_id] = self.adopt(seq)
        produced = []
        for seq, out in outputs:
            req = self.requests.get(seq.attempt_id)
            if req is not None and not req.aborted:
                produced.append((req, out))
        return produced

    async def _reap(self, keep: frozenset | set = frozenset()) -> None:
        """Ends the requests that ended (frees their blocks, tells the gateway), but those in
        `keep` (id()s: their last chunk has yet to go out). Only while no step runs."""
        now = time.time()  # one clock read a turn, not one a request
        for req in list(self.requests.values()):
            seq = req.seq
            if not seq.status.finished and not seq.expired_at(now):
                continue  # most of them, every turn: running on
            if not req.may_free or id(req) in keep:
                continue  # its transfer ends itself first (see KVFetcher.fetch)
            if not seq.status.finished:
                req.fail(failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed"))
            if req.ended:
                del self.requests[req.attempt_id]
                self.engine.release(seq)
                await self.finish(req)


def _nothing() -> None:
    """A job for the engine thread that only shows it is idle (it runs after any step)."""
