"""The in-process fakes keep the contracts of NATS and UCX that the services rely on."""

import asyncio

import pytest
import torch

from shared.control.bus import NoResponders, RequestTimeout
from shared.control.failure import Code, failed
from shared.control.messages import CancelRequest, Discover, TaskAck
from shared.dataplane.plane import KVTransferError, discard
from tests.fakes.bus import InMemoryBus
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork


async def test_publish_reaches_every_plain_subscriber_decoded():
    bus, got = InMemoryBus(), []

    async def handler(msg, respond):
        got.append((msg, respond))

    await bus.subscribe("s", handler)
    await bus.subscribe("s", handler)
    await bus.subscribe("other", handler)
    await bus.publish("s", CancelRequest(attempt_id="r1"))
    assert [m for m, _ in got] == [CancelRequest(attempt_id="r1")] * 2
    assert all(r is None for _, r in got)  # a publish has nobody to answer
    assert got[0][0] is not got[1][0]  # each subscriber decodes its own copy
    assert bus.published == [("s", CancelRequest(attempt_id="r1"))]


async def test_unsubscribe_stops_delivery():
    bus, got = InMemoryBus(), []

    async def handler(msg, respond):
        got.append(msg)

    sub = await bus.subscribe("s", handler)
    await sub.unsubscribe()
    await bus.publish("s", Discover(scheduler_id="x"))
    assert got == []


async def test_request_respond():
    bus = InMemoryBus()

    async def handler(msg, respond):
        await respond(TaskAck(failed(Code.INTERNAL, msg.attempt_id)))

    await bus.subscribe("s", handler)
    ack = await bus.request("s", CancelRequest(attempt_id="r9"), timeout=1.0, expected=TaskAck)
    assert ack == TaskAck(failed(Code.INTERNAL, "r9"))


async def test_queue_group_delivers_to_one_member_round_robin():
    bus, got = InMemoryBus(), []

    def member(name):
        async def handler(msg, respond):
            got.append(name)

        return handler

    for name in ("a", "b", "c"):
        await bus.subscribe("s", member(name), queue="q")
    await bus.subscribe("s", member("plain"))
    for _ in range(6):
        await bus.publish("s", Discover(scheduler_id="x"))
    assert got.count("plain") == 6
    assert [g for g in got if g != "plain"] == ["a", "b", "c", "a", "b", "c"]


async def test_no_responders():
    bus = InMemoryBus()
    await bus.subscribe("elsewhere", lambda m, r: asyncio.sleep(0))
    with pytest.raises(NoResponders):
        await bus.request("s", Discover(scheduler_id="x"), timeout=1.0, expected=TaskAck)


async def test_request_timeout_when_nobody_answers():
    bus = InMemoryBus()

    async def silent(msg, respond):
        pass

    await bus.subscribe("s", silent)
    with pytest.raises(RequestTimeout):
        await bus.request("s", Discover(scheduler_id="x"), timeout=0.05, expected=TaskAck)


async def test_request_timeout_applies_to_slow_handlers():
    bus = InMemoryBus()

    async def slow(msg, respond):
        await asyncio.sleep(5)
        await respond(TaskAck())

    await bus.subscribe("s", slow)
    with pytest.raises(
        RequestTimeout
    ):  # NATS gives up after `timeout`, however long the responder takes
        await asyncio.wait_for(
            bus.request("s", Discover(scheduler_id="x"), timeout=0.05, expected=TaskAck), 0.5
        )


async def test_a_failing_handler_does_not_fail_the_publisher():
    bus, got = InMemoryBus(), []

    async def broken(msg, respond):
        raise RuntimeError("boom")

    async def fine(msg, respond):
        got.append(msg)

    await bus.subscribe("s", broken)
    await bus.subscribe("s", fine)
    await bus.publish("s", Discover(scheduler_id="x"))
    assert got == [Discover(scheduler_id="x")]


# --- data plane -------------------------------------------------------------------------------


async def test_send_then_receive_copies_bytes_and_counts():
    net = LoopbackNetwork()
    prefill, decode = InProcessDataPlane(net, "prefill"), InProcessDataPlane(net, "decode")
    sent = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    received = torch.empty(2, 3, 4)
    receiving = asyncio.ensure_future(decode.receive(tag=7, buffer=received))
    await prefill.send(decode.address, tag=7, buffer=sent, timeout=1.0)
    sent.zero_()  # the sender may reuse its buffer once the send returns
    assert await receiving == 24 * 4
    assert torch.equal(received, torch.arange(24, dtype=torch.float32).reshape(2, 3, 4))
    assert prefill.counters.bytes_sent == decode.counters.bytes_received == 24 * 4
    assert prefill.counters.transfers_failed == decode.counters.transfers_failed == 0


async def test_receive_posted_before_send_and_tags_do_not_mix():
    net = LoopbackNetwork()
    a, b = InProcessDataPlane(net, "a"), InProcessDataPlane(net, "b")
    one, two = torch.empty(4), torch.empty(4)
    waiting = asyncio.gather(b.receive(1, one), b.receive(2, two))
    await asyncio.sleep(0)
    await a.send(b"b", 2, torch.full((4,), 2.0), 1.0)
    await a.send(b"b", 1, torch.full((4,), 1.0), 1.0)
    await waiting
    assert one.tolist() == [1.0] * 4 and two.tolist() == [2.0] * 4


