"""DecodeEngine: the loop that reads drain inputs -> schedule -> run -> publish.

Every mutation of a Sequence after admission happens here (the model step runs in the engine
thread); message handlers only set flags and wake the loop.
"""

import asyncio
import contextlib
import logging
import time
from typing import Awaitable, Callable

from shared.engine.model_runner import EngineExecutor
from shared.engine.sampler import sample
from shared.engine.sequence import SeqStatus, Sequence, StepOutput
from shared.lifecycle import wait_or_stop
from shared.worker.runtime import WorkerRuntime

log = logging.getLogger(__name__)

Publish = Callable[[Sequence, StepOutput], Awaitable[None]]
Finish = Callable[[Sequence], Awaitable[None]]


class DecodeEngine:
    def __init__(self, runtime: WorkerRuntime, executor: EngineExecutor, publish: Publish, finish: Finish):
        self.rt = runtime
        self.executor = executor
        self.publish = publish
        self.finish = finish
        self.seqs: dict[str, Sequence] = {}
        self.wakeup = asyncio.Event()

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.request_id] = seq
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
            if not await self._iterate():
                self.wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self.wakeup.wait(), max(0.01, deadline - time.monotonic()))

    async def _iterate(self) -> bool:
        """drain inputs -> schedule -> run -> publish; False when there was nothing to run."""
        await self._reap()
        prefills, ready, running = self._schedule()
        if not (prefills or ready or running):
            return False
        for seq, out in await self.executor.run(self._step, prefills, ready, running):
            if not seq.cancel_reason and seq.error is None:
                await self.publish(seq, out)
        return True

    async def abort_all(self, code: str, message: str) -> None:
        """Ends every sequence still held (shutdown): each gets its error, each frees its blocks."""
        for seq in self.seqs.values():
            seq.error = seq.error or (code, message)
        await self._reap()

    async def _reap(self) -> None:
        """Ends sequences that finished, failed, were cancelled or ran past their deadline."""
        for seq in list(self.seqs.values()):
            if seq.status is not SeqStatus.FINISHED and seq.expired and seq.error is None:
                seq.error = ("DEADLINE_EXCEEDED", "the request's deadline passed")
            if seq.status is SeqStatus.FINISHED or seq.error is not None or seq.cancel_reason:
                del self.seqs[seq.request_id]
                seq.cache = seq.kv_buffer = None
                await self.finish(seq)

    def _schedule(self) -> tuple[list[Sequence], list[Sequence], list[Sequence]]:
        by_status: dict[SeqStatus, list[Sequence]] = {s: [] for s in SeqStatus}
        for seq in self.seqs.values():
            by_status[seq.status].append(seq)
        # One local prefill per step bounds how long the running streams wait for it.
        return by_status[SeqStatus.WAITING_PREFILL][:1], by_status[SeqStatus.KV_READY], by_status[SeqStatus.RUNNING]

    def _step(self, prefills: list[Sequence], ready: list[Sequence], running: list[Sequence]):
        outputs = []
        for work, batch in ((self._emit_first, ready), (self._prefill, prefills), (self._decode, running)):
            for seq in batch:
                try:
                    outputs.append((seq, work(seq)))
                except Exception as err:
                    log.exception("step of %s failed", seq.request_id)
                    seq.error = ("INTERNAL", f"model step failed: {type(err).__name__}")
        return outputs

    def _emit_first(self, seq: Sequence) -> StepOutput:
        seq.cache = self.rt.runner.unpack(seq.kv_buffer)
        seq.kv_buffer = None
        seq.status = SeqStatus.RUNNING
        return seq.append(seq.first_token)

    def _prefill(self, seq: Sequence) -> StepOutput:
        started = time.time()
        seq.queue_ms = (started - seq.task.arrival_time) * 1000
        seq.cache, logits = self.rt.runner.prefill(seq.task.prompt_token_ids)
        seq.prefill_ms = (time.time() - started) * 1000
        seq.prefill_worker = self.rt.worker_id
        seq.status = SeqStatus.RUNNING
        return seq.append(sample(logits, seq.sampling, 0))

    def _decode(self, seq: Sequence) -> StepOutput:
        logits = self.rt.runner.decode(seq.cache, seq.last_token)
        return seq.append(sample(logits, seq.sampling, len(seq.output_ids)))
