"""Chunks of a stream already waiting at the gateway go to the client as one answer: tokens,
text and logprobs in order, the last chunk's ending kept; a failure, a gap or a duplicate is
left to the stream's own handling, and nothing is held back to be joined."""

import asyncio
import contextlib
import time

from services.gateway.attempt import Attempt
from services.gateway.chunk_waiter import ChunkWaiter
from services.gateway.joined_chunks import MAX_JOINED_TOKENS, Run, joined
from services.gateway.metrics import GatewayMetrics
from services.gateway.relay import RequestRelay
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.control.failure import worker_failed
from shared.control.liveness import Liveness
from shared.control.messages import GenerateTask, SamplingParams, TokenChunk, TokenLogprob
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus

SUBJECT = "gw.tokens"
LP = TokenLogprob(-0.5)


def joinable(first: TokenChunk, later: TokenChunk) -> bool:
    """A run of two."""
    return Run(first).takes(later)


def chunk(index: int, tokens: list[int], **fields) -> TokenChunk:
    return TokenChunk("a", index, tokens, "".join(f"<{t}>" for t in tokens), **fields)


def test_joined_chunks_keep_order_and_the_last_ones_ending():
    first = chunk(0, [1, 2], logprobs=[LP, LP])
    last = chunk(1, [3], logprobs=[LP], finish_reason="length", completion_tokens=3)
    assert joinable(first, last)
    both = joined(first, last)
    assert both.token_ids == [1, 2, 3] and both.text == "<1><2><3>"
    assert both.logprobs == [LP] * 3 and both.index == 1
    assert both.finish_reason == "length" and both.completion_tokens == 3


def test_what_is_not_joined():
    lost = chunk(1, [], failure=worker_failed("d1", "gone"))
    assert not joinable(chunk(0, [1]), lost)  # a failure is the stream's own business
    assert not joinable(chunk(0, [1], finish_reason="stop"), chunk(1, [2]))  # ended
    assert not joinable(chunk(0, [1], logprobs=[LP]), chunk(1, [2]))  # logprobs on one only
    assert not joinable(chunk(0, [1, 2], logprobs=[LP]), chunk(1, [3], logprobs=[LP]))
    big = chunk(0, [1] * MAX_JOINED_TOKENS)
    assert not joinable(big, chunk(1, [2])) and joinable(chunk(0, [1]), chunk(1, [2]))


async def _waiter(bus, router) -> ChunkWaiter:
    settings = GatewaySettings()
    liveness = Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s)
    return ChunkWaiter(settings, bus, router, liveness, context=None)


async def test_ready_takes_the_chunks_from_the_expected_one_only_when_they_are_already_here():
    bus = InMemoryBus()
    async with StreamRouter(bus, SUBJECT) as router:
        router.open("a")
        waiter = await _waiter(bus, router)
        attempt = Attempt(_task(), worker="d1", expected=1)
        takes_all = lambda _: True  # noqa: E731
        assert waiter.ready(attempt, takes_all) == []  # nothing here: nothing waited for
        for c in (chunk(0, [9]), chunk(1, [1]), chunk(3, [3])):  # a duplicate, the one, a gap
            await bus.publish(SUBJECT, c)
        assert [c.token_ids for c in waiter.ready(attempt, takes_all)] == [[1]]
        attempt = Attempt(_task(), worker="d1", expected=2)
        assert waiter.ready(attempt, takes_all) == []  # chunk 2 is missing: 3 is left
        assert (await router.next("a", 1)).index == 3
        await bus.publish(SUBJECT, chunk(2, [2]))
        assert waiter.ready(attempt, lambda _: False) == []  # not wanted: left for next()
        assert (await router.next("a", 1)).index == 2


async def test_ready_takes_a_run_in_order_and_stops_where_the_run_does():
    """Chunks that came out of order (held early) and in order join one run; the run stops at
    a gap, at a chunk it may not take (then left for next), and after the stream's end."""
    bus = InMemoryBus()
    async with StreamRouter(bus, SUBJECT) as router:
        router.open("a")
        waiter = await _waiter(bus, router)
        waiter.early[2] = chunk(2, [2])  # came before 1 (asked for again meanwhile)
        for c in (chunk(1, [1]), chunk(3, [3])):
            await bus.publish(SUBJECT, c)
        attempt = Attempt(_task(), worker="d1", expected=1)
        first = chunk(0, [0])
        run = waiter.ready(attempt, Run(first).takes)
        assert [c.index for c in run] == [1, 2, 3]
        both = joined(first, *run)
        assert both.token_ids == [0, 1, 2, 3] and both.text == "<0><1><2><3>" and both.index == 3
        attempt = attempt.received(*run)
        assert attempt.expected == 4 and list(attempt.sent) == [1, 2, 3]
        await bus.publish(SUBJECT, chunk(4, [4], logprobs=[LP]))  # logprobs: not with the run
        assert waiter.ready(attempt, Run(first).takes) == []
        assert (await router.next("a", 1)).index == 4
        attempt = Attempt(_task(), worker="d1", expected=5)
        for c in (chunk(5, [5]), chunk(6, [6]), chunk(8, [8])):
            await bus.publish(SUBJECT, c)
        ended = waiter.ready(attempt, Run(chunk(4, [4], finish_reason="stop")).takes)
        assert ended == []  # nothing joins a stream that ended
        taken = waiter.ready(attempt, Run(chunk(4, [4])).takes)
        assert [c.index for c in taken] == [5, 6]  # 7 is missing: 8 waits for it


