"""KVFetcher: a decode worker's side of every KV transfer, from reserved blocks to landed KV.

For a remote prefill the decode worker has reserved the prompt's blocks in its own pool (reusing
any prefix it holds). The fetcher posts a UCX receive for every piece straight into them, sends
the prefill worker their descriptors (NATS), and waits while the pieces land as the prefill
computes. A cancel, a deadline, a stall of a whole lease, a prefill worker that stops
heartbeating or an abort from it ends the transfer on both sides, and the blocks may be freed
only once no receive can write into them (the sequence's `kv_pending` says when).
"""

import asyncio
import logging
import secrets
import time

from shared.control.bus import BusError, MessageBus
from shared.control.liveness import Liveness
from shared.control.messages import (
    KVDestination,
    PrefillResult,
    PrefillTask,
    TaskAck,
    TransferAbort,
)
from shared.control.subjects import Subjects
from shared.dataplane.plan import PlanError, TransferPlan, new_base_tag
from shared.dataplane.receiver import KVReceiver
from shared.dataplane.ucx import DataPlane, KVTransferError, discard
from shared.engine.sequence import Sequence
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class _Failed(Exception):
    def __init__(
        self, code: str, message: str, from_prefill: bool = False, pieces_sent: int | None = None
    ):
        super().__init__(message)
        self.code, self.message = code, message
        self.from_prefill = from_prefill  # the prefill worker ended it: no need to tell it
        self.pieces_sent = pieces_sent  # how far the prefill worker got, when it said so


