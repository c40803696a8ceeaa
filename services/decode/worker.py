"""DecodeWorker: admits assignments, has each prompt's KV fetched from a prefill worker
(shared.kvtransfer's KVFetcher, by the configured connector) or prefills it here, and streams the
tokens back to the gateway.
"""

import asyncio
import logging

from services.decode.decode_loop import QUEUED, RUNS, DecodeLoop
from services.decode.request import DecodeRequest
from services.decode.stepper import Stepper
from services.decode.token_streams import TokenStreams
from shared.control.bus import MessageBus
from shared.control.choices import choice_task
from shared.control.failure import Code, Failure, failed, worker_failed, worker_full
from shared.control.liveness import Liveness
from shared.control.messages import CancelRequest, DecodeAssignment, TaskAck, WorkerHeartbeat
from shared.control.recent import RecentIds
from shared.control.subjects import Subjects
from shared.dataplane.plane import DataPlane
from shared.engine.detokenizer import Detokenizer
from shared.engine.sequence import Sequence, StepOutput
from shared.job_thread import JobThread
from shared.kvtransfer.connector import connector
from shared.kvtransfer.fetch import KVFetcher
from shared.kvtransfer.inbound import TransferState
from shared.kvtransfer.plan import PlanError
from shared.telemetry import tracing
from shared.worker.announcer import Announcer
from shared.worker.heartbeat import heartbeat, leaked_blocks
from shared.worker.runtime import WorkerRuntime, constrained
from shared.worker.serve import WorkerLifecycle
from shared.worker.settings import WorkerSettings

log = logging.getLogger(__name__)


