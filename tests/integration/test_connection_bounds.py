"""Connection bounds on both fronts, against a real gateway (mock workers, short bounds): half-sent
headers closed at the read timeout, a body trickling in answered 408, an idle keep-alive
connection closed, a connection over the cap answered 503, an SSE client that stops reading cut
off with its request ended and its blocks freed, gRPC calls over the cap refused with
RESOURCE_EXHAUSTED while half-sent ones end at the read timeout, and /metrics on the API port."""

import json
import re
import socket
import threading
import time
import urllib.request

import grpc
import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow

READ_S, IDLE_S, WRITE_S, MAX_CONNECTIONS, MAX_RPCS = 2.0, 3.0, 2.0, 6, 3
BOUNDS = {
    "TANDEM_READ_TIMEOUT_S": str(READ_S),
    "TANDEM_HTTP_IDLE_TIMEOUT_S": str(IDLE_S),
    "TANDEM_WRITE_TIMEOUT_S": str(WRITE_S),
    "TANDEM_HTTP_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
    "TANDEM_HTTP_LINGER_S": "0.5",
    "TANDEM_HTTP_SEND_BUFFER_BYTES": "16384",
    "TANDEM_GRPC_MAX_CONCURRENT_RPCS": str(MAX_RPCS),
}
MOCK = {"TANDEM_ENGINE": "mock", "TANDEM_MOCK_SPEEDUP": "0"}
CHAT = "POST /v1/chat/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"


@pytest.fixture(scope="module")
def bounded(processes, nats):
    stack = start_stack(
        processes,
        nats,
        "it-bounds",
        "colocated",
        extra_env=MOCK,
        # room for 8 x 4,000 tokens, counted at the real model's bytes (the mock holds 2 a token)
        role_env={"gateway": BOUNDS, "decode": {"TANDEM_KV_CACHE_MB": "4096"}},
    )
    yield stack
    stack.stop()


def _connect(stack, rcvbuf: int = 0) -> socket.socket:
    sock = socket.socket()
    if rcvbuf:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(("127.0.0.1", stack.http_port))
    return sock


def _until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """What the gateway sends until it closes the connection, and how long that took; fails
    if it is still open after `timeout`."""
    started, data = time.monotonic(), b""
    sock.settimeout(timeout)
    try:
        while chunk := sock.recv(65536):
            data += chunk
    except ConnectionResetError:
        pass
    except TimeoutError:
        raise AssertionError(f"still open after {timeout}s; got {data[:200]!r}") from None
    return data, time.monotonic() - started


def _trickle(sock: socket.socket, data: bytes, every_s: float) -> threading.Thread:
    def send() -> None:
        try:
            for byte in data:
                sock.sendall(bytes([byte]))
                time.sleep(every_s)
        except OSError:
            pass

    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


