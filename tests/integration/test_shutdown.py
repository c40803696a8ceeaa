"""SIGTERM drains: a decode worker or the gateway finishes the streams it holds, takes no new work,
exits cleanly; a worker that dies with nowhere to move its requests fails them fast."""

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
    stream = stack.stub().Generate(
        chat_request("Tell me a long story.", 40, ignore_eos=True), timeout=120
    )
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


def test_gateway_sigterm_refuses_new_requests_and_finishes_the_streams_in_flight(processes, nats):
    stack = start_stack(processes, nats, "it-gw-drain", "colocated")
    try:
        gateway = dict(processes.children)["it-gw-drain-gateway"]
        stream = stack.stub().Generate(
            chat_request("Tell me a long story.", 60, ignore_eos=True), timeout=120
        )
        chunks = [next(stream) for _ in range(3)]
        gateway.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        with pytest.raises(grpc.RpcError) as err:  # no new request once it is stopping
            collect(stack.stub(), chat_request("hi", 4), timeout=10)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        chunks += list(stream)  # the one in flight finishes
        assert sum(len(c.token_ids) for c in chunks) == 60
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert gateway.wait(timeout=30) == 0
    finally:
        stack.stop()


def test_a_dead_worker_fails_its_requests_fast(processes, nats):
    # (no local fallback: the scheduler's default would prefill it on the decode worker)
    # (and the request moved off the dead prefill worker fails at once: no --move-wait-s)
    failing = {"TANDEM_PREFILL_FALLBACK": "fail", "TANDEM_MOVE_WAIT_S": "0"}
    stack = start_stack(processes, nats, "it-crash", extra_env=failing)
    workers = dict(processes.children)
    prefill = workers["it-crash-prefill-0"]

    # The prefill worker dies while it computes a long prompt, and no other can take the request
    # (disaggregated: no local prefill): UNAVAILABLE, and the decode worker frees the blocks.
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

    # The only worker dies mid-stream: nowhere to move the request, and the client hears
    # UNAVAILABLE within seconds, not never (tests/integration/test_faults.py: with somewhere to go).
    colocated = start_stack(
        processes, nats, "it-crash2", mode="colocated", extra_env={"TANDEM_MAX_MIGRATIONS": "0"}
    )
    worker = dict(processes.children)["it-crash2-decode-0"]
    stream = colocated.stub().Generate(
        chat_request("Tell me a long story.", 2000, ignore_eos=True), timeout=120
    )
    next(stream)
    worker.kill()
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE, err.value.details()
    assert "stopped responding" in err.value.details()
    assert "moved 0 time(s), the limit" in err.value.details()  # --max-migrations 0: not even tried
    assert time.monotonic() - started < 10
    colocated.stop()
