"""Long prompts on the control plane: a prompt's token ids travel packed (4 bytes each), so a
128k-token prompt passes the wire and its rules; one too large to send at all is the request's
fault, INVALID_ARGUMENT (before: 65k tokens broke the cap and the client saw UNKNOWN)."""

import time

import grpc
import pytest

from services.gateway.relay import RequestRelay
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from shared.control.liveness import Liveness
from shared.control.messages import (
    GenerateTask,
    KVDestination,
    KVLayout,
    PrefillTask,
    SamplingParams,
)
from shared.control.subjects import Subjects
from shared.control.wire import MAX_MESSAGE_BYTES, MessageError, decode, encode
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import Aborted, FakeContext

LAYOUT = KVLayout(model="m", dtype="bfloat16", num_layers=32, num_kv_heads=8, head_dim=128)


def task(tokens: int) -> GenerateTask:
    return GenerateTask(
        attempt_id="r.1",
        prompt_token_ids=[(i * 7919) % 128_000 for i in range(tokens)],
        sampling=SamplingParams(max_tokens=16),
        reply_subject="gw.tokens",
        arrival_time=time.time(),
    )


def test_a_128k_token_prompt_crosses_the_wire_packed():
    big = task(128 * 1024)
    data = encode(big)
    assert len(data) < 4 * 128 * 1024 + 4096  # 4 bytes a token, not a msgpack int each
    assert decode(data, GenerateTask) == big
    prefill = PrefillTask(
        task=big,
        layout=LAYOUT,
        destination=KVDestination(b"u" * 300, 1 << 40, list(range(8192))),
        decode_worker="d1",
    )
    assert decode(encode(prefill), PrefillTask) == prefill


def test_packed_ids_are_checked_like_any_other():
    with pytest.raises(MessageError):
        encode(task(4).__class__(**{**task(4).__dict__, "prompt_token_ids": [1, -2]}))
    data = encode(task(4))
    with pytest.raises(MessageError):  # a packed field cut short is malformed
        decode(data.replace(encode(task(4))[-4:], b"\x00\x00\x00"), GenerateTask)


async def test_a_prompt_too_large_to_send_is_invalid_argument_not_unknown():
    bus, settings = InMemoryBus(), GatewaySettings()
    oversized = task(MAX_MESSAGE_BYTES // 4 + 1)
    async with (
        StreamRouter(bus, "gw.tokens") as streams,
        Liveness(bus, Subjects(settings.cluster), settings.worker_timeout_s) as liveness,
    ):
        context = FakeContext()
        relay = RequestRelay(settings, bus, streams, liveness, context)
        with pytest.raises(Aborted):
            async for _ in relay.follow(oversized):
                pass
    assert context.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "over the" in context.message and "limit" in context.message


def test_a_deadline_travels_as_time_left_so_clock_skew_does_not_matter(monkeypatch):
    """Before, the deadline was a unix instant: a host whose clock ran 60 s ahead took a request
    with 10 s left for expired, and one 60 s behind kept it a minute too long."""
    from shared.control import wire

    sent = task(8)
    sent.deadline = time.time() + 10.0
    data = encode(sent)
    for skew in (60.0, -60.0):
        monkeypatch.setattr(wire, "_now", lambda skew=skew: time.time() + skew)
        got = decode(data, GenerateTask)
        assert 9.0 < got.deadline - wire._now() <= 10.0  # 10 s left there too
    monkeypatch.undo()
    sent.deadline = time.time() - 1.0  # passed: still passed on arrival, not "no deadline"
    assert 0 < decode(encode(sent), GenerateTask).deadline <= time.time()
    sent.deadline = 0.0
    assert decode(encode(sent), GenerateTask).deadline == 0.0
