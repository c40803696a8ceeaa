"""Both ends of a KV transfer over the in-memory bus and the in-process data plane: a decode
side (KVFetcher with a stand-in runtime), a scripted prefill worker, and tiny-model runtimes for
whole workers."""

import asyncio
import time

import torch

from services.decode.request import DecodeRequest
from shared.control.failure import Failure
from shared.control.messages import (
    GenerateTask,
    KVLayout,
    PrefillResult,
    PrefillTask,
    SamplingParams,
    TaskAck,
)
from shared.control.subjects import Subjects
from shared.engine.kv_cache import KVPool
from shared.engine.seq_status import SeqStatus
from shared.engine.sequence import Sequence
from shared.kvtransfer.connector import connector
from shared.kvtransfer.fetch import KVFetcher
from shared.kvtransfer.inbound import TransferState
from shared.kvtransfer.plan import TransferPlan
from shared.kvtransfer.sender import KVSender
from shared.worker.runtime import WorkerRuntime
from shared.worker.settings import WorkerSettings
from tests.fakes.bus import InMemoryBus
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork
from tests.unit.test_engine import make_engine

BS = 4
LAYOUT = KVLayout(
    model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=8, block_size=BS
)
PREFILL, DECODE = "prefill-1", "decode-1"


class FakeLiveness:
    """Liveness with the answer set by the test: the workers in `gone` are lost."""

    def __init__(self) -> None:
        self.gone: set[str] = set()
        self.asked = 0

    async def lost(self, worker_id: str) -> bool:
        self.asked += 1
        return worker_id in self.gone


class FakeTokenizer:
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + i % 26) for i in ids)


def settings(**overrides) -> WorkerSettings:
    values = dict(block_size=BS, kv_segment_tokens=8, kv_lease_s=5.0, prefill_timeout_s=30.0)
    return WorkerSettings(**{**values, **overrides})


def make_task(attempt_id: str, prompt_len: int, deadline: float = 0.0, max_tokens: int = 4):
    return GenerateTask(
        attempt_id=attempt_id,
        prompt_token_ids=[3 + i % 100 for i in range(prompt_len)],
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        reply_subject=f"reply.{attempt_id}",
        arrival_time=time.time(),
        deadline=deadline,
    )


