"""KVShipper: a prefill worker's side of every KV transfer, from an accepted task to the last
piece on the wire, the I/O that KVFetcher does on the decode side.

Each accepted PrefillTask becomes an OutboundTransfer (outbound.py: its states and events) over
its connector's sender. After each engine step the worker hands the shipper what the step
produced: every segment whose tokens are now computed is put on the wire while the next chunks
compute (chunk-wise pipelining), and when a prompt is done its decode worker is told the first
tokens. A prompt's blocks are held until every piece has left (pieces go straight from the pool
where they can). Each transfer has a lease: a send that makes no progress for `lease_s` fails,
and a TransferAbort from the decode worker stops it at the next step.
"""

import asyncio
import logging
from collections.abc import Callable

from shared.control.bus import MessageBus
from shared.control.failure import Failure
from shared.control.messages import PrefillResult, PrefillTask, TransferAbort
from shared.control.subjects import Subjects
from shared.dataplane.plane import DataPlane, KVTransferError
from shared.engine.kv_cache import KVPool
from shared.engine.sequence import Sequence, StepOutput
from shared.job_thread import JobThread
from shared.kvtransfer.connector import connector
from shared.kvtransfer.outbound import OutboundState, OutboundTransfer, send_failure
from shared.kvtransfer.plan import PlanError
from shared.kvtransfer.sender import KVSender

log = logging.getLogger(__name__)


