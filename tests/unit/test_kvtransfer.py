"""TransferPlan, KVSender and KVReceiver over the in-process data plane: pieces land in the right
blocks bit for bit, only the missing suffix moves, and an abort ends every receive."""

import asyncio

import pytest
import torch

from shared.control.messages import KVDestination, KVLayout
from shared.dataplane.plane import KVTransferError
from shared.engine.kv_cache import KVPool, bytes_per_token
from shared.kvtransfer.connector import PushConnector, StagedConnector, connector
from shared.kvtransfer.plan import (
    MAX_PIECES,
    PlanError,
    Run,
    TransferPlan,
    new_base_tag,
    piece_per_segment,
    segment_tokens,
)
from shared.kvtransfer.receiver import KVReceiver
from shared.kvtransfer.sender import KVSender
from shared.worker.settings import WorkerSettings
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork

BS = 4
LAYOUT = KVLayout(
    model="tiny", dtype="float32", num_layers=3, num_kv_heads=2, head_dim=8, block_size=BS
)


def destination(block_ids, skip=0, segment=8, tag_bits=5):
    return KVDestination(
        ucx_address=b"decode",
        base_tag=new_base_tag(tag_bits),
        block_ids=block_ids,
        skip_tokens=skip,
        segment_tokens=segment,
        lease_s=1.0,
    )


def filled_pool(num_blocks: int, seed: int) -> KVPool:
    pool = KVPool(LAYOUT, num_blocks, BS, "cpu")
    pool.kv.copy_(torch.randn(pool.kv.shape, generator=torch.Generator().manual_seed(seed)))
    return pool


def test_plan_runs_follow_consecutive_decode_blocks_within_segments():
    plan = TransferPlan(LAYOUT, 18, destination([3, 4, 9, 10, 11], segment=8))
    assert [(s.start, s.end) for s in plan.segments] == [(0, 8), (8, 16), (16, 18)]
    # (positions, first decode block, blocks): a piece is a run of whole blocks, every layer
    pieces = [(p.segment, p.start, p.end, p.runs[0].first, p.blocks) for p in plan.pieces]
    assert pieces == [(0, 0, 8, 3, 2), (1, 8, 16, 9, 2), (2, 16, 18, 11, 1)]
    assert [p.index for p in plan.pieces] == [0, 1, 2]
    # one rank, every KV head: what a tensor-parallel connector will cut further
    assert {(p.routes[0].source, p.dest, p.heads) for p in plan.pieces} == {
        (0, 0, (0, LAYOUT.num_kv_heads))
    }
    assert plan.nbytes == 5 * BS * 3 * 2 * 2 * 8 * 4  # the last block travels whole


def test_plan_skips_a_cached_prefix_and_splits_broken_runs():
    plan = TransferPlan(LAYOUT, 13, destination([7, 2], skip=8, segment=8))
    assert plan.num_tokens == 5
    pieces = [(p.start, p.end, p.runs[0].first, p.blocks) for p in plan.pieces]
    assert pieces == [(8, 12, 7, 1), (12, 13, 2, 1)]


@pytest.mark.parametrize("kwargs", [dict(skip=3), dict(skip=16), dict(segment=6), dict(segment=0)])
def test_plan_rejects_bad_destinations(kwargs):
    with pytest.raises(PlanError):
        TransferPlan(LAYOUT, 16, destination([0, 1, 2, 3], **kwargs))


def test_segments_default_to_the_pools_memory_and_a_setting_wins():
    assert segment_tokens(0, "cpu") == 1024
    assert segment_tokens(0, "cuda:1") == 16384  # few large pieces: see segment_tokens
    assert segment_tokens(256, "cuda") == segment_tokens(256, "cpu") == 256


def test_plan_rejects_a_wrong_block_count_and_a_bad_tag():
    with pytest.raises(PlanError):
        TransferPlan(LAYOUT, 16, destination([0, 1, 2]))
    bad = destination([0, 1, 2, 3])
    bad.base_tag += 1
    with pytest.raises(PlanError):
        TransferPlan(LAYOUT, 16, bad)
    assert new_base_tag(2**64 - 1) % MAX_PIECES == 0 and 0 < new_base_tag(0) < 2**64


def test_a_staged_plan_sends_each_segment_as_one_piece_of_its_runs():
    plan = TransferPlan(LAYOUT, 18, destination([3, 4, 9, 10, 11], segment=16), piece_per_segment)
    pieces = [(p.segment, p.start, p.end, p.runs) for p in plan.pieces]
    assert pieces == [(0, 0, 16, (Run(3, 2), Run(9, 2))), (1, 16, 18, (Run(11, 1),))]
    assert plan.nbytes == 5 * BS * bytes_per_token(LAYOUT)


def test_connectors_are_known_by_name_and_a_worker_offers_each():
    plane, pool = InProcessDataPlane(LoopbackNetwork(), "x"), KVPool(LAYOUT, 4, BS, "cpu")
    assert isinstance(connector("staged", plane, [pool]), StagedConnector)
    assert isinstance(connector("push", plane, [pool]), PushConnector)
    assert WorkerSettings(kv_connector="staged").kv_connector == "staged"
    with pytest.raises(ValueError, match="kv_connector"):
        WorkerSettings(kv_connector="pull")
    with pytest.raises(PlanError, match="unknown KV connector"):
        connector("pull", plane, [pool])


