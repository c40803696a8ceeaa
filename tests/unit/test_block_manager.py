"""BlockManager: reserve a sequence's whole budget up front, free it on every path."""

import pytest

from shared.engine.block_manager import BlockManager


@pytest.mark.parametrize("tokens, blocks", [(0, 0), (1, 1), (15, 1), (16, 1), (17, 2), (32, 2), (33, 3)])
def test_blocks_for_rounds_up(tokens, blocks):
    assert BlockManager(10, 16).blocks_for(tokens) == blocks


def test_allocate_and_deallocate_accounting():
    bm = BlockManager(num_blocks=10, block_size=16)
    bm.allocate("a", 40)          # 3 blocks
    bm.allocate("b", 16)          # 1 block
    assert (bm.used, bm.free) == (4, 6)
    assert bm.holds("a") and bm.holds("b") and not bm.holds("c")
    bm.deallocate("a")
    assert (bm.used, bm.free) == (1, 9)
    assert not bm.holds("a")
    bm.deallocate("b")
    assert (bm.used, bm.free) == (0, 10)


def test_can_allocate_matches_free_blocks():
    bm = BlockManager(4, 16)
    assert bm.can_allocate(64) and not bm.can_allocate(65)
    bm.allocate("a", 33)          # 3 blocks
    assert bm.can_allocate(16) and not bm.can_allocate(17)


def test_memory_error_when_full_leaves_state_unchanged():
    bm = BlockManager(4, 16)
    bm.allocate("a", 48)
    with pytest.raises(MemoryError):
        bm.allocate("b", 17)
    assert bm.used == 3 and not bm.holds("b")
    bm.allocate("b", 16)          # exactly the last block
    assert bm.free == 0


def test_double_allocate_raises_and_keeps_the_first():
    bm = BlockManager(10, 16)
    bm.allocate("a", 16)
    with pytest.raises(ValueError):
        bm.allocate("a", 64)
    assert bm.used == 1


def test_double_free_is_harmless():
    bm = BlockManager(10, 16)
    bm.allocate("a", 20)
    bm.allocate("b", 20)
    bm.deallocate("a")
    bm.deallocate("a")
    bm.deallocate("never-allocated")
    assert bm.used == 2 and bm.holds("b")


@pytest.mark.parametrize("blocks, size", [(0, 16), (10, 0), (-1, 16)])
def test_rejects_non_positive_sizes(blocks, size):
    with pytest.raises(ValueError):
        BlockManager(blocks, size)


def test_negative_token_counts_are_refused():
    blocks = BlockManager(num_blocks=4, block_size=16)
    with pytest.raises(ValueError):
        blocks.allocate("a", -100)
    assert blocks.used == 0 and blocks.free == 4
