"""One client must not starve the others: identities and API keys, priority capped by the key,
per-client limits at the gateway, each client in turn in the scheduler's queue and at the
tokenizer, and a head request that fits nowhere letting smaller ones by (boundedly)."""

import asyncio
import json
import threading
import time

import grpc
import pytest

from services.gateway.clients import Client, ClientKeys, ClientPolicy, Unauthenticated
from services.gateway.fair_tokenizer import FairTokenizer
from services.gateway.servicer import TandemServicer
from services.gateway.settings import GatewaySettings
from services.gateway.streams import StreamRouter
from services.scheduler.admission import AdmissionQueue
from shared.api import tandem_pb2 as pb
from shared.control.liveness import Liveness
from shared.control.messages import GenerateTask, SamplingParams, SubmitReply, TokenChunk
from shared.control.subjects import Subjects
from tests.fakes.bus import InMemoryBus
from tests.unit.test_gateway_moves import LIMITS, Aborted, FakeContext

KEY_A, KEY_B = "a" * 32, "b" * 32
DEFAULT = ClientPolicy(max_priority=0, max_streams=2, max_queued=2, max_kv_tokens=1000)


def keys_file(tmp_path) -> str:
    path = tmp_path / "keys.json"
    clients = [
        {"name": "alice", "key": KEY_A, "max_priority": 5, "max_streams": 3},
        {"name": "bob", "key": KEY_B},
    ]
    path.write_text(json.dumps({"clients": clients}))
    return str(path)


def test_a_client_is_its_key_name_else_its_certificate_else_its_address(tmp_path):
    keys = ClientKeys.load(keys_file(tmp_path), DEFAULT)
    alice = keys.identify([("authorization", f"Bearer {KEY_A}")], "", "ipv4:1.2.3.4")
    assert alice == Client("key:alice", ClientPolicy(5, 3, 2, 1000))
    assert keys.identify([("authorization", f"bearer {KEY_B}")], "", "x").name == "key:bob"
    for metadata in ([], [("authorization", "Bearer nope")], [("authorization", KEY_A)]):
        with pytest.raises(Unauthenticated) as err:
            keys.identify(metadata, "cn", "ipv4:1.2.3.4")
        assert KEY_A not in str(err.value)  # a key is never echoed
    open_ = ClientKeys.load("", DEFAULT)
    assert open_.identify([], "svc-7", "ipv4:1.2.3.4").name == "cert:svc-7"
    assert open_.identify([], "", "ipv4:1.2.3.4") == Client("addr:ipv4:1.2.3.4", DEFAULT)


def test_a_keys_file_naming_no_client_is_refused_not_taken_for_no_keys(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text('{"clients": []}')
    with pytest.raises(ValueError, match="no client keys"):
        ClientKeys.load(str(path), DEFAULT)


def test_a_keys_file_entry_without_a_name_or_key_is_a_clear_error(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"clients": [{"name": "a", "key": KEY_A}, {"key": KEY_B}]}))
    with pytest.raises(ValueError, match="client 1 needs a name and a key") as err:
        ClientKeys.load(str(path), DEFAULT)
    assert KEY_B not in str(err.value)
    path.write_text(json.dumps({"clients": [{"name": "a", "key": "short"}]}))
    with pytest.raises(ValueError, match="shorter than 16"):
        ClientKeys.load(str(path), DEFAULT)


async def test_the_tokenizer_takes_each_client_in_turn():
    fair, order, gate = FairTokenizer(), [], threading.Event()

    def job(name: str) -> str:
        gate.wait(5)
        order.append(name)
        return name

    flood = [asyncio.ensure_future(fair.run("A", job, f"A{i}")) for i in range(5)]
    await asyncio.sleep(0.05)  # A0 is running; A1..A4 wait
    short = asyncio.ensure_future(fair.run("B", job, "B0"))
    await asyncio.sleep(0.05)
    gate.set()
    assert await short == "B0" and len(await asyncio.gather(*flood)) == 5
    assert order[:3] == ["A0", "A1", "B0"] or order[:2] == ["A0", "B0"]
    assert order.index("B0") <= 2  # not behind the whole flood
    fair.close()


def task(client: str, n: int, priority: int = 0) -> GenerateTask:
    return GenerateTask(
        attempt_id=f"{client}{n}",
        prompt_token_ids=[1],
        sampling=SamplingParams(),
        reply_subject="r",
        arrival_time=time.time(),
        priority=priority,
        client=client,
    )


def test_the_queue_takes_equal_priorities_from_each_client_in_turn():
    queue = AdmissionQueue(max_pending=100, timeout_s=60)
    for n in range(6):
        queue.offer(task("A", n), None)
    queue.pop()  # A0 goes; then B comes with two requests
    queue.offer(task("B", 0), None)
    queue.offer(task("B", 1), None)
    queue.offer(task("C", 0, priority=1), None)  # a higher priority still goes first
    order = [queue.pop().task.attempt_id for _ in range(len(queue))]
    assert order == ["C0", "A1", "B0", "A2", "B1", "A3", "A4", "A5"]


