"""HeadSplit and routes: which heads each rank of a tensor-parallel group holds, and which prefill
rank sends which KV heads to which decode rank, for matched and mismatched degrees."""

import itertools

import pytest

from shared.parallel.heads import HeadSplit, TPError, routes, valid_degrees

# (query heads, KV heads): SmolLM2, a Qwen2.5-0.5B shape, GQA with one KV head, Llama-3-8B
SHAPES = [(9, 3), (14, 2), (4, 1), (32, 8)]


def test_the_degrees_that_split_each_shape():
    assert valid_degrees(9, 3) == [1, 3, 9]
    assert valid_degrees(14, 2) == [1, 2, 14]
    assert valid_degrees(4, 1) == [1, 2, 4]
    assert valid_degrees(32, 8) == [1, 2, 4, 8, 16, 32]


def test_a_degree_that_does_not_split_the_heads_is_refused_naming_those_that_would():
    with pytest.raises(
        TPError,
        match="degree of 2 does not split 9 query heads and 3 KV heads; "
        "degrees that would: 1, 3, 9",
    ):
        HeadSplit(9, 3, 2)
    with pytest.raises(TPError, match="degrees that would: 1, 2, 14"):
        HeadSplit(14, 2, 7)  # divides the query heads, not the KV heads


@pytest.mark.parametrize("shape", SHAPES)
def test_each_rank_reads_only_kv_heads_it_holds(shape):
    heads, kv = shape
    group = heads // kv  # query heads per KV head
    for tp in valid_degrees(heads, kv):
        split = HeadSplit(heads, kv, tp)
        held = [split.kv_heads(r) for r in range(tp)]
        assert {h for a, b in held for h in range(a, b)} == set(range(kv))  # every head somewhere
        assert all(b - a == split.kv_per_rank for a, b in held)
        assert all(len(split.holders(h)) == split.replicas for h in range(kv))
        for rank in range(tp):
            q0, q1 = split.q_heads(rank)
            needed = {q // group for q in range(q0, q1)}
            a, b = split.kv_heads(rank)
            assert needed <= set(range(a, b)), (shape, tp, rank)


@pytest.mark.parametrize("shape", SHAPES)
def test_every_decode_rank_receives_each_head_it_holds_once_from_a_rank_that_holds_it(shape):
    heads, kv = shape
    for p, d in itertools.product(valid_degrees(heads, kv)[:4], repeat=2):
        prefill, decode = HeadSplit(heads, kv, p), HeadSplit(heads, kv, d)
        plan = routes(prefill, decode)
        for dest in range(d):
            got = sorted(h for r in plan if r.dest == dest for h in range(r.first, r.end))
            assert got == list(range(*decode.kv_heads(dest))), (shape, p, d, dest)
        for r in plan:
            src0, src1 = prefill.kv_heads(r.source)
            assert src0 <= r.first and r.end <= src1
            assert r.source_offset == r.first - src0
            assert r.dest_offset == r.first - decode.kv_heads(r.dest)[0]
        # the heads moved per decode rank: 1/tp of the whole (times the replication factor)
        per_rank = [sum(r.heads for r in plan if r.dest == dest) for dest in range(d)]
        assert per_rank == [decode.kv_per_rank] * d
        assert sum(per_rank) == kv * decode.replicas


def test_mismatched_degrees_in_both_directions():
    two, one = HeadSplit(14, 2, 2), HeadSplit(14, 2, 1)
    # TP=2 -> TP=1: two senders fill one pool, each its head range
    assert [(r.source, r.dest, r.first, r.end, r.dest_offset) for r in routes(two, one)] == [
        (0, 0, 0, 1, 0),
        (1, 0, 1, 2, 1),
    ]
    # TP=1 -> TP=2: one sender splits its heads between two receivers
    assert [(r.source, r.dest, r.first, r.end, r.source_offset) for r in routes(one, two)] == [
        (0, 0, 0, 1, 0),
        (0, 1, 1, 2, 1),
    ]
    # matched: rank to rank
    assert [(r.source, r.dest) for r in routes(two, two)] == [(0, 0), (1, 1)]


def test_replicated_heads_are_sent_once_per_receiver_and_spread_over_the_senders():
    four_one = HeadSplit(4, 1, 2)  # one KV head, held by both ranks
    assert [(r.source, r.dest) for r in routes(four_one, four_one)] == [(0, 0), (1, 1)]
    assert [(r.source, r.dest) for r in routes(four_one, HeadSplit(4, 1, 1))] == [(0, 0)]
    assert [(r.source, r.dest) for r in routes(HeadSplit(4, 1, 1), four_one)] == [(0, 0), (0, 1)]


def test_groups_of_different_models_never_pair():
    with pytest.raises(TPError, match="different models"):
        routes(HeadSplit(14, 2, 1), HeadSplit(9, 3, 1))