class DecodeSide:
    """A KVFetcher over the fakes, with one request whose blocks are 2, 3, 5 and 6."""

    def __init__(self, prompt_len: int = 16, deadline: float = 0.0, **overrides):
        self.net = LoopbackNetwork()
        self.plane = InProcessDataPlane(self.net, "decode")
        self.bus = InMemoryBus()
        self.liveness = FakeLiveness()
        self.arrived: list[Sequence] = []
        self.freed: list[list[int]] = []  # block tables handed back to the block manager
        self.pool = KVPool(LAYOUT, 8, BS, "cpu")
        self.settings = settings(**overrides)
        self.fetcher = fetcher(self.settings, self.plane, self.pool, self.bus, self.liveness)
        self.fetcher.free_blocks = self.freed.append
        task = make_task("r1", prompt_len, deadline)
        seq = Sequence.from_task(task, None, set(), 512)
        seq.block_table = [2, 3, 5, 6][: -(-prompt_len // BS)]
        self.req = DecodeRequest(seq, task, ReservedOnly())
        self.prefill = ScriptedPrefill(self.bus, self.net)

    async def start(self) -> asyncio.Task:
        results = Subjects("default").prefill_results(DECODE)
        await self.bus.subscribe(results, self.fetcher.on_prefill_result)
        await self.prefill.listen()
        self.req.transfer = self.fetcher.open(self.req.seq, PREFILL)
        return asyncio.create_task(self.fetch())

    async def fetch(self) -> None:
        """What the decode worker does with a transfer (DecodeWorker._fetch_kv): drive it until
        settled, then hand the KV to the engine, or fail the request with its cause."""
        t, req = self.req.transfer, self.req
        await self.fetcher.fetch(t, req.seq, req.task)
        if t.state is TransferState.COMPLETE:
            req.prefill_worker = t.result.prefill_worker
            self.arrived.append(req.seq)
        elif not req.cancel_reason:
            req.fail(t.cause.failure)


class ReservedOnly:
    """The engine as a sequence whose blocks are only reserved for a transfer sees it: aborting
    it ends it (Engine.abort; it is in no queue)."""

    def abort(self, seq: Sequence) -> bool:
        if seq.status.finished:
            return False
        seq.move(SeqStatus.FINISHED_ABORTED)
        return True


def fetcher(settings: WorkerSettings, plane, pool: KVPool, bus, liveness) -> KVFetcher:
    """A decode worker's KVFetcher over `plane` and `pool` (the push connector)."""
    return KVFetcher(
        DECODE,
        LAYOUT,
        connector(settings.kv_connector, plane, [pool]),
        settings.kv_segment_tokens,
        settings.fetch_times(),
        bus,
        liveness,
        lambda blocks: None,
        Subjects("default"),
    )


class ScriptedPrefill:
    """The prefill worker's side, step by step as a test says: acks, sends, results."""

    def __init__(self, bus: InMemoryBus, net: LoopbackNetwork, worker_id: str = PREFILL):
        self.bus, self.worker_id = bus, worker_id
        self.plane = InProcessDataPlane(net, worker_id)
        self.subjects = Subjects("default")
        self.pool = KVPool(LAYOUT, 8, BS, "cpu")
        self.pool.kv.copy_(
            torch.randn(self.pool.kv.shape, generator=torch.Generator().manual_seed(1))
        )
        self.ack: TaskAck | None = TaskAck()  # None: never answers
        self.answer = asyncio.Event()  # the ack waits for it
        self.answer.set()
        self.tasks: list[PrefillTask] = []
        self.aborts: list = []
        self.got_task = asyncio.Event()

    async def listen(self) -> None:
        await self.bus.subscribe(self.subjects.prefill_tasks(self.worker_id), self._on_task)
        await self.bus.subscribe(self.subjects.transfer_aborts(self.worker_id), self._on_abort)

    async def _on_task(self, task: PrefillTask, respond) -> None:
        self.tasks.append(task)
        self.got_task.set()
        await self.answer.wait()
        if self.ack is not None and respond is not None:
            await respond(self.ack)

    async def _on_abort(self, message, respond) -> None:
        self.aborts.append(message)

    def sender(self) -> KVSender:
        task = self.tasks[-1]
        plan = TransferPlan(task.layout, len(task.task.prompt_token_ids), task.destination)
        return KVSender(self.plane, [self.pool], plan, timeout_s=5.0)

    def send(self, segments: int | None = None) -> KVSender:
        """Puts the first `segments` segments (all by default) on the wire."""
        sender = self.sender()
        for seg in sender.plan.segments[:segments]:
            staged = sender.stage(seg, [0, 1, 2, 3, 4, 5, 6, 7])
            sender.send(staged.direct)
            sender.send(sender.gather(staged))
        return sender

    async def result(self, failure: Failure | None = None, **fields) -> None:
        task = self.tasks[-1]
        if failure is None:
            fields = dict(
                first_tokens=[7], computed_at=time.time(), transport="inprocess", **fields
            )
        message = PrefillResult(
            attempt_id=task.attempt_id,
            base_tag=task.destination.base_tag,
            failure=failure,
            prefill_worker=self.worker_id,
            **fields,
        )
        await self.bus.publish(self.subjects.prefill_results(task.decode_worker), message)


class CountingEngine:
    """Wraps an engine's release: how many times each request's blocks were freed."""

    def __init__(self, engine) -> None:
        self.freed: dict[str, int] = {}
        release = engine.release

        def counted(seq) -> None:
            self.freed[seq.attempt_id] = self.freed.get(seq.attempt_id, 0) + 1
            release(seq)

        engine.release = counted


def tiny_runtime(model, worker_id: str, role: str, num_blocks: int = 64) -> WorkerRuntime:
    engine = make_engine(model, num_blocks=num_blocks)
    return WorkerRuntime(
        worker_id, role, "host", engine.runner, FakeTokenizer(), engine.blocks, engine, 512, set()
    )


async def until(condition, timeout: float = 10.0) -> None:
    """Waits until condition() holds (the fakes hand work between tasks)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


class Pair:
    """A PrefillWorker and a DecodeWorker on tiny models, over one in-memory bus and network."""

    def __init__(self, model, **overrides):
        from services.decode.worker import DecodeWorker
        from services.prefill.worker import PrefillWorker

        self.net, self.bus = LoopbackNetwork(), InMemoryBus()
        self.settings = settings(
            **{"block_size": 16, "kv_segment_tokens": 32, "drain_timeout_s": 5.0, **overrides}
        )
        self.prefill_rt = tiny_runtime(model, PREFILL, "prefill")
        self.decode_rt = tiny_runtime(model, DECODE, "decode")
        self.prefill_freed = CountingEngine(self.prefill_rt.engine).freed
        self.decode_freed = CountingEngine(self.decode_rt.engine).freed
        self.prefill_plane = InProcessDataPlane(self.net, PREFILL)
        self.decode_plane = InProcessDataPlane(self.net, DECODE)
        self.liveness = FakeLiveness()
        self.prefill = PrefillWorker(self.settings, self.prefill_rt, self.bus, self.prefill_plane)
        self.decode = DecodeWorker(
            self.settings, self.decode_rt, self.bus, self.decode_plane, self.liveness
        )
        self.subjects = Subjects("default")
        self.chunks: dict[str, list] = {}
        self.stop = asyncio.Event()
        self.serving: list[asyncio.Task] = []

    async def __aenter__(self) -> "Pair":
        self.serving = [
            asyncio.create_task(w.serve(self.stop)) for w in (self.prefill, self.decode)
        ]
        await asyncio.sleep(0)
        return self

    async def __aexit__(self, *exc) -> None:
        self.stop.set()
        await asyncio.wait_for(asyncio.gather(*self.serving), 30)

    async def submit(self, task: GenerateTask, remote: bool = True) -> TaskAck:
        from shared.control.messages import DecodeAssignment, TokenBatch

        async def collect(message, respond):
            chunks = message.chunks if isinstance(message, TokenBatch) else [message]
            self.chunks[task.attempt_id].extend(chunks)

        self.chunks[task.attempt_id] = []
        await self.bus.subscribe(task.reply_subject, collect)
        assignment = DecodeAssignment(task=task, prefill_worker=PREFILL if remote else "")
        return await self.bus.request(self.subjects.decode_tasks(DECODE), assignment, 5, TaskAck)

    async def outcome(self, attempt_id: str, timeout: float = 30.0):
        """The last chunk of the request, once it came: a finish reason or an error."""
        chunks = self.chunks[attempt_id]
        await until(lambda: chunks and (chunks[-1].finish_reason or chunks[-1].failure), timeout)
        return chunks[-1]

    def tokens(self, attempt_id: str) -> list[int]:
        return [t for c in self.chunks[attempt_id] for t in c.token_ids]

    async def idle(self) -> None:
        """Both workers hold nothing: every block back, nothing leaked."""
        await until(lambda: not self.prefill.ship.held and not self.decode.loop.requests)
        await until(lambda: not self.decode.kv.transfers)
        assert self.prefill_rt.blocks.used == 0 and self.decode_rt.blocks.used == 0
        assert self.prefill.snapshot().kv_blocks_leaked == 0
        assert self.decode.snapshot().kv_blocks_leaked == 0