async def transfer(prompt_len: int, src_table, dst_table, skip=0, segment=8, how="push"):
    net = LoopbackNetwork()
    sender_plane, receiver_plane = (
        InProcessDataPlane(net, "prefill"),
        InProcessDataPlane(net, "decode"),
    )
    src, dst = filled_pool(8, seed=1), KVPool(LAYOUT, 12, BS, "cpu")
    where = destination(dst_table[skip // BS :], skip=skip, segment=segment)
    receiver = connector(how, receiver_plane, [dst]).reserve(LAYOUT, prompt_len, where)
    receiver.start()
    sender = connector(how, sender_plane, [src]).sender(LAYOUT, prompt_len, where)
    computed = 0
    while not sender.all_staged:  # as the prefill computes, one chunk of 4 tokens a step
        computed = min(prompt_len, computed + 4)
        for seg in sender.ready(computed):
            staged = sender.stage(seg, src_table)
            sender.send(staged.direct)
            sender.send(sender.gather(staged))
    await sender.finish()
    await asyncio.wait_for(receiver.done.wait(), 1.0)
    return src, dst, receiver, sender


@pytest.mark.parametrize("how", ["push", "staged"])
async def test_every_block_arrives_bit_identical(how):
    src_table, dst_table = [5, 0, 3, 1, 7], [2, 3, 4, 9, 10]
    src, dst, receiver, sender = await transfer(19, src_table, dst_table, how=how)
    assert receiver.complete and sender.bytes_sent == receiver.landed_bytes == receiver.plan.nbytes
    assert torch.equal(
        dst.export(dst.slots(dst_table, 0, 19)), src.export(src.slots(src_table, 0, 19))
    )
    assert sender.bytes_sent == 5 * BS * bytes_per_token(LAYOUT)
    untouched = [b for b in range(12) if b not in dst_table]
    assert not dst.kv[untouched].any()


async def test_a_staged_transfer_sends_a_message_per_segment_into_scattered_blocks():
    """Fragmented on both sides: push sends a message per decode run, staged one per segment,
    gathered from the prefill pool and scattered over the decode blocks, bit for bit."""
    src_table, dst_table = [5, 0, 3, 1, 7], [8, 2, 6, 9, 4]
    src, dst, receiver, _ = await transfer(19, src_table, dst_table, segment=12, how="staged")
    assert len(receiver.plan.pieces) == len(receiver.plan.segments) == 2
    assert [len(p.runs) for p in receiver.plan.pieces] == [3, 2]
    assert torch.equal(
        dst.export(dst.slots(dst_table, 0, 19)), src.export(src.slots(src_table, 0, 19))
    )
    untouched = [b for b in range(12) if b not in dst_table]
    assert not dst.kv[untouched].any()
    _, _, pushed, _ = await transfer(19, src_table, dst_table, segment=12, how="push")
    assert len(pushed.plan.pieces) == 5


@pytest.mark.parametrize("how", ["push", "staged"])
async def test_only_the_missing_suffix_moves(how):
    src_table, dst_table = [5, 0, 3, 1, 7], [2, 3, 4, 9, 10]
    src, dst, receiver, _ = await transfer(19, src_table, dst_table, skip=8, how=how)
    assert torch.equal(
        dst.export(dst.slots(dst_table, 8, 19)), src.export(src.slots(src_table, 8, 19))
    )
    assert not dst.kv[[2, 3]].any()  # blocks 2 and 3 (the prefix) were not written
    assert receiver.landed_bytes == 3 * BS * bytes_per_token(LAYOUT)


async def test_abort_releases_every_open_receive_and_reports_what_was_unfilled():
    net = LoopbackNetwork()
    plane = InProcessDataPlane(net, "decode")
    pool = KVPool(LAYOUT, 4, BS, "cpu")
    plan = TransferPlan(LAYOUT, 16, destination([0, 1, 2, 3], segment=4))
    receiver = KVReceiver(plane, [pool], plan)
    receiver.start()
    await asyncio.sleep(0)
    assert await receiver.abort(1.0)
    assert not receiver.complete and plane.counters.receives_released == len(plan.pieces) == 4
    assert len(receiver.unfilled(pieces_sent=3)) == 3
    with pytest.raises(KVTransferError):
        receiver.check(lease_s=10.0)


async def test_a_stalled_transfer_is_reported_after_its_lease():
    net = LoopbackNetwork()
    sender_plane, plane = InProcessDataPlane(net, "prefill"), InProcessDataPlane(net, "decode")
    src, dst = filled_pool(4, seed=2), KVPool(LAYOUT, 4, BS, "cpu")
    plan = TransferPlan(LAYOUT, 16, destination([0, 1, 2, 3]))
    receiver = KVReceiver(plane, [dst], plan)
    receiver.start()
    sender = KVSender(sender_plane, [src], plan, timeout_s=1.0)
    first = plan.segments[0]
    staged = sender.stage(first, [0, 1, 2, 3])
    assert not staged.scattered and len(staged.direct) == len(first.pieces)  # one run here: no copy
    await sender.send(staged.direct)
    receiver.check(lease_s=0.05)  # progress just now: fine
    await asyncio.sleep(0.1)
    with pytest.raises(KVTransferError, match="no KV piece landed"):
        receiver.check(lease_s=0.05)
    assert await receiver.abort(1.0)
