"""KVPool: slots through a block table, write/read, export/load between pools; the KV layout."""

import pytest
import torch
from transformers import LlamaConfig

from shared.engine import kv_cache
from shared.engine.kv_cache import KVPool
from shared.messages import KVLayout

LAYOUT = KVLayout(model="tiny", dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
BLOCK = 4


def random_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_layout_of_a_config():
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2)
    assert kv_cache.layout_of(config, "tiny", torch.float32) == LAYOUT
    assert kv_cache.bytes_per_token(LAYOUT) == 2 * 2 * 2 * 16 * 4


def test_bytes_per_token_by_dtype():
    layout = kv_cache.layout_of(LlamaConfig(hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                                            num_hidden_layers=30), "m", torch.bfloat16)
    assert (layout.dtype, layout.head_dim) == ("bfloat16", 64)
    assert kv_cache.bytes_per_token(layout) == 2 * 30 * 3 * 64 * 2


def test_empty_buffer_matches_the_transfer_layout():
    buffer = kv_cache.empty_buffer(LAYOUT, 7, "cpu")
    assert buffer.shape == (2, 2, 7, 2, 16) and buffer.dtype == torch.float32
    assert buffer.numel() * buffer.element_size() == 7 * kv_cache.bytes_per_token(LAYOUT)


def test_pool_shape():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    assert pool.kv.shape == (2, 2, 6 * BLOCK, 2, 16)
    assert not pool.kv.any()


def test_slots_map_positions_through_the_block_table():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    table = [3, 0, 5]
    assert pool.slots(table, 0, 12).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21, 22, 23]
    assert pool.slots(table, 5, 9).tolist() == [1, 2, 3, 20]
    assert pool.slots(table, 11, 12).tolist() == [23]
    assert pool.slots(table, 4, 4).numel() == 0
    assert pool.slots(table, 0, 3).dtype == torch.long


def test_slots_past_the_block_table_fail():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    with pytest.raises(IndexError):
        pool.slots([1], 0, BLOCK + 1)


def test_write_read_round_trip():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    slots = pool.slots([4, 1], 0, 6)
    keys, values = random_kv(6, seed=0)
    pool.write(1, slots, keys, values)
    got_k, got_v = pool.read(1, slots)
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert not pool.kv[0].any()                       # other layer untouched
    untouched = torch.ones(pool.kv.shape[2], dtype=torch.bool)
    untouched[slots] = False
    assert not pool.kv[1][:, untouched].any()         # other slots untouched
    k2, _ = pool.read(1, pool.slots([4, 1], 2, 5))    # a partial read
    assert torch.equal(k2, keys[2:5])


def test_export_load_between_pools_with_different_block_tables():
    n = 11
    src = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    dst = KVPool(LAYOUT, num_blocks=8, block_size=BLOCK, device="cpu")
    src_table, dst_table = [5, 2, 0], [1, 7, 3]
    src_slots, dst_slots = src.slots(src_table, 0, n), dst.slots(dst_table, 0, n)
    for layer in range(LAYOUT.num_layers):
        src.write(layer, src_slots, *random_kv(n, seed=10 + layer))
    buffer = src.export(src_slots)
    assert buffer.shape == (LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    assert buffer.is_contiguous()
    assert buffer.numel() * buffer.element_size() == n * kv_cache.bytes_per_token(LAYOUT)
    received = kv_cache.empty_buffer(LAYOUT, n, "cpu")
    received.copy_(buffer)                            # what crosses the wire
    dst.load(dst_slots, received)
    for layer in range(LAYOUT.num_layers):
        for pos in range(n):
            a_k, a_v = src.read(layer, src_slots[pos:pos + 1])
            b_k, b_v = dst.read(layer, dst_slots[pos:pos + 1])
            assert torch.equal(a_k, b_k) and torch.equal(a_v, b_v), (layer, pos)
    assert torch.equal(dst.export(dst_slots), buffer)
    assert int((dst.kv != 0).any(dim=(0, 1, 3, 4)).sum()) == n   # only the n destination slots written


def test_load_of_a_suffix_keeps_the_cached_prefix():
    """A decode worker with the first tokens cached loads only the rest of the transfer buffer."""
    n, cached = 10, 4
    src = KVPool(LAYOUT, num_blocks=4, block_size=BLOCK, device="cpu")
    dst = KVPool(LAYOUT, num_blocks=4, block_size=BLOCK, device="cpu")
    src_slots = src.slots([0, 1, 2], 0, n)
    for layer in range(LAYOUT.num_layers):
        src.write(layer, src_slots, *random_kv(n, seed=layer))
    buffer = src.export(src_slots)
    dst_table = [3, 2, 1]
    dst.load(dst.slots(dst_table, 0, cached), buffer[:, :, :cached])
    dst.load(dst.slots(dst_table, cached, n), buffer[:, :, cached:n])
    assert torch.equal(dst.export(dst.slots(dst_table, 0, n)), buffer)
