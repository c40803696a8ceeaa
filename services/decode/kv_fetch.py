"""KVFetcher: a decode worker's side of every KV transfer, from reserved blocks to landed KV.

For a remote prefill the decode worker has reserved the prompt's blocks in its own pool (reusing
any prefix it holds). `open` makes the InboundTransfer that owns them (kv_transfer.py: its states
and events); `fetch` drives it: posts a UCX receive for every piece straight into the blocks,
sends the prefill worker their descriptors (NATS), and waits while the pieces land as the
prefill computes. The fetcher only routes PrefillResults to their transfer by base tag, asks
Liveness (in `_lost`, the one place), does each step's I/O, and keeps the quarantine list. The
blocks may be freed once the transfer is settled (DecodeRequest.may_free).
"""

import asyncio
import dataclasses
import logging
import secrets
import time

from services.decode.kv_transfer import InboundTransfer, TransferState
from services.decode.request import DecodeRequest
from shared.control.bus import BusError, MessageBus
from shared.control.failure import Code, failed, worker_failed
from shared.control.liveness import Liveness
from shared.control.messages import (
    KVDestination,
    PrefillResult,
    PrefillTask,
    TaskAck,
    TransferAbort,
)
from shared.control.subjects import Subjects
from shared.dataplane.plan import PlanError, TransferPlan, new_base_tag, segment_tokens
from shared.dataplane.plane import DataPlane
from shared.dataplane.receiver import KVReceiver
from shared.engine.sequence import Sequence, StepOutput
from shared.telemetry import tracing
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

POLL_S = 0.25  # how often the clocks and the prefill worker's liveness are looked at
RECLAIM_POLL_S = 1.0  # how often a quarantine's peer is looked at


@dataclasses.dataclass
class Quarantine:
    """KV blocks a receive that could not be proven ended may still write into, and its peer."""

    blocks: list[int]
    peer: str  # the prefill worker that was sending


