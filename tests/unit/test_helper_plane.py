"""The data-plane helper's parts without a process: the shared region, the framing of its
messages, the helper's command server over the in-process fake plane, and what the worker side
names and refuses."""

import asyncio
import os

import msgpack
import numpy
import pytest
import torch

from shared.control.messages import KVDestination, KVLayout
from shared.dataplane.helper import HelperServer
from shared.dataplane.helper_plane import HelperDataPlane
from shared.dataplane.helper_wire import ASSEMBLE, FAILED, LANDED, HelperGone, frame, read_frame
from shared.dataplane.plane import KVTransferError
from shared.engine.kv_cache import KVPool
from shared.engine.shared_region import SharedRegion, locate
from shared.kvtransfer.plan import TransferPlan, new_base_tag
from shared.kvtransfer.sender import KVSender
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork

LAYOUT = KVLayout(
    model="t", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4
)


def test_a_region_is_one_memory_in_two_mappings_and_names_only_what_it_holds():
    region = SharedRegion(4096)
    other = SharedRegion.attach(os.dup(region.fd), 4096)  # as the helper maps it
    region.array[100:104] = [1, 2, 3, 4]
    assert other.view(100, 4).tolist() == [1, 2, 3, 4]
    assert locate([SharedRegion(64), region], region.base + 100, 4) == (1, 100)
    with pytest.raises(ValueError):
        locate([region], region.base + 4090, 8)  # runs past its end
    with pytest.raises(ValueError):
        other.view(4000, 200)


def test_a_shared_pool_lives_in_its_region():
    pool = KVPool(LAYOUT, 3, 4, "cpu", shared=True)
    assert pool.kv.data_ptr() == pool.region.base and pool.kv.nbytes == pool.region.nbytes
    pool.kv[1, 0, 1].fill_(1.5)
    assert (
        pool.region.array.any() and not KVPool(LAYOUT, 3, 4, "cpu", shared=True).region.array.any()
    )


async def _reader(data: bytes, eof: bool = True) -> asyncio.StreamReader:
    reader = asyncio.StreamReader()
    reader.feed_data(data)
    if eof:
        reader.feed_eof()
    return reader


async def test_frames_round_trip_and_a_broken_stream_is_the_helper_gone():
    message = {"op": "send", "peer": b"\x00\xff", "pieces": [[7, [0, 16, 32]]]}
    reader = await _reader(frame(message) + frame({"op": "ping", "id": 1}))
    assert await read_frame(reader) == message
    assert await read_frame(reader) == {"op": "ping", "id": 1}
    with pytest.raises(HelperGone):
        await read_frame(reader)  # the end of the stream
    with pytest.raises(HelperGone):  # a length no message has: corrupt, not a 4 GiB read
        await read_frame(await _reader(b"\xff\xff\xff\xff" + b"x" * 8))
    with pytest.raises(HelperGone):
        await read_frame(await _reader(frame({"op": "x"})[:4] + msgpack.packb([1, 2])[:1]))


class Collect:
    """A StreamWriter stand-in: the frames a server wrote, decoded."""

    def __init__(self):
        self.data = b""

    def write(self, data: bytes) -> None:
        self.data += data

    async def messages(self) -> list[dict]:
        reader, out = await _reader(self.data), []
        while True:
            try:
                out.append(await read_frame(reader))
            except HelperGone:
                return out


async def test_the_helper_assembles_parts_into_one_message_and_reports_it_landed():
    network = LoopbackNetwork()
    src, dst = SharedRegion(256), SharedRegion(256)
    src.array[:] = numpy.arange(256, dtype=numpy.uint8)
    receiving = HelperServer(InProcessDataPlane(network, "decode"), [dst], Collect())
    sending = HelperServer(InProcessDataPlane(network, "prefill"), [src], Collect())
    receiving.post([[41, [0, 100, 24]]])
    parts = [[0, [8], [1], [0, 10, 8]], [8, [16], [1], [0, 200, 16]]]  # two runs, one piece
    await sending.answer(
        "send",
        {"id": 3, "peer": b"decode", "pieces": [[41, [ASSEMBLE, 24, parts]]], "timeout": 1},
    )
    await asyncio.sleep(0.01)
    expected = list(range(10, 18)) + list(range(200, 216))
    assert dst.array[100:124].tolist() == expected
    assert await sending.writer.messages() == [{"ev": "reply", "id": 3, "transport": "inprocess"}]
    assert await receiving.writer.messages() == [{"ev": "landed", "items": [[41, 24, LANDED, ""]]}]
    await sending.answer(
        "send", {"id": 4, "peer": b"nobody", "pieces": [[1, [0, 0, 8]]], "timeout": 1}
    )
    assert "error" in (await sending.writer.messages())[-1]  # a failure is a reply, not a crash


