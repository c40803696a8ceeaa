"""The gateway's stream loop over an in-memory bus and a scripted cluster: when and how a request
moves to a new attempt, what the client sees, and what each new attempt asks for."""

import asyncio
import copy

import grpc

from services.gateway import chunk_waiter, relay
from services.gateway.migration import FULL_MOVES, client_id
from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.gateway.validation import Limits
from shared.api import tandem_pb2 as pb
from shared.control.failure import Code, Failure, Retry, worker_failed, worker_full
from shared.control.failure import failed as request_failed
from shared.control.liveness import Liveness
from shared.control.messages import (
    CancelRequest,
    GenerateTask,
    StreamReplay,
    SubmitReply,
    TaskAck,
    TokenChunk,
)
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus

SHUTTING_DOWN = Failure(Code.UNAVAILABLE, "the scheduler is shutting down", Retry.ELSEWHERE)
LOSE = "lose"
FORGET = "forget"
SILENT = "silent"
LIMITS = Limits(
    max_model_len=2048, default_max_tokens=16, max_tokens_limit=1024, max_stop_strings=8
)


class Aborted(Exception):
    pass


class FakeContext:
    code = None
    trailing = ()

    def __init__(self, metadata=(), peer: str = "ipv4:127.0.0.1:5000"):
        self.metadata, self._peer = tuple(metadata), peer

    def peer(self) -> str:
        return self._peer

    def invocation_metadata(self):
        return self.metadata

    def auth_context(self) -> dict:
        return {}

    def time_remaining(self):
        return None

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = metadata

    async def abort(self, code, message):
        self.code, self.message = code, message
        raise Aborted(message)


class ScriptedCluster:
    """Answers submit n with `replies[n]` where given (a SubmitReply not ok, or SILENT: no answer),
    else as a scheduler placing it on decode worker d<p>, the pth placed, then plays script p, in
    turn: a TokenChunk is sent (its attempt id and next index filled in), LOSE loses the next chunk
    on the way (the worker keeps it: asked, it sends it again), FORGET has the worker forget the
    stream (asked, it says so), a callable is called with the bus."""

    def __init__(self, bus: InMemoryBus, scripts: list[list], replies: dict | None = None):
        self.bus, self.scripts, self.replies = bus, scripts, replies or {}
        self.tasks: list[GenerateTask] = []
        self.plays: list[asyncio.Task] = []
        self.kept: dict[str, list[TokenChunk]] = {}  # attempt id -> the chunks its worker keeps
        self.replays: list[StreamReplay] = []

    async def on_submit(self, task: GenerateTask, respond) -> None:
        self.tasks.append(task)
        reply = self.replies.get(len(self.tasks) - 1)
        if reply is SILENT:
            return
        if reply is not None:
            await respond(reply)
            return
        placed = len(self.plays) + 1
        self.kept[task.attempt_id] = []
        await self.bus.subscribe(Subjects("default").stream_replay(f"d{placed}"), self.on_replay)
        await respond(SubmitReply(prefill_worker="p1", decode_worker=f"d{placed}"))
        self.plays.append(asyncio.create_task(self._play(task, self.scripts[placed - 1])))

    async def on_replay(self, ask: StreamReplay, respond) -> None:
        self.replays.append(ask)
        kept = self.kept.get(ask.attempt_id)
        if kept is None:
            await respond(TaskAck(worker_failed("d", "no longer has the stream")))
            return
        for sent in kept[ask.from_index :]:
            await self.bus.publish(self.tasks[0].reply_subject, copy.copy(sent))
        await respond(TaskAck())

    async def _play(self, task: GenerateTask, script: list) -> None:
        lose, kept = False, self.kept[task.attempt_id]
        for step in script:
            await asyncio.sleep(0.01)
            if step is LOSE or step is FORGET:
                lose = step is LOSE
                if step is FORGET:
                    del self.kept[task.attempt_id]
                continue
            if callable(step):
                step(self.bus)
                continue
            step.attempt_id, step.index = task.attempt_id, len(kept)
            kept.append(step)
            if not lose:
                await self.bus.publish(task.reply_subject, copy.copy(step))
            lose = False