class KVFetcher:
    def __init__(
        self,
        settings: WorkerSettings,
        runtime: WorkerRuntime,
        bus: MessageBus,
        plane: DataPlane,
        liveness: Liveness,
    ):
        self.settings = settings
        self.rt = runtime
        self.bus = bus
        self.plane = plane
        self.liveness = liveness
        self.subjects = Subjects(settings.cluster)
        self.results: dict[int, asyncio.Queue] = {}  # base tag -> the PrefillResults that came
        self.draining: dict[
            int, asyncio.Task
        ] = {}  # base tag -> pieces of an aborted transfer to discard
        self.drains: set[asyncio.Task] = set()
        self.quarantined: list[list[int]] = []  # blocks a receive that never ended may still write
        self.transports: set[str] = set()  # what prefill workers said carried KV here

    async def fetch(self, seq: Sequence, prefill_worker: str) -> None:
        """Reserves nothing new (admit did): posts the receives into seq's blocks, asks the prefill
        worker for the KV, and waits for every piece; any failure aborts the transfer on both sides."""
        try:
            receiver = KVReceiver(self.plane, self.rt.runner.pool, self._plan(seq))
        except PlanError as err:  # the reservation does not fit the prompt: a bug, but never a hang
            log.exception("%s: no transfer plan", seq.request_id)
            seq.error = ("INTERNAL", f"no KV transfer plan: {err}")
            return
        base_tag = receiver.plan.destination.base_tag
        inbox = self.results[base_tag] = asyncio.Queue()
        seq.kv_pending, asked = True, False
        receiver.start()
        try:
            await self._request_prefill(seq, receiver.plan, prefill_worker)
            asked = True
            result = await self._await_transfer(seq, receiver, inbox, prefill_worker)
            seq.first_token, seq.prefill_worker = result.first_token, result.prefill_worker
            seq.queue_ms, seq.prefill_ms = result.queue_ms, result.prefill_ms
            seq.cached_tokens = result.cached_tokens
            if result.transport:
                self.transports.add(result.transport)
            self.rt.engine.kv_arrived(seq)
        except _Failed as failure:
            if not seq.cancel_reason:
                seq.error = (failure.code, failure.message)
                if failure.code in (
                    "UNAVAILABLE",
                    "RESOURCE_EXHAUSTED",
                ):  # the prefill worker failed or
                    seq.failed_worker = (
                        prefill_worker  # was full, not the request: the gateway places it again
                    )
            await self._abort_transfer(
                seq,
                receiver,
                inbox,
                prefill_worker,
                asked and not failure.from_prefill,
                failure.pieces_sent,
            )
        except BusError:
            seq.error = ("UNAVAILABLE", f"prefill worker {prefill_worker} did not answer")
            seq.failed_worker = prefill_worker
            await self._abort_transfer(seq, receiver, inbox, prefill_worker, True, None)
        except (
            Exception
        ) as err:  # a bug: the request fails, the transfer ends, nothing hangs or leaks
            log.exception("%s: KV fetch failed", seq.request_id)
            seq.error = ("INTERNAL", f"KV fetch failed: {type(err).__name__}")
            await self._abort_transfer(seq, receiver, inbox, prefill_worker, asked, None)
        finally:
            if base_tag not in self.draining:
                self.results.pop(base_tag, None)
            seq.kv_pending = False

    def _plan(self, seq: Sequence) -> TransferPlan:
        """Where seq's KV goes: its blocks past the prefix this worker already holds."""
        bs = self.rt.blocks.block_size
        destination = KVDestination(
            ucx_address=self.plane.address,
            base_tag=new_base_tag(secrets.randbits(39)),
            block_ids=seq.block_table[seq.num_cached_tokens // bs :],
            skip_tokens=seq.num_cached_tokens,
            segment_tokens=self.settings.kv_segment_tokens,
            lease_s=self.settings.kv_lease_s,
        )
        return TransferPlan(self.rt.runner.layout, seq.prompt_len, destination)

    async def _request_prefill(
        self, seq: Sequence, plan: TransferPlan, prefill_worker: str
    ) -> None:
        task = PrefillTask(
            request_id=seq.request_id,
            prompt_token_ids=seq.task.prompt_token_ids,
            sampling=seq.sampling,
            layout=self.rt.runner.layout,
            destination=plan.destination,
            decode_worker=self.rt.worker_id,
            arrival_time=seq.task.arrival_time,
            deadline=seq.task.deadline,
            priority=seq.task.priority,
            output_offset=seq.task.resume_tokens,
        )
        asking = asyncio.ensure_future(
            self.bus.request(self.subjects.prefill_tasks(prefill_worker), task, 5.0, TaskAck)
        )
        try:
            while (
                not asking.done()
            ):  # a worker killed as it was asked never answers: do not wait the 5 s out
                await asyncio.wait([asking], timeout=0.25)
                if not asking.done() and await self.liveness.lost(prefill_worker):
                    raise _Failed(
                        "UNAVAILABLE", f"prefill worker {prefill_worker} stopped responding"
                    )
        finally:
            asking.cancel()  # gone, or this fetch was cancelled: nobody waits for the answer any more
        ack = asking.result()
        if not ack.ok:
            raise _Failed(ack.code or "UNAVAILABLE", ack.message, from_prefill=True)

    async def _await_transfer(
        self, seq: Sequence, receiver: KVReceiver, inbox: asyncio.Queue, prefill_worker: str
    ) -> PrefillResult:
        """Until every piece has landed and the prefill worker has sent the first token."""
        result, announced = None, 0.0
        deadline = time.monotonic() + self.settings.prefill_timeout_s
        lease = self.settings.kv_lease_s
        while not (receiver.complete and result is not None):
            while not inbox.empty():
                news = inbox.get_nowait()
                if not news.ok:
                    raise _Failed(news.code or "UNAVAILABLE", news.message, True, news.pieces_sent)
                result, announced = news, time.monotonic()
            if seq.cancel_reason:
                raise _Failed("CANCELLED", seq.cancel_reason)
            if seq.expired:
                raise _Failed("DEADLINE_EXCEEDED", "the request's deadline passed")
            try:
                receiver.check(lease)
            except KVTransferError as err:
                log.error("%s: %s", seq.request_id, err)
                raise _Failed(
                    "UNAVAILABLE", "the KV transfer from the prefill worker failed"
                ) from None
            if announced and time.monotonic() - max(announced, receiver.last_progress) > lease:
                raise _Failed("UNAVAILABLE", f"the KV transfer stalled for {lease:.0f}s")
            if await self.liveness.lost(prefill_worker):
                raise _Failed("UNAVAILABLE", f"prefill worker {prefill_worker} stopped responding")
            if time.monotonic() > deadline:
                raise _Failed(
                    "UNAVAILABLE", f"prefill worker {prefill_worker} did not finish in time"
                )
            await self._news(receiver, inbox, seq)
        seq.kv_transfer_ms = (receiver.last_landed - receiver.first_landed) * 1000
        seq.kv_exposed_ms = max(0.0, receiver.last_landed - result.computed_at) * 1000
        return result

    async def _news(self, receiver: KVReceiver, inbox: asyncio.Queue, seq: Sequence) -> None:
        """Waits a moment for a landed transfer, a prefill result or a cancel."""
        waits = [
            asyncio.ensure_future(receiver.done.wait()),
            asyncio.ensure_future(inbox.get()),
            asyncio.ensure_future(seq.news.wait()),
        ]
        try:
            done, _ = await asyncio.wait(waits, timeout=0.25, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for w in waits:
                w.cancel()
        if waits[1] in done and not waits[1].cancelled():
            inbox.put_nowait(waits[1].result())
        seq.news.clear()

    async def _abort_transfer(
        self,
        seq: Sequence,
        receiver: KVReceiver,
        inbox: asyncio.Queue,
        prefill_worker: str,
        tell_prefill: bool,
        pieces_sent: int | None,
    ) -> None:
        """Ends the transfer on both sides; seq's blocks may be freed when this returns."""
        base_tag = receiver.plan.destination.base_tag
        if tell_prefill:
            try:
                await self.bus.publish(
                    self.subjects.transfer_aborts(prefill_worker),
                    TransferAbort(
                        request_id=seq.request_id,
                        base_tag=base_tag,
                        reason=seq.cancel_reason or (seq.error or ("", ""))[1],
                    ),
                )
            except Exception as err:  # the prefill worker's own lease ends its side
                log.warning(
                    "could not tell %s to abort %s: %s", prefill_worker, seq.request_id, err
                )
        if not await receiver.abort(self.settings.kv_lease_s):
            self.quarantined.append(seq.block_table)  # a receive may still write there: never reuse
            seq.block_table = []
        drain = asyncio.create_task(
            self._drain(seq.request_id, receiver, inbox, prefill_worker, pieces_sent)
        )
        self._track(drain)
        self.draining[base_tag] = drain
        drain.add_done_callback(
            lambda _: (self.draining.pop(base_tag, None), self.results.pop(base_tag, None))
        )

    async def _drain(
        self,
        request_id: str,
        receiver: KVReceiver,
        inbox: asyncio.Queue,
        prefill_worker: str,
        pieces_sent: int | None,
    ) -> None:
        """Takes off the wire the pieces the prefill worker sent before it heard of the abort."""
        deadline = time.monotonic() + self.settings.kv_lease_s
        while (
            pieces_sent is None
            and time.monotonic() < deadline
            and not await self.liveness.lost(prefill_worker)
        ):
            try:
                news = await asyncio.wait_for(inbox.get(), 0.5)
            except asyncio.TimeoutError:
                continue
            if not news.ok:
                pieces_sent = news.pieces_sent
        await discard(self.plane, receiver.unfilled(pieces_sent or 0), self.settings.kv_lease_s)

    async def on_prefill_result(self, result: PrefillResult, respond) -> None:
        waiting = self.results.get(result.base_tag)
        if waiting is not None:
            waiting.put_nowait(result)

    def _track(self, task: asyncio.Task) -> None:
        """Keeps a background task alive until it ends; its outcome only matters to the log."""
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)
        task.add_done_callback(lambda t: t.cancelled() or t.exception())
