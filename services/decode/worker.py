"""DecodeWorker: admits assignments, fetches each prompt's KV from a prefill worker, streams tokens.

For a remote prefill the decode worker owns the destination buffer: it picks a transfer tag,
asks the prefill worker (NATS) to send the KV with that tag to its UCX address, and posts the
UCX receive when the prefill worker says the bytes are on the wire.
"""

import asyncio
import logging
import os
import secrets
import time

import torch

from services.decode.engine import DecodeLoop
from shared.engine.detokenizer import Detokenizer
from shared.engine.kv_cache import bytes_per_token, empty_buffer
from shared.engine.model_runner import EngineExecutor
from shared.engine.sequence import SeqStatus, Sequence, StepOutput
from shared.messages import (CancelRequest, DecodeAssignment, PrefillResult, PrefillTask, TaskAck,
                             Timing, TokenChunk, WorkerHeartbeat)
from shared.liveness import Liveness
from shared.recent import RecentIds
from shared.subjects import Subjects
from shared.transport.bus import BusError, MessageBus
from shared.transport.kv import DataPlane, KVTransferError
from shared.worker.announcer import Announcer
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class _Failed(Exception):
    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class DecodeWorker:
    def __init__(self, settings: WorkerSettings, runtime: WorkerRuntime, bus: MessageBus, plane: DataPlane,
                 liveness: Liveness):
        self.settings = settings
        self.rt = runtime
        self.bus = bus
        self.plane = plane
        self.liveness = liveness
        self.subjects = Subjects(settings.cluster)
        self.executor = EngineExecutor()
        self.loop = DecodeLoop(runtime.engine, self.executor, self._publish, self._finish)
        self.results: dict[int, asyncio.Queue] = {}    # transfer tag -> the PrefillResults that came
        self.fetches: dict[str, asyncio.Task] = {}     # request id -> its remote-prefill task
        self.drains: set[asyncio.Task] = set()
        # A cancel can overtake its assignment (the gateway gave up while the scheduler placed it).
        self.cancelled = RecentIds(ttl_s=120)
        self.served = 0
        self.stopping = False

    def snapshot(self) -> WorkerHeartbeat:
        return WorkerHeartbeat(
            worker_id=self.rt.worker_id, role=self.rt.role, host=self.rt.host, pid=os.getpid(),
            ucx_address=self.plane.address, layout=self.rt.runner.layout,
            max_model_len=self.rt.max_model_len,
            running=self.loop.count(SeqStatus.RUNNING, SeqStatus.KV_READY),
            queued=self.loop.count(SeqStatus.WAITING_KV, SeqStatus.WAITING),
            kv_blocks_used=self.rt.blocks.used, kv_blocks_total=self.rt.blocks.num_blocks,
            block_size=self.rt.blocks.block_size,
            requests_served=self.served, kv_bytes_sent=self.plane.counters.bytes_sent,
            kv_bytes_received=self.plane.counters.bytes_received,
            kv_transfers_failed=self.plane.counters.transfers_failed, stopping=self.stopping)

    async def serve(self, stop: asyncio.Event) -> None:
        subs = [await self.bus.subscribe(self.subjects.worker_tasks(self.rt.worker_id), self.on_assignment),
                await self.bus.subscribe(self.subjects.prefill_results(self.rt.worker_id), self.on_prefill_result),
                await self.bus.subscribe(self.subjects.cancel, self.on_cancel)]
        try:
            async with Announcer(self.bus, self.subjects, self.snapshot, self.settings.heartbeat_interval_s,
                                 self.settings.alive_file) as announcer:
                await self.loop.run(stop)
                self.stopping = True  # no new work; the scheduler drops this worker now
                await announcer.announce()
                log.info("draining %d request(s) for up to %.0fs", len(self.loop.seqs), self.settings.drain_timeout_s)
                await self.loop.drain(self.settings.drain_timeout_s)
                await self.loop.abort_all("UNAVAILABLE", "the decode worker shut down before the request finished")
        finally:
            for task in [*self.fetches.values(), *self.drains]:
                task.cancel()
            for sub in subs:
                await sub.unsubscribe()
            self.executor.close()

    # -- admission -------------------------------------------------------------------------

    async def on_assignment(self, assignment: DecodeAssignment, respond) -> None:
        task = assignment.task
        refusal = self._refusal(assignment)
        if refusal is None:
            seq = Sequence(task, Detokenizer(self.rt.tokenizer, task.sampling.stop),
                           self.rt.eos_token_ids, self.rt.max_model_len)
            if not assignment.prefill_worker:
                seq.prefill_worker = self.rt.worker_id
                self.loop.add(seq, local_prefill=True)
            elif self.rt.engine.admit(seq):  # the prompt's blocks, reserved before its KV comes
                seq.status = SeqStatus.WAITING_KV
                self.loop.add(seq, local_prefill=False)
                self.fetches[seq.request_id] = asyncio.create_task(self._fetch_kv(seq, assignment.prefill_worker))
            else:
                refusal = ("RESOURCE_EXHAUSTED", f"decode worker {self.rt.worker_id} has no KV blocks free")
        if respond is not None:
            code, message = refusal or ("", "")
            await respond(TaskAck(ok=refusal is None, code=code, message=message))

    def _refusal(self, assignment: DecodeAssignment) -> tuple[str, str] | None:
        task = assignment.task
        if self.stopping:
            return ("UNAVAILABLE", f"decode worker {self.rt.worker_id} is shutting down")
        if task.request_id in self.cancelled:
            return ("CANCELLED", f"request {task.request_id} was cancelled before it started")
        if task.request_id in self.loop.seqs:
            return ("ALREADY_EXISTS", f"request {task.request_id} is already running")
        if len(task.prompt_token_ids) + task.sampling.max_tokens > self.rt.max_model_len:
            return ("INVALID_ARGUMENT", f"prompt plus max_tokens exceeds {self.rt.max_model_len} tokens")
        if len(self.loop.seqs) >= self.settings.max_queue:
            return ("RESOURCE_EXHAUSTED", f"decode worker {self.rt.worker_id} is full")
        if self.rt.blocks.blocks_for(len(task.prompt_token_ids) + task.sampling.max_tokens) > self.rt.blocks.num_blocks:
            return ("RESOURCE_EXHAUSTED", f"the request needs more KV than decode worker {self.rt.worker_id} has")
        return None

    # -- remote prefill --------------------------------------------------------------------

    async def _fetch_kv(self, seq: Sequence, prefill_worker: str) -> None:
        tag = secrets.randbits(63) | 1
        self.results[tag] = asyncio.Queue()
        try:
            result = await self._request_prefill(seq, prefill_worker, tag)
            seq.kv_buffer = await self._receive(seq, tag, result)
            seq.first_token, seq.prefill_worker = result.first_token, result.prefill_worker
            seq.queue_ms, seq.prefill_ms = result.queue_ms, result.prefill_ms
            self.rt.engine.kv_arrived(seq)
        except _Failed as failure:
            seq.error = (failure.code, failure.message)
        except BusError:
            seq.error = ("UNAVAILABLE", f"prefill worker {prefill_worker} did not answer")
        except asyncio.TimeoutError:
            seq.error = ("UNAVAILABLE", f"prefill worker {prefill_worker} did not finish in time")
        except KVTransferError as err:
            log.error("%s: %s", seq.request_id, err)
            seq.error = ("UNAVAILABLE", "the KV transfer from the prefill worker failed")
        finally:
            self.results.pop(tag, None)
            self.fetches.pop(seq.request_id, None)
            self.loop.wakeup.set()

    async def _request_prefill(self, seq: Sequence, prefill_worker: str, tag: int) -> PrefillResult:
        task = PrefillTask(
            request_id=seq.request_id, prompt_token_ids=seq.task.prompt_token_ids, sampling=seq.sampling,
            layout=self.rt.runner.layout, transfer_tag=tag, decode_worker=self.rt.worker_id,
            decode_ucx_address=self.plane.address, arrival_time=seq.task.arrival_time,
            deadline=seq.task.deadline)
        ack = await self.bus.request(self.subjects.worker_tasks(prefill_worker), task, 5.0, TaskAck)
        if not ack.ok:
            raise _Failed(ack.code or "UNAVAILABLE", ack.message)
        result = await self._while_alive(self.results[tag].get(), prefill_worker, self.settings.prefill_timeout_s)
        if not result.ok:
            raise _Failed(result.code or "UNAVAILABLE", result.message)
        return result

    async def _while_alive(self, awaitable, worker_id: str, timeout_s: float):
        """Awaits, but gives up as soon as `worker_id` stops sending heartbeats."""
        task = asyncio.ensure_future(awaitable)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=min(0.5, max(0.0, deadline - time.monotonic())))
                if done:
                    return task.result()
                if not self.liveness.alive(worker_id):
                    raise _Failed("UNAVAILABLE", f"prefill worker {worker_id} stopped responding")
                if time.monotonic() >= deadline:
                    raise asyncio.TimeoutError
        finally:
            task.cancel()

    async def _receive(self, seq: Sequence, tag: int, result: PrefillResult) -> torch.Tensor:
        buffer = empty_buffer(self.rt.runner.layout, seq.prompt_len, self.rt.runner.device)
        if result.kv_bytes != buffer.numel() * buffer.element_size():
            raise _Failed("FAILED_PRECONDITION", "the prefill worker's KV size does not match this worker's layout")
        failure = asyncio.ensure_future(self.results[tag].get())  # a later "my send failed"
        started = time.time()
        receive = asyncio.create_task(self.plane.receive(tag, buffer, self.settings.kv_transfer_timeout_s))
        either = asyncio.wait({receive, failure}, return_when=asyncio.FIRST_COMPLETED)
        try:
            await self._while_alive(either, result.prefill_worker, self.settings.kv_transfer_timeout_s)
            if not receive.done():  # the prefill worker reported that its send failed
                raise _Failed(failure.result().code or "UNAVAILABLE", failure.result().message)
            receive.result()
        finally:
            failure.cancel()
            if not receive.done():
                # ucxx cannot withdraw a posted receive: let it finish (or time out) on its own,
                # so its buffer is released instead of abandoned.
                self._track(receive)
        seq.kv_transfer_ms = (time.time() - started) * 1000
        return buffer

    async def on_prefill_result(self, result: PrefillResult, respond) -> None:
        waiting = self.results.get(result.transfer_tag)
        if waiting is not None:
            waiting.put_nowait(result)
        elif result.ok:
            # Its request is gone (cancelled, timed out): take the bytes off the wire and drop them.
            limit = self.rt.max_model_len * bytes_per_token(self.rt.runner.layout)
            if 0 < result.kv_bytes <= limit:
                self._track(asyncio.create_task(self._drain(result)))

    def _track(self, task: asyncio.Task) -> None:
        """Keeps a background receive alive until it ends; its outcome only matters to the log."""
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _drain(self, result: PrefillResult) -> None:
        scratch = torch.empty(result.kv_bytes, dtype=torch.uint8)
        try:
            await self.plane.receive(result.transfer_tag, scratch, self.settings.kv_transfer_timeout_s)
        except KVTransferError as err:
            log.warning("could not drain the KV of %s: %s", result.request_id, err)

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        seq = self.loop.seqs.get(message.request_id)
        if seq is None:
            self.cancelled.add(message.request_id)
            return
        seq.cancel_reason = message.reason or "cancelled"
        fetch = self.fetches.get(seq.request_id)
        if fetch is not None:
            fetch.cancel()
        self.loop.wakeup.set()

    # -- output ----------------------------------------------------------------------------

    def _chunk(self, seq: Sequence, **fields) -> TokenChunk:
        chunk = TokenChunk(request_id=seq.request_id, index=seq.chunk_index, **fields)
        seq.chunk_index += 1
        return chunk

    async def _publish(self, seq: Sequence, out: StepOutput) -> None:
        extra = {}
        if out.finish_reason:
            extra = dict(prompt_tokens=seq.prompt_len, completion_tokens=len(seq.output_ids),
                         timing=Timing(queue_ms=seq.queue_ms, prefill_ms=seq.prefill_ms,
                                       kv_transfer_ms=seq.kv_transfer_ms,
                                       prefill_worker=seq.prefill_worker, decode_worker=self.rt.worker_id))
        chunk = self._chunk(seq, token_ids=out.token_ids, text=out.text, finish_reason=out.finish_reason, **extra)
        await self.bus.publish(seq.task.reply_subject, chunk)

    async def _finish(self, seq: Sequence) -> None:
        """Tells the gateway how the sequence ended (the loop freed its blocks), on every path."""
        fetch = self.fetches.get(seq.request_id)
        if fetch is not None:
            fetch.cancel()
        if seq.status is SeqStatus.FINISHED and seq.error is None and not seq.cancel_reason:
            self.served += 1
            return
        if seq.cancel_reason:
            chunk = self._chunk(seq, finish_reason="cancelled", prompt_tokens=seq.prompt_len,
                                completion_tokens=len(seq.output_ids))
        else:
            chunk = self._chunk(seq, code=seq.error[0], message=seq.error[1])
        try:
            await self.bus.publish(seq.task.reply_subject, chunk)
        except Exception as err:
            log.warning("could not tell the gateway that %s ended: %s", seq.request_id, err)