@dataclasses.dataclass
class _Table:
    """Blocks to free, in the shape BlockManager.deallocate takes."""

    block_table: list[int]
    num_cached_tokens: int = 0
    num_hashed_blocks: int = 0
    last_block_hash: bytes = b""


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
        self.transfers: dict[int, InboundTransfer] = {}  # base tag -> transfer, until drained
        self.drains: set[asyncio.Task] = set()
        self.quarantined: list[Quarantine] = []  # blocks a receive that never ended may write
        self.transports: set[str] = set()  # what prefill workers said carried KV here

    def open(self, req: DecodeRequest, prefill_worker: str) -> bool:
        """The transfer into req's reserved blocks (RESERVED); False, with req's error set, when
        the reservation does not fit the prompt (a bug, but never a hang)."""
        try:
            plan = self._plan(req)
        except PlanError as err:
            log.exception("%s: no transfer plan", req.attempt_id)
            req.fail(failed(Code.INTERNAL, f"no KV transfer plan: {err}"))
            return False
        req.transfer = InboundTransfer(
            req.attempt_id,
            prefill_worker,
            KVReceiver(self.plane, self.rt.runner.pool, plan),
            lease_s=self.settings.kv_lease_s,
            timeout_s=self.settings.prefill_timeout_s,
            deadline=req.seq.task.deadline,
        )
        req.transfer.choices = req.seq.sampling.n  # the first tokens its prefill must send
        self.transfers[plan.destination.base_tag] = req.transfer
        return True

    def _plan(self, req: DecodeRequest) -> TransferPlan:
        """Where the KV goes: the blocks past the prefix this worker already holds."""
        seq, bs = req.seq, self.rt.blocks.block_size
        destination = KVDestination(
            ucx_address=self.plane.address,
            base_tag=new_base_tag(secrets.randbits(39)),
            block_ids=seq.block_table[seq.num_cached_tokens // bs :],
            skip_tokens=seq.num_cached_tokens,
            segment_tokens=segment_tokens(
                self.settings.kv_segment_tokens, self.rt.runner.pool.device
            ),
            lease_s=self.settings.kv_lease_s,
        )
        return TransferPlan(self.rt.runner.layout, seq.prompt_len, destination)

    async def fetch(self, req: DecodeRequest) -> list[tuple[Sequence, StepOutput]]:
        """Drives req's transfer to COMPLETE (the KV is handed to the engine) or through an abort
        to RELEASED or QUARANTINED (req's error set); either way it is settled on return. What
        the engine produced on landing it (its first token, when the batch had room) is returned:
        to send at once."""
        t = req.transfer
        asking = None
        try:
            await self._plane_ready(t)
            if t.active:
                t.post_receives()
            if t.active:
                t.requested()
                asking = asyncio.ensure_future(self._ask(req, t))
            await self._follow(t)
        except Exception as err:  # a bug: the request fails, the transfer ends, nothing hangs
            log.exception("%s: KV fetch failed", req.attempt_id)
            t.on_bug(err)
        finally:
            if asking is not None:
                asking.cancel()  # ended, or this fetch was cancelled: nobody waits for the answer
            if t.state is not TransferState.ABORTING:
                self._forget(t)
        if t.state is TransferState.COMPLETE:
            return self._land(req, t)
        await self._abort(req, t)
        return []

    async def _plane_ready(self, t: InboundTransfer) -> None:
        """Waits (up to a lease) for a data plane that is restarting (its helper replaced); the
        destination then names the one up now. One still down fails the receives at once."""
        if await self.plane.ready(self.settings.kv_lease_s):
            plan = t.receiver.plan
            if plan.destination.ucx_address != self.plane.address:
                plan.destination = dataclasses.replace(
                    plan.destination, ucx_address=self.plane.address
                )

    async def _ask(self, req: DecodeRequest, t: InboundTransfer) -> None:
        """Sends the PrefillTask; its TaskAck (or its absence) is the transfer's next event."""
        subject = self.subjects.prefill_tasks(t.prefill_worker)
        try:
            ack = await self.bus.request(subject, self._task(req, t), 5.0, TaskAck)
        except BusError:
            t.on_no_answer()
            return
        except Exception as err:  # a bug
            log.exception("%s: KV fetch failed", req.attempt_id)
            t.on_bug(err)
            return
        t.on_ack(ack)

    def _task(self, req: DecodeRequest, t: InboundTransfer) -> PrefillTask:
        return PrefillTask(
            task=req.seq.task,
            layout=self.rt.runner.layout,
            destination=t.receiver.plan.destination,
            decode_worker=self.rt.worker_id,
        )

    async def _follow(self, t: InboundTransfer) -> None:
        """Until the transfer ends: its events come by themselves; the clocks and the prefill
        worker's liveness are looked at between them."""
        while t.active:
            t.tick()
            if t.active and await self._lost(t.prefill_worker):
                t.on_peer_lost()
            if t.active:
                t.news.clear()
                try:
                    await asyncio.wait_for(t.news.wait(), POLL_S)
                except asyncio.TimeoutError:
                    pass

    async def _lost(self, worker_id: str) -> bool:
        return await self.liveness.lost(worker_id)

    def _land(self, req: DecodeRequest, t: InboundTransfer) -> list[tuple[Sequence, StepOutput]]:
        """COMPLETE: the timings come from the transfer, and the sequence joins the batch."""
        seq, result = req.seq, t.result
        seq.first_tokens, req.prefill_worker = result.first_tokens, result.prefill_worker
        seq.first_logprobs = result.first_logprobs
        seq.queue_ms, seq.prefill_ms = result.queue_ms, result.prefill_ms
        seq.cached_tokens = result.cached_tokens
        seq.kv_transfer_ms, seq.kv_exposed_ms = t.kv_transfer_ms, t.kv_exposed_ms
        self.rt.metrics.on_transfer(t.kv_transfer_ms, t.kv_exposed_ms)
        landed = tracing.now()
        tracing.record("decode.kv_receive", req.trace, landed - t.kv_transfer_ms / 1000, landed)
        if result.transport:
            self.transports.add(result.transport)
        return self.rt.engine.kv_arrived(seq)

    async def _abort(self, req: DecodeRequest, t: InboundTransfer) -> None:
        """ABORTING: req gets the cause as its error, the prefill worker is told, every receive
        is ended (RELEASED, or QUARANTINED with its blocks out of use), pieces sent drain."""
        cause = t.cause
        if not req.cancel_reason:
            req.fail(cause.failure)
        if cause.tell_prefill:
            await self._tell_prefill(req, t)
        if await t.receiver.abort(self.settings.kv_lease_s):
            t.released()
        else:  # a receive may still write there: out of use until the prefill worker is gone
            held = Quarantine(req.seq.block_table, t.prefill_worker)
            self.quarantined.append(held)
            req.seq.block_table = []
            t.quarantined()
            self._track(asyncio.create_task(self._reclaim(held)))
        drain = self._track(asyncio.create_task(self._drain(t)))
        drain.add_done_callback(self._drained(t))

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        """A task of this fetcher's own: cancelled at shutdown (see DecodeWorker._cancel_tasks)."""
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)
        return task

    async def _reclaim(self, held: "Quarantine") -> None:
        """Frees quarantined blocks once their peer is known gone: nothing can write there any
        more. (A peer that lives on keeps them out of use, counted in every heartbeat.)"""
        while not await self._lost(held.peer):
            await asyncio.sleep(RECLAIM_POLL_S)
        with self.rt.engine.lock:
            self.rt.blocks.deallocate(_Table(held.blocks))
        self.quarantined.remove(held)
        log.info("reclaimed %d quarantined KV blocks: %s is gone", len(held.blocks), held.peer)

    async def _tell_prefill(self, req: DecodeRequest, t: InboundTransfer) -> None:
        reason = req.cancel_reason or (req.failure.message if req.failure else "")
        message = TransferAbort(attempt_id=req.attempt_id, base_tag=t.base_tag, reason=reason)
        try:
            await self.bus.publish(self.subjects.transfer_aborts(t.prefill_worker), message)
        except Exception as err:  # the prefill worker's own lease ends its side
            log.warning("could not tell %s to abort %s: %s", t.prefill_worker, req.attempt_id, err)

    async def _drain(self, t: InboundTransfer) -> None:
        """Takes off the wire the pieces the prefill worker sent before it heard of the abort:
        how many, its failure result says (waited for up to a lease, unless it is gone)."""
        gives_up_at = time.monotonic() + self.settings.kv_lease_s
        while (
            t.cause.pieces_sent is None
            and time.monotonic() < gives_up_at
            and not await self._lost(t.prefill_worker)
        ):
            t.news.clear()
            try:
                await asyncio.wait_for(t.news.wait(), 0.5)
            except asyncio.TimeoutError:
                continue
        sent = t.cause.pieces_sent or 0
        await self.plane.discard(t.receiver.unfilled(sent), self.settings.kv_lease_s)

    def _drained(self, t: InboundTransfer):
        def done(task: asyncio.Task) -> None:
            self._forget(t)
            task.cancelled() or task.exception()  # its outcome only matters to the log

        return done

    def _forget(self, t: InboundTransfer) -> None:
        if self.transfers.get(t.base_tag) is t:
            del self.transfers[t.base_tag]

    async def on_prefill_result(self, result: PrefillResult, respond) -> None:
        t = self.transfers.get(result.base_tag)
        if t is not None:
            if result.ok and len(result.first_tokens) != t.choices:  # a faulty prefill worker
                why = f"sent {len(result.first_tokens)} first tokens for {t.choices} choices"
                failure = worker_failed(
                    t.prefill_worker, f"prefill worker {t.prefill_worker} {why}"
                )
                result = dataclasses.replace(result, failure=failure)
            t.on_result(result)