def _get(sock: socket.socket, path: str) -> bytes:
    """One keep-alive GET: the answer, read by its Content-Length."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    sock.settimeout(10)
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head, re.I).group(1))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def _model(stack) -> str:
    with urllib.request.urlopen(f"{stack.http_url}/v1/models", timeout=10) as reply:
        return json.load(reply)["data"][0]["id"]


def _metrics(stack, port: int = 0) -> str:
    """The gateway's metrics, from the API port (or the metrics port given)."""
    url = f"http://127.0.0.1:{port}/metrics" if port else f"{stack.http_url}/metrics"
    with urllib.request.urlopen(url, timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        return reply.read().decode()


def _sample(text: str, name: str, **labels) -> float:
    """The value of one series in Prometheus text (0 when absent)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_half_sent_headers_are_closed_at_the_read_timeout_however_slowly_they_trickle(bounded):
    socks = [_connect(bounded) for _ in range(MAX_CONNECTIONS - 1)]
    for sock in socks:  # a byte every 0.3 s: never whole, each byte after the deadline's start
        _trickle(sock, (CHAT + "X-Padding: " + "a" * 200).encode(), 0.3)
    for sock in socks:
        answer, took = _until_closed(sock, READ_S + 3)
        assert answer == b"", answer  # no headers, nothing to answer
        sock.close()


def test_a_body_trickling_in_gets_a_408_at_the_read_timeout(bounded):
    body = json.dumps({"model": "x", "messages": [{"role": "user", "content": "hi"}]}).encode()
    sock = _connect(bounded)
    sock.sendall(f"{CHAT}Content-Length: {len(body)}\r\n\r\n".encode())
    started = time.monotonic()
    _trickle(sock, body, 0.3)
    answer, _ = _until_closed(sock, READ_S + 5)
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"did not arrive whole within 2s" in answer
    assert time.monotonic() - started < READ_S + 3
    sock.close()


def test_an_idle_keep_alive_connection_is_closed(bounded):
    sock = _connect(bounded)
    assert _get(sock, "/health").startswith(b"HTTP/1.1 200")
    answer, took = _until_closed(sock, IDLE_S + 3)
    assert answer == b"" and IDLE_S - 0.5 < took < IDLE_S + 2, (answer, took)
    sock.close()


def test_a_connection_over_the_cap_gets_a_503(bounded):
    held = [_connect(bounded) for _ in range(MAX_CONNECTIONS)]
    for sock in held:  # each one served: open and counted
        assert _get(sock, "/health").startswith(b"HTTP/1.1 200")
    extra = _connect(bounded)
    extra.sendall(b"GET /health HTTP/1.1\r\nHost: gateway\r\n\r\n")
    answer, _ = _until_closed(extra, 5)
    assert answer.startswith(b"HTTP/1.1 503") and b"Retry-After: 1" in answer, answer
    assert b"HTTP connections open, its limit" in answer
    for sock in held:
        sock.close()
    time.sleep(0.2)
    assert _sample(_metrics(bounded), "tandem_http_connections_cut_total", reason="refused") >= 1


def test_an_sse_client_that_stops_reading_is_cut_off_and_its_request_ends(bounded):
    """Eight choices of 4,000 tokens: some MB of events, more than the socket buffers hold."""
    cancelled = {"name": "tandem_requests_total", "api": "openai", "status": "cancelled"}
    port = bounded.metrics_ports["it-bounds-gateway"]
    before = _sample(_metrics(bounded, port), **cancelled)
    request = {
        "model": _model(bounded),
        "messages": [{"role": "user", "content": "Count."}],
        **{"stream": True, "n": 8, "max_tokens": 4000, "ignore_eos": True},
    }
    body = json.dumps(request).encode()
    sock = _connect(bounded, rcvbuf=4096)
    sock.sendall(f"{CHAT}Content-Length: {len(body)}\r\n\r\n".encode() + body)
    sock.settimeout(30)
    head = sock.recv(12)
    assert head == b"HTTP/1.1 200", head + sock.recv(2000)  # and then nothing more is read
    deadline = time.monotonic() + 90
    while True:
        text = _metrics(bounded, port)
        ended = _sample(text, **cancelled) > before
        if ended and not _sample(text, "tandem_requests_in_flight", api="openai"):
            break
        assert time.monotonic() < deadline, "the stalled stream was never cut off"
        time.sleep(0.5)
    assert _sample(text, "tandem_http_connections_cut_total", reason="write_timeout") >= 1
    bounded.wait_idle()
    sock.close()


def test_grpc_calls_over_the_cap_are_refused_and_half_sent_ones_end_at_the_read_timeout(bounded):
    never = threading.Event()

    def no_request():
        never.wait(60)
        yield pb.GenerateRequest().SerializeToString()

    channel = bounded.channel()
    generate = channel.stream_stream("/tandem.v1.Tandem/Generate")
    held = [generate(no_request()) for _ in range(MAX_RPCS)]
    time.sleep(0.5)
    with pytest.raises(grpc.RpcError) as refused:
        bounded.status()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in held:
        with pytest.raises(grpc.RpcError) as ended:
            next(call)
        assert ended.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED, ended.value
        assert "did not arrive within 2s" in ended.value.details()
    never.set()
    assert bounded.status().workers  # served again
    channel.close()


def test_metrics_are_served_on_the_http_api_port(bounded):
    body = json.dumps({"model": _model(bounded), "prompt": "Hello", "max_tokens": 3}).encode()
    urllib.request.urlopen(
        urllib.request.Request(
            f"{bounded.http_url}/v1/completions",
            data=body,
            headers={"Content-Type": "application/json"},
        ),
        timeout=30,
    ).read()
    text = _metrics(bounded)
    assert _sample(text, "tandem_requests_total", api="openai", status="ok") >= 1
    assert "# TYPE tandem_time_to_first_token_seconds histogram" in text
    assert _sample(text, "tandem_http_connections_open") >= 1  # this scrape's own
