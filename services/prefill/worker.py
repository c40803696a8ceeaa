"""PrefillWorker: batches the prompts decode workers send it, and streams each prompt's KV out.

The loop reads: drain inputs -> the aborts due -> step the engine (prompt chunks of many requests
in one batch) -> ship: the KVShipper (shared.kvtransfer.ship) puts every segment whose tokens are
now computed on the wire while the next chunks compute, and tells a decode worker its first
tokens when its prompt is done. This worker admits tasks and steps the engine; every byte and
message of a transfer is the shipper's.
"""

import asyncio
import logging
from dataclasses import asdict

from shared.control.bus import MessageBus
from shared.control.failure import Code, Failure, failed, worker_failed, worker_full
from shared.control.messages import (
    CancelRequest,
    PrefillTask,
    TaskAck,
    TransferAbort,
    WorkerHeartbeat,
)
from shared.control.subjects import Subjects
from shared.control.worker_roles import Role
from shared.dataplane.plane import DataPlane
from shared.engine.sequence import Sequence
from shared.engine.step_runner import RunnerLost
from shared.job_thread import JobThread
from shared.kvtransfer.plan import PlanError
from shared.kvtransfer.ship import KVShipper
from shared.worker import steps
from shared.worker.announcer import Announcer
from shared.worker.heartbeat import heartbeat, leaked_blocks
from shared.worker.runtime import WorkerRuntime, constrained
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
        self.executor = JobThread()
        self.wakeup = asyncio.Event()
        self.stopping = False
        self.announcer = Announcer(
            bus,
            self.subjects,
            runtime.worker_id,
            self.snapshot,
            settings.heartbeat_interval_s,
            settings.alive_file,
        )
        self.ship = KVShipper(
            runtime.worker_id,
            plane,
            runtime.pools,
            bus,
            self.subjects,
            self.executor,
            self.engine.release,
            self.announcer.nudge,
        )

    def snapshot(self) -> WorkerHeartbeat:
        held, queued = len(self.ship.held), self.ship.queued
        return heartbeat(
            self.rt,
            self.settings,
            self.plane,
            self.bus,
            role=Role.PREFILL,
            running=held - queued,
            queued=queued,
            served=self.ship.served,
            leaked=leaked_blocks(self.rt, self.ship.tables),
            transport=self.plane.transports(),
            stopping=self.stopping,
        )

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
            settle_tasks=self.ship.settle,
        ).serve(stop)

    async def _run(self, stop: asyncio.Event) -> None:
        await steps.step_until_stopped(self._iterate, self.wakeup, stop)

    def _stop_accepting(self) -> None:
        self.stopping = True

    async def _drain(self, timeout_s: float) -> None:
        """Computes and sends the prompts already accepted, for up to `timeout_s`."""
        log.info("draining %d prompt(s) for up to %.0fs", len(self.ship.held), timeout_s)
        poll_s = self.settings.kv_poll_s  # deadlines and aborts no message announces
        await steps.drain(self._iterate, self.wakeup, self.ship.computing, timeout_s, poll_s)

    async def _abort_rest(self) -> None:
        await self.ship.abort_computing(self._shut_down())  # not computed in time

    # -- inputs ---------------------------------------------------------------------------------

    async def on_task(self, task: PrefillTask, respond) -> None:
        refusal, mask = self._refusal(task), None
        if refusal is None and task.task.sampling.constraint is not None:
            mask, refusal = await constrained(self.rt, task.task)
            refusal = refusal or self._refusal(task)  # stopping, a duplicate... meanwhile
        if refusal is None:
            try:
                sender = self.ship.sender(task)
            except PlanError as err:
                refusal = failed(Code.INVALID_ARGUMENT, f"bad KV destination: {err}")
        if refusal is None:
            seq = (
                Sequence.from_task(  # the end tokens: min_tokens may hold them back from the first
                    task.task, None, self.rt.eos_token_ids, self.rt.max_model_len, True, mask
                )
            )
            self.ship.hold(task, seq, sender)
            self.engine.add(seq)
            self.wakeup.set()
            self.announcer.nudge()  # the schedulers hear of it soon (a gateway may have placed it)
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
        if task.layout != self.rt.layout:
            message = (
                f"KV layout mismatch: decode has {asdict(task.layout)}, "
                f"prefill {me} has {asdict(self.rt.layout)}"
            )
            return failed(Code.FAILED_PRECONDITION, message, me)
        if task.attempt_id in self.ship.held:
            # no Code.ALREADY_EXISTS: the client gets INTERNAL, as it always did
            return failed(Code.INTERNAL, f"attempt {task.attempt_id} is already here", me)
        if len(self.ship.held) >= self.settings.max_queue:
            return worker_full(me, f"prefill worker {me} queue is full")
        if self.rt.blocks.blocks_for(len(task.task.prompt_token_ids)) > self.rt.blocks.num_blocks:
            return worker_full(me, "prompt is larger than the prefill worker's KV budget")
        return None

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        if self.ship.on_cancel(message.attempt_id, message.reason or "cancelled"):
            self.wakeup.set()

    async def on_abort(self, message: TransferAbort, respond) -> None:
        """The decode worker gave up on this transfer: stop it and free its blocks now."""
        if self.ship.on_abort(message):
            self.wakeup.set()

    # -- the loop -------------------------------------------------------------------------------

    async def _iterate(self) -> bool:
        await self.ship.abort_due()
        if not self.engine.has_work():
            return False
        try:
            outputs = await self.executor.run(self.engine.step)
        except RunnerLost:
            raise  # the worker goes; its prompts are placed elsewhere (shared.worker.serve)
        except Exception as err:
            log.exception("prefill step failed")
            message = f"prefill failed: {type(err).__name__}"
            await self.ship.abort_computing(failed(Code.INTERNAL, message, self.rt.worker_id))
            return True
        if outputs is None:
            return False
        await self.ship.after_step(outputs)
        return True

    def _shut_down(self) -> Failure:
        """A prompt not computed before this worker shut down: placed again elsewhere."""
        return worker_failed(self.rt.worker_id, f"prefill worker {self.rt.worker_id} shut down")
