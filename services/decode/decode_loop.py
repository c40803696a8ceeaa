"""DecodeLoop: the decode worker's loop — drain inputs -> schedule -> run -> publish.

The Engine does the batching; this loop feeds it from the event loop, runs its step in the
engine thread, publishes what each step produced, and ends requests that finished, failed,
were cancelled or ran past their deadline. Message handlers only record events and wake the loop.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable

from services.decode.request import DecodeRequest
from shared.control.failure import Code, Failure, failed
from shared.engine.engine import Engine
from shared.engine.executor import EngineExecutor
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence, StepOutput
from shared.engine.step_runner import RunnerLost
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
        executor: EngineExecutor,
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
        for req in self.requests.values():
            req.fail(failure)  # (no effect on one that finished)
        await self._reap()

    async def _iterate(self) -> bool:
        """One step; False when nothing could run (then wait for news)."""
        await self._reap()
        if not self.engine.has_work():
            return False
        try:
            outputs = await self.executor.run(self.engine.step)
        except RunnerLost:
            raise  # the worker goes; its requests are placed elsewhere (shared.worker.serve)
        except Exception as err:
            log.exception("engine step failed")
            for req in self.requests.values():
                if req.seq.status in STEPPED:
                    req.fail(failed(Code.INTERNAL, f"model step failed: {type(err).__name__}"))
            return True
        if outputs is None:
            return False
        # each group's other choices first (they go as the group went), then its own sequence,
        # choice 0 now (re-keyed; a cancel of that choice alone applies to it alone)
        for seq in sorted(self.engine.take_forked(), key=lambda s: s.forked_from is None):
            self.requests[seq.attempt_id] = self.adopt(seq)
        produced = []
        for seq, out in outputs:
            req = self.requests.get(seq.attempt_id)
            if req is not None and not req.aborted:
                produced.append((req, out))
        if produced:
            await self.publish(produced)
        return True

    async def _reap(self) -> None:
        for req in list(self.requests.values()):
            if not req.may_free:
                continue  # its transfer ends itself first (see KVFetcher.fetch)
            seq = req.seq
            if not seq.status.finished and seq.expired:
                req.fail(failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed"))
            if req.ended:
                del self.requests[req.attempt_id]
                self.engine.release(seq)
                await self.finish(req)