async def generate(
    scripts: list[list],
    max_migrations: int = 2,
    tokenizer=None,
    replies=None,
    take=None,
    bus=None,
    **options,
):
    """Runs one Generate against the scripted cluster: (responses, context, cluster, bus). The
    client goes away after `take` responses where given."""
    bus, settings = bus or InMemoryBus(), GatewaySettings(max_migrations=max_migrations, **options)
    cluster = ScriptedCluster(bus, scripts, replies)
    await bus.subscribe(Subjects(settings.cluster).submit, cluster.on_submit)
    context, responses = FakeContext(), []
    async with (
        StreamRouter(bus, "gw.replies") as streams,
        Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s) as liveness,
    ):
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness)
        request = pb.GenerateRequest(
            request_id="req", prompt="Hello there", sampling=pb.SamplingParams(max_tokens=3)
        )
        stream = servicer.Generate(request, context)
        try:
            async for response in stream:
                responses.append(response)
                if len(responses) == take:
                    break
        except Aborted:
            pass
        finally:
            await stream.aclose()
    return responses, context, cluster, bus


def tokens(responses) -> list[int]:
    return [t for r in responses for t in r.token_ids]


def chunk(token_ids: list[int]) -> TokenChunk:
    return TokenChunk(attempt_id="", index=0, token_ids=token_ids)


def done(token_ids: list[int]) -> TokenChunk:
    return TokenChunk(
        attempt_id="",
        index=0,
        token_ids=token_ids,
        finish_reason="length",
        prompt_tokens=3,
        completion_tokens=3,
    )


def failed(code: Code, worker: str) -> TokenChunk:
    """The last chunk of a request a worker failed (or was full for), not the request itself."""
    message = f"{worker} said {code.value}"
    if code is Code.RESOURCE_EXHAUSTED:
        return TokenChunk(attempt_id="", index=0, failure=worker_full(worker, message))
    return TokenChunk(attempt_id="", index=0, failure=worker_failed(worker, message, code))


def cancels(bus: InMemoryBus) -> set[str]:
    return {m.attempt_id for _, m in bus.published if isinstance(m, CancelRequest)}


