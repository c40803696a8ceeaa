"""KVFetcher: a decode worker's side of every KV transfer, from reserved blocks to landed KV.

For a remote prefill the decode worker has reserved the prompt's blocks in its own pool (reusing
any prefix it holds). `open` makes the InboundTransfer that owns them (inbound.py: its states and
events) over its connector's receiver; `fetch` drives it: posts a receive for every piece straight
into the blocks, sends the prefill worker their descriptors (NATS), and waits while the pieces
land as the prefill computes. The fetcher only routes PrefillResults to their transfer by base
tag, asks Liveness (in `_lost`, the one place), does each step's I/O, and keeps the quarantine
list. Once `fetch` returns the transfer is settled: COMPLETE (the worker hands the KV to its
engine) or ended with its `cause` (the worker fails the request); the blocks may be freed.
"""

import asyncio
import dataclasses
import logging
import secrets
import time
from collections.abc import Callable

from shared.control.bus import BusError, MessageBus
from shared.control.failure import worker_failed
from shared.control.liveness import Liveness
from shared.control.messages import (
    GenerateTask,
    KVDestination,
    KVLayout,
    PrefillResult,
    PrefillTask,
    TaskAck,
    TransferAbort,
)
from shared.control.subjects import Subjects
from shared.dataplane.plane import DataPlane
from shared.engine.sequence import Sequence
from shared.kvtransfer.connector import KVConnector
from shared.kvtransfer.inbound import InboundTransfer, TransferState
from shared.kvtransfer.plan import new_base_tag, segment_tokens

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class FetchTimes:
    """The decode side's clocks (from the worker's settings)."""

    lease_s: float  # no progress this long ends a transfer; also the longest wait to end one
    prefill_timeout_s: float  # the prefill worker's time from accepting to the last piece
    ask_timeout_s: float  # for the prefill worker's TaskAck
    poll_s: float  # how often the clocks and the prefill worker's liveness are looked at
    reclaim_poll_s: float  # how often a quarantine's peer is looked at


@dataclasses.dataclass
class Quarantine:
    """KV blocks a receive that could not be proven ended may still write into, and its peer."""

    blocks: list[int]
    peer: str  # the prefill worker that was sending


