"""Client shares against a real stack with four gateway replicas: a lone client may fill the
queue (64 concurrent requests from one address, none refused: a fixed per-client cap of 32 refused
half of them), a flooding client is held to its share while another client's requests all pass,
and a key's cap holds over two replicas while another key's is its own."""

import concurrent.futures
import http.client
import json
import sys
import time

import grpc
import pytest

from shared.api import tandem_pb2_grpc as pb_grpc
from shared.cli.processes import child_env, free_port
from tests.integration.helpers import chat_request
from tests.integration.stack import start_stack, wait_serving

pytestmark = pytest.mark.slow
SMALL, OTHER = "small-key-0123456789abcdef", "other-key-0123456789abcdef"
CHAT = {"model": "SmolLM2-135M-Instruct.Q4_1", "max_tokens": 2}


def spawn_gateway(group, nats, cluster: str, name: str, env: dict) -> tuple[str, int]:
    """Another gateway replica on the stack's cluster: its gRPC address and HTTP port."""
    port, http_port = free_port(), free_port()
    env = {
        "TANDEM_NATS_URL": nats.url,
        "TANDEM_CLUSTER": cluster,
        "TANDEM_GRPC_PORT": str(port),
        "TANDEM_HTTP_PORT": str(http_port),
        "TANDEM_METRICS_PORT": str(free_port()),
        **env,
    }
    group.spawn(name, [sys.executable, "-m", "services.gateway"], child_env(env))
    wait_serving(f"127.0.0.1:{port}", group, names=[name])
    return f"127.0.0.1:{port}", http_port


@pytest.fixture(scope="module")
def replicas(processes, nats, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.json"
    clients = [{"name": "small", "key": SMALL, "max_streams": 2}, {"name": "other", "key": OTHER}]
    keys.write_text(json.dumps({"clients": clients}))
    # the queue the clients share is every replica's part together: 50 + 3 x 6 = 68
    keyed = {"TANDEM_API_KEYS_FILE": str(keys), "TANDEM_MAX_QUEUED": "6"}
    queue = {"TANDEM_MAX_QUEUED": "50"}
    stack = start_stack(processes, nats, "it-shares", "colocated", extra_env=queue)
    first = spawn_gateway(processes, nats, "it-shares", "it-shares-gateway-1", keyed)
    second = spawn_gateway(processes, nats, "it-shares", "it-shares-gateway-2", keyed)
    open_ = spawn_gateway(
        processes, nats, "it-shares", "it-shares-gateway-open", {"TANDEM_MAX_QUEUED": "6"}
    )
    yield stack, (first, second), open_
    stack.stop()


REFUSALS: list[bytes] = []  # the bodies of the answers that were not 200, for a failure's message


def chat(port: int, source: str = "127.0.0.1", key: str = "", max_tokens: int = 2) -> int:
    """POSTs one chat request from `source`; its HTTP status."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120, source_address=(source, 0))
    body = json.dumps(
        CHAT | {"max_tokens": max_tokens, "messages": [{"role": "user", "content": "Hi"}]}
    )
    headers = {"Content-Type": "application/json"} | (
        {"Authorization": f"Bearer {key}"} if key else {}
    )
    try:
        conn.request("POST", "/v1/chat/completions", body, headers)
        response = conn.getresponse()
        body = response.read()
        if response.status != 200:
            REFUSALS.append(body)
        return response.status
    finally:
        conn.close()


def test_a_lone_client_may_fill_the_queue(replicas):
    stack = replicas[0]
    with concurrent.futures.ThreadPoolExecutor(64) as pool:
        statuses = list(pool.map(lambda _: chat(stack.http_port), range(64)))
    assert statuses == [200] * 64
    stack.wait_idle()


def test_a_flooding_client_is_held_to_its_share_and_another_still_gets_in(replicas):
    _, _, (_, port) = replicas
    with concurrent.futures.ThreadPoolExecutor(104) as pool:
        flood = [pool.submit(chat, port, "127.0.0.2", max_tokens=16) for _ in range(100)]
        time.sleep(0.5)  # the flood holds the queue
        steady = [pool.submit(chat, port, "127.0.0.1") for _ in range(4)]
        steady_statuses = [f.result() for f in steady]
        flood_statuses = [f.result() for f in flood]
    assert steady_statuses == [200] * 4, REFUSALS[-4:]  # within its half of the queue of 68
    assert 429 in flood_statuses and set(flood_statuses) <= {200, 429}
    assert sum(s == 200 for s in flood_statuses) >= 34  # at least its half of it


def test_a_keys_cap_holds_over_two_replicas_and_another_keys_is_its_own(replicas):
    stack, ((first, _), (second, _)), _ = replicas
    small, other = ([("authorization", f"Bearer {k}")] for k in (SMALL, OTHER))
    first_stub = pb_grpc.TandemStub(grpc.insecure_channel(first))
    long = chat_request("Write a very long story.", 200, ignore_eos=True)
    held = [first_stub.Generate(long, metadata=small, timeout=120) for _ in range(2)]
    for call in held:
        next(call)  # both streams are open at the first replica
    time.sleep(1.0)  # a few of the replicas' holdings intervals (0.25 s)
    stub = pb_grpc.TandemStub(grpc.insecure_channel(second))
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Generate(chat_request("Hi", 2), metadata=small, timeout=60))
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert list(stub.Generate(chat_request("Hi", 2), metadata=other, timeout=60))
    with pytest.raises(grpc.RpcError) as nobody:
        list(stub.Generate(chat_request("Hi", 2), timeout=60))
    assert nobody.value.code() == grpc.StatusCode.UNAUTHENTICATED
    for call in held:
        call.cancel()
    stack.wait_idle()
