"""Failure: one vocabulary for refusals and failures, and how the codec carries its enums."""

import msgpack
import pytest

from shared.control import wire
from shared.control.failure import Code, Failure, Retry, failed, worker_failed, worker_full
from shared.control.messages import TaskAck
from shared.control.wire import MessageError


def test_a_failed_worker_is_avoided_and_a_full_one_is_not():
    lost = worker_failed("decode-1", "stopped responding")
    full = worker_full("prefill-2", "queue full")
    assert (lost.code, lost.retry, lost.avoid, lost.movable) == (
        Code.UNAVAILABLE,
        Retry.ELSEWHERE,
        "decode-1",
        True,
    )
    assert (full.code, full.retry, full.avoid, full.movable) == (
        Code.RESOURCE_EXHAUSTED,
        Retry.HERE,
        "",
        True,
    )


def test_a_failure_of_the_request_is_not_moved():
    cancelled = failed(Code.CANCELLED, "client went away")
    assert not cancelled.movable and cancelled.avoid == ""


def test_codes_are_the_grpc_status_names():
    import grpc

    assert all(grpc.StatusCode[code.value] for code in Code)


def test_failures_are_values():
    lost = worker_failed("d", "gone")
    with pytest.raises(AttributeError):
        lost.blame = "other"  # type: ignore[misc]
    assert lost == Failure(Code.UNAVAILABLE, "gone", Retry.ELSEWHERE, "d")


def test_the_codec_reads_enums_by_value_and_refuses_unknown_ones():
    ack = TaskAck(Failure(Code.UNAVAILABLE, "gone", Retry.HERE, "d"))
    body = msgpack.unpackb(wire.encode(ack), raw=False)
    assert body["failure"]["code"] == "UNAVAILABLE" and body["failure"]["retry"] == "here"
    assert wire.decode(wire.encode(ack), TaskAck) == ack
    for bad in ("unavailable", 5, None):
        body["failure"]["code"] = bad
        with pytest.raises(MessageError):
            wire.decode(msgpack.packb(body), TaskAck)
