"""PrefillWorker: batches the prompts decode workers send it, then pushes each prompt's KV over UCX.

The loop reads: drain inputs -> step the engine (prompt chunks of many requests in one batch)
-> for each finished prompt: announce the result, then send its KV in the background while the
next prompts compute. A prompt's blocks stay held until its KV has left.
"""

import asyncio
import logging
import os
from dataclasses import asdict

import torch

from shared.engine.model_runner import EngineExecutor
from shared.engine.sequence import SeqStatus, Sequence
from shared.lifecycle import wait_or_stop
from shared.messages import (CancelRequest, GenerateTask, PrefillResult, PrefillTask, TaskAck,
                             WorkerHeartbeat)
from shared.subjects import Subjects
from shared.transport.bus import MessageBus
from shared.transport.kv import DataPlane, KVTransferError
from shared.worker.announcer import Announcer
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, settings: WorkerSettings, runtime: WorkerRuntime, bus: MessageBus, plane: DataPlane):
        self.settings = settings
        self.rt = runtime
        self.engine = runtime.engine
        self.bus = bus
        self.plane = plane
        self.subjects = Subjects(settings.cluster)
        self.executor = EngineExecutor()
        self.held: dict[str, tuple[PrefillTask, Sequence]] = {}   # request id -> its task, until its KV left
        self.sends: set[asyncio.Task] = set()
        self.wakeup = asyncio.Event()
        self.served = 0
        self.stopping = False

    def snapshot(self) -> WorkerHeartbeat:
        queued = sum(1 for _, s in self.held.values() if s.status is SeqStatus.WAITING and not s.num_computed_tokens)
        return WorkerHeartbeat(
            worker_id=self.rt.worker_id, role="prefill", host=self.rt.host, pid=os.getpid(),
            ucx_address=self.plane.address, layout=self.rt.runner.layout,
            max_model_len=self.rt.max_model_len, running=len(self.held) - queued, queued=queued,
            kv_blocks_used=self.rt.blocks.used, kv_blocks_total=self.rt.blocks.num_blocks,
            block_size=self.rt.blocks.block_size,
            requests_served=self.served, kv_bytes_sent=self.plane.counters.bytes_sent,
            kv_bytes_received=self.plane.counters.bytes_received,
            kv_transfers_failed=self.plane.counters.transfers_failed, stopping=self.stopping)

    async def serve(self, stop: asyncio.Event) -> None:
        subs = [await self.bus.subscribe(self.subjects.worker_tasks(self.rt.worker_id), self.on_task),
                await self.bus.subscribe(self.subjects.cancel, self.on_cancel)]
        try:
            async with Announcer(self.bus, self.subjects, self.snapshot, self.settings.heartbeat_interval_s,
                                 self.settings.alive_file) as announcer:
                while not stop.is_set():
                    if not await self._iterate():
                        self.wakeup.clear()
                        await wait_or_stop(self.wakeup.wait(), stop)
                self.stopping = True
                await announcer.announce()
                for task, seq in list(self.held.values()):
                    if seq.status is not SeqStatus.FINISHED:  # not computed yet: tell its decode worker now
                        await self._fail(task, seq, "UNAVAILABLE", f"prefill worker {self.rt.worker_id} shut down")
        finally:
            for sub in subs:
                await sub.unsubscribe()
            if self.sends:  # let transfers in flight finish (each is bounded by its timeout)
                await asyncio.gather(*self.sends, return_exceptions=True)
            self.executor.close()

    # -- inputs ---------------------------------------------------------------------------------

    async def on_task(self, task: PrefillTask, respond) -> None:
        refusal = self._refusal(task)
        if refusal is None:
            request = GenerateTask(request_id=task.request_id, prompt_token_ids=task.prompt_token_ids,
                                   sampling=task.sampling, reply_subject="", arrival_time=task.arrival_time,
                                   deadline=task.deadline)
            seq = Sequence(request, None, set(), self.rt.max_model_len, prefill_only=True)
            self.held[task.request_id] = (task, seq)
            self.engine.add(seq)
            self.wakeup.set()
        if respond is not None:
            code, message = refusal or ("", "")
            await respond(TaskAck(ok=refusal is None, code=code, message=message))

    def _refusal(self, task: PrefillTask) -> tuple[str, str] | None:
        if self.stopping:
            return ("UNAVAILABLE", f"prefill worker {self.rt.worker_id} is shutting down")
        if task.layout != self.rt.runner.layout:
            return ("FAILED_PRECONDITION",
                    f"KV layout mismatch: decode has {asdict(task.layout)}, "
                    f"prefill {self.rt.worker_id} has {asdict(self.rt.runner.layout)}")
        if task.request_id in self.held:
            return ("ALREADY_EXISTS", f"request {task.request_id} is already here")
        if len(self.held) >= self.settings.max_queue:
            return ("RESOURCE_EXHAUSTED", f"prefill worker {self.rt.worker_id} queue is full")
        if self.rt.blocks.blocks_for(len(task.prompt_token_ids)) > self.rt.blocks.num_blocks:
            return ("RESOURCE_EXHAUSTED", "prompt is larger than the prefill worker's KV budget")
        return None

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        held = self.held.get(message.request_id)
        if held is not None and held[1].status is not SeqStatus.FINISHED:
            held[1].cancel_reason = message.reason or "cancelled"
            self.wakeup.set()

    # -- the loop -------------------------------------------------------------------------------

    async def _iterate(self) -> bool:
        for task, seq in list(self.held.values()):
            if seq.status is SeqStatus.FINISHED:
                continue
            if seq.cancel_reason:
                await self._fail(task, seq, "CANCELLED", "cancelled before its prefill finished")
            elif seq.expired:
                await self._fail(task, seq, "DEADLINE_EXCEEDED", "the request's deadline passed")
        if not self.engine.has_work():
            return False
        try:
            outputs = await self.executor.run(self.engine.step)
        except Exception as err:
            log.exception("prefill step failed")
            for task, seq in list(self.held.values()):
                if seq.status is not SeqStatus.FINISHED:
                    await self._fail(task, seq, "INTERNAL", f"prefill failed: {type(err).__name__}")
            return True
        if outputs is None:
            return False
        for seq, out in outputs:
            await self._ship(self.held[seq.request_id][0], seq, out.token_ids[0])
        return True

    async def _fail(self, task: PrefillTask, seq: Sequence, code: str, message: str) -> None:
        self.held.pop(task.request_id, None)
        self.engine.release(seq)
        await self.bus.publish(self.subjects.prefill_results(task.decode_worker), PrefillResult(
            request_id=task.request_id, transfer_tag=task.transfer_tag, ok=False, code=code, message=message,
            prefill_worker=self.rt.worker_id))

    async def _ship(self, task: PrefillTask, seq: Sequence, first_token: int) -> None:
        """Announces the finished prompt, then sends its KV in the background."""
        try:
            buffer = await self.executor.run(self._export, seq)
            result = PrefillResult(
                request_id=task.request_id, transfer_tag=task.transfer_tag, ok=True, first_token=first_token,
                kv_bytes=buffer.numel() * buffer.element_size(), queue_ms=seq.queue_ms, prefill_ms=seq.prefill_ms,
                prefill_worker=self.rt.worker_id)
            # Announce first: the decode worker posts its receive for this tag when it reads this.
            await self.bus.publish(self.subjects.prefill_results(task.decode_worker), result)
        except Exception:
            self.held.pop(task.request_id, None)
            self.engine.release(seq)
            raise
        send = asyncio.create_task(self._send(task, seq, buffer))
        self.sends.add(send)
        send.add_done_callback(self.sends.discard)

    def _export(self, seq: Sequence) -> torch.Tensor:
        pool = self.rt.runner.pool
        buffer = pool.export(pool.slots(seq.block_table, 0, seq.prompt_len))
        if buffer.is_cuda:  # UCX reads it on its own streams: the copy must have landed
            torch.cuda.current_stream().synchronize()
        return buffer

    async def _send(self, task: PrefillTask, seq: Sequence, buffer: torch.Tensor) -> None:
        try:
            await self.plane.send(task.decode_ucx_address, task.transfer_tag, buffer,
                                  self.settings.kv_transfer_timeout_s)
            self.served += 1
        except KVTransferError as err:
            log.error("KV of %s to %s not sent: %s", task.request_id, task.decode_worker, err)
            await self.bus.publish(self.subjects.prefill_results(task.decode_worker), PrefillResult(
                request_id=task.request_id, transfer_tag=task.transfer_tag, ok=False,
                code="UNAVAILABLE", message="KV transfer failed", prefill_worker=self.rt.worker_id))
        finally:
            self.held.pop(task.request_id, None)
            self.engine.release(seq)