async def test_a_send_waits_for_its_receive_like_rendezvous():
    net = LoopbackNetwork()
    a, b = InProcessDataPlane(net, "a"), InProcessDataPlane(net, "b")
    sending = asyncio.ensure_future(a.send(b"b", 9, torch.ones(4), 1.0))
    await asyncio.sleep(0.05)
    assert not sending.done()
    received = torch.zeros(4)
    await b.receive(9, received)
    await sending
    assert received.tolist() == [1.0] * 4


async def test_release_ends_an_open_receive_and_leaves_a_landed_one():
    net = LoopbackNetwork()
    a, b = InProcessDataPlane(net, "a"), InProcessDataPlane(net, "b")
    landed, open_ = torch.zeros(4), torch.zeros(4)
    first = asyncio.ensure_future(b.receive(1, landed))
    second = asyncio.ensure_future(b.receive(2, open_))
    await asyncio.sleep(0)
    await a.send(b"b", 1, torch.ones(4), 1.0)
    await b.release([1, 2])
    assert await first == 16 and landed.tolist() == [1.0] * 4
    with pytest.raises(KVTransferError):
        await second
    assert b.counters.receives_released == 1 and open_.tolist() == [0.0] * 4


async def test_a_send_nobody_receives_times_out():
    net = LoopbackNetwork()
    a, _ = InProcessDataPlane(net, "a"), InProcessDataPlane(net, "b")
    with pytest.raises(KVTransferError):
        await a.send(b"b", 3, torch.ones(4), timeout=0.05)
    assert a.counters.transfers_failed == 1 and a.counters.bytes_sent == 0


async def test_unknown_peer_raises():
    plane = InProcessDataPlane(LoopbackNetwork(), "p")
    with pytest.raises(KVTransferError):
        await plane.send(b"nobody", 1, torch.ones(4), timeout=1.0)
    assert plane.counters.transfers_failed == 1 and plane.counters.bytes_sent == 0


async def test_a_message_larger_than_its_receive_fails_both_ends():
    net = LoopbackNetwork()
    a, b = InProcessDataPlane(net, "a"), InProcessDataPlane(net, "b")
    receiving = asyncio.ensure_future(b.receive(5, torch.empty(4)))
    await asyncio.sleep(0)
    with pytest.raises(KVTransferError):
        await a.send(b"b", 5, torch.ones(8), 1.0)
    with pytest.raises(KVTransferError):
        await receiving


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_ucx_sees_every_kv_dtype_as_its_bytes(dtype):
    from shared.dataplane.ucx_views import ucx_view

    tensor = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4).to(dtype)
    view = ucx_view(tensor)
    assert view.nbytes == tensor.numel() * tensor.element_size()
    assert bytes(view.tobytes()) == bytes(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    assert ucx_view(torch.tensor(7.0, dtype=dtype)).nbytes == tensor.element_size()  # 0-d


def test_a_cuda_buffer_is_described_to_ucx_as_its_bytes():
    from types import SimpleNamespace

    from shared.dataplane.ucx_views import CudaBytes

    tensor = SimpleNamespace(nbytes=4096, data_ptr=lambda: 0x7F0000001000)  # as a CUDA tensor
    interface = CudaBytes(tensor).__cuda_array_interface__
    assert interface["shape"] == (4096,) and interface["typestr"] == "|u1"
    assert interface["data"] == (0x7F0000001000, False) and interface["strides"] is None


async def test_discard_takes_late_pieces_off_the_wire_and_releases_the_rest():
    net = LoopbackNetwork()
    a, b = InProcessDataPlane(net, "a"), InProcessDataPlane(net, "b")
    late = asyncio.ensure_future(a.send_many(b"b", [(1, torch.ones(8)), (2, torch.ones(4))], 1.0))
    await discard(b, [(1, 32), (2, 16), (3, 64)], timeout=0.1)  # piece 3 never comes
    await late  # the sender is not left hanging
    assert b.counters.bytes_received == 48 and b.counters.receives_released == 1


def test_endpoint_lanes_are_read_from_ucx_print_info():
    from shared.dataplane.ucx_info import parse_lanes, transport_summary

    info = """#
# UCP endpoint 0x7f
#               peer: <no debug data>
#                 lane[0]:  2:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] seg 4294967295 am keepalive
#                 lane[1]:  3:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255] seg 4294967295
#                 lane[2]:  5:cma/memory md[5]              -> md[5]/cma/sysdev[255] seg 0 rma_bw#0
#
"""
    lanes = parse_lanes(info)
    assert lanes == ["sysv/memory am keepalive", "posix/memory", "cma/memory rma_bw#0"]
    assert transport_summary(lanes) == "sysv+posix+cma"
    assert (
        transport_summary(
            parse_lanes("#  lane[0]:  1:tcp/lo.0 md[1] -> md[1]/tcp seg 0 am keepalive wireup")
        )
        == "tcp"
    )
    assert transport_summary([]) == "unknown"
