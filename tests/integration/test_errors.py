"""Bad input, deadlines, cancellation and missing workers: a clear status, nothing leaked, nothing down."""

import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.helpers import chat_request, collect, long_document
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow


def _sampling(**kw) -> pb.SamplingParams:
    return pb.SamplingParams(**kw)


BAD_REQUESTS = {
    "no prompt and no messages": pb.GenerateRequest(sampling=_sampling(max_tokens=4)),
    "both prompt and messages": pb.GenerateRequest(
        prompt="hi",
        messages=[pb.ChatMessage(role="user", content="hi")],
        sampling=_sampling(max_tokens=4),
    ),
    "max_tokens 0": pb.GenerateRequest(prompt="hi", sampling=_sampling(max_tokens=0)),
    "max_tokens above the limit": pb.GenerateRequest(
        prompt="hi", sampling=_sampling(max_tokens=100_000)
    ),
    "longer than the context": pb.GenerateRequest(
        prompt="word " * 8000, sampling=_sampling(max_tokens=4000)
    ),
    "negative temperature": pb.GenerateRequest(prompt="hi", sampling=_sampling(temperature=-0.5)),
    "top_p 0": pb.GenerateRequest(prompt="hi", sampling=_sampling(top_p=0.0)),
    "top_p above 1": pb.GenerateRequest(prompt="hi", sampling=_sampling(top_p=1.5)),
    "unknown role": pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]),
    "bad request id": pb.GenerateRequest(request_id="a b/c", prompt="hi"),
}


@pytest.mark.parametrize("case", sorted(BAD_REQUESTS))
def test_bad_input_is_invalid_argument(disagg, case):
    with pytest.raises(grpc.RpcError) as err:
        collect(disagg.stub(), BAD_REQUESTS[case], timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details()


def test_services_survive_bad_input(disagg):
    for request in BAD_REQUESTS.values():
        with pytest.raises(grpc.RpcError):
            collect(disagg.stub(), request, timeout=30)
    assert not disagg.dead()
    _, ids, _ = collect(disagg.stub(), chat_request("Say hello.", 8))
    assert ids


def test_deadline_exceeded_frees_the_kv(disagg):
    disagg.wait_idle()
    request = chat_request("Write a very long story.", 2000, ignore_eos=True)
    stream = disagg.stub().Generate(request, timeout=4)
    assert next(stream).token_ids  # it decodes, and its blocks are held, when the deadline passes
    _wait_until(
        lambda: _held(disagg, "decode"), "the decode worker never reported the blocks it holds", 3
    )
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    seconds = _seconds_until_free(disagg)
    print(f"deadline passed -> every pool free in ClusterStatus: {seconds:.2f}s")
    assert seconds < 3  # the bar is a second: see the cancel test for the margin


# A client process that streams a request and tells when its third chunk came.
CLIENT = """
import sys, grpc
from shared.api import tandem_pb2 as pb, tandem_pb2_grpc as pb_grpc
stub = pb_grpc.TandemStub(grpc.insecure_channel(sys.argv[1]))
for i, _ in enumerate(stub.Generate(pb.GenerateRequest.FromString(bytes.fromhex(sys.argv[2])))):
    if i == 2:
        print("streaming", flush=True)
"""


def test_a_client_killed_mid_stream_frees_the_kv(disagg):
    """The client's process dies (SIGKILL, no cancel sent): its connection drops, and that is a cancel."""
    disagg.wait_idle()
    request = chat_request("Write a very long story.", 2000, ignore_eos=True)
    client = subprocess.Popen(
        [sys.executable, "-c", CLIENT, disagg.address, request.SerializeToString().hex()],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert client.stdout.readline().strip() == "streaming"
        _wait_until(
            lambda: _held(disagg, "decode"), "the decode worker never reported the blocks it holds"
        )
    finally:
        client.kill()
        client.wait()
    seconds = _seconds_until_free(disagg)
    print(f"client killed -> every pool free in ClusterStatus: {seconds:.2f}s")
    assert seconds < 3


def _held(stack, role: str) -> bool:
    return any(w.kv_blocks_used > 0 for w in stack.status().workers if w.role == role)


def _seconds_until_free(stack) -> float:
    """From now until ClusterStatus shows every worker's KV pool free (heartbeats every 0.5 s)."""
    started = time.monotonic()
    while any(
        w.kv_blocks_used or w.kv_blocks_leaked or w.running or w.queued
        for w in stack.status().workers
    ):
        assert time.monotonic() - started < 10, f"not freed: {stack.status()}"
        time.sleep(0.02)
    return time.monotonic() - started


def _wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_client_cancel_frees_the_kv_on_every_worker_within_about_a_second(disagg):
    disagg.wait_idle()
    # While it decodes: the decode worker holds the sequence's blocks.
    stream = disagg.stub().Generate(
        chat_request("Write a very long story.", 2000, ignore_eos=True), timeout=60
    )
    received = [next(stream) for _ in range(3)]
    assert all(c.token_ids for c in received)
    _wait_until(
        lambda: _held(disagg, "decode"), "the decode worker never reported the blocks it holds"
    )
    stream.cancel()
    while_decoding = _seconds_until_free(disagg)

    # While the prefill worker computes a long prompt: it holds the prompt's blocks, and the
    # decode worker the blocks reserved for the KV on its way.
    stream = disagg.stub().Generate(chat_request(long_document(2500), 4), timeout=60)
    _wait_until(
        lambda: _held(disagg, "prefill") and _held(disagg, "decode"), "the prefill never started"
    )
    stream.cancel()
    while_prefilling = _seconds_until_free(disagg)
    print(
        f"cancel -> every pool free in ClusterStatus: {while_decoding:.2f}s decoding, "
        f"{while_prefilling:.2f}s prefilling"
    )
    # The bar is a second; the counters travel in heartbeats every 0.5 s, and a prompt chunk
    # already on the CPU finishes first: 3 s catches a cancel that does not reach every worker.
    assert while_decoding < 3 and while_prefilling < 3


def _wait_for_unavailable(stack, reason: str) -> float:
    """Retries until the gateway is up and answers UNAVAILABLE mentioning `reason`; returns how long that answer took."""
    deadline = time.monotonic() + 60
    while True:
        started = time.monotonic()
        with pytest.raises(grpc.RpcError) as err:
            collect(stack.stub(), chat_request("hi", 4), timeout=30)
        if err.value.code() == grpc.StatusCode.UNAVAILABLE and reason in err.value.details():
            return time.monotonic() - started
        assert time.monotonic() < deadline, err.value
        time.sleep(0.5)


def test_no_workers_and_then_no_scheduler_are_unavailable_quickly(processes, nats):
    lonely = start_stack(processes, nats, "it-lonely", prefill=0, decode=0, wait=False)
    _wait_for_unavailable(lonely, "no live")
    assert _wait_for_unavailable(lonely, "no live") < 5  # a second request, with everything up
    dict(processes.children)["it-lonely-scheduler"].terminate()
    # NATS answers "no responders" at once: no waiting for a timeout.
    assert _wait_for_unavailable(lonely, "scheduler") < 5
    lonely.stop()
