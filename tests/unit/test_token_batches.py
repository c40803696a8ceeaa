"""A decode worker sends one step's token chunks for a gateway as one message (TokenBatch), not
one per sequence; batches are cut before they pass the wire's cap; the gateway's StreamRouter
hands each chunk of a batch to its own stream."""

import asyncio
import dataclasses

from services.decode.token_streams import BATCH_BYTES, _parts, _size
from services.gateway.streams import StreamRouter
from shared.control import wire
from shared.control.messages import (
    DecodeAssignment,
    PromptLogprobs,
    TaskAck,
    Timing,
    TokenBatch,
    TokenChunk,
    TokenLogprob,
)
from tests.fakes.bus import InMemoryBus
from tests.unit.transfer_fakes import DECODE, Pair, make_task, until

SUBJECT = "tandem.default.gateway.g.tokens"


async def test_one_message_per_step_carries_every_stream_of_a_gateway(tiny_model):
    async with Pair(tiny_model) as pair:
        messages, chunks = [], {}

        async def collect(message, respond):
            messages.append(message)
            for chunk in message.chunks if isinstance(message, TokenBatch) else [message]:
                chunks.setdefault(chunk.attempt_id, []).append(chunk)

        await pair.bus.subscribe(SUBJECT, collect)
        tasks = [
            dataclasses.replace(make_task(f"r{i}", 20, max_tokens=16), reply_subject=SUBJECT)
            for i in range(8)
        ]
        acks = await asyncio.gather(
            *(
                pair.bus.request(
                    pair.subjects.decode_tasks(DECODE), DecodeAssignment(task=t), 5, TaskAck
                )
                for t in tasks
            )
        )
        assert all(ack.ok for ack in acks)
        await until(lambda: sum(bool(c[-1].finish_reason) for c in chunks.values()) == 8)
        for stream in chunks.values():
            assert [c.index for c in stream] == list(range(len(stream)))
            assert sum(len(c.token_ids) for c in stream) == 16
        tokens = 8 * 16
        assert len(messages) * 4 <= tokens, f"{len(messages)} messages for {tokens} tokens"
        assert any(isinstance(m, TokenBatch) and len(m.chunks) == 8 for m in messages)
        await pair.idle()


def test_the_size_estimate_bounds_chunks_with_logprobs_and_timing():
    top = TokenLogprob(-0.5, list(range(1 << 20, (1 << 20) + 20)), [-1.0 / 3] * 20)
    rows = 1000  # a prompt's logprobs, 5 alternatives each
    prompt = PromptLogprobs(5, [-1.0 / 3] * rows, [1 << 30] * 5 * rows, [-1.0 / 7] * 5 * rows)
    chunk = TokenChunk(
        "a" * 64,
        1 << 30,
        [1 << 30] * 8,
        "x",
        [top] * 8,
        prompt_logprobs=prompt,
        finish_reason="length",
        prompt_tokens=1 << 20,
        completion_tokens=1 << 20,
        timing=Timing(1.5, 2.5, 3.5, 4.5, "p" * 64, "d" * 64, "disaggregated", 1 << 20),
    )
    assert len(wire.encode(chunk)) <= _size(chunk)
    assert wire.decode(wire.encode(chunk), TokenChunk).prompt_logprobs == prompt


def test_batches_are_cut_below_the_wire_cap():
    big = TokenChunk("a", 0, token_ids=[1] * 100, text="é" * 60_000)
    pairs = [(None, dataclasses.replace(big, attempt_id=f"r{i}")) for i in range(12)]
    parts = _parts(pairs)
    assert len(parts) > 1 and sum(len(p) for p in parts) == 12
    for part in parts:
        assert len(part) == 1 or sum(_size(c) for _, c in part) <= BATCH_BYTES
        batch = TokenBatch([c for _, c in part])
        encoded = wire.encode(batch)  # raises over the cap
        assert len(encoded) <= sum(_size(c) for _, c in part)  # the estimate is an upper bound
        assert wire.decode(encoded, TokenBatch) == batch


async def test_the_gateway_hands_each_chunk_of_a_batch_to_its_stream():
    bus = InMemoryBus()
    async with StreamRouter(bus, SUBJECT) as router:
        router.open("a")
        router.open("b")
        batch = TokenBatch([TokenChunk("a", 0, [1]), TokenChunk("b", 0, [2]), TokenChunk("x", 0)])
        await bus.publish(SUBJECT, batch)
        assert (await router.next("a", 1)).token_ids == [1]
        assert (await router.next("b", 1)).token_ids == [2]
