"""DecodeLoop: the decode worker's loop — drain inputs -> schedule -> run -> publish.

The Engine does the batching; its steps run one after another in the engine thread (Stepper),
while this loop publishes what each step produced and ends requests that finished, failed, were
cancelled or ran past their deadline. Message handlers only record events and wake the loop.

Each turn takes every step that ended since the last (one, or several when the loop fell
behind: a stream's tokens of those steps go out as one chunk), reaps the requests they did not
touch (their blocks are freed when the step running ends), starts a run when none runs and
there is work, and publishes. Every stream of a step goes out together, one hand-off per step.
A request that finished is reaped at the next turn, after its last chunk went out.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from services.decode.request import DecodeRequest
from services.decode.stepper import RunEnd, Stepper
from shared.control.failure import Code, Failure, failed
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence, StepOutput
from shared.engine.step_runner import RunnerLost
from shared.worker import steps

log = logging.getLogger(__name__)

Publish = Callable[[list[tuple[DecodeRequest, StepOutput]]], Awaitable[None]]  # one step's
Finish = Callable[[DecodeRequest], Awaitable[None]]
Adopt = Callable[[Sequence], DecodeRequest]
# where a sequence may be when a step fails (WAITING_KV ones are not in it)
STEPPED = (SeqStatus.WAITING, SeqStatus.PREEMPTED, SeqStatus.RUNNING, SeqStatus.KV_READY)
RUNS = (SeqStatus.RUNNING, SeqStatus.KV_READY)  # what the heartbeat counts as running
QUEUED = (SeqStatus.WAITING_KV, SeqStatus.WAITING, SeqStatus.PREEMPTED)  # and as queued


class DecodeLoop:
    def __init__(self, stepper: Stepper, publish: Publish, finish: Finish, adopt: Adopt):
        self.stepper = stepper  # runs the engine's steps in the engine thread
        self.engine = stepper.engine
        self.executor = stepper.executor
        self.publish = publish
        self.finish = finish
        self.adopt = adopt  # a choice the engine forked becomes a request of its own
        self.requests: dict[str, DecodeRequest] = {}  # every request this worker holds, by id
        self.wakeup = asyncio.Event()
        stepper.wake = self.wakeup.set
        self._landed: list[tuple[Sequence, StepOutput]] = []  # see landed

    def add(self, req: DecodeRequest, local_prefill: bool) -> None:
        self.requests[req.attempt_id] = req
        if local_prefill:
            self.engine.add(req.seq)
        self.wakeup.set()

    def landed(self, outputs: list[tuple[Sequence, StepOutput]]) -> None:
        """The first tokens of a prompt computed elsewhere, its sequence in the batch now
        (Engine.kv_arrived): they go out at the loop's next turn, before any step's after them,
        with the tokens the steps that ended meanwhile produced."""
        self._landed += outputs
        self.wakeup.set()

    def count(self, *statuses: SeqStatus) -> int:
        return sum(1 for r in self.requests.values() if r.seq.status in statuses)

    async def run(self, stop: asyncio.Event) -> None:
        """Steps until `stop` is set."""
        await steps.step_until_stopped(self._iterate, self.wakeup, stop)

    async def drain(self, timeout_s: float) -> None:
        """Keeps stepping the sequences already held until they finish or `timeout_s` passes."""
        await steps.drain(self._iterate, self.wakeup, lambda: bool(self.requests), timeout_s)

    async def abort_all(self, failure: Failure) -> None:
        """Ends every request still held (shutdown): each gets the failure, each frees its blocks."""
        await self._settle()
        for req in self.requests.values():
            req.fail(failure)  # (no effect on one that finished)
        await self._reap()

    async def _settle(self) -> None:
        """No step runs after this: the run (if any) is over, the tokens of its steps sent, and
        the engine thread idle (a cancelled wait for a step leaves the step running there)."""
        await self.stepper.pause()
        with contextlib.suppress(RunnerLost):  # the worker goes anyway
            self.stepper.ended()
        produced = []
        with contextlib.suppress(RunnerLost):
            produced = self._produced(self._take())
        if produced:
            await self.publish(produced)
        await self.executor.run(_nothing)

    async def _iterate(self) -> bool:
        """Takes the steps that ended (if any), reaps, starts a run when none runs and publishes
        the steps' tokens meanwhile; False when nothing came (then wait for news: a step's end
        wakes it too)."""
        ended = self.stepper.ended()
        taken = self._take()
        produced = self._produced(taken)
        # a request whose last chunk is in `produced` is reaped next turn, once it went out
        await self._reap(keep={id(req) for req, _ in produced})
        # a run that found nothing to run starts again only on news since it looked (news that
        # woke the loop while it ran may have been taken by a turn that could not start one)
        news = ended is not RunEnd.STARVED or self.engine.changes != self.engine.scheduled_at
        if self.stepper.run is None and news and self.engine.has_work():
            self.stepper.start()
        if produced:
            await self.publish(produced)
        return bool(taken)

    def _take(self) -> list:
        """The first tokens landed since the last turn (as a step's outputs), then every step's
        outputs waiting."""
        landed, self._landed = self._landed, []
        taken = self.stepper.take()
        return [landed, *taken] if landed else taken

    def _produced(self, taken: list) -> list[tuple[DecodeRequest, StepOutput]]:
        """Each request's output of the steps taken, one per request (several steps' joined),
        in the order they first came. A failed step fails the requests it may have held."""
        produced: dict[int, tuple[DecodeRequest, StepOutput]] = {}
        for outputs in taken:
            if isinstance(outputs, BaseException):
                self._failed(outputs)
                continue
            for req, out in self._of_step(outputs):
                held = produced.get(id(req))
                produced[id(req)] = (req, out if held is None else _joined(held[1], out))
        return list(produced.values())

    def _failed(self, err: BaseException) -> None:
        """A step raised: RunnerLost goes on (the worker goes; its requests are placed elsewhere,
        shared.worker.serve); else its requests fail (the gateway moves them)."""
        if isinstance(err, RunnerLost):
            raise err
        log.error("engine step failed", exc_info=err)
        for req in self.requests.values():
            if req.seq.status in STEPPED:
                req.fail(failed(Code.INTERNAL, f"model step failed: {type(err).__name__}"))
            elif req.seq.status.finished:  # it ended in that step: its last output is lost
                req.last_taken = True

    def _of_step(self, outputs) -> list[tuple[DecodeRequest, StepOutput]]:
        """Each output with its request: each group's other choices first (they go as the group
        went), then its own sequence, choice 0 now (re-keyed; a cancel of that choice alone
        applies to it alone)."""
        for seq in sorted(self.engine.take_forked(), key=lambda s: s.forked_from is None):
            self.requests[seq.attempt_id] = self.adopt(seq)
        produced = []
        for seq, out in outputs:
            req = self.requests.get(seq.attempt_id)
            if req is not None and not req.aborted:
                produced.append((req, out))
                req.last_taken = out.finished is not None
        return produced

    async def _reap(self, keep: frozenset | set = frozenset()) -> None:
        """Ends the requests that ended (frees their blocks, tells the gateway), but those in
        `keep` (id()s: their last chunk has yet to go out) and those whose last output is still
        to come from the engine (DecodeRequest.reapable). A step may run meanwhile: the blocks
        of a sequence it runs are freed when it ends (Engine.release)."""
        now = time.time()  # one clock read a turn, not one a request
        for req in list(self.requests.values()):
            seq = req.seq
            if not seq.status.finished and not seq.expired_at(now):
                continue  # most of them, every turn: running on
            if not req.may_free or id(req) in keep:
                continue  # its transfer ends itself first (see KVFetcher.fetch)
            if not seq.status.finished:
                req.fail(failed(Code.DEADLINE_EXCEEDED, "the request's deadline passed"))
            if req.reapable:
                del self.requests[req.attempt_id]
                self.engine.release(seq)
                await self.finish(req)


def _joined(first: StepOutput, then: StepOutput) -> StepOutput:
    """One stream's output of two steps in a row, as one."""
    return StepOutput(
        first.token_ids + then.token_ids,
        first.text + then.text,
        then.finished,
        first.logprobs + then.logprobs,
        first.prompt_logprobs or then.prompt_logprobs,
    )


def _nothing() -> None:
    """A job for the engine thread that only shows it is idle (it runs after any step)."""
