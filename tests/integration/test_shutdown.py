"""SIGTERM drains: a decode worker finishes the streams it holds, takes no new work, exits cleanly."""

import signal
import time

import grpc
import pytest

from shared.api import tandem_pb2 as pb
from tests.integration.helpers import chat_request, collect, long_document
from tests.integration.stack import start_stack

pytestmark = pytest.mark.slow


def test_sigterm_drains_running_streams(processes, nats):
    stack = start_stack(processes, nats, "it-drain")
    decode = dict(processes.children)["it-drain-decode-0"]
    stream = stack.stub().Generate(chat_request("Tell me a long story.", 40, ignore_eos=True), timeout=120)
    chunks = [next(stream) for _ in range(3)]
    decode.send_signal(signal.SIGTERM)
    chunks += list(stream)
    assert sum(len(c.token_ids) for c in chunks) == 40
    assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert decode.wait(timeout=30) == 0

    deadline = time.monotonic() + 10  # the scheduler forgot it at once: no new work goes there
    while True:
        with pytest.raises(grpc.RpcError) as err:
            collect(stack.stub(), chat_request("hi", 4), timeout=30)
        if err.value.code() == grpc.StatusCode.UNAVAILABLE:
            break
        assert time.monotonic() < deadline
    stack.stop()


def test_a_dead_worker_fails_its_requests_fast(processes, nats):
    stack = start_stack(processes, nats, "it-crash")
    workers = dict(processes.children)
    prefill = workers["it-crash-prefill-0"]

    # The prefill worker dies while it computes a long prompt: UNAVAILABLE, and decode frees the blocks.
    stream = stack.stub().Generate(chat_request(long_document(3000), 8), timeout=120)
    time.sleep(1.0)
    prefill.kill()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert time.monotonic() - started < 15
    stack.wait_idle()
    stack.stop()

    # The decode worker dies mid-stream: the client hears UNAVAILABLE within seconds, not never.
    colocated = start_stack(processes, nats, "it-crash2", mode="colocated")
    worker = dict(processes.children)["it-crash2-decode-0"]
    stream = colocated.stub().Generate(chat_request("Tell me a long story.", 2000, ignore_eos=True), timeout=120)
    next(stream)
    worker.kill()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "stopped responding" in err.value.details()
    assert time.monotonic() - started < 10
    colocated.stop()
