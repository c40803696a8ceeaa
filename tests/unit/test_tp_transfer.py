"""KV between tensor-parallel groups through the KV-transfer interface: for every pair of degrees
(and both connectors) each decode rank's pool ends up holding exactly its KV heads of the
prompt's blocks, bit for bit, from scattered blocks into scattered blocks, each piece assembled
on the sending side in the receiving rank's layout (the data-plane helper's assembly is torch's,
byte for byte); the plan's bytes per decode rank are 1/tp of the whole (times the replication
factor)."""

import asyncio
import dataclasses

import pytest
import torch

from shared.control.messages import KVDestination, KVLayout
from shared.dataplane.helper import HelperServer
from shared.dataplane.helper_plane import HelperDataPlane
from shared.engine.kv_cache import KVPool
from shared.kvtransfer.assembly import assembled
from shared.kvtransfer.connector import connector
from shared.kvtransfer.plan import PlanError, TransferPlan, new_base_tag
from shared.kvtransfer.sender import KVSender
from shared.parallel.heads import HeadSplit
from tests.fakes.dataplane import InProcessDataPlane, LoopbackNetwork
from tests.unit.test_helper_plane import Collect

BS, PROMPT = 4, 30
SRC_TABLE = [9, 2, 3, 4, 11, 0, 1, 7]  # a run of three, and scattered blocks
DST_TABLE = [5, 6, 1, 2, 3, 10, 0, 8]
SHAPES = {  # KV heads -> the degrees that split them (fewer KV heads than ranks: replicated)
    4: (1, 2, 4),
    2: (1, 2, 4),
    1: (1, 2),
}


def layout_of(kv_heads: int) -> KVLayout:
    return KVLayout("m", "float32", 2, kv_heads, 8, BS)


def rank_pools(whole: KVPool, tp: int) -> list[KVPool]:
    """Each rank's pool holding its heads of `whole`'s (empty where `whole` is)."""
    split = HeadSplit(whole.layout.num_kv_heads * tp, whole.layout.num_kv_heads, tp)
    layout = dataclasses.replace(whole.layout, num_kv_heads=split.kv_per_rank)
    pools = []
    for rank in range(tp):
        pool = KVPool(layout, whole.num_blocks, BS, "cpu")
        first, end = split.kv_heads(rank)
        pool.kv.copy_(whole.kv[..., first:end, :])
        pools.append(pool)
    return pools


def destination(p: int, d: int, how_segment: int = 8) -> KVDestination:
    return KVDestination(
        ucx_address=b"decode",
        base_tag=new_base_tag(7),
        block_ids=DST_TABLE,
        segment_tokens=how_segment,
        lease_s=1.0,
        prefill_tp=p,
        decode_tp=d,
    )


async def move(layout: KVLayout, p: int, d: int, how: str) -> tuple[KVPool, list[KVPool], int]:
    net = LoopbackNetwork()
    whole = KVPool(layout, 12, BS, "cpu")
    whole.kv.copy_(torch.randn(whole.kv.shape, generator=torch.Generator().manual_seed(p * d)))
    senders = rank_pools(whole, p)
    receivers = rank_pools(KVPool(layout, 12, BS, "cpu"), d)  # zeros
    where = destination(p, d)
    receiver = connector(how, InProcessDataPlane(net, "decode"), receivers).reserve(
        layout, PROMPT, where
    )
    receiver.start()
    sender = connector(how, InProcessDataPlane(net, "prefill"), senders).sender(
        layout, PROMPT, where
    )
    for segment in sender.ready(PROMPT):
        staged = sender.stage(segment, SRC_TABLE)
        sender.send(staged.direct)
        sender.send(sender.gather(staged))
    await sender.finish()
    await asyncio.wait_for(receiver.done.wait(), 2.0)
    receiver.check(1.0)
    return whole, receivers, sender.plan.nbytes


@pytest.mark.parametrize("how", ["push", "staged"])
@pytest.mark.parametrize(
    "kv_heads, p, d", [(h, p, d) for h, degrees in SHAPES.items() for p in degrees for d in degrees]
)
async def test_each_decode_rank_holds_exactly_its_heads_after_a_transfer(kv_heads, p, d, how):
    layout = layout_of(kv_heads)
    whole, receivers, _ = await move(layout, p, d, how)
    split = HeadSplit(kv_heads * d, kv_heads, d)
    blocks = -(-PROMPT // BS)
    for rank, pool in enumerate(receivers):
        first, end = split.kv_heads(rank)
        want = whole.kv[SRC_TABLE[:blocks]][..., first:end, :]
        assert torch.equal(pool.kv[DST_TABLE[:blocks]], want), (rank, first, end)
        untouched = [b for b in range(12) if b not in DST_TABLE[:blocks]]
        assert not pool.kv[untouched].any()  # nothing lands outside the reserved blocks


@pytest.mark.parametrize("kv_heads, p, d", [(4, 2, 1), (4, 1, 2), (4, 2, 2), (2, 1, 4), (1, 1, 2)])
def test_each_decode_rank_receives_its_share_of_the_bytes(kv_heads, p, d):
    layout = layout_of(kv_heads)
    plan = TransferPlan(layout, PROMPT, destination(p, d))
    whole = TransferPlan(layout, PROMPT, destination(1, 1)).nbytes
    replicas = max(1, d // kv_heads)
    per_rank = {}
    for piece in plan.pieces:
        per_rank[piece.dest] = per_rank.get(piece.dest, 0) + plan.piece_bytes(piece)
    assert per_rank == {rank: whole * replicas // d for rank in range(d)}


def test_a_degree_that_does_not_split_the_kv_heads_has_no_plan():
    with pytest.raises(PlanError, match="3 -> 1 do not split 2 KV heads"):
        TransferPlan(layout_of(2), PROMPT, destination(3, 1))


@pytest.mark.parametrize("p, d", [(2, 1), (1, 2), (4, 2)])
def test_the_helper_assembles_a_piece_as_torch_does(p, d):
    """A piece from the prefill group's rank pools (shared regions, as a worker's): what the
    data-plane helper assembles from the Assembly's refs (one copy, in its process) is, byte for
    byte, what torch assembles in the engine thread, and the receiving rank's layout."""
    layout = layout_of(4)
    whole = KVPool(layout, 12, BS, "cpu")
    whole.kv.copy_(torch.randn(whole.kv.shape, generator=torch.Generator().manual_seed(9)))
    pools = []
    for source in rank_pools(whole, p):  # the same, in shared regions
        shared = KVPool(source.layout, 12, BS, "cpu", shared=True)
        shared.kv.copy_(source.kv)
        pools.append(shared)
    plan = TransferPlan(layout, PROMPT, destination(p, d))
    plane = HelperDataPlane([pool.region for pool in pools])
    sender = KVSender(plane, pools, plan, 1.0)
    staged = sender.stage(plan.segments[0], SRC_TABLE)
    server = HelperServer(InProcessDataPlane(LoopbackNetwork(), "x"), plane.regions, Collect())
    split = HeadSplit(4 * d, 4, d)
    for (_, piece, blocks), (_, made) in zip(staged.scattered, sender.gather(staged)):
        by_helper = server.buffer(plane._ref(made), [])
        by_torch = assembled(sender._parts(piece, blocks))
        assert by_helper.tobytes() == by_torch.numpy().tobytes()
        first, end = split.kv_heads(piece.dest)
        assert torch.equal(by_torch, whole.kv[blocks][..., first:end, :])