class KVFetcher:
    def __init__(
        self,
        worker_id: str,
        layout: KVLayout,
        connector: KVConnector,
        segment_tokens: int,
        times: FetchTimes,
        bus: MessageBus,
        liveness: Liveness,
        free_blocks: Callable[[list[int]], None],
        subjects: Subjects,
    ):
        self.worker_id = worker_id
        self.layout = layout
        self.connector = connector
        self.segment_tokens = segment_tokens  # configured; 0: the pool's default
        self.times = times
        self.bus = bus
        self.liveness = liveness
        self.free_blocks = free_blocks  # the engine's, for quarantined blocks reclaimed
        self.subjects = subjects
        self.transfers: dict[int, InboundTransfer] = {}  # base tag -> transfer, until drained
        self.drains: set[asyncio.Task] = set()
        self.quarantined: list[Quarantine] = []  # blocks a receive that never ended may write
        self.transports: set[str] = set()  # what prefill workers said carried KV here

    @property
    def plane(self) -> DataPlane:
        return self.connector.plane

    def open(self, seq: Sequence, prefill_worker: str, prefill_tp: int = 1) -> InboundTransfer:
        """The transfer into seq's reserved blocks (RESERVED) from a prefill worker of
        `prefill_tp` ranks; PlanError when the reservation does not fit the prompt (a bug, but
        never a hang)."""
        bs = self.layout.block_size
        destination = KVDestination(
            ucx_address=self.plane.address,
            base_tag=new_base_tag(secrets.randbits(39)),
            block_ids=seq.block_table[seq.num_cached_tokens // bs :],
            skip_tokens=seq.num_cached_tokens,
            segment_tokens=segment_tokens(self.segment_tokens, self.connector.pools[0].device),
            lease_s=self.times.lease_s,
            connector=self.connector.name,
            prefill_tp=prefill_tp,
            decode_tp=len(self.connector.pools),
        )
        t = InboundTransfer(
            seq.attempt_id,
            prefill_worker,
            self.connector.reserve(self.layout, seq.prompt_len, destination),
            lease_s=self.times.lease_s,
            timeout_s=self.times.prefill_timeout_s,
            deadline=seq.deadline,
        )
        t.choices = seq.sampling.n  # the first tokens its prefill must send
        self.transfers[destination.base_tag] = t
        return t

    async def fetch(self, t: InboundTransfer, seq: Sequence, task: GenerateTask) -> None:
        """Drives the transfer into seq's blocks to COMPLETE (the first tokens and timings written
        into seq), or through an abort to RELEASED or QUARANTINED (its `cause` says why); either
        way it is settled on return. `task`: the request, as the prefill worker is asked it."""
        asking = None
        try:
            await self._plane_ready(t)
            if t.active:
                t.post_receives()
            if t.active:
                t.requested()
                asking = asyncio.ensure_future(self._ask(t, task))
            await self._follow(t)
        except Exception as err:  # a bug: the request fails, the transfer ends, nothing hangs
            log.exception("%s: KV fetch failed", t.attempt_id)
            t.on_bug(err)
        finally:
            if asking is not None:
                asking.cancel()  # ended, or this fetch was cancelled: nobody waits for the answer
            if t.state is not TransferState.ABORTING:
                self._forget(t)
        if t.state is TransferState.COMPLETE:
            self._complete(t, seq)
        else:
            await self._abort(t, seq)

    def _complete(self, t: InboundTransfer, seq: Sequence) -> None:
        """COMPLETE: what the prefill computed and how the KV came, written into the sequence.
        Its penalties need nothing more: appending the first tokens (Engine.kv_arrived) and its
        prompt are all its counts are made of."""
        result = t.result
        seq.first_tokens, seq.first_logprobs = result.first_tokens, result.first_logprobs
        seq.prompt_logprobs = result.prompt_logprobs
        seq.queue_ms, seq.prefill_ms = result.queue_ms, result.prefill_ms
        seq.cached_tokens = result.cached_tokens
        seq.kv_transfer_ms, seq.kv_exposed_ms = t.kv_transfer_ms, t.kv_exposed_ms
        if result.transport:
            self.transports.add(result.transport)

    async def _plane_ready(self, t: InboundTransfer) -> None:
        """Waits (up to a lease) for a data plane that is restarting (its helper replaced); the
        destination then names the one up now. One still down fails the receives at once."""
        if await self.plane.ready(self.times.lease_s):
            plan = t.receiver.plan
            if plan.destination.ucx_address != self.plane.address:
                plan.destination = dataclasses.replace(
                    plan.destination, ucx_address=self.plane.address
                )

    async def _ask(self, t: InboundTransfer, task: GenerateTask) -> None:
        """Sends the PrefillTask; its TaskAck (or its absence) is the transfer's next event."""
        subject = self.subjects.prefill_tasks(t.prefill_worker)
        ask = PrefillTask(task, self.layout, t.receiver.plan.destination, self.worker_id)
        try:
            ack = await self.bus.request(subject, ask, self.times.ask_timeout_s, TaskAck)
        except BusError:
            t.on_no_answer()
            return
        except Exception as err:  # a bug
            log.exception("%s: KV fetch failed", t.attempt_id)
            t.on_bug(err)
            return
        t.on_ack(ack)

    async def _follow(self, t: InboundTransfer) -> None:
        """Until the transfer ends: its events come by themselves; the clocks and the prefill
        worker's liveness are looked at between them."""
        while t.active:
            t.tick()
            if t.active and await self._lost(t.prefill_worker):
                t.on_peer_lost()
            if t.active:
                await self._news(t)

    async def _news(self, t: InboundTransfer) -> None:
        """Until the transfer changes, or a poll interval passes."""
        t.news.clear()
        try:
            await asyncio.wait_for(t.news.wait(), self.times.poll_s)
        except asyncio.TimeoutError:
            pass

    async def _lost(self, worker_id: str) -> bool:
        return await self.liveness.lost(worker_id)

    async def _abort(self, t: InboundTransfer, seq: Sequence) -> None:
        """ABORTING: the prefill worker is told, every receive is ended (RELEASED, or
        QUARANTINED with its blocks out of use), pieces sent drain."""
        if t.cause.tell_prefill:
            await self._tell_prefill(t)
        if await t.receiver.abort(self.times.lease_s):
            t.released()
        else:  # a receive may still write there: out of use until the prefill worker is gone
            held = Quarantine(seq.block_table, t.prefill_worker)
            self.quarantined.append(held)
            seq.block_table = []
            t.quarantined()
            self._track(asyncio.create_task(self._reclaim(held)))
        drain = self._track(asyncio.create_task(self._drain(t)))
        drain.add_done_callback(self._drained(t))

    def _track(self, task: asyncio.Task) -> asyncio.Task:
        """A task of this fetcher's own: cancelled at shutdown (`drains`)."""
        self.drains.add(task)
        task.add_done_callback(self.drains.discard)
        return task

    async def _reclaim(self, held: Quarantine) -> None:
        """Frees quarantined blocks once their peer is known gone: nothing can write there any
        more. (A peer that lives on keeps them out of use, counted in every heartbeat.)"""
        while not await self._lost(held.peer):
            await asyncio.sleep(self.times.reclaim_poll_s)
        self.free_blocks(held.blocks)
        self.quarantined.remove(held)
        log.info("reclaimed %d quarantined KV blocks: %s is gone", len(held.blocks), held.peer)

    async def _tell_prefill(self, t: InboundTransfer) -> None:
        reason = t.cause.failure.message
        message = TransferAbort(attempt_id=t.attempt_id, base_tag=t.base_tag, reason=reason)
        try:
            await self.bus.publish(self.subjects.transfer_aborts(t.prefill_worker), message)
        except Exception as err:  # the prefill worker's own lease ends its side
            log.warning("could not tell %s to abort %s: %s", t.prefill_worker, t.attempt_id, err)

    async def _drain(self, t: InboundTransfer) -> None:
        """Takes off the wire the pieces the prefill worker sent before it heard of the abort:
        how many, its failure result says (waited for up to a lease, unless it is gone)."""
        gives_up_at = time.monotonic() + self.times.lease_s
        while (
            t.cause.pieces_sent is None
            and time.monotonic() < gives_up_at
            and not await self._lost(t.prefill_worker)
        ):
            await self._news(t)
        sent = t.cause.pieces_sent or 0
        await self.plane.discard(t.receiver.unfilled(sent), self.times.lease_s)

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