async def test_the_helper_scatters_one_message_over_the_spans_a_receive_names():
    """A staged piece: one message lands in several runs of the receiver's region, in order."""
    network = LoopbackNetwork()
    src, dst = SharedRegion(256), SharedRegion(256)
    src.array[:] = numpy.arange(256, dtype=numpy.uint8)
    receiving = HelperServer(InProcessDataPlane(network, "decode"), [dst], Collect())
    sending = HelperServer(InProcessDataPlane(network, "prefill"), [src], Collect())
    receiving.post([[42, [[0, 40, 8], [0, 120, 16]]]])  # two runs of slots, one piece
    await sending.answer(
        "send", {"id": 5, "peer": b"decode", "pieces": [[42, [0, 0, 24]]], "timeout": 1}
    )
    await asyncio.sleep(0.01)
    assert dst.array[40:48].tolist() == list(range(0, 8))
    assert dst.array[120:136].tolist() == list(range(8, 24))
    assert not dst.array[48:120].any() and not dst.array[136:].any()
    assert await receiving.writer.messages() == [{"ev": "landed", "items": [[42, 24, LANDED, ""]]}]


async def test_the_worker_side_refuses_buffers_outside_its_regions_and_a_helper_that_is_down():
    pool = KVPool(LAYOUT, 4, 4, "cpu", shared=True)
    plane = HelperDataPlane([pool.region])
    block = pool.blocks(0, 1).nbytes
    assert plane._ref(pool.blocks(1, 2)) == [0, block, 2 * block]
    with pytest.raises(ValueError):
        plane._ref(torch.zeros(8))  # not in the region: the helper could not reach it
    (future,) = plane.post_receives([(5, pool.blocks(0, 1))])
    with pytest.raises(KVTransferError, match="restarting"):
        await future  # no helper up: fails at once, never hangs
    with pytest.raises(KVTransferError):
        await plane.send_many(b"peer", [(5, pool.blocks(0, 1))], timeout=1)
    assert plane.counters.transfers_failed == 1


def test_the_sender_hands_a_gathering_plane_the_runs_of_scattered_blocks_to_assemble():
    pool = KVPool(LAYOUT, 8, 4, "cpu", shared=True)
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(0)))
    destination = KVDestination(b"d", new_base_tag(9), [0, 1, 2], 0, 16, 1.0)
    plan = TransferPlan(LAYOUT, 12, destination)
    plane = HelperDataPlane([pool.region])
    sender = KVSender(plane, [pool], plan, 1.0)
    staged = sender.stage(plan.segments[0], [5, 1, 2])  # block 5, then the run 1, 2
    gathered = sender.gather(staged)
    assert len(gathered) == 1
    assert [(tag, blocks) for tag, _, blocks in staged.scattered] == [(gathered[0][0], [5, 1, 2])]
    piece = gathered[0][1]  # an Assembly: the helper puts the runs together, in order
    runs = [view for _, _, _, view in piece.parts]
    assert [run.shape[0] for run in runs] == [1, 2]  # two runs of blocks, in order
    assert (
        runs[0].data_ptr() == pool.kv[5].data_ptr() and runs[1].data_ptr() == pool.kv[1].data_ptr()
    )
    block_bytes = pool.kv[0].nbytes
    assert [offset for offset, _, _, _ in piece.parts] == [0, block_bytes]
    assert piece.nbytes == 3 * block_bytes
    server = HelperServer(InProcessDataPlane(LoopbackNetwork(), "x"), [pool.region], Collect())
    made = server.buffer(plane._ref(piece), [])
    assert made.tobytes() == pool.kv[[5, 1, 2]].view(torch.uint8).numpy().tobytes()


async def test_a_receive_outside_its_region_fails_alone_and_the_helper_goes_on():
    region = SharedRegion(64)
    server = HelperServer(InProcessDataPlane(LoopbackNetwork(), "d"), [region], Collect())
    server.post([[9, [0, 60, 16]]])  # runs past the region's end
    await asyncio.sleep(0.01)
    ((item,),) = [m["items"] for m in await server.writer.messages()]
    assert item[:3] == [9, 0, FAILED] and "not posted" in item[3]
    server.post([[10, [0, 0, 16]]])  # the next one is posted as usual
    assert 10 in server.plane._posted
