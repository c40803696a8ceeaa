"""A decode worker's streams outlive a NATS outage: chunks it could not send are kept and sent
again when the gateway asks (StreamReplay); the worker never dies of a failed publish, and a
stream it cannot send for too long fails (movable), freeing its blocks."""

from services.decode.stream_log import StreamLog
from shared.control.failure import Code
from shared.control.messages import StreamReplay, TaskAck, TokenChunk
from tests.unit.transfer_fakes import DECODE, Pair, make_task, until


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def chunk(attempt_id: str, index: int) -> TokenChunk:
    return TokenChunk(attempt_id=attempt_id, index=index, token_ids=[index])


def test_the_log_keeps_live_streams_and_ended_ones_for_a_while_within_a_bound():
    clock = Clock()
    log = StreamLog(retain_s=60, max_ended_chunks=5, clock=clock)
    log.open("a", "s.a")
    assert log.since("a", 0) == ("s.a", []) and log.since("nobody", 0) is None
    for i in range(3):
        log.record("s.a", chunk("a", i))
    assert [c.index for c in log.since("a", 1)[1]] == [1, 2]
    log.end("a")
    clock.now += 59
    assert [c.index for c in log.since("a", 0)[1]] == [0, 1, 2]  # ended, still kept
    for i in range(3):
        log.record("s.b", chunk("b", i))
    log.end("b")  # 6 ended chunks, over the bound: the oldest stream goes
    assert log.since("a", 0) is None and log.ended_chunks == 3
    clock.now += 61
    assert log.since("b", 0) is None and len(log) == 0 and log.ended_chunks == 0


async def replay(pair: Pair, attempt_id: str, from_index: int) -> TaskAck:
    ask = StreamReplay(attempt_id, from_index)
    return await pair.bus.request(pair.subjects.stream_replay(DECODE), ask, 5, TaskAck)


async def test_a_stream_generated_while_nats_is_down_is_sent_again_when_asked(tiny_model):
    """Before: the first failed publish escaped the decode loop and ended the worker."""
    async with Pair(tiny_model) as pair:
        assert (await pair.submit(make_task("before", 40, max_tokens=6), remote=False)).ok
        await pair.outcome("before")
        assert (await pair.submit(make_task("r", 40, max_tokens=6), remote=False)).ok
        pair.bus.connected = False  # NATS goes away: nothing reaches the gateway
        await until(lambda: "r" not in pair.decode.loop.requests)  # it ran to its end anyway
        assert not any(t.done() for t in pair.serving)  # the worker did not die
        pair.bus.connected = True
        got = len(pair.chunks["r"])
        assert (await replay(pair, "r", got)).ok
        last = await pair.outcome("r")
        assert last.finish_reason == "length"
        assert [c.index for c in pair.chunks["r"]] == list(range(len(pair.chunks["r"])))
        assert pair.tokens("r") == pair.tokens("before")
        unknown = await replay(pair, "nobody", 0)
        assert unknown.failure.code is Code.UNAVAILABLE
        await pair.idle()


async def test_a_stream_held_too_long_fails_movable_and_frees_its_blocks(tiny_model):
    async with Pair(tiny_model, max_held_chunks=2) as pair:
        assert (await pair.submit(make_task("r", 40, max_tokens=50), remote=False)).ok
        pair.bus.connected = False
        await until(lambda: "r" not in pair.decode.loop.requests)
        pair.bus.connected = True
        assert (await replay(pair, "r", len(pair.chunks["r"]))).ok
        last = await pair.outcome("r")
        assert last.failure.movable and last.failure.blame == ""
        assert "could not send its tokens" in last.failure.message
        assert len(pair.tokens("r")) < 50  # it stopped early: its blocks are back
        await pair.idle()
