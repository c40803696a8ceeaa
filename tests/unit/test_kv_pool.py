"""KVPool: slots through a block table, write/read, export, runs of blocks; the KV layout."""

import pytest
import torch
from transformers import LlamaConfig

from shared.control.messages import KVLayout
from shared.engine import kv_cache
from shared.engine.kv_cache import KVPool

BLOCK = 4
LAYOUT = KVLayout(
    model="tiny",
    dtype="float32",
    num_layers=2,
    num_kv_heads=2,
    head_dim=16,
    block_size=BLOCK,
    pool_order="blocks",
)


def random_kv(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def test_layout_of_a_config():
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    assert kv_cache.layout_of(config, "tiny", torch.float32, BLOCK) == LAYOUT
    assert kv_cache.bytes_per_token(LAYOUT) == 2 * 2 * 2 * 16 * 4


def test_bytes_per_token_by_dtype():
    layout = kv_cache.layout_of(
        LlamaConfig(
            hidden_size=576, num_attention_heads=9, num_key_value_heads=3, num_hidden_layers=30
        ),
        "m",
        torch.bfloat16,
    )
    assert (layout.dtype, layout.head_dim) == ("bfloat16", 64)
    assert kv_cache.bytes_per_token(layout) == 2 * 30 * 3 * 64 * 2


def test_pool_shape():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    assert pool.kv.shape == (6, 2, 2, BLOCK, 2, 16)  # block-major
    assert not pool.kv.any()
    keys, values = pool.layers[1]  # what the kernels read: blocks a whole block's KV apart
    assert keys.shape == (6, BLOCK, 2, 16) and keys.stride(0) == pool.kv[0].numel()
    assert keys.data_ptr() == pool.kv[0, 1, 0].data_ptr()
    assert values.data_ptr() == pool.kv[0, 1, 1].data_ptr()


def test_slots_map_positions_through_the_block_table():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    table = [3, 0, 5]
    assert pool.slots(table, 0, 12).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21, 22, 23]
    assert pool.slots(table, 5, 9).tolist() == [1, 2, 3, 20]
    assert pool.slots(table, 11, 12).tolist() == [23]
    assert pool.slots(table, 4, 4).numel() == 0
    assert pool.slots(table, 0, 3).dtype == torch.long
    for start, end in [(0, 12), (5, 9), (11, 12), (4, 4), (7, 8)]:  # the batch builder's ints
        assert pool.slot_list(table, start, end) == pool.slots(table, start, end).tolist()


def test_slots_past_the_block_table_fail():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    with pytest.raises(IndexError):
        pool.slots([1], 0, BLOCK + 1)
    with pytest.raises(IndexError):
        pool.slot_list([1], 0, BLOCK + 1)


def test_write_read_round_trip():
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    slots = pool.slots([4, 1], 0, 6)
    keys, values = random_kv(6, seed=0)
    pool.write(1, pool.rows(slots), keys, values)
    got_k, got_v = pool.read(1, pool.rows(slots))
    assert torch.equal(got_k, keys) and torch.equal(got_v, values)
    assert not pool.kv[:, 0].any()  # other layer untouched
    written = pool.kv[:, 1].flatten(3).any(-1).any(1).flatten()  # by slot
    assert written.nonzero().flatten().tolist() == sorted(slots.tolist())  # no other slot
    assert torch.equal(pool.layers[1][0][4, 1], keys[1])  # slot 17: block 4, offset 1
    k2, _ = pool.read(1, pool.rows(pool.slots([4, 1], 2, 5)))  # a partial read
    assert torch.equal(k2, keys[2:5])


def test_export_packs_a_sequence_and_a_run_of_blocks_is_one_contiguous_range():
    n = 11
    pool = KVPool(LAYOUT, num_blocks=6, block_size=BLOCK, device="cpu")
    table = [5, 2, 0]
    slots = pool.slots(table, 0, n)
    for layer in range(LAYOUT.num_layers):
        pool.write(layer, pool.rows(slots), *random_kv(n, seed=10 + layer))
    buffer = pool.export(slots)
    assert buffer.shape == (LAYOUT.num_layers, 2, n, LAYOUT.num_kv_heads, LAYOUT.head_dim)
    assert buffer.is_contiguous()
    assert buffer.numel() * buffer.element_size() == n * kv_cache.bytes_per_token(LAYOUT)
    run = pool.blocks(2, 1)  # block 2 = positions 4..7, every layer
    assert run.is_contiguous() and run.data_ptr() == pool.kv[2].data_ptr()
    block_bytes = BLOCK * kv_cache.bytes_per_token(LAYOUT)  # every layer's keys and values
    assert run.nbytes == block_bytes
    assert torch.equal(run[0, 1, 0], buffer[1, 0, 4:8]) and torch.equal(
        run[0, 0, 1], buffer[0, 1, 4:8]
    )
    assert pool.blocks(0, 3).nbytes == 3 * block_bytes


def test_pool_refuses_a_layout_of_another_block_size():
    with pytest.raises(ValueError):
        KVPool(LAYOUT, num_blocks=2, block_size=BLOCK * 2, device="cpu")