def test_a_run_counts_its_tokens_and_ends_with_the_stream():
    run = Run(chunk(0, [1] * (MAX_JOINED_TOKENS - 2)))
    assert run.takes(chunk(1, [2])) and run.takes(chunk(2, [3]))
    assert not run.takes(chunk(3, [4]))  # one more passes the cap
    run = Run(chunk(0, [1]))
    assert run.takes(chunk(1, [2], finish_reason="length"))
    assert not run.takes(chunk(2, [3]))  # nothing after the end


@contextlib.asynccontextmanager
async def _relay():
    """(bus, router, a relay) with stream "a" open and its attempt placed on d1."""
    bus, settings = InMemoryBus(), GatewaySettings()
    async with (
        StreamRouter(bus, SUBJECT) as router,
        Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s) as liveness,
    ):
        router.open("a")
        yield bus, router, RequestRelay(settings, bus, router, liveness, context=None)


async def test_a_stream_that_came_meanwhile_reaches_the_client_as_one_answer():
    async with _relay() as (bus, router, relay):
        for i, tokens in enumerate([[1], [2, 3], [4]]):
            await bus.publish(SUBJECT, chunk(i, tokens))
        await bus.publish(SUBJECT, chunk(3, [5], finish_reason="length", completion_tokens=5))
        placed = Attempt(_task(), worker="d1")
        answers = [c async for _, c in relay.follow(placed.task, placed)]
        assert len(answers) == 1
        assert answers[0].token_ids == [1, 2, 3, 4, 5] and answers[0].finish_reason == "length"
        assert "a" not in router  # the stream is closed at the end


async def test_each_chunk_goes_alone_when_the_client_keeps_up():
    async with _relay() as (bus, _, relay):
        placed = Attempt(_task(), worker="d1")
        answers = []

        async def feed() -> None:
            for i in range(3):
                await asyncio.sleep(0.01)
                last = {"finish_reason": "length"} if i == 2 else {}
                await bus.publish(SUBJECT, chunk(i, [i], **last))

        feeding = asyncio.ensure_future(feed())
        async for _, c in relay.follow(placed.task, placed):
            answers.append(c.token_ids)
        await feeding
        assert answers == [[0], [1], [2]]


def _task() -> GenerateTask:
    return GenerateTask(
        attempt_id="a",
        prompt_token_ids=[1, 2, 3],
        sampling=SamplingParams(max_tokens=5),
        reply_subject=SUBJECT,
        arrival_time=0.0,
    )


async def test_the_gateway_times_a_tokens_stay_from_its_arrival_to_its_answer():
    bus = InMemoryBus()
    async with StreamRouter(bus, SUBJECT) as router:
        router.open("a")
        assert router.arrived("a") is None
        before = time.monotonic()
        await bus.publish(SUBJECT, chunk(0, [1]))
        await bus.publish(SUBJECT, chunk(1, [2]))
        await router.next("a", 1)
        began = router.arrived("a")
        assert before <= began <= time.monotonic()
        router.take("a")  # joins the answer next() began: its arrival is the answer's
        assert router.arrived("a") == began
        metrics = GatewayMetrics("g1")
        metrics.waited(began)
        metrics.waited(None)  # not known: not counted
        count = metrics.registry.get_sample_value(
            "tandem_gateway_token_wait_seconds_count", {"role": "gateway", "worker": "g1"}
        )
        assert count == 1


async def test_a_wait_for_a_chunk_times_out_without_a_timer_of_its_own_and_a_chunk_ends_it():
    """next() raises asyncio.TimeoutError once its time passed (within the router's watch
    tick), and returns a chunk that comes before then; the stream is usable after a timeout."""
    bus = InMemoryBus()
    async with StreamRouter(bus, SUBJECT) as router:
        router.open("a")
        started = time.monotonic()
        try:
            await router.next("a", 0.2)
            raise AssertionError("no chunk came, yet next() returned")
        except asyncio.TimeoutError:
            waited = time.monotonic() - started
        assert 0.2 <= waited < 0.6
        later = asyncio.get_running_loop().call_later(0.1, _send, bus, chunk(0, [1]))
        got = await router.next("a", 5)
        assert got.index == 0 and time.monotonic() - started < 2
        later.cancel()


def _send(bus, message) -> None:
    asyncio.ensure_future(bus.publish(SUBJECT, message))
