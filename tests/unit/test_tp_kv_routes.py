"""The bytes of the routes between TP groups: each decode rank's pool ends up holding exactly its
heads of the prompt's blocks, bit for bit, for matched and mismatched degrees, replicated heads
included; each decode rank receives 1/tp of the KV (times the replication factor)."""

import itertools

import pytest
import torch

from shared.parallel.heads import HeadSplit, routes, valid_degrees
from shared.parallel.kv_routes import gather, scatter

LAYERS, BS, DIM = 3, 4, 8
PREFILL_BLOCKS, DECODE_BLOCKS = [1, 4, 2], [7, 3, 5]


def pools_of(whole: torch.Tensor, split: HeadSplit) -> list[torch.Tensor]:
    """Each rank's pool: its heads of every block."""
    return [whole[..., slice(*split.kv_heads(r)), :].clone() for r in range(split.tp)]


@pytest.mark.parametrize("shape", [(14, 2), (4, 1), (9, 3), (32, 8)])
def test_every_decode_rank_gets_its_heads_bit_for_bit(shape):
    heads, kv_heads = shape
    whole = torch.randn(6, LAYERS, 2, BS, kv_heads, DIM)
    for p, d in itertools.product(valid_degrees(heads, kv_heads)[:4], repeat=2):
        prefill, decode = HeadSplit(heads, kv_heads, p), HeadSplit(heads, kv_heads, d)
        senders = pools_of(whole, prefill)
        receivers = [torch.zeros(9, LAYERS, 2, BS, decode.kv_per_rank, DIM) for _ in range(d)]
        moved = [0] * d
        for route in routes(prefill, decode):
            data = gather(senders[route.source], PREFILL_BLOCKS, route)
            assert data.is_contiguous()
            scatter(receivers[route.dest], DECODE_BLOCKS, route, data)
            moved[route.dest] += data.numel()
        for rank, pool in enumerate(receivers):
            want = whole[PREFILL_BLOCKS][..., slice(*decode.kv_heads(rank)), :]
            assert torch.equal(pool[DECODE_BLOCKS], want), (shape, p, d, rank)
            untouched = [b for b in range(9) if b not in DECODE_BLOCKS]
            assert not pool[untouched].any()
        per_block = LAYERS * 2 * BS * DIM
        assert moved == [len(PREFILL_BLOCKS) * per_block * decode.kv_per_rank] * d
        assert sum(moved) == len(PREFILL_BLOCKS) * per_block * kv_heads * decode.replicas