def test_a_full_queue_still_takes_a_client_under_its_share():
    """A lone client may fill the scheduler's queue; a newcomer then gets up to half of it, and
    the first none more until it is back under its own half."""
    queue = AdmissionQueue(max_pending=4, timeout_s=60)
    assert all(queue.offer(task("A", n), None) for n in range(4))
    assert queue.offer(task("A", 4), None) is None
    assert queue.offer(task("B", 0), None) and queue.offer(task("B", 1), None)
    assert queue.offer(task("B", 2), None) is None  # its half of 4
    assert len(queue) == 6  # over its bound by B's share, no more
    assert [queue.pop().task.attempt_id for _ in range(2)] == ["A0", "B0"]
    assert queue.offer(task("A", 5), None) is None  # full, and A holds 3: over its half
    assert queue.offer(task("B", 3), None)  # B holds 1: under its half


async def generate(servicer, request, context) -> list:
    responses = []
    try:
        async for response in servicer.Generate(request, context):
            responses.append(response)
    except Aborted:
        pass
    return responses


async def test_the_gateway_authenticates_caps_priority_and_refuses_past_a_limit(
    tmp_path, tokenizer
):
    bus, submitted = InMemoryBus(), []

    async def scheduler(t: GenerateTask, respond) -> None:
        submitted.append(t)
        await respond(SubmitReply(decode_worker="d1"))
        chunk = TokenChunk(t.attempt_id, 0, [7], finish_reason="length", completion_tokens=1)
        asyncio.get_running_loop().call_later(
            0.3, lambda: asyncio.ensure_future(bus.publish(t.reply_subject, chunk))
        )

    settings = GatewaySettings(api_keys_file=keys_file(tmp_path))
    await bus.subscribe(Subjects(settings.cluster).submit, scheduler)
    keys = ClientKeys.load(settings.api_keys_file, DEFAULT)
    async with (
        StreamRouter(bus, "gw.r") as streams,
        Liveness(bus, Subjects(settings.cluster), 3.0) as liveness,
    ):
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness, keys=keys)

        def request(priority: int = 0, max_tokens: int = 4) -> pb.GenerateRequest:
            sampling = pb.SamplingParams(max_tokens=max_tokens)
            return pb.GenerateRequest(prompt="Hi", sampling=sampling, priority=priority)

        nobody = FakeContext()
        assert await generate(servicer, request(), nobody) == []
        assert nobody.code == grpc.StatusCode.UNAUTHENTICATED
        status = FakeContext()
        with pytest.raises(Aborted):
            await servicer.ClusterStatus(pb.ClusterStatusRequest(), status)
        assert status.code == grpc.StatusCode.UNAUTHENTICATED

        alice = [("authorization", f"Bearer {KEY_A}")]
        bob = [("authorization", f"Bearer {KEY_B}")]
        await generate(servicer, request(priority=2**31 - 1), FakeContext(alice))
        await generate(servicer, request(priority=9), FakeContext(bob))
        assert [(t.client, t.priority) for t in submitted] == [("key:alice", 5), ("key:bob", 0)]

        # bob may hold 2 streams, 1000 KV tokens: a third stream, or one too big, is refused
        held = [
            asyncio.ensure_future(generate(servicer, request(), FakeContext(bob))) for _ in "ab"
        ]
        await asyncio.sleep(0.1)
        third, big = FakeContext(bob), FakeContext(bob)
        await generate(servicer, request(), third)
        assert third.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(third.trailing)["retry-after-ms"] == "1000"
        await asyncio.gather(*held)
        await generate(servicer, request(max_tokens=1000), big)
        assert big.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV tokens" in big.message
        assert not servicer.seats.held() and servicer.seats.open == 0  # all given back


async def test_no_job_runs_on_the_event_loop_however_short():
    """A request's cost is known only once it ran (36,000 empty messages are a few characters):
    every job given runs on the tokenizer thread, none on the loop (what the servicer validates
    on the loop itself is bounded by its shape: test_validation's light requests)."""
    fair = FairTokenizer()

    def where(_: str) -> str:
        return threading.current_thread().name

    assert (await fair.run("A", where, "x")).startswith("tokenize")
    jobs = [fair.run(c, where, "x") for c in "ABAB"]
    assert all(name.startswith("tokenize") for name in await asyncio.gather(*jobs))
    fair.close()


async def test_requests_still_being_validated_count_against_their_client(tokenizer, monkeypatch):
    """A client's request waiting for the tokenizer holds its seat: with one queued request
    allowed, a second one is refused at once, not queued behind the first's validation."""
    from services.gateway import servicer as servicer_module

    gate, real = threading.Event(), servicer_module.validate

    def slow(*args):
        gate.wait(5)
        return real(*args)

    monkeypatch.setattr(servicer_module, "validate", slow)
    bus = InMemoryBus()

    async def scheduler(t: GenerateTask, respond) -> None:
        await respond(SubmitReply(decode_worker="d1"))
        await bus.publish(
            t.reply_subject,
            TokenChunk(t.attempt_id, 0, [7], finish_reason="length", completion_tokens=1),
        )

    settings = GatewaySettings(max_queued_per_client=1)
    await bus.subscribe(Subjects(settings.cluster).submit, scheduler)
    async with (
        StreamRouter(bus, "gw.r") as streams,
        Liveness(bus, Subjects(settings.cluster), 3.0) as liveness,
    ):
        servicer = TandemServicer(settings, bus, streams, tokenizer, LIMITS, liveness)
        hi = pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(max_tokens=1))
        first = asyncio.ensure_future(generate(servicer, hi, FakeContext()))
        await asyncio.sleep(0.1)  # being validated
        second = FakeContext()
        assert await generate(servicer, hi, second) == []
        assert second.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "waiting" in second.message
        gate.set()
        assert [r.token_ids for r in await first] == [[7]]
        assert servicer.seats.open == 0
