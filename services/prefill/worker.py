"""PrefillWorker: batches the prompts decode workers send it, and streams each prompt's KV out over UCX.

The loop reads: drain inputs -> step the engine (prompt chunks of many requests in one batch)
-> ship: every transfer segment whose tokens are now computed is put on the wire while the next
chunks compute (chunk-wise pipelining) -> when a prompt is done, tell its decode worker the
first token. A prompt's blocks are held until every piece has left (pieces go straight from
the pool where they can). Each transfer has a lease: a send that makes no progress for
`lease_s` fails, and a TransferAbort from the decode worker stops it at once. Each prompt's
transfer is an OutboundTransfer (kv_transfer.py: its states and events); this worker does the
I/O of each step.
"""

import asyncio
import logging
from dataclasses import asdict

from services.prefill.kv_transfer import OutboundState, OutboundTransfer, send_failure
from shared.control.bus import MessageBus
from shared.control.failure import Code, Failure, failed, worker_failed, worker_full
from shared.control.messages import (
    CancelRequest,
    PrefillResult,
    PrefillTask,
    TaskAck,
    TransferAbort,
    WorkerHeartbeat,
)
from shared.control.subjects import Subjects
from shared.dataplane.plan import PlanError, TransferPlan
from shared.dataplane.plane import DataPlane, KVTransferError
from shared.dataplane.sender import KVSender
from shared.engine.executor import EngineExecutor
from shared.engine.sequence import Sequence
from shared.worker import steps
from shared.worker.announcer import Announcer
from shared.worker.heartbeat import heartbeat, leaked_blocks
from shared.worker.runtime import WorkerRuntime
from shared.worker.serve import WorkerLifecycle
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class PrefillWorker:
    def __init__(
        self, settings: WorkerSettings, runtime: WorkerRuntime, bus: MessageBus, plane: DataPlane
    ):
        self.settings = settings
        self.rt = runtime
        self.engine = runtime.engine
        self.bus = bus
        self.plane = plane
        self.subjects = Subjects(settings.cluster)
        self.executor = EngineExecutor()
        self.held: dict[str, OutboundTransfer] = {}  # attempt id -> its transfer, until released
        self.finishing: set[asyncio.Task] = set()
        self.wakeup = asyncio.Event()
        self.served = 0
        self.stopping = False
        self.announcer = Announcer(
            bus,
            self.subjects,
            runtime.worker_id,
            self.snapshot,
            settings.heartbeat_interval_s,
            settings.alive_file,
        )

    def snapshot(self) -> WorkerHeartbeat:
        queued = sum(t.state is OutboundState.QUEUED for t in self.held.values())
        return heartbeat(
            self.rt,
            self.settings,
            self.plane,
            self.bus,
            role="prefill",
            running=len(self.held) - queued,
            queued=queued,
            served=self.served,
            leaked=leaked_blocks(self.rt, self._held_tables),
            transport=self.plane.transports(),
            stopping=self.stopping,
        )

    def _held_tables(self) -> list[list[int]]:
        return [t.seq.block_table for t in self.held.values() if t.holds_blocks]

    async def serve(self, stop: asyncio.Event) -> None:
        worker = self.rt.worker_id
        await WorkerLifecycle(
            self.bus,
            self.announcer,
            self.executor,
            self.settings.drain_timeout_s,
            subscriptions=[
                (self.subjects.prefill_tasks(worker), self.on_task),
                (self.subjects.transfer_aborts(worker), self.on_abort),
                (self.subjects.cancel, self.on_cancel),
            ],
            run=self._run,
            stop_accepting=self._stop_accepting,
            drain=self._drain,
            abort_rest=self._abort_rest,
            settle_tasks=self._settle,
        ).serve(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        await steps.step_until_stopped(self._iterate, self.wakeup, stop)

    def _stop_accepting(self) -> None:
        self.stopping = True

    async def _drain(self, timeout_s: float) -> None:
        """Computes and sends the prompts already accepted, for up to `timeout_s`."""
        log.info("draining %d prompt(s) for up to %.0fs", len(self.held), timeout_s)
        await steps.drain(self._iterate, self.wakeup, self._computing, timeout_s, poll_s=0.1)

    def _computing(self) -> bool:
        return any(t.computing for t in self.held.values())

    async def _abort_rest(self) -> None:
        for t in [t for t in self.held.values() if t.computing]:  # not computed in time
            await self._abort(t, self._shut_down())

    async def _settle(self) -> None:
        if self.finishing:  # let transfers in flight finish (each is bounded by its lease)
            await asyncio.gather(*self.finishing, return_exceptions=True)

    # -- inputs ---------------------------------------------------------------------------------

    async def on_task(self, task: PrefillTask, respond) -> None:
        refusal = self._refusal(task)
        if refusal is None:
            try:
                plan = TransferPlan(task.layout, len(task.task.prompt_token_ids), task.destination)
            except PlanError as err:
                refusal = failed(Code.INVALID_ARGUMENT, f"bad KV destination: {err}")
        if refusal is None:
            seq = Sequence(task.task, None, set(), self.rt.max_model_len, prefill_only=True)
            sender = KVSender(self.plane, self.rt.runner.pool, plan, task.destination.lease_s)
            self.held[task.attempt_id] = OutboundTransfer(task, seq, sender, self.engine.release)
            self.engine.add(seq)
            self.wakeup.set()
        elif refusal.code is Code.RESOURCE_EXHAUSTED:
            self.announcer.nudge()  # the scheduler hears now that this worker is full
        if respond is not None:
            await respond(TaskAck(refusal))

    def _refusal(self, task: PrefillTask) -> Failure | None:
        """Why the task is not taken (None: it is), blaming this worker. Full or shutting down:
        the request is placed again; anything else fails it."""
        me = self.rt.worker_id
        if self.stopping:
            return worker_failed(me, f"prefill worker {me} is shutting down")
        if task.layout != self.rt.runner.layout:
            message = (
                f"KV layout mismatch: decode has {asdict(task.layout)}, "
                f"prefill {me} has {asdict(self.rt.runner.layout)}"
            )
            return failed(Code.FAILED_PRECONDITION, message, me)
        if task.attempt_id in self.held:
            # no Code.ALREADY_EXISTS: the client gets INTERNAL, as it always did
            return failed(Code.INTERNAL, f"attempt {task.attempt_id} is already here", me)
        if len(self.held) >= self.settings.max_queue:
            return worker_full(me, f"prefill worker {me} queue is full")
        if self.rt.blocks.blocks_for(len(task.task.prompt_token_ids)) > self.rt.blocks.num_blocks:
            return worker_full(me, "prompt is larger than the prefill worker's KV budget")
        return None

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        t = self.held.get(message.attempt_id)
        if t is not None:
            t.on_cancel(message.reason or "cancelled")
            self.wakeup.set()

    async def on_abort(self, message: TransferAbort, respond) -> None:
        """The decode worker gave up on this transfer: stop it and free its blocks now."""
        t = self.held.get(message.attempt_id)
        if t is not None and t.on_transfer_abort(message.base_tag, message.reason):
            log.info(
                "%s: transfer aborted by its decode worker: %s", message.attempt_id, message.reason
            )
            self.wakeup.set()

    # -- the loop -------------------------------------------------------------------------------

    async def _iterate(self) -> bool:
        for t in list(self.held.values()):
            due = t.pending_abort()
            if due is not None:
                await self._abort(t, due)
        if not self.engine.has_work():
            return False
        try:
            outputs = await self.executor.run(self.engine.step)
        except Exception as err:
            log.exception("prefill step failed")
            for t in [t for t in self.held.values() if t.computing]:
                message = f"prefill failed: {type(err).__name__}"
                await self._abort(t, failed(Code.INTERNAL, message, self.rt.worker_id))
            return True
        if outputs is None:
            return False
        for seq, out in outputs:
            self.held[seq.attempt_id].on_prompt_done(out)
        await self._ship()
        return True

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
        await self._publish(t, t.result(self.rt.worker_id, transport))
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
                log.error(
                    "KV of %s to %s not sent: %s", t.task.attempt_id, t.task.decode_worker, err
                )
                lost = send_failure(self.rt.worker_id, err)
                await self._publish(t, t.aborted(self.rt.worker_id, lost))
        finally:
            t.on_sends_done()
            self._forget(t)

    def _forget(self, t: OutboundTransfer) -> None:
        if self.held.get(t.task.attempt_id) is t:
            del self.held[t.task.attempt_id]

    def _shut_down(self) -> Failure:
        """A prompt not computed before this worker shut down: placed again elsewhere."""
        return worker_failed(self.rt.worker_id, f"prefill worker {self.rt.worker_id} shut down")

    async def _abort(self, t: OutboundTransfer, failure: Failure) -> None:
        """Stops a transfer (between engine steps): no more segments, its blocks freed now, its
        decode worker told how far it got. Pieces still on the wire may read reused blocks; they
        belong to the aborted transfer, and the decode worker discards them."""
        watch = t.abort()
        await self._publish(t, t.aborted(self.rt.worker_id, failure))
        self.announcer.nudge()
        if watch:
            self._await_sends(t)
        elif t.state is OutboundState.RELEASED:
            self._forget(t)

    async def _publish(self, t: OutboundTransfer, result: PrefillResult) -> None:
        try:
            await self.bus.publish(self.subjects.prefill_results(t.task.decode_worker), result)
        except Exception as err:  # NATS down: the decode worker's lease ends the transfer
            log.warning(
                "could not tell %s about %s: %s", t.task.decode_worker, t.task.attempt_id, err
            )
