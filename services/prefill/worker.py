"""PrefillWorker: takes PrefillTasks from decode workers, runs the prompt, pushes the KV over UCX.

The loop reads: take a task -> prefill (off the event loop) -> announce the result -> send the KV.
"""

import asyncio
import logging
import os
import time
from dataclasses import asdict

import torch

from shared.engine.sampler import sample
from shared.lifecycle import wait_or_stop
from shared.messages import CancelRequest, PrefillResult, PrefillTask, TaskAck, WorkerHeartbeat
from shared.engine.model_runner import EngineExecutor
from shared.subjects import Subjects
from shared.transport.bus import MessageBus
from shared.transport.kv import DataPlane, KVTransferError
from shared.worker.announcer import Announcer
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(self, settings: WorkerSettings, runtime: WorkerRuntime, bus: MessageBus,
                 plane: DataPlane):
        self.settings = settings
        self.rt = runtime
        self.bus = bus
        self.plane = plane
        self.subjects = Subjects(settings.cluster)
        self.queue: asyncio.Queue[PrefillTask] = asyncio.Queue()
        self.cancelled: set[str] = set()
        self.queued_ids: set[str] = set()
        self.running = 0
        self.sends: set[asyncio.Task] = set()
        self.stopping = False
        self.served = 0
        self.executor = EngineExecutor()

    def snapshot(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.rt.worker_id, role="prefill", host=self.rt.host, pid=os.getpid(),
            ucx_address=self.plane.address, layout=self.rt.runner.layout,
            max_model_len=self.rt.max_model_len, running=self.running, queued=self.queue.qsize(),
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
                    task = await wait_or_stop(self.queue.get(), stop)
                    if task is not None:
                        self.queued_ids.discard(task.request_id)
                        await self.handle(task)
                self.stopping = True
                await announcer.announce()
                await self._refuse_queued()
        finally:
            for sub in subs:
                await sub.unsubscribe()
            if self.sends:  # let transfers in flight finish (each is bounded by its timeout)
                await asyncio.gather(*self.sends, return_exceptions=True)
            self.executor.close()

    async def _refuse_queued(self) -> None:
        """Shutting down: tell each waiting decode worker now, instead of letting it time out."""
        while not self.queue.empty():
            task = self.queue.get_nowait()
            await self.bus.publish(self.subjects.prefill_results(task.decode_worker), PrefillResult(
                request_id=task.request_id, transfer_tag=task.transfer_tag, ok=False, code="UNAVAILABLE",
                message=f"prefill worker {self.rt.worker_id} shut down", prefill_worker=self.rt.worker_id))

    async def on_task(self, task: PrefillTask, respond) -> None:
        refusal = self._refusal(task)
        if refusal is None:
            self.queue.put_nowait(task)
            self.queued_ids.add(task.request_id)
        if respond is not None:
            await respond(TaskAck(ok=refusal is None, code="" if refusal is None else refusal[0],
                                  message="" if refusal is None else refusal[1]))

    def _refusal(self, task: PrefillTask) -> tuple[str, str] | None:
        if self.stopping:
            return ("UNAVAILABLE", f"prefill worker {self.rt.worker_id} is shutting down")
        if task.layout != self.rt.runner.layout:
            return ("FAILED_PRECONDITION",
                    f"KV layout mismatch: decode has {asdict(task.layout)}, "
                    f"prefill {self.rt.worker_id} has {asdict(self.rt.runner.layout)}")
        if self.queue.qsize() >= self.settings.max_queue:
            return ("RESOURCE_EXHAUSTED", f"prefill worker {self.rt.worker_id} queue is full")
        if self.rt.blocks.blocks_for(len(task.prompt_token_ids)) > self.rt.blocks.num_blocks:
            return ("RESOURCE_EXHAUSTED", "prompt is larger than the prefill worker's KV budget")
        return None

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        # Cancels are broadcast; remember only those of tasks still waiting here. A prefill
        # already computing finishes, and the decode worker drops its KV.
        if message.request_id in self.queued_ids:
            self.cancelled.add(message.request_id)

    async def handle(self, task: PrefillTask) -> None:
        """Prefill one task; its KV goes out in the background while the next prompt computes."""
        result = PrefillResult(request_id=task.request_id, transfer_tag=task.transfer_tag, ok=False,
                               prefill_worker=self.rt.worker_id)
        target = self.subjects.prefill_results(task.decode_worker)
        if task.request_id in self.cancelled or (task.deadline and time.time() > task.deadline):
            self.cancelled.discard(task.request_id)
            result.code, result.message = "CANCELLED", "cancelled before prefill"
            await self.bus.publish(target, result)
            return
        while not self.rt.blocks.can_allocate(len(task.prompt_token_ids)):
            await asyncio.sleep(0.01)  # blocks still held by transfers in flight
        self.rt.blocks.allocate(task.request_id, len(task.prompt_token_ids))
        started = time.time()
        result.queue_ms = (started - task.arrival_time) * 1000
        self.running += 1
        try:
            buffer, first_token = await self.executor.run(self._compute, task)
        except Exception as err:
            log.exception("prefill of %s failed", task.request_id)
            self.rt.blocks.deallocate(task.request_id)
            result.code, result.message = "INTERNAL", f"prefill failed: {type(err).__name__}"
            await self.bus.publish(target, result)
            return
        finally:
            self.running -= 1
        result.prefill_ms = (time.time() - started) * 1000
        result.ok, result.first_token = True, first_token
        result.kv_bytes = buffer.numel() * buffer.element_size()
        # Announce first: the decode worker posts its receive for this tag when it reads this.
        try:
            await self.bus.publish(target, result)
        except Exception:
            self.rt.blocks.deallocate(task.request_id)
            raise
        send = asyncio.create_task(self._send(task, buffer, target))
        self.sends.add(send)
        send.add_done_callback(self.sends.discard)

    async def _send(self, task: PrefillTask, buffer, target: str) -> None:
        try:
            await self.plane.send(task.decode_ucx_address, task.transfer_tag, buffer,
                                  self.settings.kv_transfer_timeout_s)
            self.served += 1
        except KVTransferError as err:
            log.error("KV of %s to %s not sent: %s", task.request_id, task.decode_worker, err)
            await self.bus.publish(target, PrefillResult(
                request_id=task.request_id, transfer_tag=task.transfer_tag, ok=False,
                code="UNAVAILABLE", message="KV transfer failed", prefill_worker=self.rt.worker_id))
        finally:
            self.rt.blocks.deallocate(task.request_id)
            self.cancelled.discard(task.request_id)

    def _compute(self, task: PrefillTask):
        cache, logits = self.rt.runner.prefill(task.prompt_token_ids)
        first_token = sample(logits, task.sampling, 0)
        buffer = self.rt.runner.pack(cache)
        if buffer.is_cuda:  # UCX reads it on its own streams: the copies must have landed
            torch.cuda.current_stream().synchronize()
        return buffer, first_token