async def test_a_prefill_worker_full_moves_the_request_without_avoiding_it(tokenizer):
    responses, context, cluster, bus = await generate(
        [[failed(Code.RESOURCE_EXHAUSTED, "p1")], [done([7, 8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.avoid_workers == [] and second.resume_tokens == 0
    assert (
        second.prompt_token_ids == first.prompt_token_ids and second.attempt_id != first.attempt_id
    )
    assert first.attempt_id in cancels(bus)
    assert responses[-1].timing.migrations == 1


async def test_a_failed_worker_is_avoided_by_the_next_attempt(tokenizer):
    responses, context, cluster, _ = await generate(
        [[chunk([7]), failed(Code.UNAVAILABLE, "p1")], [done([8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.avoid_workers == ["p1"] and second.resume_tokens == 1
    assert second.prompt_token_ids == first.prompt_token_ids + [7]
    assert second.sampling.max_tokens == 2


async def test_past_the_migration_limit_the_client_gets_the_last_failures_code(tokenizer):
    full, broken = [failed(Code.RESOURCE_EXHAUSTED, "p1")], [failed(Code.UNAVAILABLE, "d1")]
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


async def test_a_last_chunk_lost_in_a_nats_reconnect_is_asked_for_again(tokenizer, monkeypatch):
    """The stream's last chunk vanishes while NATS reconnects: nothing after it shows a gap, so
    once the stream stays quiet the gateway asks the worker for it again: no move (before, the
    request moved, and was computed again, from the tokens sent)."""
    monkeypatch.setattr(chunk_waiter, "REPLAY_AFTER_RECONNECT_S", 0.2)

    def reconnect(bus):  # the connection came back; the final chunk was in flight and is lost
        bus.reconnects += 1

    responses, context, cluster, bus = await generate(
        [[chunk([7]), reconnect, LOSE, done([8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    assert len(cluster.tasks) == 1 and responses[-1].timing.migrations == 0
    assert [(r.attempt_id, r.from_index) for r in cluster.replays] == [
        (cluster.tasks[0].attempt_id, 1)
    ]


async def test_a_gap_in_the_chunk_indexes_is_filled_in_order_and_duplicates_are_dropped(
    tokenizer,
):
    responses, context, cluster, _ = await generate(
        [[chunk([7]), LOSE, chunk([8]), chunk([9]), done([10])]],
        tokenizer=tokenizer,
        **{"default_max_tokens": 4},
    )
    # the replay sends 8, 9 and 10 again after they came: each reaches the client once
    assert context.code is None and tokens(responses) == [7, 8, 9, 10]
    assert len(cluster.tasks) == 1 and responses[-1].timing.migrations == 0


async def test_a_worker_that_no_longer_has_the_stream_has_it_moved_on(tokenizer, monkeypatch):
    monkeypatch.setattr(chunk_waiter, "REPLAY_AFTER_RECONNECT_S", 0.2)

    def reconnect(bus):
        bus.reconnects += 1

    responses, context, cluster, bus = await generate(
        [[chunk([7]), reconnect, FORGET, LOSE, done([99])], [done([8, 9])]], tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.resume_tokens == 1 and second.prompt_token_ids == first.prompt_token_ids + [7]
    assert second.avoid_workers == []  # nobody failed: the decode worker may take it again
    assert first.attempt_id in cancels(bus)


async def test_a_scheduler_handing_the_request_back_has_it_submitted_again_as_a_new_attempt(
    tokenizer,
):
    responses, context, cluster, bus = await generate(
        [[done([7, 8, 9])]], replies={0: SubmitReply(SHUTTING_DOWN)}, tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert client_id(first.attempt_id) == client_id(second.attempt_id) == "req"
    assert second.attempt_id != first.attempt_id and first.attempt_id in cancels(bus)
    assert second.moves == 0 and responses[-1].timing.migrations == 0


async def test_a_request_no_scheduler_places_twice_fails_and_both_attempts_are_cancelled(
    tokenizer,
):
    responses, context, cluster, bus = await generate(
        [], replies={0: SILENT, 1: SILENT}, submit_timeout_s=0.1, tokenizer=tokenizer
    )
    assert responses == [] and context.code == grpc.StatusCode.UNAVAILABLE
    assert context.message == "the scheduler did not place the request in time"
    assert {t.attempt_id for t in cluster.tasks} <= cancels(bus) and len(cluster.tasks) == 2


async def test_a_worker_failing_to_confirm_the_placement_moves_the_request_without_it(tokenizer):
    refused = SubmitReply(worker_failed("d9", "d9 did not ack"))
    responses, context, cluster, bus = await generate(
        [[done([7, 8, 9])]], replies={0: refused}, tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, second = cluster.tasks
    assert second.avoid_workers == ["d9"] and first.attempt_id in cancels(bus)
    assert responses[-1].timing.migrations == 1


async def test_a_refusal_after_a_move_says_why_the_request_moved(tokenizer):
    full = SubmitReply(
        request_failed(Code.RESOURCE_EXHAUSTED, "the cluster is full"), retry_after_ms=1500
    )
    responses, context, _, _ = await generate(
        [[chunk([7]), failed(Code.UNAVAILABLE, "d1")]], replies={1: full}, tokenizer=tokenizer
    )
    assert tokens(responses) == [7] and context.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert context.message == "d1 said UNAVAILABLE, and the cluster is full (retry after 1.5s)"
    assert context.trailing == (("retry-after-ms", "1500"),)


NO_WORKER = SubmitReply(Failure(Code.UNAVAILABLE, "no live decode worker", Retry.ELSEWHERE))


async def test_a_moved_request_nobody_can_place_asks_again_until_a_worker_is_back(
    tokenizer, monkeypatch
):
    """A NATS node cut off hides the workers connected to it for seconds: a request moved off
    one of them finds no live worker, and is asked for again until one is back."""
    monkeypatch.setattr(relay, "MOVE_RETRY_S", 0.01)
    scripts = [[chunk([7]), failed(Code.UNAVAILABLE, "d1")], [done([8, 9])]]
    replies = {1: NO_WORKER, 2: NO_WORKER, 3: NO_WORKER}
    responses, context, cluster, _ = await generate(scripts, replies=replies, tokenizer=tokenizer)
    assert context.code is None and tokens(responses) == [7, 8, 9]
    first, moved, *again = cluster.tasks
    assert len(again) == 3 and {t.attempt_id for t in again[1:]} == {again[0].attempt_id}
    assert all(t.resume_tokens == 1 and t.avoid_workers == ["d1"] for t in [moved, *again])
    assert responses[-1].timing.migrations == 1


async def test_past_move_wait_s_or_unmoved_a_request_nobody_can_place_fails(tokenizer, monkeypatch):
    monkeypatch.setattr(relay, "MOVE_RETRY_S", 0.01)
    scripts = [[chunk([7]), failed(Code.UNAVAILABLE, "d1")]]
    replies = dict.fromkeys(range(1, 1000), NO_WORKER)
    responses, context, cluster, _ = await generate(
        scripts, replies=replies, move_wait_s=0.2, tokenizer=tokenizer
    )
    assert tokens(responses) == [7] and context.code == grpc.StatusCode.UNAVAILABLE
    assert (
        context.message == "d1 said UNAVAILABLE, and no live decode worker (asked again for 0.2s)"
    )
    assert 4 <= len(cluster.tasks) < 100
    # never moved: refused at once (submitted once more, as any request a scheduler hands back)
    responses, context, cluster, _ = await generate(
        [], replies={0: NO_WORKER, 1: NO_WORKER}, tokenizer=tokenizer
    )
    assert context.message == "no live decode worker" and len(cluster.tasks) == 2


async def test_a_decode_worker_that_stops_responding_has_its_request_moved_off_it(tokenizer):
    responses, context, cluster, _ = await generate(
        [[chunk([7])], [done([8, 9])]], worker_timeout_s=0.5, tokenizer=tokenizer
    )
    assert context.code is None and tokens(responses) == [7, 8, 9]
    assert cluster.tasks[1].avoid_workers == ["d1"] and cluster.tasks[1].resume_tokens == 1


async def test_a_silent_stream_fails_after_the_idle_timeout(tokenizer):
    responses, context, cluster, bus = await generate(
        [[chunk([7])]], stream_idle_timeout_s=0.3, tokenizer=tokenizer
    )
    assert tokens(responses) == [7] and context.code == grpc.StatusCode.UNAVAILABLE
    assert context.message == "the worker sent nothing for 0s"
    assert cluster.tasks[0].attempt_id in cancels(bus)


async def test_a_chunk_with_a_final_error_ends_the_stream_with_its_code(tokenizer):
    final = TokenChunk(
        attempt_id="", index=0, failure=request_failed(Code.INVALID_ARGUMENT, "bad stop")
    )
    responses, context, _, _ = await generate([[chunk([7]), final]], tokenizer=tokenizer)
    assert tokens(responses) == [7]
    assert (context.code, context.message) == (grpc.StatusCode.INVALID_ARGUMENT, "bad stop")
    blamed = request_failed(Code.FAILED_PRECONDITION, "layout mismatch", "p1")  # not movable
    final = TokenChunk(attempt_id="", index=0, failure=blamed)
    responses, context, cluster, _ = await generate([[final]], tokenizer=tokenizer)
    assert (context.code, context.message) == (grpc.StatusCode.FAILED_PRECONDITION, blamed.message)
    assert len(cluster.tasks) == 1  # not placed again


async def test_a_client_going_away_cancels_the_attempt_and_a_finished_stream_does_not(tokenizer):
    responses, _, cluster, bus = await generate(
        [[chunk([7]), chunk([8]), done([9])]], take=1, tokenizer=tokenizer
    )
    assert tokens(responses) == [7] and cluster.tasks[0].attempt_id in cancels(bus)
    responses, _, cluster, bus = await generate([[done([7, 8, 9])]], tokenizer=tokenizer)
    assert tokens(responses) == [7, 8, 9] and cancels(bus) == set()
    timing = responses[-1].timing
    assert timing.migrations == 0 and 0 < timing.ttft_ms <= timing.total_ms


class RecordingBus(InMemoryBus):
    """Keeps every message the gateway asked with, and a copy of it as it was when asked."""

    def __init__(self):
        super().__init__()
        self.asked: list[tuple] = []

    async def request(self, subject, message, timeout, expected):
        self.asked.append((message, copy.deepcopy(message)))
        return await super().request(subject, message, timeout, expected)


async def test_no_task_the_gateway_submitted_is_changed_afterwards(tokenizer):
    bus = RecordingBus()
    responses, context, _, _ = await generate(
        [[chunk([7]), failed(Code.UNAVAILABLE, "d1")], [done([8, 9])]],
        replies={0: SubmitReply(SHUTTING_DOWN)},
        bus=bus,
        tokenizer=tokenizer,
    )
    assert context.code is None and tokens(responses) == [7, 8, 9] and len(bus.asked) == 3
    assert all(task == as_asked for task, as_asked in bus.asked)
    assert len({task.attempt_id for task, _ in bus.asked}) == 3


def test_a_failures_code_is_the_grpc_status_of_the_same_name():
    assert relay.grpc_status(Code.DEADLINE_EXCEEDED) is grpc.StatusCode.DEADLINE_EXCEEDED