class KVShipper:
    def __init__(
        self,
        worker_id: str,
        plane: DataPlane,
        pools: list[KVPool],
        bus: MessageBus,
        subjects: Subjects,
        executor: JobThread,
        free_blocks: Callable[[Sequence], None],
        on_freed: Callable[[], None],
    ):
        self.worker_id = worker_id
        self.plane = plane
        self.pools = pools  # each rank's
        self.bus = bus
        self.subjects = subjects
        self.executor = executor  # stages and gathers run in the engine thread, between steps
        self.free_blocks = free_blocks  # the engine's release: between steps only
        self.on_freed = on_freed  # blocks came free early (an abort): the scheduler may hear now
        self.held: dict[str, OutboundTransfer] = {}  # attempt id -> its transfer, until released
        self.finishing: set[asyncio.Task] = set()
        self.served = 0  # transfers whose every piece left

    def sender(self, task: PrefillTask) -> KVSender:
        """The sender of the task's KV, by the connector its destination names; PlanError when
        the destination does not fit the prompt, names a connector this worker lacks, or
        takes this worker for another degree than its own."""
        if task.destination.prefill_tp != len(self.pools):
            raise PlanError(
                f"the decode worker planned for a prefill of {task.destination.prefill_tp} "
                f"rank(s); this one has {len(self.pools)}"
            )
        how = connector(task.destination.connector, self.plane, self.pools)
        prompt_len = len(task.task.prompt_token_ids)
        return how.sender(task.layout, prompt_len, task.destination)

    def hold(self, task: PrefillTask, seq: Sequence, sender: KVSender) -> None:
        """The transfer of a task the engine computes from now on (QUEUED)."""
        self.held[task.attempt_id] = OutboundTransfer(task, seq, sender, self.free_blocks)

    def computing(self) -> bool:
        """Some prompt is still being computed."""
        return any(t.computing for t in self.held.values())

    @property
    def queued(self) -> int:
        return sum(t.state is OutboundState.QUEUED for t in self.held.values())

    def tables(self) -> list[list[int]]:
        """The block tables transfers hold."""
        return [t.seq.block_table for t in self.held.values() if t.holds_blocks]

    # -- events from the control plane (acted on between engine steps) ---------------------------

    def on_cancel(self, attempt_id: str, reason: str) -> bool:
        t = self.held.get(attempt_id)
        if t is not None:
            t.on_cancel(reason)
        return t is not None

    def on_abort(self, message: TransferAbort) -> bool:
        """The decode worker gave up on this transfer: it stops at the next step."""
        t = self.held.get(message.attempt_id)
        if t is None or not t.on_transfer_abort(message.base_tag, message.reason):
            return False
        log.info("%s: transfer aborted by its decode worker: %s", t.attempt_id, message.reason)
        return True

    # -- between engine steps ----------------------------------------------------------------------

    async def abort_due(self) -> None:
        """The aborts due now (cancels, deadlines, the decode worker's TransferAborts)."""
        for t in list(self.held.values()):
            due = t.pending_abort()
            if due is not None:
                await self._abort(t, due)

    async def abort_computing(self, failure: Failure) -> None:
        """Every prompt still computing fails with `failure` (a failed step, a shutdown)."""
        for t in [t for t in self.held.values() if t.computing]:
            await self._abort(t, failure)

    async def after_step(self, outputs: list[tuple[Sequence, StepOutput]]) -> None:
        """The prompts a step finished have their first tokens; computed segments go out."""
        for seq, out in outputs:
            self.held[seq.attempt_id].on_prompt_done(out)
        await self._ship()

    async def settle(self) -> None:
        """Waits for the transfers in flight to finish (each is bounded by its lease)."""
        if self.finishing:
            await asyncio.gather(*self.finishing, return_exceptions=True)

    # -- the I/O ---------------------------------------------------------------------------------

    async def _ship(self) -> None:
        """Puts every segment whose tokens are computed on the wire: first the pieces that go
        straight from the pool, then, gathered while those travel, the others."""
        ready = [(t, seg) for t in self.held.values() for seg in t.ready()]
        if not ready:
            return
        staged = await self.executor.run(
            lambda: [t.sender.stage(seg, t.seq.block_table) for t, seg in ready]
        )
        live = [(t, st) for (t, _), st in zip(ready, staged) if t.computing]
        for t, st in live:
            t.sender.send(st.direct)
        if any(st.scattered for _, st in live):
            gathered = await self.executor.run(lambda: [t.sender.gather(st) for t, st in live])
            for (t, _), pieces in zip(live, gathered):
                if t.computing:
                    t.sender.send(pieces)
        for t in {id(t): t for t, _ in live}.values():
            if t.on_all_staged():
                await self._finish(t)

    async def _finish(self, t: OutboundTransfer) -> None:
        """The whole prompt is computed and on the wire: tell the decode worker its first token."""
        transport = self.plane.transport_to(t.task.destination.ucx_address)
        await self._publish(t, t.result(self.worker_id, transport))
        self._await_sends(t)

    def _await_sends(self, t: OutboundTransfer) -> None:
        task = asyncio.create_task(self._sends_done(t))
        self.finishing.add(task)
        task.add_done_callback(self.finishing.discard)

    async def _sends_done(self, t: OutboundTransfer) -> None:
        """When every piece has left (or failed, at the latest after a lease), the blocks go."""
        try:
            await t.sender.finish()
            if t.state is OutboundState.SENDING:
                self.served += 1
        except KVTransferError as err:
            if t.state is OutboundState.SENDING:
                t.abort()
                log.error("KV of %s to %s not sent: %s", t.attempt_id, t.task.decode_worker, err)
                lost = send_failure(self.worker_id, err)
                await self._publish(t, t.aborted(self.worker_id, lost))
        finally:
            t.on_sends_done()
            self._forget(t)

    def _forget(self, t: OutboundTransfer) -> None:
        if self.held.get(t.attempt_id) is t:
            del self.held[t.attempt_id]

    async def _abort(self, t: OutboundTransfer, failure: Failure) -> None:
        """Stops a transfer (between engine steps): no more segments, its blocks freed now, its
        decode worker told how far it got. Pieces still on the wire may read reused blocks; they
        belong to the aborted transfer, and the decode worker discards them."""
        watch = t.abort()
        await self._publish(t, t.aborted(self.worker_id, failure))
        self.on_freed()
        if watch:
            self._await_sends(t)
        elif t.state is OutboundState.RELEASED:
            self._forget(t)

    async def _publish(self, t: OutboundTransfer, result: PrefillResult) -> None:
        try:
            await self.bus.publish(self.subjects.prefill_results(t.task.decode_worker), result)
        except Exception as err:  # NATS down: the decode worker's lease ends the transfer
            log.warning("could not tell %s about %s: %s", t.task.decode_worker, t.attempt_id, err)
