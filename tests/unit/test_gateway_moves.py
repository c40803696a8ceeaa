"""The gateway's stream loop over an in-memory bus and a scripted cluster: when and how a request
moves to a new attempt, what the client sees, and what each new attempt asks for."""

import asyncio

import grpc

from services.gateway import servicer as servicer_module
from services.gateway.migration import FULL_MOVES
from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.gateway.validation import Limits
from shared.api import tandem_pb2 as pb
from shared.control.liveness import Liveness
from shared.control.messages import CancelRequest, GenerateTask, SubmitReply, TokenChunk
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus

LOSE = "lose"
LIMITS = Limits(
    max_model_len=2048, default_max_tokens=16, max_tokens_limit=1024, max_stop_strings=8
)


class Aborted(Exception):
    pass


class FakeContext:
    code = None

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def time_remaining(self):
        return None

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata

    async def abort(self, code, message):
        self.code, self.message = code, message
        raise Aborted(message)


class ScriptedCluster:
    """Answers every submit as a scheduler placing it on decode worker d<n>, then plays attempt
    n's script, in turn: a TokenChunk is sent (its request id and next index filled in), LOSE
    skips an index (a chunk lost on the way), a callable is called with the bus."""

    def __init__(self, bus: InMemoryBus, scripts: list[list]):
        self.bus, self.scripts = bus, scripts
        self.tasks: list[GenerateTask] = []
        self.plays: list[asyncio.Task] = []

    async def on_submit(self, task: GenerateTask, respond) -> None:
        self.tasks.append(task)
        await respond(
            SubmitReply(ok=True, prefill_worker="p1", decode_worker=f"d{len(self.tasks)}")
        )
        self.plays.append(asyncio.create_task(self._play(task, self.scripts[len(self.tasks) - 1])))

    async def _play(self, task: GenerateTask, script: list) -> None:
        index = 0
        for step in script:
            await asyncio.sleep(0.01)
            if step is LOSE:
                index += 1
                continue
            if callable(step):
                step(self.bus)
                continue
            step.request_id, step.index = task.request_id, index
            index += 1
            await self.bus.publish(task.reply_subject, step)


async def generate(scripts: list[list], max_migrations: int = 2, tokenizer=None):
    """Runs one Generate against the scripted cluster: (responses, context, cluster, bus)."""
    bus, settings = InMemoryBus(), GatewaySettings(max_migrations=max_migrations)
    cluster = ScriptedCluster(bus, scripts)
    await bus.subscribe(Subjects(settings.cluster).submit, cluster.on_submit)
    context, responses = FakeContext(), []
    async with (
        StreamRouter(bus, "gw.replies") as streams,
        Liveness(bus, Subjects(settings.cluster), timeout_s=3.0) as liveness,
    ):
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness)
        request = pb.GenerateRequest(
            request_id="req", prompt="Hello there", sampling=pb.SamplingParams(max_tokens=3)
        )
        try:
            async for response in servicer.Generate(request, context):
                responses.append(response)
        except Aborted:
            pass
    return responses, context, cluster, bus


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def chunk(token_ids: list[int]) -> TokenChunk:
    return TokenChunk(request_id="", index=0, token_ids=token_ids)


def done(token_ids: list[int]) -> TokenChunk:
    return TokenChunk(
        request_id="",
        index=0,
        token_ids=token_ids,
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=3,
    )


def failed(code: str, worker: str) -> TokenChunk:
    return TokenChunk(
        request_id="",
        index=0,
        code=code,
        message=f"{worker} said {code}",
        retry=True,
        failed_worker=worker,
    )


def cancels(bus: InMemoryBus) -> set[str]:
    return {m.request_id for _, m in bus.published if isinstance(m, CancelRequest)}


async def test_a_prefill_worker_full_moves_the_request_without_avoiding_it(tokenizer):
    responses, context, cluster, bus = await generate(
        [[failed("RESOURCE_EXHAUSTED", "p1")], [done([7, 8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.avoid_workers == [] and second.resume_tokens == 0
    assert (
        second.prompt_token_ids == first.prompt_token_ids and second.request_id != first.request_id
    )
    assert first.request_id in cancels(bus)
    assert responses[-1].timing.migrations == 1


async def test_a_failed_worker_is_avoided_by_the_next_attempt(tokenizer):
    responses, context, cluster, _ = await generate(
        [[chunk([7]), failed("UNAVAILABLE", "p1")], [done([8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.avoid_workers == ["p1"] and second.resume_tokens == 1
    assert second.prompt_token_ids == first.prompt_token_ids + [7]
    assert second.sampling.max_tokens == 2


async def test_past_the_migration_limit_the_client_gets_the_last_failures_code(tokenizer):
    full, broken = [failed("RESOURCE_EXHAUSTED", "p1")], [failed("UNAVAILABLE", "d1")]
    # Turned away as full: a limit of its own, whatever --max-migrations says.
    responses, context, cluster, _ = await generate(
        [full] * (FULL_MOVES + 2), max_migrations=0, tokenizer=tokenizer
    )
    assert responses == [] and len(cluster.tasks) == FULL_MOVES + 1
    assert (
        context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        and f"moved {FULL_MOVES} time(s)" in context.message
    )
    # A failed worker: --max-migrations; moves of the other kind do not use it up.
    responses, context, cluster, _ = await generate(
        [full, broken, full, broken, broken], max_migrations=1, tokenizer=tokenizer
    )
    assert len(cluster.tasks) == 4 and context.code == grpc.StatusCode.UNAVAILABLE
    assert "moved 1 time(s)" in context.message


async def test_a_last_chunk_lost_in_a_nats_reconnect_resumes_from_the_tokens_sent(
    tokenizer, monkeypatch
):
    """The stream's last chunk vanishes while NATS reconnects: nothing after it shows a gap, so
    the gateway goes on from the tokens the client has once the stream stays quiet."""
    monkeypatch.setattr(servicer_module, "LOST_AFTER_RECONNECT_S", 0.2)

    def reconnect(bus):  # the connection came back; the final chunk was in flight and is lost
        bus.reconnects += 1

    responses, context, cluster, bus = await generate(
        [[chunk([7]), reconnect, LOSE], [done([8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.resume_tokens == 1 and second.prompt_token_ids == first.prompt_token_ids + [7]
    assert second.avoid_workers == []  # nobody failed: the decode worker may take it again
    assert first.request_id in cancels(bus)


async def test_a_gap_in_the_chunk_indexes_resumes_after_the_last_chunk_received(tokenizer):
    responses, context, cluster, _ = await generate(
        [[chunk([7]), LOSE, chunk([99])], [done([8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    assert cluster.tasks[1].resume_tokens == 1 and cluster.tasks[1].avoid_workers == []
