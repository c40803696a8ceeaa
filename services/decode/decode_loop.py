"""DecodeLoop: the decode worker's loop — drain inputs -> schedule -> run -> publish.

The Engine does the batching; this loop feeds it from the event loop, runs its step in the
engine thread, publishes what each step produced, and ends sequences that finished, failed,
were cancelled or ran past their deadline. Message handlers only set flags and wake the loop.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from shared.engine.engine import Engine
from shared.engine.executor import EngineExecutor
from shared.engine.sequence import SeqStatus, Sequence, StepOutput
from shared.lifecycle import wait_or_stop

log = logging.getLogger(__name__)

Publish = Callable[[Sequence, StepOutput], Awaitable[None]]
Finish = Callable[[Sequence], Awaitable[None]]


class DecodeLoop:
    def __init__(self, engine: Engine, executor: EngineExecutor, publish: Publish, finish: Finish):
        self.engine = engine
        self.executor = executor
        self.publish = publish
        self.finish = finish
        self.seqs: dict[str, Sequence] = {}  # every sequence this worker holds, by request id
        self.wakeup = asyncio.Event()

    def add(self, seq: Sequence, local_prefill: bool) -> None:
        self.seqs[seq.request_id] = seq
        if local_prefill:
            self.engine.add(seq)
        self.wakeup.set()

    def count(self, *statuses: SeqStatus) -> int:
        return sum(1 for s in self.seqs.values() if s.status in statuses)

    async def run(self, stop: asyncio.Event) -> None:
        """Steps until `stop` is set."""
        while not stop.is_set():
            if not await self._iterate():
                self.wakeup.clear()
                await wait_or_stop(self.wakeup.wait(), stop)

    async def drain(self, timeout_s: float) -> None:
        """Keeps stepping the sequences already held until they finish or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while self.seqs and time.monotonic() < deadline:
            if (
                not await self._iterate() and self.seqs
            ):  # _iterate may just have reaped the last one
                self.wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(
                        self.wakeup.wait(), max(0.01, deadline - time.monotonic())
                    )

    async def abort_all(self, code: str, message: str, failed_worker: str = "") -> None:
        """Ends every sequence still held (shutdown): each gets its error, each frees its blocks."""
        for seq in self.seqs.values():
            if seq.error is None:
                seq.error, seq.failed_worker = (code, message), failed_worker
        await self._reap()

    async def _iterate(self) -> bool:
        """One step; False when nothing could run (then wait for news)."""
        await self._reap()
        if not self.engine.has_work():
            return False
        try:
            outputs = await self.executor.run(self.engine.step)
        except Exception as err:
            log.exception("engine step failed")
            for seq in self.seqs.values():
                if seq.status in (SeqStatus.WAITING, SeqStatus.RUNNING, SeqStatus.KV_READY):
                    seq.error = ("INTERNAL", f"model step failed: {type(err).__name__}")
            return True
        if outputs is None:
            return False
        for seq, out in outputs:
            if not seq.cancel_reason and seq.error is None:
                await self.publish(seq, out)
        return True

    async def _reap(self) -> None:
        for seq in list(self.seqs.values()):
            if seq.kv_pending:
                continue  # its transfer ends itself first (see DecodeWorker._fetch_kv)
            if seq.status is not SeqStatus.FINISHED and seq.expired and seq.error is None:
                seq.error = ("DEADLINE_EXCEEDED", "the request's deadline passed")
            if seq.status is SeqStatus.FINISHED or seq.error is not None or seq.cancel_reason:
                del self.seqs[seq.request_id]
                self.engine.release(seq)
                await self.finish(seq)
