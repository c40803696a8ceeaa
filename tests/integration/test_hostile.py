"""Hostile input against a real stack: a thousand random and adversarial requests at the gRPC API
(hypothesis), raw garbage on the gRPC port, on every NATS subject the services listen to, and on
the workers' UCX sockets, and bodies at the HTTP API that cost more than they look (nested deep,
tens of thousands of empty messages). No service goes down, every reply is a proper status,
nothing leaks, and the stack still answers correctly afterwards.
"""

import asyncio
import concurrent.futures
import json
import os
import random
import socket
import time
import urllib.error
import urllib.request
from collections import Counter

import grpc
import msgpack
import nats
import psutil
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from services.gateway.http_body import MAX_OBJECTS
from shared.api import tandem_pb2 as pb
from shared.control.subjects import Subjects
from tests.integration.helpers import chat_request, collect, long_document
from tests.integration.stack import AUTO_GATEWAY_ID

pytestmark = pytest.mark.slow

REFUSALS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}


@pytest.fixture(scope="module")
def hostile(auto):
    return auto, collect(auto.stub(), chat_request("Name a colour.", 4))[1]


def _still_serving(stack, reference) -> None:
    assert not stack.dead(), stack.dead()
    assert collect(stack.stub(), chat_request("Name a colour.", 4))[1] == reference
    stack.wait_idle()


# --- the gRPC API, by hypothesis -----------------------------------------------------------------

# control characters too
TEXT = st.text(st.characters(codec="utf-8", categories=None), max_size=300)
FLOATS = st.floats(width=32)  # nan, inf, -0.0, huge
SAMPLING = st.builds(
    pb.SamplingParams,
    max_tokens=st.one_of(st.none(), st.integers(0, 6), st.integers(0, 2**32 - 1)),
    temperature=st.one_of(st.just(0.0), FLOATS),
    top_p=st.one_of(st.none(), FLOATS),
    top_k=st.integers(0, 2**32 - 1),
    seed=st.one_of(st.none(), st.integers(0, 2**64 - 1)),
    stop=st.lists(TEXT, max_size=20),
    ignore_eos=st.booleans(),
)
MESSAGES = st.lists(
    st.builds(
        pb.ChatMessage,
        role=st.sampled_from(["user", "system", "assistant", "wizard", ""]),
        content=TEXT,
    ),
    max_size=4,
)
REQUESTS = st.builds(
    pb.GenerateRequest,
    request_id=st.one_of(st.just(""), st.text(max_size=300)),
    prompt=st.one_of(st.just(""), TEXT, st.just("word " * 3000)),
    messages=st.one_of(st.just([]), MESSAGES),
    sampling=st.one_of(st.none(), SAMPLING),
    priority=st.integers(-(2**31), 2**31 - 1),
).map(pb.GenerateRequest.SerializeToString)
INVALID_UTF8 = st.binary(min_size=1, max_size=50).map(
    lambda b: b"\x12" + bytes([len(b) + 2]) + b"\xff\xfe" + b
)
MUTATED = st.tuples(REQUESTS, st.randoms(use_true_random=False)).map(
    lambda pair: bytes(b ^ (0xFF if pair[1].random() < 0.05 else 0) for b in pair[0])[
        : pair[1].randint(0, len(pair[0]))
    ]
)
BODIES = st.one_of(REQUESTS, st.binary(max_size=2048), INVALID_UTF8, MUTATED)


def _status_of(generate, body: bytes) -> str:
    """'OK' (a valid request's first response; then we leave) or the refusal's status code."""
    stream = generate(body, timeout=120)
    try:
        first = next(stream)
        assert isinstance(first, pb.GenerateResponse)
        stream.cancel()
        return "OK"
    except StopIteration:
        raise AssertionError(
            f"a stream ended without a response or a status: {body[:100]}"
        ) from None
    except grpc.RpcError as err:
        assert err.code() in REFUSALS, (err.code(), err.details(), body[:100])
        assert err.details(), f"a refusal without a message: {body[:100]}"
        return err.code().name