class DecodeWorker:
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
        self.executor = JobThread()
        self.out = TokenStreams(
            bus,
            runtime.worker_id,
            settings.stream_retain_s,
            settings.max_held_chunks,
            lambda: self.loop.wakeup.set(),
            runtime.metrics,
        )
        stepper = Stepper(runtime.engine, self.executor, settings.steps_ahead)
        self.loop = DecodeLoop(stepper, self.out.publish_step, self._finish, self._adopt)
        self.kv = self._fetcher()
        self.fetches: dict[str, asyncio.Task] = {}  # attempt id -> its remote-prefill task
        # A cancel can overtake its assignment (the gateway gave up while the scheduler placed it).
        self.cancelled = RecentIds(ttl_s=120)
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

    def _fetcher(self) -> KVFetcher:
        """This worker's side of KV transfers, by the connector its settings name."""
        s, rt = self.settings, self.rt
        return KVFetcher(
            rt.worker_id,
            rt.layout,
            connector(s.kv_connector, self.plane, rt.pools),
            s.kv_segment_tokens,
            s.fetch_times(),
            self.bus,
            self.liveness,
            self._free_blocks,
            self.subjects,
        )

    def snapshot(self) -> WorkerHeartbeat:
        return heartbeat(
            self.rt,
            self.settings,
            self.plane,
            self.bus,
            role=self.rt.role,
            running=self.loop.count(*RUNS),
            queued=self.loop.count(*QUEUED),
            served=self.served,
            leaked=leaked_blocks(self.rt, self._held_tables),
            quarantined=sum(len(q.blocks) for q in self.kv.quarantined),
            transport=",".join(sorted(self.kv.transports)),
            stopping=self.stopping,
        )

    def _held_tables(self) -> list[list[int]]:
        held = [r.seq.block_table for r in self.loop.requests.values()]
        forked = [seq.block_table for seq in self.rt.engine.forked]  # not adopted yet
        releasing = [seq.block_table for seq in self.rt.engine.releasing]  # freed after a step
        return held + forked + releasing + [q.blocks for q in self.kv.quarantined]

    async def serve(self, stop: asyncio.Event) -> None:
        worker = self.rt.worker_id
        await WorkerLifecycle(
            self.bus,
            self.announcer,
            self.executor,
            self.settings.drain_timeout_s,
            subscriptions=[
                (self.subjects.decode_tasks(worker), self.on_assignment),
                (self.subjects.prefill_results(worker), self.kv.on_prefill_result),
                (self.subjects.cancel, self.on_cancel),
                (self.subjects.stream_replay(worker), self.out.on_replay),
            ],
            run=self.loop.run,
            stop_accepting=self._stop_accepting,
            drain=self._drain,
            abort_rest=self._abort_rest,
            cancel_tasks=self._cancel_tasks,
        ).serve(stop)

    def _stop_accepting(self) -> None:
        self.stopping = True

    async def _drain(self, timeout_s: float) -> None:
        log.info("draining %d request(s) for up to %.0fs", len(self.loop.requests), timeout_s)
        await self.loop.drain(timeout_s)

    async def _abort_rest(self) -> None:
        await self.loop.abort_all(self._shut_down())  # the gateway moves them elsewhere

    def _cancel_tasks(self) -> None:
        self.loop.stepper.halt()  # no step after the one running: the engine thread is closed
        for task in [*self.fetches.values(), *self.kv.drains]:
            task.cancel()

    def _shut_down(self) -> Failure:
        """A request not finished before this worker shut down: placed again elsewhere."""
        message = "the decode worker shut down before the request finished"
        return worker_failed(self.rt.worker_id, message)

    # -- admission -------------------------------------------------------------------------

    async def on_assignment(self, assignment: DecodeAssignment, respond) -> None:
        """Within its decode.admit span: the request (and its remote prefill) carry it on."""
        with tracing.tracer().start_as_current_span("decode.admit"):
            await self._admit(assignment, respond)

    async def _admit(self, assignment: DecodeAssignment, respond) -> None:
        task = assignment.task
        refusal, mask = self._refusal(assignment), None
        if refusal is None and task.sampling.constraint is not None:
            mask, refusal = await constrained(self.rt, task)
            refusal = refusal or self._refusal(assignment)  # cancelled, stopping... meanwhile
        if refusal is None:
            engine, rt, ids = self.rt.engine, self.rt, task.prompt_token_ids
            detokenizer = Detokenizer(rt.tokenizer, task.sampling.stop, task.sampling.min_tokens)
            detokenizer.prime(ids[len(ids) - task.resume_tokens :])
            seq = Sequence.from_task(
                task, detokenizer, rt.eos_token_ids, rt.max_model_len, mask=mask
            )
            self.out.open(task)
            if not assignment.prefill_worker:
                req = DecodeRequest(seq, task, engine, self.rt.worker_id)
                self.loop.add(req, local_prefill=True)
            elif engine.admit(seq):  # the prompt's blocks, reserved before its KV comes
                self._prefill_remotely(DecodeRequest(seq, task, engine), assignment)
            else:
                self.out.forget(task)
                refusal = worker_full(
                    self.rt.worker_id, f"decode worker {self.rt.worker_id} has no KV blocks free"
                )
        if refusal is None:  # the schedulers hear of it soon (a gateway may have placed it)
            self.announcer.nudge()
        if refusal is None and task.resume_tokens:
            self.rt.metrics.migrated("in")
        if respond is not None:
            await respond(TaskAck(refusal))

    def _refusal(self, assignment: DecodeAssignment) -> Failure | None:
        """Why the assignment is not taken (None: it is). Full: the scheduler may place it here
        again later; shutting down: elsewhere; anything else fails the request."""
        task, me = assignment.task, self.rt.worker_id
        if self.stopping:
            return worker_failed(me, f"decode worker {me} is shutting down")
        if task.attempt_id in self.cancelled:
            message = f"attempt {task.attempt_id} was cancelled before it started"
            return failed(Code.CANCELLED, message, me)
        if task.attempt_id in self.loop.requests:
            # no Code.ALREADY_EXISTS: the client gets INTERNAL, as it always did
            return failed(Code.INTERNAL, f"attempt {task.attempt_id} is already running", me)
        if len(task.prompt_token_ids) + task.sampling.max_tokens > self.rt.max_model_len:
            message = f"prompt plus max_tokens exceeds {self.rt.max_model_len} tokens"
            return failed(Code.INVALID_ARGUMENT, message, me)
        if len(self.loop.requests) >= self.settings.max_queue:
            return worker_full(me, f"decode worker {me} is full")
        tokens = len(task.prompt_token_ids) + task.sampling.n * task.sampling.max_tokens
        if self.rt.blocks.blocks_for(tokens) > self.rt.blocks.num_blocks:
            return worker_full(me, f"the request needs more KV than decode worker {me} has")
        return None

    # -- remote prefill --------------------------------------------------------------------

    def _prefill_remotely(self, req: DecodeRequest, assignment: DecodeAssignment) -> None:
        """The blocks are reserved: the transfer into them is opened now (so they stay held
        until it settles), and run in a task of its own."""
        try:
            req.transfer = self.kv.open(req.seq, assignment.prefill_worker, assignment.prefill_tp)
        except PlanError as err:  # a bug, but never a hang
            log.exception("%s: no transfer plan", req.attempt_id)
            req.fail(failed(Code.INTERNAL, f"no KV transfer plan: {err}"))
        self.loop.add(req, local_prefill=False)
        if req.transfer is not None:
            self.fetches[req.attempt_id] = asyncio.create_task(self._fetch_kv(req))

    async def _fetch_kv(self, req: DecodeRequest) -> None:
        """The transfer settles; its KV joins the batch (the first tokens go out at the loop's
        next turn, not a step later), or the request fails with its cause."""
        t = req.transfer
        try:
            await self.kv.fetch(t, req.seq, req.task)
            if t.state is TransferState.COMPLETE:
                self.loop.landed(self._land(req))
            elif not req.cancel_reason:
                req.fail(t.cause.failure)
        finally:
            self.fetches.pop(req.attempt_id, None)
            self.loop.wakeup.set()

    def _land(self, req: DecodeRequest) -> list[tuple[Sequence, StepOutput]]:
        """COMPLETE (the fetch wrote the first tokens and timings into the sequence): it joins
        the batch."""
        t = req.transfer
        req.prefill_worker = t.result.prefill_worker
        self.rt.metrics.on_transfer(t.kv_transfer_ms, t.kv_exposed_ms)
        landed = tracing.now()
        tracing.record("decode.kv_receive", req.trace, landed - t.kv_transfer_ms / 1000, landed)
        return self.rt.engine.kv_arrived(req.seq)

    def _free_blocks(self, blocks: list[int]) -> None:
        """Blocks no sequence holds any more (a quarantine whose peer is gone)."""
        with self.rt.engine.lock:
            self.rt.blocks.release_blocks(blocks)

    async def on_cancel(self, message: CancelRequest, respond) -> None:
        req = self.loop.requests.get(message.attempt_id)
        if req is None:
            self.cancelled.add(message.attempt_id)
            return
        req.cancel(message.reason or "cancelled")  # a transfer in flight aborts itself
        self.loop.wakeup.set()

    # -- output ----------------------------------------------------------------------------

    async def _finish(self, req: DecodeRequest) -> None:
        """Tells the gateway how the request ended (the loop freed its blocks), on every path."""
        if await self.out.end(req):
            self.served += 1
        # its blocks and batch slot are free: the scheduler hears it within NUDGE_GAP_S, not
        # at the next interval (meanwhile it counts what it placed here as taking room)
        self.announcer.nudge()

    def _adopt(self, seq: Sequence) -> DecodeRequest:
        """A choice forked from a group held here: a request of its own from now on (ended at
        once when its group was, or when its own cancel came before it existed). The group's
        own sequence, choice 0 now, keeps its request under the choice's id."""
        if seq.forked_from is None:
            req = self.loop.requests.pop(seq.group_id)
            req.task = choice_task(req.task, 0)
            if seq.attempt_id in self.cancelled:
                req.cancel("cancelled")
            return req
        # the group's request is still held under its id: it is adopted after its choices
        parent = self.loop.requests[seq.forked_from.group_id]
        task = choice_task(parent.task, seq.choice)
        req = DecodeRequest(seq, task, self.rt.engine, parent.prefill_worker)
        req.trace = parent.trace
        if seq.attempt_id in self.cancelled:
            req.cancel("cancelled")
        elif parent.cancel_reason:
            req.cancel(parent.cancel_reason)
        elif parent.failure:
            req.fail(parent.failure)
        return req