def test_a_thousand_random_requests_get_a_proper_status_each(hostile):
    """Hypothesis makes the requests; eight at a time are in flight (one at a time left the
    stack idle between them), and each one's outcome is checked once all have come back."""
    stack, reference = hostile
    channel = stack.channel()
    generate = channel.unary_stream(
        "/tandem.v1.Tandem/Generate",
        request_serializer=None,
        response_deserializer=pb.GenerateResponse.FromString,
    )
    sent: list[tuple[bytes, concurrent.futures.Future]] = []

    @settings(
        max_examples=1000,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(BODIES)
    def one(body: bytes) -> None:
        sent.append((body, pool.submit(_status_of, generate, body)))

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        one()
    seen = Counter(future.result() for _, future in sent)  # the first failure raises here
    print(f"gRPC API: {len(sent)} requests: {dict(seen)}")
    assert len(sent) == 1000 and seen["OK"] and seen["INVALID_ARGUMENT"], seen
    channel.close()
    _still_serving(stack, reference)


# --- raw bytes on the gRPC port ------------------------------------------------------------------


def test_garbage_bytes_on_the_grpc_port(hostile):
    stack, reference = hostile
    host, port = stack.address.rsplit(":", 1)
    rng = random.Random(7)
    payloads = [
        b"",
        b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
        bytes(rng.randrange(256) for _ in range(65536)),
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\xff" * 9 + os.urandom(4096),  # preface, bad frame
        b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x7f\xff\xff\x00\x00\x00\x00\x00\x01",
    ]  # a 8 MiB frame header
    for payload in payloads * 4:
        with socket.create_connection((host, int(port)), timeout=5) as conn:
            conn.sendall(payload)
            conn.settimeout(1)
            try:
                conn.recv(4096)
            except (TimeoutError, ConnectionError):
                pass
    _still_serving(stack, reference)


# --- raw bytes and bad messages on the NATS subjects ---------------------------------------------


def _bad_payloads(rng: random.Random) -> list[bytes]:
    out_of_range = dict(type="CancelRequest", attempt_id="r" * 100_000)
    return [
        b"",
        os.urandom(64),
        os.urandom(200_000),
        msgpack.packb([1, 2, 3]),
        msgpack.packb({"type": "Nope"}),
        msgpack.packb({"type": "TokenChunk", "attempt_id": "r", "index": -5}),
        msgpack.packb(out_of_range),
        msgpack.packb({"type": "WorkerHeartbeat"}),
        msgpack.packb({"type": 7}),
        msgpack.packb(
            {
                "type": "GenerateTask",
                "attempt_id": "x",
                "prompt_token_ids": [-1],
                "sampling": {},
                "reply_subject": "r",
                "arrival_time": 1.0,
            }
        ),
        bytes(rng.randrange(256) for _ in range(1000)),
    ]


async def _flood(url: str, subjects: list[str]) -> None:
    """Each bad payload published on each subject, and sent as a request too (all at once: nobody
    answers garbage, so each request waits for its timeout or hears no responders)."""
    client = await nats.connect(url)
    rng = random.Random(9)

    async def ask(subject: str, payload: bytes) -> None:
        try:
            await client.request(subject, payload, timeout=0.5)
        except Exception:  # a timeout or no responders
            pass

    try:
        sent = [(subject, payload) for subject in subjects for payload in _bad_payloads(rng)]
        for subject, payload in sent:
            await client.publish(subject, payload)
        await asyncio.gather(*(ask(subject, payload) for subject, payload in sent))
        await client.flush()
    finally:
        await client.close()


def test_garbage_on_every_nats_subject_is_dropped_and_counted(hostile, nats):
    stack, reference = hostile
    s = Subjects(stack.cluster)
    workers = [w.id for w in stack.status().workers]
    subjects = [
        s.heartbeat,
        s.discover,
        s.submit,
        s.status,
        s.cancel,
        s.gateway_tokens(AUTO_GATEWAY_ID),
    ]
    for w in workers:
        subjects += [
            s.decode_tasks(w),
            s.prefill_tasks(w),
            s.prefill_results(w),
            s.transfer_aborts(w),
            s.ping(w),
        ]
    asyncio.run(_flood(nats.url, subjects))
    deadline = time.monotonic() + 15  # the workers' counters travel in heartbeats
    while True:
        status = stack.status()
        if (
            all(w.messages_dropped > 0 for w in status.workers)
            and status.scheduler_messages_dropped > 0
            and status.gateway_messages_dropped > 0
        ):
            break
        assert time.monotonic() < deadline, status
        time.sleep(0.2)
    _still_serving(stack, reference)


# --- raw bytes on the workers' UCX sockets --------------------------------------------------------


def test_garbage_on_the_ucx_sockets(hostile):
    stack, reference = hostile
    ports = []
    for w in stack.status().workers:
        worker = psutil.Process(w.pid)  # and its data-plane helper, where its UCX runs
        for conn in [c for p in [worker, *worker.children()] for c in p.net_connections("tcp")]:
            if conn.status == psutil.CONN_LISTEN:
                ports.append((w.id, conn.laddr.ip, conn.laddr.port))
                assert conn.laddr.ip in ("127.0.0.1", "::1"), (
                    f"{w.id} listens on {conn.laddr} (loopback only by default)"
                )
    for _, ip, port in ports:
        for payload in (os.urandom(64), os.urandom(100_000), b"\x00" * 4096):
            try:
                with socket.create_connection((ip, port), timeout=5) as conn:
                    conn.sendall(payload)
            except ConnectionError:
                pass
    print(f"UCX sockets hit: {ports}")
    # every worker was hit
    assert {w for w, _, _ in ports} == {w.id for w in stack.status().workers}, ports
    long = chat_request(long_document(300), 4)  # over the local-prefill threshold: KV over UCX
    chunks, _, _ = collect(stack.stub(), long)
    assert chunks[-1].timing.path == "disaggregated"
    _still_serving(stack, reference)


# --- bodies at the HTTP API that cost more than they look ----------------------------------------


def _post(stack, body: bytes) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"{stack.http_url}/v1/chat/completions",
        data=body,
        headers={"Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_a_body_nested_deep_is_a_400_not_a_500(hostile):
    stack, reference = hostile
    status, body = _post(stack, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert status == 400 and "nested too deeply" in body["error"]["message"], (status, body)
    _still_serving(stack, reference)


def test_floods_of_empty_messages_are_refused_by_their_count(hostile):
    """Under 1 MiB each, and a few characters of content: 36,000 messages are refused while the
    body is decoded, past the most objects a request holds (4,000 by their template frames,
    before a message is copied)."""
    stack, reference = hostile
    too_many = f"more than {MAX_OBJECTS} JSON objects"
    for count, why in ((36_000, too_many), (4_000, "4000 messages take at least")):
        body = json.dumps({"messages": [{"role": "user"}] * count}).encode()
        assert len(body) < 1 << 20
        started = time.monotonic()
        status, answer = _post(stack, body)
        assert status == 400 and why in answer["error"]["message"], (status, answer)
        print(f"{count} empty messages refused in {time.monotonic() - started:.3f}s")
    _still_serving(stack, reference)
